"""Inference export: int8 weights + per-tensor scale and offset (SPEC section 4, last point).

For each quantized layer ``L`` the export holds ``L.weight`` as int8 codes ``c`` with
``L.weight_scale`` and ``L.weight_offset`` (fp32, 0-d) such that the weight the layer used in its
forward pass is ``c * scale + offset``; everything else (biases, norms, embeddings, heads kept
full precision, activation-range buffers) is copied as is.
"""
from __future__ import annotations

import torch
from torch import nn

from .functional import quantize_codes, tensor_range
from .layers import QuantGemmLayer

SCALE_SUFFIX, OFFSET_SUFFIX = "_scale", "_offset"


@torch.no_grad()
def export_int8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict of `model` with every quantized layer's weight stored as int8 codes.

    Codes are the affine codes of SPEC 4 shifted to signed range, ``c = q - 2**(bits-1)``, so
    ``offset = min + 2**(bits-1) * scale``. Tied weights are exported once per state-dict key.
    """
    quant_weights = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantGemmLayer)}
    if not quant_weights:
        raise ValueError("export_int8_state_dict: model has no quantized layers (call quantize_model first)")
    out = {}
    for key, value in model.state_dict().items():
        layer = quant_weights.get(key)
        if layer is None:
            out[key] = value
            continue
        bits = layer.quant_config.bits
        lo, hi = tensor_range(value)
        codes, scale = quantize_codes(value, lo, hi, bits)
        half = 2 ** (bits - 1)
        out[key] = (codes - half).to(torch.int8)
        out[key + SCALE_SUFFIX] = scale.float()
        out[key + OFFSET_SUFFIX] = (lo + half * scale).float()
    return out


def dequantize_int8_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float state dict from ``export_int8_state_dict``'s output (weights ``c * scale + offset``),
    loadable into the float or quantized model with ``load_state_dict``."""
    coded = {k for k, v in state_dict.items() if v.dtype == torch.int8 and k + SCALE_SUFFIX in state_dict}
    extras = {k + s for k in coded for s in (SCALE_SUFFIX, OFFSET_SUFFIX)}
    return {
        key: value.float() * state_dict[key + SCALE_SUFFIX] + state_dict[key + OFFSET_SUFFIX] if key in coded else value
        for key, value in state_dict.items()
        if key not in extras
    }


def state_dict_nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes held by the tensors of `state_dict` (each distinct storage counted once)."""
    seen, total = set(), 0
    for t in state_dict.values():
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
