"""Real int8 GEMMs for the 8-bit layers (``QuantConfig(kernel="int8")``, SPEC section 4).

The forward GEMM and the layer-gradient GEMM run on int8 codes (:func:`int8_gemm`:
``torch._int_mm`` with int32 accumulation where it is a real int8 GEMM, CUDA or a CPU with
AVX512-VNNI; an fp32 GEMM of the codes on other CPUs, where ``torch._int_mm`` is a scalar loop);
the weight gradient is a float GEMM of the dequantized input and the full-precision output
gradient, as gradient bifurcation requires.

Affine operands, exactly. An operand holds int8 codes ``c = q - 2**(bits-1)`` of the SPEC-4 codes
``q`` with ``value = c * scale + offset``, ``offset = lo + 2**(bits-1) * scale`` (the shift to
signed range is folded into the offset). For ``A (M, K)`` and ``B (K, N)``::

    A^ @ B^ = s_a s_b (C_a @ C_b) + s_a o_b rowsum(C_a) 1^T + o_a s_b 1 colsum(C_b) + K o_a o_b

The integer product is exact in int32 (``|c| <= 128``, so up to ``K < 2**17``: a layer summing more
products per output, forward or layer gradient, falls back to the simulated kernel), and in an fp32
GEMM up to ``K = 1024`` (rounded like any fp32 GEMM beyond); the correction terms are cheap
vectors (no symmetric-scale approximation). The four terms are added in float64 and rounded once
to fp32: they are far larger than their sum where the offsets are (an activation range's middle
times a column's code sum; up to about 1e4 in MiniLM's output layers against outputs of about
1-40), and summed in fp32 their rounding errors, about 1e-3 there, would be hundreds of the
output's own fp32 steps. So the result is the exact product of the dequantized operands
(``codes * scale + offset`` taken exactly) rounded to fp32, within float64 error (on the fp32-GEMM
path for ``K`` up to 1,024; beyond, its integer product carries an fp32 GEMM's rounding): at least
as close as the simulated kernel's fp32 GEMM of the same operands. A convolution's layer gradient
by im2col folds the float64 columns before the one rounding.

Conv2d on a CPU with oneDNN's int8 convolution (:func:`onednn_conv_available`) runs it directly on
the codes (:func:`affine_int8_conv2d`; the layer gradient as a convolution of the output gradient
with the flipped weight); elsewhere as a GEMM over im2col patches of the codes.
"""
from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..functional import quantize_fused
from ..gemm import Conv2dGemm, Gemm, LinearGemm, TransposedLinearGemm
from .base import Kernel
from .simulated import dequantize_codes

CUDA_MIN_ROWS = 17  # torch._int_mm on CUDA: M > 16, K and N multiples of 8
CUDA_MULTIPLE = 8


class Int8Operand(NamedTuple):
    """Quantized tensor: ``value = codes * scale + offset``.

    ``codes`` int8, the shape of the float tensor; ``scale``/``offset`` fp32, 0-d or (per-sample
    ranges) shape ``(batch, 1, ..., 1)`` broadcastable to ``codes``; ``last_dim_sums`` fp32, the
    codes summed over the last dim (keepdim; exact: integers below 2**24), or None.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    last_dim_sums: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The fp32 values ``codes * scale + offset``, the float tensor's shape."""
        return dequantize_codes(self.codes, self.scale, self.offset)

    def rows(self) -> "Int8Operand":
        """As a matrix ``(M, K)`` over the last dim, contiguous; scale/offset/sums 0-d or ``(M, 1)``."""
        k = self.codes.shape[-1]
        lead = self.codes.shape[:-1] + (1,)
        scale, offset = (t if t.dim() == 0 else t.expand(lead).reshape(-1, 1) for t in (self.scale, self.offset))
        sums = None if self.last_dim_sums is None else self.last_dim_sums.reshape(-1, 1)
        return Int8Operand(self.codes.reshape(-1, k).contiguous(), scale, offset, sums)


