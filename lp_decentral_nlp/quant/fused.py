"""One-pass CPU quantizer (numba) for ``functional.quantize_uint8`` and the int8 kernel, and the
int8 kernel's other compiled passes: the GEMM epilogue (:func:`affine_epilogue`), code column
sums (:func:`code_column_sums`) and, around oneDNN's int8 convolution, channel sums, window sums
and the convolution epilogue (:func:`channel_sums`, :func:`window_sums`, :func:`conv_epilogue`).
The epilogues add the affine terms in float64 and round once (``kernels.int8``'s docstring says
why).

SPEC 4's affine quantizer in torch is a chain of whole-tensor passes: scale, shift, round (or add
the dither and floor), clamp, convert to 8 bits, and for the simulated kernel dequantize again
(multiply, add) -- seven reads and writes of the tensor. :func:`quantize_rows` does them in one
pass that keeps the intermediates in registers, with the same fp32 operations in the same order
(``v = (x - lo) * inv``, no fused multiply-add; ``rint`` rounds half to even like
``torch.round``; clamping to the integer bounds before rounding gives the same codes; the
stochastic dither is :func:`dither_words`' word of each element, computed in place), so its codes
and values are bit for bit those of the torch passes (tests). It needs a float32 CPU tensor,
contiguous or channels last (a 4-D conv activation, walked in memory order:
:mod:`lp_decentral_nlp.utils.layout`), whose ranges are 0-d or one per sample (dim 0);
``functional`` uses the torch passes for anything else (CUDA, other dtypes or strides).

The CPU dither (SPEC 4 stochastic rounding) is counter based: element ``i`` of a call gets the
16-bit word ``hash(i, key)``, ``key`` one 64-bit draw of torch's generator per call. So the words
of any element come without drawing the ones before it (the rounding splits over threads like
the rest of the pass), a run is reproducible from ``torch.manual_seed``, and the generator moves
by one draw per stochastic call whatever the tensor's size (a resumed run stays in step).

numba compiles each kernel on its first use and caches the machine code on disk; this module is
imported on the first CPU call that needs it. Kernels run with the GIL released; a tensor of at
least ``utils.numba_threads.PARALLEL_MIN_ELEMENTS`` is split by rows over as many threads as
torch's intra-op pool (``torch.get_num_threads()``, at most numba's ``NUMBA_NUM_THREADS``),
without changing torch's thread count (:mod:`lp_decentral_nlp.utils.numba_threads`).
"""
from __future__ import annotations


import numba
import numpy as np
import torch

from ..utils.layout import is_channels_last, is_dense, memory_order
from ..utils.numba_threads import compile_serial_and_parallel, run_kernel
from .functional import MIN_STEP
from .gemm import conv_output_hw


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _clamp(v, low, high):
    # rounding commutes with clamping to integer bounds, so clamping first keeps |v| small
    v = v if v > low else low
    return v if v < high else high


_U32 = np.uint32


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _dither_word(index, key_low, key_high):
    """The dither word in ``[-2**15, 2**15)`` of element `index` (an integer, taken mod 2**32)
    under the 64-bit key ``(key_high, key_low)`` (two uint32): the top 16 bits of
    ``lowbias32((index * 0x9E3779B9 + key_low) ^ key_high)``, C. Wellons' 32-bit integer hash
    (a bijection with full avalanche). All arithmetic in uint32 (wraps mod 2**32)."""
    h = _U32(_U32(_U32(index) * _U32(0x9E3779B9)) + key_low)  # numba widens uint32 products: cast back
    h = _U32(h ^ key_high)
    h = _U32(h ^ (h >> _U32(16)))
    h = _U32(h * _U32(0x7FEB352D))
    h = _U32(h ^ (h >> _U32(15)))
    h = _U32(h * _U32(0x846CA68B))
    h = _U32(h ^ (h >> _U32(16)))
    return np.int32(h >> _U32(16)) - np.int32(32768)


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _stochastic_code(value, lo, inv, offset, index, key_low, key_high, dither_scale, low, high):
    """The stochastically rounded code of `value`: ``floor(clamp((value - lo) * inv + offset + w *
    dither_scale))``, ``w`` the dither word of element `index` (fp32 operations in that order, no
    fused multiply-add)."""
    v = (value - lo) * inv
    v = v + offset
    d = np.float32(_dither_word(index, key_low, key_high))
    return np.floor(_clamp(v + d * dither_scale, low, high))


