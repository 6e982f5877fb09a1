"""lp_decentral_nlp: low-precision decentralized training for Hugging Face models.

Subpackages:
    quant   -- 8-bit layers (gradient bifurcation) and the model surgery; importing the package
               registers the surgery as a transformers quantizer ("lp_decentral_nlp"), so saved
               8-bit models reload with from_pretrained / pipeline.
    gossip  -- graphs, push-sum, compressors, Choco-SGD / Deep-Squeeze, transports.
    data    -- tasks and skewed (non-IID) shards.
    vision  -- ResNet/VGG with EvoNorm and Range EvoNorm.
"""

__version__ = "0.1.0"

from .quant import (
    LpQuantizationConfig,
    QuantConfig,
    dequantize_model,
    export_int8_state_dict,
    kernel_report,
    load_quantized,
    quantize_model,
    saved_tensor_bytes,
)

__all__ = ["LpQuantizationConfig", "QuantConfig", "dequantize_model", "export_int8_state_dict", "kernel_report",
           "load_quantized", "quantize_model", "saved_tensor_bytes"]