# An fp32 GEMM of int8 codes is exact while every partial sum is an integer of at most 2**24:
# |c_a c_b| <= 128 * 128 = 2**14 per product, so up to 2**10 products in any order
FLOAT_EXACT_MAX_K = 2**24 // 128**2
# The most products an int32 sum holds without overflow: signed codes (torch._int_mm: |c_a c_b| <= 2**14), and
# oneDNN's convolution of unsigned activation codes (|q c_w| <= 255 * 128)
INT32_MAX_K = (2**31 - 1) // 128**2  # 131,071
ONEDNN_CONV_MAX_K = (2**31 - 1) // (255 * 128)  # 65,793
INT_MM_CPU_FLAG = "avx512_vnni"
INT_MM_PATH, FLOAT_PATH = "torch._int_mm", "fp32 GEMM of the codes"  # int8_gemm_path's answers


@functools.cache
def _cpu_has_int8_dot_flag() -> bool:
    """Whether the CPU has ``INT_MM_CPU_FLAG``, as PyTorch's own probe (the cpuinfo library, on
    every OS; ``torch.cpu.get_capabilities``) reports it, which is what its ``_int_mm`` checks;
    from Linux's ``/proc/cpuinfo`` on a torch without that function (False where unknown)."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        return bool(capabilities().get(INT_MM_CPU_FLAG, False))
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return INT_MM_CPU_FLAG in flags


def cpu_has_int8_dot() -> bool:
    """Whether ``torch._int_mm`` runs a real int8 GEMM on this CPU: PyTorch's CPU ``_int_mm`` calls
    oneDNN only when the CPU has AVX512-VNNI (AMX CPUs have it too) and oneDNN is enabled
    (``torch.backends.mkldnn``); everywhere else (AVX2, AVX-VNNI without AVX-512, ARM) it runs a
    scalar triple loop, 10-60x slower than an fp32 GEMM (``aten/src/ATen/native/LinearAlgebra.cpp``,
    ``_int_mm_out_cpu``). Where this is False, :func:`int8_gemm` takes fp32 GEMMs of the codes instead."""
    return _cpu_has_int8_dot_flag() and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def _int_mm_operand(b: torch.Tensor) -> torch.Tensor:
    """`b` ``(K, N)`` in a layout ``torch._int_mm`` computes exactly: contiguous, or on the CPU also
    the transpose of a contiguous ``(N, K)`` tensor (a Linear's ``W.T``; oneDNN's preferred
    layout). Both checked exact in tests; other strides are copied (strided operands have given
    wrong results). On an AMX CPU the contiguous layout costs 0.3 ms more than the preferred one
    in a 1,024 x 3,072 x 768 GEMM, a transposed copy of the codes 1-2 ms."""
    if b.is_contiguous() or (b.device.type == "cpu" and b.T.is_contiguous()):
        return b
    return b.contiguous()


def int8_gemm_path(device: torch.device) -> str:
    """How :func:`int8_gemm` multiplies on `device`: ``"torch._int_mm"`` (a real int8 GEMM: CUDA, or
    a CPU where :func:`cpu_has_int8_dot`) or ``"fp32 GEMM of the codes"`` (other CPUs)."""
    if torch.device(device).type == "cpu" and not cpu_has_int8_dot():
        return FLOAT_PATH
    return INT_MM_PATH


def int8_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The integer product ``a @ b`` of int8 `a` ``(M, K)`` (contiguous) and `b` ``(K, N)`` (any
    strides), ``(M, N)``.

    ``torch._int_mm`` (int32, exact) on CUDA and on CPUs where it is a real int8 GEMM
    (:func:`cpu_has_int8_dot`; :func:`int8_gemm_path` says which). On other CPUs one fp32 GEMM
    of the codes (the BLAS's fast path): exact for ``K <= FLOAT_EXACT_MAX_K`` (1,024: every
    partial sum is an integer below 2**24), beyond that rounded like any fp32 GEMM's partial sums
    (fp32 result).
    """
    if int8_gemm_path(a.device) == FLOAT_PATH:
        return a.float() @ b.float()
    m = a.shape[0]
    if a.is_cuda and m < CUDA_MIN_ROWS:  # zero rows are exact and dropped below
        a = F.pad(a, (0, 0, 0, CUDA_MIN_ROWS - m))
    return torch._int_mm(a, _int_mm_operand(b))[:m]


