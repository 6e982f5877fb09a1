"""Kernels of the 8-bit layers (``QuantConfig.kernel``): the interface and registry (``base``), the
simulated kernel (``simulated``), the int8 kernels (``int8``) and the ``"auto"`` choice (``auto``)."""
from .auto import AUTO_MIN_CONV_CHANNELS, AUTO_MIN_CONV_MACS, AUTO_MIN_FEATURES, describe_kernel, resolve_kernel
from .base import AUTO, KERNELS, Kernel, get_kernel, kernel_names, register_kernel
from .int8 import (
    Int8Bf16Kernel, Int8Kernel, Int8Operand, affine_int8_conv2d, affine_int8_matmul, cpu_has_int8_dot, int8_conv2d,
    int8_gemm, int8_gemm_path, onednn_conv_available,
)
from .simulated import SimulatedKernel

register_kernel(SimulatedKernel())
register_kernel(Int8Kernel())
register_kernel(Int8Bf16Kernel())

__all__ = [
    "AUTO", "AUTO_MIN_CONV_CHANNELS", "AUTO_MIN_CONV_MACS", "AUTO_MIN_FEATURES", "KERNELS", "Int8Bf16Kernel", "Int8Kernel",
    "Int8Operand", "Kernel", "SimulatedKernel", "affine_int8_conv2d", "affine_int8_matmul", "cpu_has_int8_dot",
    "describe_kernel", "get_kernel", "int8_conv2d", "int8_gemm", "int8_gemm_path", "kernel_names", "onednn_conv_available",
    "register_kernel", "resolve_kernel",
]
