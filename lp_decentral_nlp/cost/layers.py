"""Layers costed by their type rather than by the ATen ops they happen to run (SPEC 7).

* GEMM layers -- ``nn.Linear``, ``nn.Conv1d/2d/3d`` and transformers' ``Conv1D`` (and the 8-bit
  layers of ``lp_decentral_nlp.quant``, which subclass them): the layers 8-bit training quantizes.
  Their cost is the SPEC 7 GEMM formula, whatever their forward runs internally (the simulated
  quantization of the 8-bit layers is priced separately, see ``report``).
* The vision norm layers of SPEC 5 (``lp_decentral_nlp.vision.norms``): EvoNorm-S0, Range
  EvoNorm, Range BatchNorm, costed from their equations. Imported lazily: the cost model works
  without the vision package.
* ``nn.Embedding`` (and the 8-bit ``QuantEmbedding``): a lookup, no arithmetic; an 8-bit table's
  quantization of the looked-up rows is priced in ``report``, the same for a float model's plan
  and its quantized copy.

Every other module (LayerNorm, BatchNorm, activations, attention, residual blocks, pooling) is
costed from the ATen ops it runs (``ops.aten_cost``), and so is a subclass of these types that
overrides ``forward`` (a LoRA layer adding ``B(A(x))``, say): its forward may do more than the
type's formula (:func:`computes_its_type`).
"""
from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from .ops import Ops

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _hf_conv1d() -> tuple[type, ...]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional for vision-only use
        return ()
    return (Conv1D,)


def gemm_layer_types() -> tuple[type, ...]:
    """Module types whose forward is one GEMM/convolution (the quantizable layers)."""
    return (nn.Linear, *_CONV, *_hf_conv1d())


def computes_its_type(module: nn.Module) -> bool:
    """Whether `module` computes what its GEMM, norm or embedding type's formula prices: its
    ``forward`` is one of those types' own, or it is an 8-bit layer of ``lp_decentral_nlp`` (whose
    forward runs the same GEMM, norm or lookup on quantized operands). Any other override (a scaled
    embedding, say) may do more work."""
    from ..quant import QuantModule

    if isinstance(module, QuantModule):
        return True
    forward = type(module).forward
    return any(isinstance(module, base) and forward is base.forward
               for base in gemm_layer_types() + norm_layer_types() + embedding_layer_types())


def embedding_layer_types() -> tuple[type, ...]:
    """Module types whose forward is one table lookup."""
    return (nn.Embedding,)


def gemm_macs(module: nn.Module, output: torch.Tensor) -> int:
    """Forward multiply-accumulates of a GEMM layer for one call: ``out.numel() * fan_in``.

    Conv: ``b*Cout*Hout*Wout * (Cin/groups)*prod(K)``; Linear: ``out.numel() * in_features``;
    HF Conv1D (weight stored ``(nx, nf)``): ``out.numel() * nx``.
    """
    if isinstance(module, _CONV):
        fan_in = module.in_channels // module.groups * math.prod(module.kernel_size)
    elif isinstance(module, nn.Linear):
        fan_in = module.in_features
    else:  # transformers Conv1D
        fan_in = module.weight.shape[0]
    return output.numel() * fan_in


# Norm layers of SPEC 5. ``n`` elements, ``units`` independent statistics (sample x group for the
# EvoNorms, channels for Range BN). Each returns the forward Ops of one call. ``act``: the layer
# applies its fused activation (``apply_act=True``, parameter ``v``).


def _evonorm_s0(n: int, units: int, act: bool) -> Ops:
    """``x * sigmoid(v*x) / sqrt(groupvar(x) + eps) * gamma + beta`` (SPEC 5).

    Group variance: mean (n adds, 1 mult/unit), centre (n adds), square (n mults), sum (n adds),
    divide (1 mult/unit), +eps (1 add/unit), rsqrt (1 mult/unit); scale (n mults); gamma
    (n mults), beta (n adds). The activation adds v*x, sigmoid, x*sigmoid (3n mults).
    """
    return Ops(adds=4 * n + units, mults=3 * n + 3 * units + (3 * n if act else 0))


def _range_evonorm(n: int, units: int, act: bool) -> Ops:
    """``x * hsig(v*x) / (C(c/g) * (range_group(x) + eps)) * gamma + beta`` (SPEC 5, eq. 5).

    Range: max and min (2n comparisons), max - min and +eps (2 adds/unit), times C and reciprocal
    (2 mults/unit); scale (n mults); gamma (n mults), beta (n adds). The activation adds v*x
    (n mults), hsig = clamp((t + 3)/6, 0, 1) (3n adds, n mults) and x*hsig (n mults).
    """
    return Ops(adds=3 * n + 2 * units + (3 * n if act else 0), mults=2 * n + 2 * units + (3 * n if act else 0))


def _range_batchnorm(n: int, channels: int, training: bool) -> Ops:
    """Range BN (SPEC 5, Banner et al. eq. 3): ``(x - mean) / (C(b) * range(x - mean) + eps) * gamma + beta``.

    Training (batch statistics): mean (n adds, 1 mult/channel), range (2n comparisons,
    1 add/channel), +eps (1 add/channel), times C(b) and reciprocal (2 mults/channel), centre
    (n adds), scale (n mults), gamma (n mults), beta (n adds). Eval (running statistics): one
    per-channel scale and shift, costed as eval BatchNorm (``ops._batch_norm_eval``).
    """
    if training:
        return Ops(adds=5 * n + 2 * channels, mults=2 * n + 3 * channels)
    return Ops(adds=n + 2 * channels, mults=n + 3 * channels)


def norm_layer_cost(module: nn.Module, x: torch.Tensor, training: bool) -> Ops:
    """Forward Ops of one call of a SPEC 5 vision norm layer on ``x`` of shape (B, C, H, W)."""
    norms = importlib.import_module("lp_decentral_nlp.vision.norms")
    n, batch = x.numel(), x.shape[0]
    if isinstance(module, norms.RangeEvoNorm2d):
        return _range_evonorm(n, batch * module.groups, module.apply_act)
    if isinstance(module, norms.EvoNormS0):
        return _evonorm_s0(n, batch * module.groups, module.apply_act)
    if isinstance(module, norms.RangeBatchNorm2d):
        return _range_batchnorm(n, x.shape[1], training)
    raise TypeError(f"{type(module).__name__} is not a SPEC 5 norm layer")


def norm_layer_types() -> tuple[type, ...]:
    """The SPEC 5 norm classes present in ``lp_decentral_nlp.vision.norms`` (empty without it)."""
    try:
        norms = importlib.import_module("lp_decentral_nlp.vision.norms")
    except ImportError:
        return ()
    return (norms.RangeEvoNorm2d, norms.EvoNormS0, norms.RangeBatchNorm2d)
