"""Process-wide helpers: :mod:`.cpu_malloc` (glibc malloc policy for CPU training)."""