def _quantize_rows(x, lo, hi, levels, shift, stochastic, key_low, key_high, dither_scale, dither_offset, min_step,
                   channels, codes, scale, values, row_sums):
    rows, cols = x.shape
    ranges = lo.shape[0]
    # functional._affine_parameters' fp32 operations, one range at a time (serial: a few values)
    inv = np.empty(ranges, np.float32)
    # rounded on the unsigned grid [0, levels], then shifted: exact, and rounding v - shift instead
    # could put a .5 tie on the other side (float rounding of v - shift differs from that of v).
    # The bounds are computed, not `high = levels`: that failed numba's typing (float32 against a
    # 0-d array) in a fresh process under torch.compile (tests/test_quant_models.py)
    low = shift - shift
    high = levels - low
    for j in range(ranges):
        step = (hi[j] - lo[j]) / levels
        scale[j] = step
        inv[j] = np.float32(1.0) / step if step >= min_step else np.float32(0.0)
    rows_per_range = rows // ranges
    for r in numba.prange(rows):  # rows are independent: each element's operations do not change
        # int64: a parallel prange index may be uint64, and uint64 with int64 types as float64
        k = np.int64(r) // rows_per_range
        a, x_lo = inv[k], lo[k]
        x_row, code_row = x[r], codes[r]
        if stochastic and channels == 0:
            # the dither's counter: the element's flat index mod 2**32, counted in uint32 (16 lanes
            # of a vector where an int64 index gives 8)
            index = _U32(np.int64(r) * cols)
            for c in range(cols):
                code = _stochastic_code(x_row[c], x_lo, a, dither_offset, index, key_low, key_high, dither_scale, low,
                                        high)
                code_row[c] = code - shift
                index = _U32(index + _U32(1))
        elif stochastic:
            # a channels-last sample, memory (positions, channels): element (p, ch) gets the word
            # of its row-major (channels-first) index ch * positions + p, as a contiguous tensor
            positions = cols // channels
            first = _U32(np.int64(r) * cols)
            for p in range(positions):
                index = _U32(first + _U32(p))
                base = p * channels
                for ch in range(channels):
                    code = _stochastic_code(x_row[base + ch], x_lo, a, dither_offset, index, key_low, key_high,
                                            dither_scale, low, high)
                    code_row[base + ch] = code - shift
                    index = _U32(index + _U32(positions))
        else:
            for c in range(cols):
                v = (x_row[c] - x_lo) * a
                code_row[c] = np.rint(_clamp(v, low, high)) - shift
        if values.shape[0] > 0:  # a row at a time: the codes are still in cache
            s, base, value_row = scale[k], lo[k], values[r]
            for c in range(cols):
                q = np.float32(code_row[c]) * s
                value_row[c] = q + base
        if row_sums.shape[0] > 0:
            total = np.int32(0)  # integer adds: exact, and in any order (vectorised)
            for c in range(cols):
                total += np.int32(code_row[c])
            row_sums[r] = np.float32(total)


def _dither_rows(key_low, key_high, words):
    rows, cols = words.shape
    for r in numba.prange(rows):
        index, word_row = _U32(np.int64(r) * cols), words[r]  # as in _quantize_rows
        for c in range(cols):
            word_row[c] = _dither_word(index, key_low, key_high)
            index = _U32(index + _U32(1))


def _dequantize_rows(codes, scale, lo, values):
    rows, cols = codes.shape
    row_step = 1 if scale.shape[0] > 1 else 0  # one range per row, or one for all
    for r in numba.prange(rows):
        s, base = scale[r * row_step], lo[r * row_step]
        code_row, value_row = codes[r], values[r]
        for c in range(cols):
            q = np.float32(code_row[c]) * s
            value_row[c] = q + base


