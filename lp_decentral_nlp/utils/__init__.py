"""Process-wide helpers: :mod:`.cpu_malloc` (glibc's malloc policy for CPU training),
:mod:`.numba_threads` (numba's kernels on torch's thread count), :mod:`.layout` (the memory layouts
the compiled kernels take), :mod:`.lazy` (lazy package namespaces), :mod:`.logs` (the package's
loggers follow ``log_level``), :mod:`.models` (what a model exposes by transformers' conventions)
and :mod:`.fields_doc` (``help()`` of the argument dataclasses lists their fields)."""
