"""Real int8 GEMMs for the 8-bit layers (``QuantConfig(kernel="int8")``, SPEC section 4).

The forward GEMM and the layer-gradient GEMM run on int8 codes with int32 accumulation
(``torch._int_mm``); the weight gradient is a float GEMM of the dequantized input and the
full-precision output gradient, as gradient bifurcation requires.

Affine operands, exactly. An operand holds int8 codes ``c = q - 2**(bits-1)`` of the SPEC-4 codes
``q`` with ``value = c * scale + offset``, ``offset = lo + 2**(bits-1) * scale`` (the shift to
signed range is folded into the offset). For ``A (M, K)`` and ``B (K, N)``::

    A^ @ B^ = s_a s_b (C_a @ C_b) + s_a o_b rowsum(C_a) 1^T + o_a s_b 1 colsum(C_b) + K o_a o_b

The integer product is exact in int32 (``|c| <= 128``, so up to ``K < 2**17``); the correction
terms are cheap vectors, so the result equals the simulated kernel's float GEMM of the same
dequantized operands up to fp32 rounding (no symmetric-scale approximation).
"""
from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..functional import quantize_codes
from ..gemm import Gemm, LinearGemm, TransposedLinearGemm
from .base import Kernel

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
        return torch.mul(self.codes, self.scale).add_(self.offset)

    def rows(self) -> "Int8Operand":
        """As a matrix ``(M, K)`` over the last dim, contiguous; scale/offset/sums 0-d or ``(M, 1)``."""
        k = self.codes.shape[-1]
        lead = self.codes.shape[:-1] + (1,)
        scale, offset = (t if t.dim() == 0 else t.expand(lead).reshape(-1, 1) for t in (self.scale, self.offset))
        sums = None if self.last_dim_sums is None else self.last_dim_sums.reshape(-1, 1)
        return Int8Operand(self.codes.reshape(-1, k).contiguous(), scale, offset, sums)


def _int_mm_operand(b: torch.Tensor) -> torch.Tensor:
    """`b` ``(K, N)`` in a layout ``torch._int_mm`` computes correctly: contiguous, or on the CPU
    also the transpose of a contiguous ``(N, K)`` tensor (oneDNN's preferred layout, checked exact
    in tests). Other strides are copied (strided operands have given wrong results)."""
    if b.is_contiguous() or (b.device.type == "cpu" and b.T.is_contiguous()):
        return b
    return b.contiguous()


def affine_int8_matmul(a: Int8Operand, b: Int8Operand, b_colsum: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A^ @ B^ + bias`` (fp32, ``(M, N)``) of row operand `a` (``(M, K)`` contiguous codes, as
    from ``Int8Operand.rows``) and `b` (``(K, N)`` codes, any strides, 0-d scale/offset), via one
    int8 x int8 -> int32 GEMM and the exact zero-point terms. `b_colsum`: `b`'s codes summed over
    dim 0, ``(1, N)``, when already known; `bias`: ``(N,)`` or None."""
    a_codes, b_codes = a.codes, _int_mm_operand(b.codes)
    m, k = a_codes.shape
    if a_codes.is_cuda and m < CUDA_MIN_ROWS:  # zero rows are exact and dropped below
        a_codes = F.pad(a_codes, (0, 0, 0, CUDA_MIN_ROWS - m))
    acc = torch._int_mm(a_codes, b_codes)[:m]
    rowsum = a.last_dim_sums if a.last_dim_sums is not None else a.codes.sum(1, keepdim=True, dtype=torch.int32)
    colsum = b_colsum if b_colsum is not None else b_codes.sum(0, keepdim=True, dtype=torch.int32)  # (1, N)
    row_term = a.scale * b.offset * rowsum + k * a.offset * b.offset  # (M, 1)
    col_term = a.offset * (b.scale * colsum)  # (1, N), or (M, N) with per-row offsets
    if bias is not None:
        col_term = col_term + bias
    return torch.mul(acc, a.scale * b.scale).add_(row_term).add_(col_term)


@functools.cache
def cpu_has_int8_dot() -> bool:
    """Whether the CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8), which
    make ``torch._int_mm`` fast on the CPU (Linux ``/proc/cpuinfo``; False where unknown)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


class Int8Kernel(Kernel):
    """``torch._int_mm`` for the forward and layer-gradient GEMMs of Linear and Conv1D layers."""

    name = "int8"

    def unsupported_reason(self, gemm_type, weight):
        if gemm_type not in (LinearGemm, TransposedLinearGemm):
            return f"{gemm_type.__name__[:-4]} has no int8 kernel"
        if weight.device.type == "cuda":
            bad = [d for d in weight.shape if d % CUDA_MULTIPLE]
            if bad:
                return f"CUDA int8 GEMM needs in/out features multiple of {CUDA_MULTIPLE}, got {tuple(weight.shape)}"
        elif weight.device.type != "cpu":
            return f"no int8 GEMM on device type {weight.device.type!r}"
        return None

    def quantize(self, x, lo, hi, bits, stochastic):
        codes, scale = quantize_codes(x, lo, hi, bits, stochastic, signed=True)
        return Int8Operand(codes.to(torch.int8), scale, lo + 2 ** (bits - 1) * scale, codes.sum(-1, keepdim=True))

    def forward(self, gemm: Gemm, x_q: Int8Operand, w_q: Int8Operand, bias):
        if isinstance(gemm, LinearGemm):  # W (out, in): B = W.T, its column sums are W's row sums
            w, colsum = w_q.codes.T, w_q.last_dim_sums.reshape(1, -1)
        else:
            w, colsum = w_q.codes, None
        y = affine_int8_matmul(x_q.rows(), Int8Operand(w, w_q.scale, w_q.offset), colsum, bias)
        return y.reshape(x_q.codes.shape[:-1] + (y.shape[-1],))

    def grad_input(self, gemm: Gemm, g_q: Int8Operand, w_q: Int8Operand, input_shape):
        if isinstance(gemm, LinearGemm):  # B = W (out, in); on the CPU as the transpose of a contiguous
            w, colsum = w_q.codes, None  # (in, out) copy, _int_mm's fast layout (CUDA takes W as it is)
            if w.device.type == "cpu":
                w = w.T.contiguous().T
        else:  # Conv1D: B = W.T (out, in), its column sums are W's row sums
            w, colsum = w_q.codes.T, w_q.last_dim_sums.reshape(1, -1)
        return affine_int8_matmul(g_q.rows(), Int8Operand(w, w_q.scale, w_q.offset), colsum).reshape(input_shape)

    def grad_weight(self, gemm: Gemm, x_q: Int8Operand, g, weight_shape):
        return gemm.grad_weight(x_q.dequantize(), g, weight_shape)


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
