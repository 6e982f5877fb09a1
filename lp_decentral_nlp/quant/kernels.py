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
    #: keep the forward's quantized operands for backward instead of re-quantizing the float input
    saves_operands: bool = False

    def unsupported_reason(self, gemm_type: type, weight: torch.Tensor) -> str | None:
        """Why this kernel cannot run a layer of `gemm_type` (a class of ``gemm.py``) with `weight`
        (its device and shape), or None when it can. The layer then uses the simulated kernel."""
        return None

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
    """The registered kernel called `name` (``"auto"`` is resolved per layer by ``resolve_kernel``)."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {name!r}")
    return KERNELS[name]


AUTO = "auto"
# kernel="auto" takes int8 for layers at least this wide (in and out features). From
# `benchmarks/bench_quant.py --threads 2 --layer-sweep --repeats 3` on the 2-core CPU with no other
# job running (forward + backward of one square Linear, 1,024 rows, time relative to fp32):
# width 128 int8 2.79x vs simulated 2.48x; 256: 1.21x vs 1.50x; 512: 0.84x vs 1.34x; 768: 0.63x vs 1.18x.
AUTO_MIN_FEATURES = 256


def kernel_names() -> tuple[str, ...]:
    """Values ``QuantConfig.kernel`` accepts: the registered kernels and ``"auto"``."""
    return (*KERNELS, AUTO)


def resolve_kernel(name: str, gemm_type: type, weight: torch.Tensor) -> tuple[Kernel, str | None]:
    """The kernel a layer runs for ``QuantConfig.kernel == name``, and why it is not the one asked
    for (None when it is). Cheap and sync-free: called on every forward, so a layer moved to
    another device re-decides. ``"auto"`` picks int8 where it is supported and faster: a device
    with int8 dot-product hardware (CUDA, or a CPU with VNNI/AMX) and a layer of at least
    ``AUTO_MIN_FEATURES`` in and out features; the simulated kernel otherwise."""
    if name != AUTO:
        kernel = get_kernel(name)
        reason = kernel.unsupported_reason(gemm_type, weight)
        return (kernel, None) if reason is None else (KERNELS["simulated"], reason)
    int8 = KERNELS["int8"]
    reason = int8.unsupported_reason(gemm_type, weight)
    if reason is None and weight.device.type == "cpu" and not cpu_has_int8_dot():
        reason = "CPU without int8 dot-product instructions (VNNI/AMX)"
    if reason is None and min(weight.shape[:2]) < AUTO_MIN_FEATURES:
        reason = f"layer {tuple(weight.shape)} narrower than {AUTO_MIN_FEATURES} features: int8 not faster"
    return (KERNELS["simulated"], reason) if reason else (int8, None)


register_kernel(SimulatedKernel())
from .int8_kernel import Int8Bf16Kernel, Int8Kernel, cpu_has_int8_dot  # noqa: E402  (needs Kernel defined above)

register_kernel(Int8Kernel())
register_kernel(Int8Bf16Kernel())
