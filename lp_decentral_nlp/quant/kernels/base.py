"""The kernel interface and registry: how a quantized layer's GEMMs are executed (``QuantConfig.kernel``).

A kernel owns the representation of quantized operands and the three products of a layer
(forward, layer gradient, weight gradient). The autograd Function in ``layers.py`` decides *which*
operands go into each product (SPEC 4 gradient bifurcation), so adding a kernel (e.g. real int8
GEMMs with ``torch._int_mm``) needs neither a new layer nor a change to the surgery.
"""
from __future__ import annotations

import abc

import torch

from ..gemm import Gemm


class Kernel(abc.ABC):
    """Executes quantized GEMMs. A quantized operand is whatever `quantize` returns: a NamedTuple
    whose fields are tensors (or None), so the layer can keep it for backward through
    ``ctx.save_for_backward`` (visible to ``torch.autograd.graph.saved_tensors_hooks``)."""

    name: str

    def unsupported_reason(self, gemm_type: type, weight: torch.Tensor, groups: int = 1) -> str | None:
        """Why this kernel cannot run a layer of `gemm_type` (a class of ``gemm.py``) with `weight`
        (its device and shape) and `groups` (Conv2d's; 1 for other layers), or None when it can.
        The layer then uses the simulated kernel."""
        return None

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, stochastic: bool):
        """Quantize `x` on the affine grid of ``[lo, hi]`` (see ``functional.quantize_codes``)."""

    def for_backward(self, operand):
        """What of a forward operand the layer keeps for backward (same NamedTuple type; fields not
        needed set to None, e.g. a float copy rebuilt from 8-bit codes). Default: all of it."""
        return operand

    @abc.abstractmethod
    def forward(self, gemm: Gemm, x_q, w_q, bias: torch.Tensor | None) -> torch.Tensor:
        """Layer output from quantized input and weight; `bias` stays full precision."""

    @abc.abstractmethod
    def grad_input(self, gemm: Gemm, g_q, w_q, input_shape: torch.Size) -> torch.Tensor:
        """Layer gradient (w.r.t. the input) from the quantized output gradient and weight."""

    @abc.abstractmethod
    def grad_weight(self, gemm: Gemm, x_q, g: torch.Tensor, weight_shape: torch.Size) -> torch.Tensor:
        """Weight gradient from the quantized input and the full-precision output gradient `g`."""


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
    """The registered kernel called `name` (``"auto"`` is resolved per layer by ``resolve_kernel``)."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {name!r}")
    return KERNELS[name]


AUTO = "auto"


def kernel_names() -> tuple[str, ...]:
    """Values ``QuantConfig.kernel`` accepts: the registered kernels and ``"auto"``."""
    return (*KERNELS, AUTO)