def _affine_epilogue(acc, row_scale, row_offset, col_scaled_sums, col_bias, row_term, out):
    rows, cols = acc.shape
    scale_step = 1 if row_scale.shape[0] > 1 else 0  # one per row, or one for all
    offset_step = 1 if row_offset.shape[0] > 1 else 0
    for r in numba.prange(rows):
        s, o, e = row_scale[r * scale_step], row_offset[r * offset_step], row_term[r]
        acc_row, out_row = acc[r], out[r]
        for c in range(cols):
            v = o * col_scaled_sums[c]
            v = v + col_bias[c]
            v = v + np.float64(acc_row[c]) * s
            out_row[c] = v + e  # rounded once, to out's dtype


def _channel_sums(codes, out):
    # out[n, p] = sum over c of codes[n, c, p] (uint8 codes), exact int32 sums along rows (vectorised)
    samples, channels, positions = codes.shape
    for n in numba.prange(samples):
        sums = np.zeros(positions, np.int32)
        for c in range(channels):
            code_row = codes[n, c]
            for p in range(positions):
                sums[p] += np.int32(code_row[p])
        out_row = out[n]
        for p in range(positions):
            out_row[p] = np.float32(sums[p])


def _channel_sums_last(codes, out):
    # out[n, p] = sum over c of codes[n, p, c] (uint8 codes, channels last), exact int32 sums
    samples, positions, channels = codes.shape
    for n in numba.prange(samples):
        codes_n, out_n = codes[n], out[n]
        for p in range(positions):
            code_row = codes_n[p]
            total = np.int32(0)
            for c in range(channels):
                total += np.int32(code_row[c])
            out_n[p] = np.float32(total)


def _window_sums(padded, kernel_h, kernel_w, stride_h, stride_w, dilation_h, dilation_w, out):
    # out[n, i, j] = sum over the kernel taps (a, b) of padded[n, i sh + a dh, j sw + b dw], each
    # output row summed in a local row (int-valued floats: exact in any order). With stride 1 the
    # taps are a contiguous slice, which numba vectorises; indexed with a runtime stride it does not
    samples, out_h, out_w = out.shape
    for n in numba.prange(samples):
        sums = np.empty(out_w, np.float32)
        for i in range(out_h):
            sums[:] = 0
            for a in range(kernel_h):
                in_row = padded[n, i * stride_h + a * dilation_h]
                for b in range(kernel_w):
                    first = b * dilation_w
                    if stride_w == 1:  # contiguous taps (the common case): a unit-stride loop
                        taps = in_row[first:first + out_w]
                        for j in range(out_w):
                            sums[j] += taps[j]
                    else:
                        for j in range(out_w):
                            sums[j] += in_row[first + j * stride_w]
            out_row = out[n, i]
            for j in range(out_w):
                out_row[j] = sums[j]


def _conv_epilogue(acc, row_scale, window_coef, window_sums, row_offset, border, bias, out):
    # out[n, p, o] = acc[n, p, o] * row_scale[n] + window_coef[n] * window_sums[n, p]
    #                + row_offset[n] * border[p, o] + bias[o] in float64, rounded once to fp32; acc
    # and out channels last, so the loop runs along a position's channels (contiguous in memory)
    samples, positions, channels = acc.shape
    for n in numba.prange(samples):
        acc_n, out_n, sums_n = acc[n], out[n], window_sums[n]
        s, w, b0 = row_scale[n], window_coef[n], row_offset[n]
        for p in range(positions):
            acc_p, out_p, border_p = acc_n[p], out_n[p], border[p]
            window_term = w * np.float64(sums_n[p])
            for o in range(channels):
                v = np.float64(acc_p[o]) * s
                v = v + window_term
                v = v + b0 * border_p[o]
                out_p[o] = v + bias[o]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _column_sums(codes, out):
    # one row at a time into int32 sums the width of a row (exact, vectorised; a 3,072-column row
    # of sums stays in L1): 0.12 ms for 3,072 x 768 codes on one thread, too little to split
    rows, cols = codes.shape
    sums = np.zeros(cols, np.int32)
    for r in range(rows):
        code_row = codes[r]
        for c in range(cols):
            sums[c] += code_row[c]
    for c in range(cols):
        out[c] = np.float32(sums[c])


