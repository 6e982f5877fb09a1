"""Compiled CPU kernels of the codecs (numba): the top-k selection, the 8-bit affine codes and
the decoding of messages into their targets.

Each replaces a chain of whole-array numpy/torch passes by one pass that keeps its intermediates
in registers:

* :func:`split_by_magnitude`, the scan behind :class:`~.compressors.TopK` on the CPU. It reads
  the tensor 64 entries at a time: two comparisons give a 64-bit mask of the entries in each
  class, and only the set bits are visited (a de Bruijn multiply finds the lowest one), so sparse
  output costs a few cycles per entry written, not a branch per entry read. It writes the kept
  values as it goes, and for Choco-SGD it scans a difference ``a - b`` without writing it: one
  read of each input replaces a subtraction pass, numpy's ``abs``, ``greater_equal`` and
  ``flatnonzero``, and the gather of the kept values. :func:`largest_in_band` then ranks the thin
  band the scan leaves (a histogram of its magnitudes, then only the bin of the k-th largest),
  in place of ``torch.topk`` and two gathers.
* :func:`encode_affine8`, the 8-bit codes of SPEC 4's affine quantizer and their scale
  (:class:`~.compressors.Quantize` and ``value_bits=8``), in place of 5 torch passes (subtract,
  scale, round, clamp, convert) and the small ops that derive the scale. The range itself comes
  from ``torch.aminmax`` (vectorised; a compiled min/max that keeps NaN semantics is not).
* :func:`add_decoded`, a message added into its target: dense 8-bit codes, or a top-k/random-k
  message (float values or 8-bit codes) at its indices, decoded on the fly, in place of a decode
  into a buffer (convert, scale, shift) and ``add_``/``index_add_``.

Each wrapper checks its arrays' shapes and dtypes (and :func:`add_decoded` every index), because
the kernels run without bounds checks.

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
            entry in their dtype. A NaN in ``x`` counts above ``t_hi``, as ``torch.topk`` ranks NaN
            above every number.
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
    """Bit ``j`` of ``(lo, hi)``: ``|x[start + j]| >= t_lo`` and ``> t_hi`` (or NaN), for
    ``j < width <= 64``."""
    lo = hi = np.uint64(0)
    for j in range(width):
        magnitude = abs(_entry(a, b, start + j))
        lo |= np.uint64(magnitude >= t_lo) << np.uint64(j)
        hi |= np.uint64(not magnitude <= t_hi) << np.uint64(j)  # one unordered compare: > t_hi or NaN
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


def largest_in_band(band: np.ndarray, band_values: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    """The ``count = indices.size`` entries of the band with the largest ``|band_values|``: their
    positions into ``indices`` and values into ``values``, in band order (ascending position, as
    :func:`split_by_magnitude` writes the band). Of entries tied at the smallest kept magnitude,
    the earliest are kept.

    Args:
        band: ``(m,)`` integer array, the band's positions.
        band_values: ``(m,)`` float32 or float64 array, the band's values (no NaN; an infinity
            ranks above every finite magnitude).
        indices: ``(count,)`` integer array, ``count <= m``, written; its dtype must hold every
            band position (as the message's index field does).
        values: ``(count,)`` array of ``band_values``'s dtype, written.
    """
    _check_float_vector(band_values)
    if band.shape != band_values.shape or band.dtype.kind not in "iu":
        raise ValueError(f"band must be an integer array of shape {band_values.shape}, got {band.dtype} of "
                         f"shape {band.shape}")
    if indices.ndim != 1 or indices.size > band.size or indices.dtype.kind not in "iu":
        raise ValueError(f"indices must be a 1-D integer array of at most {band.size} entries, got "
                         f"{indices.dtype} of shape {indices.shape}")
    if values.shape != indices.shape or values.dtype != band_values.dtype:
        raise ValueError(f"values must be a {band_values.dtype} array of shape {indices.shape}, got "
                         f"{values.dtype} of shape {values.shape}")
    _largest_in_band(band, band_values, indices, values)


#: bins of the magnitude histogram of :func:`largest_in_band`
_BAND_BINS = 4096


@numba.njit(inline="always")
def _magnitude_bin(magnitude, smallest, scale):
    """The histogram bin of a band magnitude, ``smallest`` and ``scale`` spanning the finite ones: an
    infinite one in the top bin (``(inf - smallest) * scale`` is NaN or inf, no index)."""
    if magnitude == np.inf:
        return _BAND_BINS - 1
    return int((magnitude - smallest) * scale)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _largest_in_band(band, band_values, indices, values):
    # A histogram of the magnitudes over [min, max] finds the bin holding the count-th largest (the
    # bin of an entry never decreases with its magnitude): the bins above it are kept whole, and
    # only that bin's entries are ranked exactly. Four passes over the band, no sort.
    m, count = band_values.size, indices.size
    if count == 0:
        return
    smallest, largest = np.inf, 0.0
    for i in range(m):
        magnitude = abs(band_values[i])
        if magnitude < np.inf:
            smallest, largest = min(smallest, magnitude), max(largest, magnitude)
    scale = (_BAND_BINS - 1) / (largest - smallest) if largest > smallest else 0.0
    histogram = np.zeros(_BAND_BINS, np.int64)
    for i in range(m):
        histogram[_magnitude_bin(abs(band_values[i]), smallest, scale)] += 1
    cut, above_cut = _BAND_BINS - 1, 0  # the bin of the count-th largest; entries in bins above it
    while above_cut + histogram[cut] < count:
        above_cut += histogram[cut]
        cut -= 1
    in_cut = np.empty(histogram[cut], band_values.dtype)
    filled = 0
    for i in range(m):
        magnitude = abs(band_values[i])
        if _magnitude_bin(magnitude, smallest, scale) == cut:
            in_cut[filled] = magnitude
            filled += 1
    rank = count - above_cut  # places left for the cut bin's entries, largest first
    threshold = np.partition(in_cut, filled - rank)[filled - rank]
    ties = rank - np.sum(in_cut > threshold)  # places left for entries at the threshold
    written = 0
    for i in range(m):
        magnitude = abs(band_values[i])
        where = _magnitude_bin(magnitude, smallest, scale)
        if where > cut or (where == cut and (magnitude > threshold or (magnitude == threshold and ties > 0))):
            if where == cut and magnitude == threshold:
                ties -= 1
            indices[written] = band[i]
            values[written] = band_values[i]
            written += 1


def encode_affine8(x: np.ndarray, lo: float, hi: float, codes: np.ndarray) -> float:
    """SPEC 4's 8-bit affine codes of ``x`` on ``[lo, hi]`` (its range, from ``torch.aminmax``):
    ``scale = (hi - lo) / 255``, ``codes = clamp(round((x - lo) / scale), 0, 255)`` (all 0 when
    ``scale`` is 0 or NaN), computed in ``x``'s dtype as torch's ``sub``, ``mul`` by ``1 / scale``,
    ``round`` (half to even) and ``clamp`` do: the same codes and scale.

    Args:
        x: ``(n,)`` contiguous float32 or float64 array.
        lo, hi: the range (``lo <= hi``, or NaN as ``aminmax`` gives for a NaN in ``x``).
        codes: ``(n,)`` uint8 array, written.
    Returns:
        ``scale``, a value of ``x``'s dtype.
    """
    _check_float_vector(x)
    if codes.shape != x.shape or codes.dtype != np.uint8:
        raise ValueError(f"codes must be a uint8 array of shape {x.shape}, got {codes.dtype} of shape {codes.shape}")
    if lo > hi:
        raise ValueError(f"lo must be <= hi, got {lo} > {hi}")
    real = x.dtype.type
    return float(_encode_affine8(x, real(lo), real(hi), codes))


def add_decoded(values: np.ndarray, alpha: float, target: np.ndarray, indices: np.ndarray | None = None,
                scale: float | None = None, zero_point: float | None = None) -> None:
    """``target += alpha * decoded``: the message ``values`` decoded entry by entry and added
    densely (``target[i]``) or, with ``indices``, at ``target[indices[i]]`` (distinct positions).
    The arithmetic is that of torch's decoding (``code * scale + zero_point`` in ``target``'s
    dtype) followed by ``index_add_(..., alpha=alpha)``: ``alpha * value``, then the add.

    Args:
        values: ``(m,)`` array: floats of ``target``'s dtype, or with ``scale`` uint8 codes.
        alpha: the coefficient.
        target: ``(n,)`` contiguous float32 or float64 array, updated in place.
        indices: None (dense: ``m == n``), or ``(m,)`` integer positions in ``[0, n)``.
        scale, zero_point: the affine code's step and offset for uint8 ``values`` (both or neither).
    Raises:
        ValueError: on arrays of the wrong shape or dtype, or an index outside ``[0, n)`` (named;
            entries before it have been added).
    """
    _check_float_vector(target)
    if (scale is None) != (zero_point is None):
        raise ValueError("scale and zero_point must be given together (8-bit codes) or not at all (float values)")
    wanted = np.dtype(np.uint8) if scale is not None else target.dtype
    length = target.shape if indices is None else (indices.size,)
    if values.dtype != wanted or values.shape != length:
        raise ValueError(f"values must be a {wanted} array of shape {length}, got {values.dtype} of shape {values.shape}")
    if indices is not None and (indices.ndim != 1 or indices.dtype.kind not in "iu"):
        raise ValueError(f"indices must be a 1-D integer array, got {indices.dtype} of shape {indices.shape}")
    real = target.dtype.type
    affine = (None, None) if scale is None else (real(scale), real(zero_point))
    bad = _add_decoded(indices, values, *affine, real(alpha), target)
    if bad >= 0:
        raise ValueError(f"indices[{bad}] = {indices[bad]} is outside [0, {target.size}) (a corrupt message?)")


def _check_float_vector(x: np.ndarray) -> None:
    if x.ndim != 1 or not x.flags.c_contiguous or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"expected a contiguous 1-D float32 or float64 array, got {x.dtype} of shape {x.shape}")


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _encode_affine8(x, lo, hi, codes):
    real = x.dtype.type
    scale = (hi - lo) / real(255)
    inv_scale = real(1) / scale if scale > 0 else real(0)
    top = real(255)
    for i in range(x.size):
        codes[i] = np.uint8(min(max(np.rint((x[i] - lo) * inv_scale), real(0)), top))
    return scale


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _add_decoded(indices, values, scale, zero_point, alpha, target):
    # numba compiles the dense/sparse and float/8-bit cases separately (the None branches vanish)
    real, n = target.dtype.type, target.size
    for i in range(values.size):
        value = values[i] if scale is None else real(values[i]) * scale + zero_point
        if indices is None:
            target[i] += alpha * value
        else:
            j = indices[i]
            if j < 0 or j >= n:
                return i
            target[j] += alpha * value
    return -1
