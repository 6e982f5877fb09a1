"""The simulated kernel: float fake quantization, the method of the paper (SPEC section 4)."""
from __future__ import annotations

from ..functional import fake_quantize
from .base import Kernel


class SimulatedKernel(Kernel):
    """Quantize-dequantize in float, then float GEMMs: the method of the paper (no speed-up)."""

    name = "simulated"

    def quantize(self, x, lo, hi, bits, stochastic):
        return fake_quantize(x, lo, hi, bits, stochastic)

    def forward(self, gemm, x_q, w_q, bias):
        return gemm.forward(x_q, w_q, bias)

    def grad_input(self, gemm, g_q, w_q, input_shape):
        return gemm.grad_input(g_q, w_q, input_shape)

    def grad_weight(self, gemm, x_q, g, weight_shape):
        return gemm.grad_weight(x_q, g, weight_shape)