def code_column_sums(codes: torch.Tensor) -> torch.Tensor:
    """``(1, N)`` column sums of 8-bit `codes` ``(K, N)``, exact: one compiled pass over a contiguous
    CPU matrix (``fused.code_column_sums``: the layer gradient's weight codes), torch's int32 sum
    elsewhere."""
    if codes.device.type == "cpu" and codes.dim() == 2 and codes.is_contiguous() and type(codes) is torch.Tensor:
        from .. import fused  # numba, imported on the first call

        return fused.code_column_sums(codes)
    return codes.sum(0, keepdim=True, dtype=torch.int32)


def affine_int8_matmul(a: Int8Operand, b: Int8Operand, b_colsum: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``A^ @ B^ + bias`` (``(M, N)``, `out_dtype`: float32 or float64) of row operand `a` (``(M,
    K)`` contiguous codes, as from ``Int8Operand.rows``) and `b` (``(K, N)`` codes, any strides,
    0-d scale/offset), via one int8 x int8 GEMM (:func:`int8_gemm`) and the exact zero-point terms,
    added in float64 and rounded once (the module docstring says why): in one compiled pass on the
    CPU (``fused.affine_epilogue``), by torch ops elsewhere. `b_colsum`: `b`'s codes summed over
    dim 0, ``(1, N)``, when already known; `bias`: ``(N,)`` or None."""
    k = a.codes.shape[1]
    acc = int8_gemm(a.codes, b.codes)
    rowsum = a.last_dim_sums if a.last_dim_sums is not None else a.codes.sum(1, keepdim=True, dtype=torch.int32)
    colsum = b_colsum if b_colsum is not None else code_column_sums(b.codes)  # (1, N)
    # float64 (a 0-d float64 tensor times a float32 vector would give float32)
    a_scale, a_offset, b_scale, b_offset, rowsum, colsum = (
        t.double() for t in (a.scale, a.offset, b.scale, b.offset, rowsum, colsum))
    row_term = a_scale * b_offset * rowsum + k * a_offset * b_offset  # (M, 1)
    col_scaled_sums, row_scale = b_scale * colsum, a_scale * b_scale  # (1, N); 0-d or (M, 1)
    from .. import fused  # numba, imported on the first call

    if fused.epilogue_fusable(acc, *(() if bias is None else (bias,))):
        return fused.affine_epilogue(acc, row_scale, a_offset, col_scaled_sums, bias, row_term, out_dtype)
    col_term = a_offset * col_scaled_sums  # (1, N), or (M, N) with per-row offsets
    if bias is not None:
        col_term = col_term + bias
    return torch.addcmul(col_term, acc.double(), row_scale).add_(row_term).to(out_dtype)


def onednn_conv_available(device: torch.device) -> bool:
    """Whether :func:`int8_conv2d` runs on `device`: a CPU where :func:`cpu_has_int8_dot` (oneDNN's
    u8 x s8 convolution accumulates exactly in int32 there; without VNNI its AVX2 path sums pairs
    of products in saturating int16) and this torch's oneDNN quantized convolution computes a
    probe convolution of extreme codes exactly (:func:`_onednn_conv_exact`, once per process)."""
    return torch.device(device).type == "cpu" and cpu_has_int8_dot() and _onednn_conv_exact()


@functools.cache
def _onednn_conv_exact() -> bool:
    """One small :func:`int8_conv2d` of random and extreme codes (255 x -128 sums) against the
    exact float convolution of the same integers; False where the ops are missing or fail (an
    older torch) or the result differs."""
    if not (hasattr(torch.ops.onednn, "qconv2d_pointwise") and hasattr(torch.ops.onednn, "qconv_prepack")):
        return False
    generator = torch.Generator().manual_seed(0)
    unsigned = torch.randint(0, 256, (2, 32, 6, 5), dtype=torch.uint8, generator=generator)
    weight = torch.randint(-128, 128, (16, 32, 3, 3), dtype=torch.int8, generator=generator)
    unsigned[0], weight[0] = 255, -128  # the largest products, summed over 288 taps
    with torch.autocast("cpu", enabled=False):  # the first forward may run under the trainer's autocast
        try:
            acc = int8_conv2d(unsigned.contiguous(memory_format=torch.channels_last), weight, (1, 1), (1, 1), (1, 1))
        except RuntimeError:  # the ops' signatures differ in this torch
            return False
        exact = F.conv2d(unsigned.double(), weight.double(), None, 1, 1)
    return acc.shape == exact.shape and torch.equal(acc.double(), exact)


def int8_conv2d(unsigned: torch.Tensor, weight_codes: torch.Tensor, stride, padding, dilation) -> torch.Tensor:
    """The integer convolution of uint8 `unsigned` ``(N, C, H, W)`` (channels-last strides) with
    int8 `weight_codes` ``(Co, C, kh, kw)``, zero padding, as fp32 ``(N, Co, Ho, Wo)`` with
    channels-last strides: oneDNN's int8 convolution (``torch.ops.onednn.qconv2d_pointwise``, unit
    scales, zero points 0) where :func:`onednn_conv_available`. The int32 sums are exact up to
    ``ONEDNN_CONV_MAX_K`` taps (``C kh kw``; ``Int8Kernel`` leaves wider layers to the simulated
    kernel); their fp32 values are exact below 2**24 and rounded like any fp32 sum beyond."""
    ones, zero_points = _unit_weight_quantization()
    geometry = (list(stride), list(padding), list(dilation), 1)
    packed = torch.ops.onednn.qconv_prepack(weight_codes.contiguous(), ones, 1.0, 0, *geometry, list(unsigned.shape))
    acc = torch.ops.onednn.qconv2d_pointwise(unsigned, 1.0, 0, packed, ones, zero_points, None, *geometry,
                                             1.0, 0, torch.float32, "none", [], "")
    return acc.contiguous(memory_format=torch.channels_last)  # a no-op: oneDNN returns channels last


@functools.cache
def _unit_weight_quantization() -> tuple[torch.Tensor, torch.Tensor]:
    """The weight scale (1) and zero point (0) :func:`int8_conv2d` gives oneDNN: one for the whole
    tensor (one value per output channel costs oneDNN a host read per channel on every call; the
    same result). Cached: read, never written."""
    return torch.ones(1), torch.zeros(1, dtype=torch.int64)


CODE_SHIFT = 128  # int8 codes + 128 (the sign bit flipped) are uint8, oneDNN's activation type


@functools.lru_cache(maxsize=256)
def _valid_taps(input_hw, kernel_size, stride, padding, dilation, insert, extra, device: str) -> torch.Tensor:
    (h, w), (ih, iw) = input_hw, insert
    mask = torch.zeros(1, 1, (h - 1) * ih + 1 + extra[0], (w - 1) * iw + 1 + extra[1], device=device)
    mask[..., ::ih, ::iw][..., :h, :w] = 1
    return F.unfold(mask, kernel_size, dilation, padding, stride)[0].T.contiguous()


def valid_taps(input_hw: tuple[int, int], kernel_size: tuple[int, int], stride, padding, dilation,
               device: torch.device, insert: tuple[int, int] = (1, 1), extra: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``(Ho * Wo, kh * kw)`` fp32, 1 where a kernel tap of an output position falls on an input
    pixel, 0 where it falls on zero padding, or on a zero inserted between the pixels (``insert``:
    pixels ``sh``/``sw`` apart) or added at the bottom/right (``extra`` rows/columns). Cached: it
    depends on the geometry only (do not write to it)."""
    return _valid_taps(tuple(input_hw), tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation),
                       tuple(insert), tuple(extra), str(device))