_QUANTIZE_ROWS = compile_serial_and_parallel(_quantize_rows)
_AFFINE_EPILOGUE = compile_serial_and_parallel(_affine_epilogue)
_DEQUANTIZE_ROWS = compile_serial_and_parallel(_dequantize_rows)
_DITHER_ROWS = compile_serial_and_parallel(_dither_rows)
_CHANNEL_SUMS = compile_serial_and_parallel(_channel_sums)
_CHANNEL_SUMS_LAST = compile_serial_and_parallel(_channel_sums_last)
_CONV_EPILOGUE = compile_serial_and_parallel(_conv_epilogue)
_WINDOW_SUMS = compile_serial_and_parallel(_window_sums)
_EMPTY_F32 = np.zeros((0, 0), dtype=np.float32)
_EMPTY_F32_1D = np.zeros(0, dtype=np.float32)


def _one_per_sample(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether range `t` holds one value per sample (dim 0) of an `x` of at least 2 dims, whose
    rows over the last dim each lie in one sample (a 1-D `x` is one row): shaped ``(x.shape[0], 1,
    ..., 1)`` with `x`'s dims, as broadcasting against `x` reads it (a ``(x.shape[0],)`` range
    would broadcast along `x`'s last dim instead)."""
    return x.dim() > 1 and t.shape == (x.shape[0],) + (1,) * (x.dim() - 1)


def fusable(x: torch.Tensor, *ranges: torch.Tensor) -> bool:
    """Whether :func:`quantize_rows` can take `x` and its range tensors: `x` a float32 CPU tensor,
    contiguous or channels last (``utils.layout.is_dense``), with at least one dim and real
    storage (not a tensor subclass such as a fake tensor of a tracer), each range 0-d or (`x` at
    least 2-D) shaped ``(x.shape[0], 1, ..., 1)``."""
    if not x.is_cpu or x.dtype != torch.float32 or x.dim() == 0 or not is_dense(x) or x.numel() == 0:
        return False
    if type(x.detach()) is not torch.Tensor:  # a Parameter detaches to a plain tensor
        return False
    for t in ranges:  # called on every quantization: a plain loop costs less than all() of a generator
        if not t.is_cpu or (t.dim() > 0 and not _one_per_sample(t, x)):
            return False
    return True


def quantize_rows(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, signed: bool,
                  dither_key: int | None, dither_scale: float, dither_offset: float, values: bool,
                  last_dim_sums: bool):
    """``functional.quantize_codes``' codes of a :func:`fusable` `x` in one pass, its affine
    parameters (``_affine_parameters``' fp32 operations) included.

    Args:
        x: float32 CPU tensor, at least 1-D, contiguous or channels last. Its rows for the loop
            run along the last dim where the sums are asked for or ``x`` has at most 2 dims, else
            one row per sample (dim 0, as the per-sample ranges), so a short last dim (a conv
            input's W) costs no loop per row; the codes are the same either way. A channels-last
            `x` is walked in memory order and its codes and values come channels last; its
            dither words are those of the same elements of a contiguous `x`.
        lo, hi: float32 range, one shape: 0-d or one per sample (dim 0 of `x`), as ``(B, 1, ..., 1)``.
        bits: the grid has ``2**bits`` levels; `signed`: codes shifted by ``-2**(bits-1)``, int8
            (uint8 otherwise).
        dither_key: None (round to nearest, half to even) or a 64-bit key: ``v`` becomes
            ``floor(v + w * dither_scale)``, ``w`` the element's word of ``dither_words(n, dither_key)``
            in row-major order, with `dither_offset` (the dither's constant part) added first: the
            stochastic rounding of ``quantize_codes``.
        values: also return ``codes * scale + lo`` (fp32, `x`'s shape; unsigned codes).
        last_dim_sums: also return the codes summed over the last dim (fp32, keepdim; exact).
    Returns:
        ``(codes, values or None, sums or None, scale)``, ``scale = (hi - lo) / (2**bits - 1)``
        (fp32, `lo`'s shape).
    """
    shape = x.shape
    channels = 0  # a channels-last x's channel count: the kernel's dither then follows the row-major index
    if is_channels_last(x):
        if last_dim_sums:  # sums along W: the rows of a row-major copy
            x = x.contiguous()
        else:
            channels = shape[1]
    # numpy's reshapes: the same views as torch's, less overhead per call
    rows = (-1, shape[-1]) if last_dim_sums or len(shape) < 3 else (shape[0], -1)
    matrix = memory_order(x).detach().numpy().reshape(rows)
    # torch allocations (dispatched, so memory counters see them) in x's layout
    codes = torch.empty_like(x, dtype=torch.int8 if signed else torch.uint8)
    out_values = torch.empty_like(x, dtype=torch.float32) if values else None
    sums = torch.empty(shape[:-1] + (1,), dtype=torch.float32) if last_dim_sums else None
    scale = torch.empty(lo.shape, dtype=torch.float32)
    key_low, key_high = _NO_KEY if dither_key is None else _key_halves(dither_key)
    run_kernel(_QUANTIZE_ROWS, matrix.size,
        matrix, lo.detach().numpy().reshape(-1), hi.detach().numpy().reshape(-1), *_grid_constants(bits, signed),
        dither_key is not None, key_low, key_high, np.float32(dither_scale), np.float32(dither_offset),
        np.float32(MIN_STEP), channels,
        memory_order(codes).numpy().reshape(matrix.shape), scale.numpy().reshape(-1),
        memory_order(out_values).numpy().reshape(matrix.shape) if values else _EMPTY_F32,
        sums.numpy().reshape(-1) if last_dim_sums else _EMPTY_F32_1D,
    )
    return codes, out_values, sums, scale


def _grid_constants(bits: int, signed: bool) -> tuple[np.float32, np.float32]:
    """``(levels, shift)`` of :func:`quantize_rows`' grid as float32 scalars."""
    return np.float32(2**bits - 1), np.float32(2 ** (bits - 1) if signed else 0)


def code_column_sums(codes: torch.Tensor) -> torch.Tensor:
    """The column sums ``(1, N)`` (fp32, exact: integers below 2**24 for up to 2**17 rows) of
    contiguous 2-D 8-bit CPU `codes` ``(K, N)``, in one pass over the bytes (torch's
    ``sum(0, dtype=torch.int32)`` first writes the whole matrix out as int32: about 8x slower)."""
    out = torch.empty((1, codes.shape[1]), dtype=torch.float32)
    _column_sums(codes.numpy(), out.reshape(-1).numpy())
    return out


def epilogue_fusable(acc: torch.Tensor, *vectors: torch.Tensor) -> bool:
    """Whether :func:`affine_epilogue` takes `acc` and its float `vectors`: a contiguous 2-D int32
    or float32 CPU `acc` with real storage and float32 or float64 CPU vectors."""
    if acc.device.type != "cpu" or acc.dtype not in (torch.int32, torch.float32) or acc.dim() != 2:
        return False
    if not acc.is_contiguous() or type(acc) is not torch.Tensor:
        return False
    return _float_cpu(vectors)


def _float_cpu(vectors) -> bool:
    """Whether every tensor of `vectors` is a float32 or float64 CPU tensor with real storage (a
    Parameter, such as a bias, detaches to a plain tensor)."""
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
               and type(t.detach()) is torch.Tensor for t in vectors)


