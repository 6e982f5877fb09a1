"""The simulated kernel: float fake quantization, the method of the paper (SPEC section 4)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..functional import dequantize_uint8, quantize_uint8
from .base import Kernel


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``codes * scale + lo`` in fp32 (shape of `codes`; uint8 or int8 codes, `scale` and `lo`
    0-d or one per sample): one compiled pass on the CPU where ``fused.dequantize_rows`` takes the
    operands, torch's multiply and add elsewhere; the same two fp32 roundings, so the same bits."""
    from .. import fused  # numba, imported on the first call

    if fused.dequantizable(codes, scale, lo):
        return fused.dequantize_rows(codes, scale, lo)
    return dequantize_uint8(codes, scale, lo)


class SimulatedOperand(NamedTuple):
    """A tensor on its affine grid: ``value = codes * scale + lo``.

    ``codes`` uint8 (SPEC 4's ``q``, the float tensor's shape; what backward keeps, a quarter of
    the fp32 tensor); ``scale``/``lo`` fp32, 0-d or broadcastable to ``codes``; ``value`` the fp32
    dequantized tensor while it is in use (None once saved for backward: rebuilt from the codes,
    bit for bit).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    value: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The fp32 values ``codes * scale + lo`` (``value`` while it is held), the float tensor's shape."""
        return self.value if self.value is not None else dequantize_codes(self.codes, self.scale, self.lo)


class SimulatedKernel(Kernel):
    """Quantize-dequantize in float, then float GEMMs: the method of the paper (no speed-up)."""

    name = "simulated"

    def quantize(self, x, lo, hi, bits, stochastic):
        codes, scale, value = quantize_uint8(x, lo, hi, bits, stochastic)
        return SimulatedOperand(codes, scale, lo, value)

    def for_backward(self, operand):
        return operand._replace(value=None)

    def forward(self, gemm, x_q, w_q, bias):
        return gemm.forward(x_q.dequantize(), w_q.dequantize(), bias)

    def grad_input(self, gemm, g_q, w_q, input_shape):
        return gemm.grad_input(g_q.dequantize(), w_q.dequantize(), input_shape)

    def grad_weight(self, gemm, x_q, g, weight_shape):
        return gemm.grad_weight(x_q.dequantize(), g, weight_shape)
