"""lp_decentral_nlp: low-precision decentralized training for Hugging Face models.

Subpackages:
    quant   -- 8-bit layers (gradient bifurcation) and the model surgery.
    gossip  -- graphs, push-sum, compressors, Choco-SGD / Deep-Squeeze, transports.
    data    -- tasks and skewed (non-IID) shards.
    vision  -- ResNet/VGG with EvoNorm and Range EvoNorm.
"""

__version__ = "0.1.0"

from .quant import QuantConfig, dequantize_model, export_int8_state_dict, load_quantized, quantize_model

__all__ = ["QuantConfig", "dequantize_model", "export_int8_state_dict", "load_quantized", "quantize_model"]