def per_row_array(t: torch.Tensor, n: int) -> np.ndarray:
    """`t` (one value, or `n` values in any shape) as a contiguous array of `n` in `t`'s dtype: a
    compiled kernel's per-row (per-sample) scale or offset."""
    return t.detach().reshape(-1).expand(n).contiguous().numpy()


def _float64_array(t: torch.Tensor | None, n: int) -> np.ndarray:
    """`t` as :func:`per_row_array` in float64 (zeros for None): an epilogue's coefficients."""
    return np.zeros(n) if t is None else per_row_array(t.detach().double(), n)


def affine_epilogue(acc: torch.Tensor, row_scale: torch.Tensor, row_offset: torch.Tensor,
                    col_scaled_sums: torch.Tensor, col_bias: torch.Tensor | None, row_term: torch.Tensor,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``row_offset * col_scaled_sums + col_bias + acc * row_scale + row_term`` (``(M, N)``,
    `out_dtype`: float32 or float64) in one pass over an :func:`epilogue_fusable` integer (or
    integer-valued float) product `acc` ``(M, N)``: the int8 kernel's affine terms
    (``kernels.int8.affine_int8_matmul``), which torch adds in four passes.

    `row_scale` and `row_offset`: one value or one per row (``(M, 1)``); `col_scaled_sums` and
    `col_bias`: one per column (``(1, N)`` or ``(N,)``; `col_bias` None for none); `row_term`: one
    per row. The formula's float64 operations in this order, without fused multiply-adds (torch's
    ``addcmul``, which ``affine_int8_matmul`` runs elsewhere, may fuse one: a difference far
    below the final rounding), each coefficient read in float64, the sum rounded once to
    `out_dtype`. The result is a new tensor: written over `acc` the compiler could not prove the
    two arrays apart and would not vectorise the loop (several times slower).
    """
    rows, cols = acc.shape
    out = torch.empty((rows, cols), dtype=out_dtype)
    run_kernel(_AFFINE_EPILOGUE, acc.numel(), acc.numpy(), row_scale.detach().double().reshape(-1).numpy(),
               row_offset.detach().double().reshape(-1).numpy(), _float64_array(col_scaled_sums, cols),
               _float64_array(col_bias, cols), _float64_array(row_term, rows), out.numpy())
    return out


def conv_fusable(codes: torch.Tensor, *vectors: torch.Tensor) -> bool:
    """Whether :func:`channel_sums`, :func:`window_sums` and :func:`conv_epilogue` take a
    convolution's 8-bit `codes` (4-D CPU tensor with real storage, contiguous or channels last)
    and its float32 CPU `vectors`."""
    if codes.device.type != "cpu" or codes.dtype not in (torch.int8, torch.uint8) or codes.dim() != 4:
        return False
    if not is_dense(codes) or type(codes) is not torch.Tensor or codes.numel() == 0:
        return False
    return _float_cpu(vectors)


def channel_sums(codes: torch.Tensor) -> torch.Tensor:
    """The sums over the channels of uint8 `codes` ``(N, C, H, W)`` (contiguous or channels last):
    fp32 ``(N, 1, H, W)``, exact (integers below 2**24), in one pass (torch's ``sum(1,
    dtype=...)``: about 5x slower)."""
    n, c, h, w = codes.shape
    out = torch.empty((n, 1, h, w), dtype=torch.float32)
    if is_channels_last(codes):
        run_kernel(_CHANNEL_SUMS_LAST, codes.numel(), memory_order(codes).numpy().reshape(n, h * w, c),
                   out.numpy().reshape(n, h * w))
    else:
        run_kernel(_CHANNEL_SUMS, codes.numel(), codes.numpy().reshape(n, c, h * w), out.numpy().reshape(n, h * w))
    return out


def window_sums(values: torch.Tensor, kernel_size: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], dilation: tuple[int, int]) -> torch.Tensor:
    """The sums of fp32 `values` ``(N, 1, H, W)`` over each zero-padded window of a convolution's
    geometry: ``(N, 1, Ho, Wo)`` fp32, ``conv2d(values, ones(1, 1, kh, kw), ...)`` in one pass over
    the padded planes (exact for integer values below 2**24, whatever the order)."""
    n = values.shape[0]
    ho, wo = conv_output_hw(values.shape[2:], kernel_size, stride, padding, dilation)
    padded = torch.nn.functional.pad(values, (padding[1], padding[1], padding[0], padding[0])).contiguous()
    out = torch.empty((n, 1, ho, wo), dtype=torch.float32)
    run_kernel(_WINDOW_SUMS, out.numel() * kernel_size[0] * kernel_size[1], padded.numpy()[:, 0],
               *kernel_size, *stride, *dilation, out.numpy()[:, 0])
    return out


def conv_epilogue(acc: torch.Tensor, row_scale: torch.Tensor, window_coef: torch.Tensor,
                  window_sums: torch.Tensor, row_offset: torch.Tensor, border: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``acc * row_scale + window_coef * window_sums + row_offset * border + bias`` as an fp32
    ``(N, Co, Ho, Wo)`` tensor with channels-last strides, from the integer-valued convolution
    `acc` ``(N, Co, Ho, Wo)`` with channels-last strides (the int8 kernel's affine convolution
    terms, ``kernels.int8.affine_int8_conv2d``), in one pass.

    `row_scale`, `window_coef`, `row_offset`: one value per sample ``(N,)`` (or one for all);
    `window_sums` ``(N, 1, Ho, Wo)`` fp32; `border` ``(Ho * Wo, Co)`` (position-major); `bias`
    ``(Co,)`` or None. The float64 operations in that order, without fused multiply-adds, each
    coefficient read in float64, the sum rounded once to fp32.
    """
    n, co, ho, wo = acc.shape
    out = torch.empty((n, ho, wo, co), dtype=torch.float32)  # channels last, permuted back below
    run_kernel(_CONV_EPILOGUE, acc.numel(), memory_order(acc).numpy().reshape(n, ho * wo, co),
               _float64_array(row_scale, n), _float64_array(window_coef, n), window_sums.numpy().reshape(n, ho * wo),
               _float64_array(row_offset, n), border.detach().double().contiguous().numpy().reshape(ho * wo, co),
               _float64_array(bias, co), out.numpy().reshape(n, ho * wo, co))
    return out.permute(0, 3, 1, 2)


