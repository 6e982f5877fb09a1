"""Kernel registry: how a quantized layer's GEMMs are executed (``QuantConfig.kernel``).

A kernel owns the representation of quantized operands and the three products of a layer
(forward, layer gradient, weight gradient). The autograd Function in ``layers.py`` decides *which*
operands go into each product (SPEC 4 gradient bifurcation), so adding a kernel (e.g. real int8
GEMMs with ``torch._int_mm``) needs neither a new layer nor a change to the surgery.
"""
from __future__ import annotations

import abc

import torch

from .functional import fake_quantize
from .gemm import Gemm


class Kernel(abc.ABC):
    """Executes quantized GEMMs. Quantized operands are whatever `quantize` returns."""

    name: str

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, stochastic: bool):
        """Quantize `x` on the affine grid of ``[lo, hi]`` (see ``functional.quantize_codes``)."""

    @abc.abstractmethod
    def forward(self, gemm: Gemm, x_q, w_q, bias: torch.Tensor | None) -> torch.Tensor:
        """Layer output from quantized input and weight; `bias` stays full precision."""

    @abc.abstractmethod
    def grad_input(self, gemm: Gemm, g_q, w_q, input_shape: torch.Size) -> torch.Tensor:
        """Layer gradient (w.r.t. the input) from the quantized output gradient and weight."""

    @abc.abstractmethod
    def grad_weight(self, gemm: Gemm, x_q, g: torch.Tensor, weight_shape: torch.Size) -> torch.Tensor:
        """Weight gradient from the quantized input and the full-precision output gradient `g`."""


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


KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    """Make `kernel` selectable as ``QuantConfig(kernel=kernel.name)``."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be a Kernel instance, got {type(kernel).__name__}")
    if kernel.name in KERNELS:
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    KERNELS[kernel.name] = kernel
    return kernel


def get_kernel(name: str) -> Kernel:
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {name!r}")
    return KERNELS[name]


register_kernel(SimulatedKernel())
