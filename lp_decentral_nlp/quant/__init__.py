"""8-bit training (SPEC section 4): quantized layers with gradient bifurcation and the model surgery."""
from .config import DEFAULT_SKIP, QuantConfig
from .hf_quantizer import QUANT_METHOD, LpHfQuantizer, LpQuantizationConfig
from .export import dequantize_int8_state_dict, export_int8_state_dict, state_dict_nbytes
from .kernels import KERNELS, Kernel, register_kernel
from .layers import (
    QuantConv1D,
    QuantConv2d,
    QuantEmbedding,
    QuantGemmFunction,
    QuantGemmLayer,
    QuantLinear,
    QuantModule,
    kernel_report,
)
from .memory import saved_tensor_bytes
from .surgery import (
    QUANT_LAYERS,
    QuantReport,
    dequantize_model,
    load_quantized,
    quantize_model,
    register_quant_layer,
)

__all__ = [
    "DEFAULT_SKIP",
    "KERNELS",
    "QUANT_LAYERS",
    "Kernel",
    "LpHfQuantizer",
    "LpQuantizationConfig",
    "QUANT_METHOD",
    "QuantConfig",
    "QuantConv1D",
    "QuantConv2d",
    "QuantEmbedding",
    "QuantGemmFunction",
    "QuantGemmLayer",
    "QuantLinear",
    "QuantModule",
    "QuantReport",
    "dequantize_int8_state_dict",
    "dequantize_model",
    "export_int8_state_dict",
    "kernel_report",
    "load_quantized",
    "quantize_model",
    "register_kernel",
    "register_quant_layer",
    "saved_tensor_bytes",
    "state_dict_nbytes",
]