def dequantizable(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> bool:
    """Whether :func:`dequantize_rows` can take `codes`: 8-bit CPU codes, contiguous or channels
    last, with at least one dim and one element, `scale` and `lo` float32 CPU tensors of one
    shape, 0-d or (`codes` at least 2-D) ``(codes.shape[0], 1, ..., 1)``."""
    if not codes.is_cpu or codes.dtype not in (torch.uint8, torch.int8) or codes.dim() == 0:
        return False
    if not is_dense(codes) or codes.numel() == 0 or type(codes) is not torch.Tensor:
        return False
    if scale.shape != lo.shape or not (scale.is_cpu and lo.is_cpu):
        return False
    if scale.dtype != torch.float32 or lo.dtype != torch.float32:
        return False
    return scale.dim() == 0 or _one_per_sample(scale, codes)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``codes * scale + lo`` (fp32, shape and layout of `codes`) of :func:`dequantizable`
    operands in one pass: the same two fp32 roundings as ``torch.mul(codes, scale).add_(lo)``, so
    the same bits. `scale`, `lo`: 0-d or one per sample (dim 0)."""
    # one row per sample (dim 0, as the per-sample ranges; a 1-D tensor is one row): a short last
    # dim (a conv's W) costs no loop per row and the ranges need no repeating
    rows = codes.shape[0] if codes.dim() > 1 else 1
    values = torch.empty_like(codes, dtype=torch.float32)  # codes' layout, walked in memory order
    # numpy's reshapes (the same views as torch's, less overhead per call); one range, or one per row
    run_kernel(_DEQUANTIZE_ROWS, codes.numel(), memory_order(codes).numpy().reshape(rows, -1),
               scale.detach().numpy().reshape(-1), lo.detach().numpy().reshape(-1),
               memory_order(values).numpy().reshape(rows, -1))
    return values


def _key_halves(key: int) -> tuple[np.uint32, np.uint32]:
    """A 64-bit key (any Python int, taken mod 2**64) as ``(low, high)`` uint32 halves."""
    key %= 2**64
    return _U32(key & 0xFFFFFFFF), _U32(key >> 32)


_NO_KEY = _key_halves(0)  # what the kernel gets when it rounds to nearest (the dither unused)


def dither_words(n: int, key: int) -> torch.Tensor:
    """The ``n`` CPU dither words (int16 ``(n,)``, uniform on ``[-2**15, 2**15)``) of the 64-bit
    `key`: word ``i`` is a hash of ``(i mod 2**32, key)`` (see the module docstring), so element
    ``i`` of a tensor rounded by :func:`quantize_rows` with ``dither_key=key`` gets word ``i``.
    Distinct indices below ``2**32`` hash to distinct 32-bit values; split over threads by rows."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    words = torch.empty(n, dtype=torch.int16)
    cols = 1024 if n % 1024 == 0 else max(n, 1)  # rows for the threads, when n splits evenly
    run_kernel(_DITHER_ROWS, n, *_key_halves(key), words.numpy().reshape(-1, cols) if n else np.zeros((0, 1), np.int16))
    return words
