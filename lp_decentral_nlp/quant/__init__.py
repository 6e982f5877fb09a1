"""8-bit training (SPEC section 4): quantized layers with gradient bifurcation and the model surgery.

Lazy (:mod:`lp_decentral_nlp.utils.lazy`): a name imports its submodule on first use."""
from ..utils.lazy import lazy_namespace

# public name -> the submodule that defines it
_EXPORTS = {
    "DEFAULT_SKIP": ".config",
    "KERNELS": ".kernels",
    "Kernel": ".kernels",
    "LpHfQuantizer": ".hf_quantizer",
    "LpQuantizationConfig": ".hf_quantizer",
    "QUANT_LAYERS": ".surgery",
    "QUANT_METHOD": ".hf_quantizer",
    "QuantConfig": ".config",
    "QuantConv1D": ".layers",
    "QuantConv2d": ".layers",
    "QuantEmbedding": ".layers",
    "QuantGemmFunction": ".layers",
    "QuantGemmLayer": ".layers",
    "QuantLinear": ".layers",
    "QuantModule": ".layers",
    "QuantReport": ".surgery",
    "dequantize_int8_state_dict": ".export",
    "dequantize_model": ".surgery",
    "export_int8_state_dict": ".export",
    "kernel_report": ".layers",
    "load_int8_export": ".export",
    "load_quantized": ".surgery",
    "quantize_model": ".surgery",
    "register_kernel": ".kernels",
    "register_quant_layer": ".surgery",
    "save_int8_export": ".export",
    "saved_tensor_bytes": ".memory",
    "state_dict_nbytes": ".export",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS, subpackages=("config", "export", "functional", "fused", "gemm",
                                                                            "hf_quantizer", "kernels", "layers", "memory", "surgery"))
