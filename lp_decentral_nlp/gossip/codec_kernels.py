"""Compiled CPU kernels of the codecs (numba): the top-k scan and the 8-bit affine codes.

Each replaces a chain of whole-array numpy/torch passes by one pass that keeps its intermediates
in registers:

* :func:`split_by_magnitude`, the scan behind :class:`~.compressors.TopK` on the CPU. It reads
  the tensor 64 entries at a time: two comparisons give a 64-bit mask of the entries in each
  class, and only the set bits are visited (a de Bruijn multiply finds the lowest one), so sparse
  output costs a few cycles per entry written, not a branch per entry read. It writes the kept
  values as it goes, and for Choco-SGD it scans a difference ``a - b`` without writing it: one
  read of each input replaces a subtraction pass, numpy's ``abs``, ``greater_equal`` and
  ``flatnonzero``, and the gather of the kept values.
* :func:`encode_affine8` and :func:`add_affine8`, the 8-bit codes of SPEC 4's affine quantizer
  (:class:`~.compressors.Quantize` and ``value_bits=8``): about 0.2 ns per entry each, against
  4 and 3 torch passes (subtract, scale, round, clamp, convert; convert, scale, shift, add).

numba compiles a kernel on its first use, once per combination of array types, and caches the
machine code on disk (``NUMBA_CACHE_DIR`` moves the cache). :mod:`.compressors` imports this
module on the first CPU call that needs it, so importing the package does not import numba.
Kernels run with the GIL released: the gossip engine's segment pool runs them in parallel.
"""
from __future__ import annotations

import numba
import numpy as np

_DE_BRUIJN = 0x03F79D71B4CB0A89
# _LOWEST_BIT[(b * _DE_BRUIJN mod 2^64) >> 58] = j for the single-bit word b = 2^j
_LOWEST_BIT = np.zeros(64, dtype=np.int64)
for _j in range(64):
    _LOWEST_BIT[((1 << _j) * _DE_BRUIJN % 2**64) >> 58] = _j
del _j


def split_by_magnitude(a: np.ndarray, b: np.ndarray | None, t_lo: float, t_hi: float,
                       above: np.ndarray, above_values: np.ndarray, band: np.ndarray,
                       band_values: np.ndarray) -> tuple[int, int]:
    """The entries of ``x = a`` (or ``x = a - b``, never written whole) by magnitude: positions and
    values of ``|x| > t_hi`` into ``above`` and ``above_values``, of ``t_lo <= |x| <= t_hi`` into
    ``band`` and ``band_values``, each in ascending order of position.

    Args:
        a: ``(n,)`` contiguous float32 or float64 array.
        b: None, or an array like ``a`` (same shape and dtype): ``x = a - b`` is computed entry by
            entry in their dtype. NaNs in ``x`` fall in neither class.
        t_lo, t_hi: thresholds, ``t_lo <= t_hi`` (``t_hi`` may be ``inf``); compared in ``a``'s dtype.
        above: ``(k,)`` integer array: room for at most ``k`` positions above ``t_hi``.
        above_values: ``(k,)`` array of ``a``'s dtype: ``x`` at those positions.
        band: ``(m,)`` integer array that holds ``n - 1``: room for ``m`` positions in the band.
        band_values: ``(m,)`` array of ``a``'s dtype.
    Returns:
        ``(num_above, num_band)``, the counts written. The scan stops when a class runs out of
        room, with that count ``-1`` (both arrays then hold partial results).
    """
    _check_float_vector(a)
    if b is not None and (b.shape != a.shape or b.dtype != a.dtype or not b.flags.c_contiguous):
        raise ValueError(f"b must be a contiguous {a.dtype} array of shape {a.shape}, got {b.dtype} of shape {b.shape}")
    for name, positions, values in (("above", above, above_values), ("band", band, band_values)):
        if positions.dtype.kind not in "iu" or positions.ndim != 1 or np.iinfo(positions.dtype).max < a.size - 1:
            raise ValueError(f"{name} must be a 1-D integer array that holds position {a.size - 1}, "
                             f"got {positions.dtype} of shape {positions.shape}")
        if values.dtype != a.dtype or values.shape != positions.shape:
            raise ValueError(f"{name}_values must be a {a.dtype} array of shape {positions.shape}, "
                             f"got {values.dtype} of shape {values.shape}")
    real = a.dtype.type
    return _split(a, b, real(t_lo), real(t_hi), above, above_values, band, band_values)