def affine_int8_conv2d(x: Int8Operand, w: Int8Operand, bias: torch.Tensor | None, stride, padding, dilation,
                       insert: tuple[int, int] = (1, 1), extra: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``conv2d(X^, W^) + bias`` (fp32 ``(N, Co, Ho, Wo)``, channels last: oneDNN's layout) of the
    8-bit input `x` (``(N, C, H, W)`` int8 codes, contiguous or channels last (no copy),
    scale/offset 0-d or per sample) and weight `w` (``(Co, C, kh, kw)`` int8 codes, 0-d
    scale/offset) on a CPU: one integer convolution of the
    codes (:func:`int8_conv2d`) and the zero-point terms in one compiled pass. ``insert`` spreads
    the input's pixels apart with zeros between, ``extra`` adds zero rows/columns at the
    bottom/right: a strided convolution's layer gradient as a convolution.

    With unsigned codes ``q = c + 128`` (``X^ = s_x q + l_x``, ``l_x = o_x - 128 s_x``), a padded or
    inserted tap holds ``q = 0``, so summing over the taps ``t`` that fall on input pixels::

        conv(X^, W^) = s_x s_w conv(q, c_w) + s_x o_w sum_t q + l_x (s_w sum_t c_w + o_w C n_t)

    ``sum_t q`` are window sums of the channel sums of ``q``; ``sum_t c_w`` and the number of such
    taps ``n_t`` depend on the weight and the geometry only (:func:`valid_taps`). The result is the
    float convolution of the same dequantized operands up to fp32 rounding.
    """
    from .. import fused  # numba, imported on the first call

    n, c, h, wd = x.codes.shape
    kernel_size = tuple(w.codes.shape[2:])
    shifted = x.codes.view(torch.uint8) ^ CODE_SHIFT  # c + 128: c's bits with the sign bit flipped
    channel_sums = fused.channel_sums(shifted)  # (N, 1, H, W)
    spread = ((h - 1) * insert[0] + 1 + extra[0], (wd - 1) * insert[1] + 1 + extra[1])
    if spread == (h, wd):
        unsigned = shifted.contiguous(memory_format=torch.channels_last)
    else:  # q = 0 between the pixels and in the extra rows and columns
        unsigned = torch.zeros((n,) + spread + (c,), dtype=torch.uint8).permute(0, 3, 1, 2)  # channels last
        unsigned[..., ::insert[0], ::insert[1]][..., :h, :wd] = shifted
        spread_sums = channel_sums.new_zeros((n, 1) + spread)
        spread_sums[..., ::insert[0], ::insert[1]][..., :h, :wd] = channel_sums
        channel_sums = spread_sums
    acc = int8_conv2d(unsigned, w.codes, stride, padding, dilation)
    ho, wo = acc.shape[2:]
    window_sums = fused.window_sums(channel_sums, kernel_size, tuple(stride), tuple(padding), tuple(dilation))
    taps = valid_taps((h, wd), kernel_size, stride, padding, dilation, acc.device, insert, extra)  # (P, kh kw)
    x_scale, x_offset, w_scale, w_offset = (t.double() for t in (x.scale, x.offset, w.scale, w.offset))
    return fused.conv_epilogue(acc, x_scale * w_scale, x_scale * w_offset, window_sums,
                               x_offset - CODE_SHIFT * x_scale, _weight_over_taps(w, taps), bias)


def _weight_over_taps(w: Int8Operand, taps: torch.Tensor) -> torch.Tensor:
    """``(P, Co)`` float64: for each output position, the sum of the weight values ``W^`` over the
    kernel taps `taps` marks (``(P, kh kw)``, 1 or 0) and all input channels, ``s_w sum c_w + o_w C
    n_t``: the term an input offset multiplies in a convolution of affine codes."""
    cout, c = w.codes.shape[:2]
    tap_sums = w.codes.sum(1, dtype=torch.float64).reshape(cout, -1)  # (Co, kh kw), over C
    taps = taps.double()
    return w.scale.double() * (taps @ tap_sums.T) + (w.offset.double() * c) * taps.sum(1, keepdim=True)

def conv_windows(t: torch.Tensor, gemm: Conv2dGemm, kernel_size: tuple[int, int]) -> torch.Tensor:
    """The zero-padded kernel windows of `t` ``(N, C, H, W)`` as a view ``(N, C, Ho, Wo, kh, kw)``
    (any dtype: ``F.unfold`` has no int8 version)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel_size, gemm.stride, gemm.padding, gemm.dilation
    windows = F.pad(t, (pw, pw, ph, ph)).unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)
    return windows[..., ::dh, ::dw]


def conv_patches(codes: torch.Tensor, gemm: Conv2dGemm, kernel_size: tuple[int, int]) -> torch.Tensor:
    """im2col of int8 `codes` ``(N, C, H, W)``: ``(N * Ho * Wo, C * kh * kw)`` contiguous, rows in
    ``(n, ho, wo)`` order, columns in ``(c, i, j)`` order (a Conv2d weight's ``reshape(Cout, -1)``).
    Padded positions hold code 0; the caller corrects for them."""
    patches = conv_windows(codes, gemm, kernel_size)
    n, c, ho, wo = patches.shape[:4]
    return patches.permute(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * kernel_size[0] * kernel_size[1])


def _onednn_takes(operand: Int8Operand) -> bool:
    """Whether the oneDNN convolution path (:func:`affine_int8_conv2d`) takes `operand`'s codes."""
    from .. import fused  # numba, imported on the first call

    return onednn_conv_available(operand.codes.device) and fused.conv_fusable(operand.codes, operand.scale,
                                                                              operand.offset)


def _int32_overflow(gemm_type: type, weight: torch.Tensor) -> str | None:
    """Why the layer of `weight` cannot sum its int8 products in int32 (None: it can, or its path
    sums in fp32: the fp32 GEMM of CPUs without an int8 GEMM). Each output sums the forward's
    products over the inputs and the layer gradient's over the outputs: a Linear/Conv1D's two
    dims; a Conv2d's ``C kh kw`` and ``Cout kh kw`` of unsigned codes by oneDNN's convolution, or
    ``C kh kw`` and ``Cout`` of signed codes by im2col GEMMs. Cheap: runs on every forward."""
    if weight.device.type == "cpu" and not cpu_has_int8_dot():
        return None
    if gemm_type is not Conv2dGemm:
        k, limit = max(weight.shape[:2]), INT32_MAX_K
    elif onednn_conv_available(weight.device):
        k, limit = max(weight.shape[:2]) * weight.shape[2] * weight.shape[3], ONEDNN_CONV_MAX_K
    else:
        k, limit = max(weight.shape[1] * weight.shape[2] * weight.shape[3], weight.shape[0]), INT32_MAX_K
    if k <= limit:
        return None
    return (f"{gemm_type.__name__[:-4]} weight {tuple(weight.shape)} sums {k:,} int8 products per output, more "
            f"than an int32 sum holds exactly ({limit:,})")


class Int8Kernel(Kernel):
    """Integer GEMMs of the int8 codes (:func:`int8_gemm`) for the forward and layer-gradient
    GEMMs of Linear, Conv1D and Conv2d (``groups=1``) layers; the weight gradient is the float
    GEMM of the dequantized input.

    Conv2d: oneDNN's int8 convolution of the codes on CPUs that have it (:func:`affine_int8_conv2d`),
    elsewhere a GEMM over im2col patches of the int8 input codes, ``(N Ho Wo, C kh kw) @ (C kh kw,
    Cout)``. Zero padding is an exact 0, which no affine code represents: padded taps hold code 0
    and the zero-point terms count only taps inside the input (:func:`valid_taps`), so the output
    is ``conv2d(x^, W^)`` of the simulated kernel up to fp32 rounding. The layer gradient is the
    same convolution of ``g^`` with the flipped weight, or the int8 GEMM ``g^ (N Ho Wo, Cout) @ W^
    (Cout, C kh kw)`` folded back (col2im) onto the input.
    """

    name = "int8"

    def unsupported_reason(self, gemm_type, weight, groups=1):
        if gemm_type not in (LinearGemm, TransposedLinearGemm, Conv2dGemm):
            return f"{gemm_type.__name__[:-4]} has no int8 kernel"
        if groups != 1:
            return f"grouped Conv2d (groups={groups}) has no int8 kernel"
        overflow = _int32_overflow(gemm_type, weight)
        if overflow is not None:
            return overflow
        if weight.device.type == "cuda":
            dims = (weight.shape[0], weight[0].numel())  # (out, in) of the GEMM, or (Cout, C kh kw)
            if any(d % CUDA_MULTIPLE for d in dims):
                return (f"CUDA int8 GEMM needs GEMM dims multiple of {CUDA_MULTIPLE}, got {dims} "
                        f"(weight {tuple(weight.shape)})")
        elif weight.device.type != "cpu":
            return f"no int8 GEMM on device type {weight.device.type!r}"
        return None

    def quantize(self, x, lo, hi, bits, stochastic):
        # Linear/Conv1D rows run along the last dim; a 4-D (Conv2d) tensor's GEMM rows are patches
        codes, _, sums, scale = quantize_fused(x, lo, hi, bits, stochastic, signed=True, values=False,
                                               last_dim_sums=x.dim() < 4)
        # the offset lo + 2**(bits-1) * scale in one op: the product by a power of two is exact
        return Int8Operand(codes, scale, torch.add(lo, scale, alpha=2 ** (bits - 1)), sums)

    def forward(self, gemm: Gemm, x_q: Int8Operand, w_q: Int8Operand, bias):
        if isinstance(gemm, Conv2dGemm):
            return self._conv_forward(gemm, x_q, w_q, bias)
        if isinstance(gemm, LinearGemm):  # W (out, in): B = W.T, its column sums are W's row sums
            w, colsum = w_q.codes.T, w_q.last_dim_sums.reshape(1, -1)
        else:
            w, colsum = w_q.codes, None
        y = affine_int8_matmul(x_q.rows(), Int8Operand(w, w_q.scale, w_q.offset), colsum, bias)
        return y.reshape(x_q.codes.shape[:-1] + (y.shape[-1],))

    def grad_input(self, gemm: Gemm, g_q: Int8Operand, w_q: Int8Operand, input_shape):
        if isinstance(gemm, Conv2dGemm):
            return self._conv_grad_input(gemm, g_q, w_q, input_shape)
        if isinstance(gemm, LinearGemm):  # B = W (out, in)
            w, colsum = w_q.codes, None
        else:  # Conv1D: B = W.T (out, in), its column sums are W's row sums
            w, colsum = w_q.codes.T, w_q.last_dim_sums.reshape(1, -1)
        return affine_int8_matmul(g_q.rows(), Int8Operand(w, w_q.scale, w_q.offset), colsum).reshape(input_shape)

    def grad_weight(self, gemm: Gemm, x_q: Int8Operand, g, weight_shape):
        return gemm.grad_weight(x_q.dequantize(), g, weight_shape)

    def _conv_forward(self, gemm: Conv2dGemm, x_q: Int8Operand, w_q: Int8Operand, bias):
        """``(N, C, H, W)`` -> ``(N, Cout, Ho, Wo)``: oneDNN's int8 convolution where it runs
        (contiguous), else im2col and one int8 GEMM (channels-last strides); 0-d input range."""
        if _onednn_takes(x_q):
            return affine_int8_conv2d(x_q, w_q, bias, gemm.stride, gemm.padding, gemm.dilation)
        cout, kernel_size = w_q.codes.shape[0], tuple(w_q.codes.shape[2:])
        n, c, h, w = x_q.codes.shape
        # each patch's code sum (padding: code 0): the channel sums summed over each window, in fp32,
        # exact in any order (integers below 2**24; not a float conv, which may use TF32 or Winograd)
        channel_sums = x_q.codes.sum(1, keepdim=True, dtype=torch.float32)
        patch_sums = conv_windows(channel_sums, gemm, kernel_size).sum((-2, -1))  # (N, 1, Ho, Wo)
        ho, wo = patch_sums.shape[2:]
        patches = Int8Operand(conv_patches(x_q.codes, gemm, kernel_size), x_q.scale, x_q.offset,
                              patch_sums.reshape(-1, 1))
        w_rows = w_q.codes.reshape(cout, -1)  # (Cout, C kh kw); B is its transpose
        # (M, Cout) in float64: the padded taps' term below is taken off before the one rounding
        y = affine_int8_matmul(patches, Int8Operand(w_rows.T, w_q.scale, w_q.offset), None, bias, torch.float64)
        # that counts a padded tap as x^ = o_x (code 0); it is 0: take o_x * W^ over padded taps off
        padded = 1 - valid_taps((h, w), kernel_size, gemm.stride, gemm.padding, gemm.dilation, y.device)  # (P, kh kw)
        border = x_q.offset.double() * _weight_over_taps(w_q, padded)  # (P, Cout)
        y = y.reshape(n, ho * wo, cout).sub_(border).float()
        return y.reshape(n, ho, wo, cout).permute(0, 3, 1, 2)

    def _conv_grad_input(self, gemm: Conv2dGemm, g_q: Int8Operand, w_q: Int8Operand, input_shape):
        """``dL/dx`` ``(N, C, H, W)`` of ``g^`` (per-tensor or per-sample range) and ``W^``.

        Where oneDNN's int8 convolution runs: the transposed convolution as a convolution
        (:func:`affine_int8_conv2d`) of ``g^`` spread by the stride with zeros between, and
        ``W^`` with its channel dims swapped and its taps flipped, padding ``d (k - 1) - p``
        (when that is not negative) and ``output_padding`` as zero rows and columns at the end.
        Otherwise ``g^`` rows ``(N Ho Wo, Cout)`` times ``W^`` ``(Cout, C kh kw)``, then col2im.
        """
        kernel_size = tuple(w_q.codes.shape[2:])
        flipped_padding = tuple(d * (k - 1) - p for d, k, p in zip(gemm.dilation, kernel_size, gemm.padding))
        if _onednn_takes(g_q) and min(flipped_padding) >= 0:
            extra = tuple(size - ((g - 1) * s - 2 * p + d * (k - 1) + 1) for size, g, s, p, d, k in zip(
                input_shape[2:], g_q.codes.shape[2:], gemm.stride, gemm.padding, gemm.dilation, kernel_size))
            w_t = Int8Operand(w_q.codes.transpose(0, 1).flip(2, 3).contiguous(), w_q.scale, w_q.offset)
            return affine_int8_conv2d(g_q, w_t, None, (1, 1), flipped_padding, gemm.dilation, insert=gemm.stride,
                                      extra=extra)
        cout = w_q.codes.shape[0]
        n = g_q.codes.shape[0]
        g_rows = Int8Operand(g_q.codes.permute(0, 2, 3, 1), g_q.scale, g_q.offset).rows()  # (M, Cout)
        g_rows = g_rows._replace(last_dim_sums=g_q.codes.sum(1, dtype=torch.float32).reshape(-1, 1))
        w_rows = Int8Operand(w_q.codes.reshape(cout, -1), w_q.scale, w_q.offset)  # (Cout, K)
        cols = affine_int8_matmul(g_rows, w_rows, out_dtype=torch.float64)  # (M, K): folded, then rounded once
        cols = cols.reshape(n, -1, cols.shape[1]).transpose(1, 2)  # (N, K, P)
        return F.fold(cols, tuple(input_shape[2:]), kernel_size, gemm.dilation, gemm.padding, gemm.stride).float()


class Int8Bf16Kernel(Int8Kernel):
    """``int8``, plus a bfloat16 weight gradient (``QuantConfig(kernel="int8_bf16")``).

    ``dL/dW`` from the input's int8 codes ``C`` (exact in bfloat16) and the full-precision output
    gradient ``g`` rounded to bfloat16, as one bfloat16 GEMM with the affine terms in fp32
    (Linear: ``dL/dW = s_x (g^T C) + o_x (g^T 1) 1^T``; Conv1D its transpose). The GEMM
    accumulates in fp32 but returns bfloat16, so each weight-gradient entry carries a relative
    error up to about ``2**-8`` (bfloat16's 8 significant bits), against fp32 rounding for
    ``int8``. Fast where the hardware has bfloat16 dot products (CPUs with AVX512-BF16 or AMX,
    recent GPUs); elsewhere bfloat16 GEMMs can be slower than fp32.
    """

    name = "int8_bf16"

    def unsupported_reason(self, gemm_type, weight, groups=1):
        if gemm_type is Conv2dGemm:
            return "int8_bf16 has no bfloat16 Conv2d weight gradient"
        return super().unsupported_reason(gemm_type, weight, groups)

    def grad_weight(self, gemm, x_q, g, weight_shape):
        # the input operand has one range per tensor (0-d scale and offset, see layers.py)
        codes = x_q.codes.reshape(-1, x_q.codes.shape[-1]).to(torch.bfloat16)  # (M, in)
        g = g.reshape(-1, g.shape[-1])  # (M, out)
        g_sum = g.sum(0)  # (out,) fp32
        if isinstance(gemm, LinearGemm):  # (out, in)
            product, offset_term = g.to(torch.bfloat16).T @ codes, (x_q.offset * g_sum)[:, None]
        else:  # Conv1D: (in, out)
            product, offset_term = codes.T @ g.to(torch.bfloat16), (x_q.offset * g_sum)[None, :]
        return product.float().mul_(x_q.scale).add_(offset_term).reshape(weight_shape)