@numba.njit(inline="always")
def _entry(a, b, i):
    """``x[i]``: ``a[i]``, or ``a[i] - b[i]`` (numba compiles the ``b is None`` case separately)."""
    return a[i] if b is None else a[i] - b[i]


@numba.njit(inline="always")
def _pop_lowest(word):
    """``(j, word - 2^j)`` for the lowest set bit ``j`` of the nonzero uint64 ``word``."""
    lowest = word & (~word + np.uint64(1))
    return _LOWEST_BIT[(lowest * np.uint64(_DE_BRUIJN)) >> np.uint64(58)], word ^ lowest


@numba.njit(inline="always")
def _masks(a, b, start, width, t_lo, t_hi):
    """Bit ``j`` of ``(lo, hi)``: ``|x[start + j]| >= t_lo`` and ``> t_hi``, for ``j < width <= 64``."""
    lo = hi = np.uint64(0)
    for j in range(width):
        magnitude = abs(_entry(a, b, start + j))
        lo |= np.uint64(magnitude >= t_lo) << np.uint64(j)
        hi |= np.uint64(magnitude > t_hi) << np.uint64(j)
    return lo, hi


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _split(a, b, t_lo, t_hi, above, above_values, band, band_values):
    n, k, room = a.size, above.size, band.size
    num_above = num_band = 0
    # words of 64 entries by word index: with a constant width (not ``range`` with a step, nor a
    # variable width) the compiler unrolls and vectorises the comparisons, ~3x faster
    for word in range((n + 63) // 64):
        start = 64 * word
        lo, hi = _masks(a, b, start, 64, t_lo, t_hi) if n - start >= 64 else _masks(a, b, start, n - start, t_lo, t_hi)
        in_band = lo & ~hi
        while hi:
            if num_above == k:
                return -1, num_band
            j, hi = _pop_lowest(hi)
            above[num_above] = start + j
            above_values[num_above] = _entry(a, b, start + j)
            num_above += 1
        while in_band:
            if num_band == room:
                return num_above, -1
            j, in_band = _pop_lowest(in_band)
            band[num_band] = start + j
            band_values[num_band] = _entry(a, b, start + j)
            num_band += 1
    return num_above, num_band


def encode_affine8(x: np.ndarray, lo: float, inv_scale: float, codes: np.ndarray) -> None:
    """``codes = clamp(round((x - lo) * inv_scale), 0, 255)``, computed in ``x``'s dtype with
    round-half-to-even: the same codes as torch's ``sub``, ``mul``, ``round`` and ``clamp``.

    Args:
        x: ``(n,)`` contiguous float32 or float64 array.
        lo, inv_scale: the zero point and ``1 / scale`` (0 for a constant ``x``).
        codes: ``(n,)`` uint8 array, written.
    """
    _check_float_vector(x)
    if codes.shape != x.shape or codes.dtype != np.uint8:
        raise ValueError(f"codes must be a uint8 array of shape {x.shape}, got {codes.dtype} of shape {codes.shape}")
    _encode_affine8(x, x.dtype.type(lo), x.dtype.type(inv_scale), codes)


def add_affine8(codes: np.ndarray, scale: float, zero_point: float, alpha: float, target: np.ndarray) -> None:
    """``target += alpha * (codes * scale + zero_point)``, computed in ``target``'s dtype.

    Args:
        codes: ``(n,)`` uint8 array.
        scale, zero_point: the affine code's step and offset.
        alpha: the coefficient.
        target: ``(n,)`` contiguous float32 or float64 array, updated in place.
    """
    _check_float_vector(target)
    if codes.shape != target.shape or codes.dtype != np.uint8:
        raise ValueError(f"codes must be a uint8 array of shape {target.shape}, got {codes.dtype} of shape {codes.shape}")
    real = target.dtype.type
    _add_affine8(codes, real(scale), real(zero_point), real(alpha), target)


def _check_float_vector(x: np.ndarray) -> None:
    if x.ndim != 1 or not x.flags.c_contiguous or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"expected a contiguous 1-D float32 or float64 array, got {x.dtype} of shape {x.shape}")


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _encode_affine8(x, lo, inv_scale, codes):
    top = x.dtype.type(255)
    for i in range(x.size):
        codes[i] = np.uint8(min(max(np.rint((x[i] - lo) * inv_scale), x.dtype.type(0)), top))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _add_affine8(codes, scale, zero_point, alpha, target):
    real = target.dtype.type
    for i in range(target.size):
        target[i] += alpha * (real(codes[i]) * scale + zero_point)
