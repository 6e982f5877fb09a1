"""Our 8-bit surgery as a transformers quantizer, so saved 8-bit models reload with ``from_pretrained``.

``quantize_model`` records its ``QuantConfig`` as ``model.config.quantization_config``, a
:class:`LpQuantizationConfig` whose ``quant_method`` is ``"lp_decentral_nlp"``; ``save_pretrained``
writes it to ``config.json``. Importing ``lp_decentral_nlp`` registers that method with transformers'
quantizer registry (``transformers.quantizers.auto.register_quantizer`` /
``register_quantization_config``), so ``AutoModel*.from_pretrained(folder)`` and
``pipeline(task, model=folder)`` build the float skeleton, let :class:`LpHfQuantizer` apply the
surgery (SPEC section 4) on it before the weights load, and then load the fp32 master weights and the
activation-range buffers (``act_running_min``/``act_running_max``/``act_num_batches``) straight
into the 8-bit layers. Without ``import lp_decentral_nlp`` transformers does not know the method:
it warns "Unknown quantization type" and loads a float model.

The checkpoint holds fp32 master weights (SPEC 4), so the quantizer converts no tensor; it is
trainable (``Trainer`` and ``DecentralizedTrainer`` accept the reloaded model) and serializable.
Passing ``quantization_config=LpQuantizationConfig(...)`` (or its dict form,
``{"quant_method": "lp_decentral_nlp", "bits": ...}``) to ``from_pretrained`` of a float
checkpoint quantizes it on load (the activation ranges start uncalibrated, as after ``quantize_model``;
its ``target``/``skip`` patterns are checked as ``quantize_model`` checks them). A saved 8-bit
checkpoint lacking some layers' ranges loads them uncalibrated, with a warning; one whose 8-bit
layers' weights are not float32 (an ``export_int8_state_dict`` file) is refused.
"""
from __future__ import annotations

import warnings

import torch
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .config import QuantConfig

QUANT_METHOD = "lp_decentral_nlp"
# State-dict keys of the activation-range buffers of the 8-bit layers (``layers.ActivationQuantizer``).
ACTIVATION_RANGE_KEYS = r"\.act_(running_min|running_max|num_batches)$"


def _ranges_missing(layer) -> bool:
    """Whether `layer`'s activation-range buffers were not in the checkpoint ``from_pretrained`` loaded:
    transformers marks every loaded tensor ``_is_hf_initialized``; without the mark on the weight
    (another loading path) nothing is known, and nothing is taken as missing."""
    loaded = getattr(layer.weight, "_is_hf_initialized", None)
    return loaded is True and not all(getattr(buffer, "_is_hf_initialized", False) for buffer in (
        layer.act_running_min, layer.act_running_max, layer.act_num_batches))


@register_quantization_config(QUANT_METHOD)
class LpQuantizationConfig(QuantizationConfigMixin):
    """A ``QuantConfig`` in the form transformers stores under ``quantization_config`` in ``config.json``.

    Args:
        quant_method: must be ``"lp_decentral_nlp"`` (present in a saved ``config.json``).
        **fields: the ``QuantConfig`` fields (``bits``, ``grad_bits``, ``kernel``, ...); missing ones
            take ``QuantConfig``'s defaults, unknown ones raise ValueError.
    """

    def __init__(self, quant_method: str = QUANT_METHOD, **fields):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        self.quant_method = QUANT_METHOD
        self.__dict__.update(QuantConfig.from_dict(fields).to_dict())

    @classmethod
    def from_quant_config(cls, config: QuantConfig) -> "LpQuantizationConfig":
        """The transformers quantization config (``quantization_config``) holding `config`'s fields."""
        if not isinstance(config, QuantConfig):
            raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
        return cls(**config.to_dict())

    def to_quant_config(self) -> QuantConfig:
        """The ``QuantConfig`` these fields describe (validated again: ``update`` may have changed them)."""
        return QuantConfig.from_dict({k: v for k, v in self.__dict__.items() if k != "quant_method"})


@register_quantizer(QUANT_METHOD)
class LpHfQuantizer(HfQuantizer):
    """Applies ``quantize_model`` to the model skeleton ``from_pretrained`` builds, before its weights load.

    The 8-bit layers keep their float layers' parameter names and add the activation-range
    buffers, so the checkpoint's keys load into them as they are. Master weights are fp32 (SPEC 4):
    a ``dtype`` other than float32 is refused.
    """

    requires_calibration = False
    quantization_config: LpQuantizationConfig

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is not None and dtype != torch.float32:
            raise ValueError(f"dtype={dtype} is not supported for an {QUANT_METHOD} 8-bit model: its master weights "
                             "are float32 (SPEC 4); pass dtype=torch.float32 to from_pretrained (its default, "
                             "dtype='auto', takes the checkpoint's dtype)")
        return torch.float32

    def _process_model_before_weight_loading(self, model, **kwargs):
        from .surgery import _quantize

        # a saved 8-bit model's patterns were checked when it was quantized; a float checkpoint's are checked now
        _quantize(model, self.quantization_config.to_quant_config(), dry_run=False, reloading=self.pre_quantized)
        if not self.pre_quantized:  # a float checkpoint has no activation ranges: not worth a warning
            model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or ()) | {
                ACTIVATION_RANGE_KEYS}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """Start uncalibrated ranges when the checkpoint was a float one (``quantization_config`` passed
        to ``from_pretrained``), as ``quantize_model`` does, and in a saved 8-bit model the layers
        whose ranges the checkpoint lacks (transformers leaves such buffers uninitialised memory, which
        evaluation would take as a calibrated range), with a warning. ValueError for a layer whose
        weight loaded in another dtype than float32 (an ``export_int8_state_dict`` file saved as the
        model's weights)."""
        from .layers import ActivationQuantizer, QuantModule

        source = getattr(getattr(model, "config", None), "_name_or_path", "the checkpoint")
        for name, module in model.named_modules():
            if not isinstance(module, QuantModule):
                continue
            not_float32 = [p for p in module.parameters(recurse=False) if p.dtype != torch.float32]
            if not_float32:
                raise ValueError(f"{source}: the weights of 8-bit layer {name!r} loaded as {not_float32[0].dtype}, not "
                                 "float32 master weights: an export_int8_state_dict file is for inference runtimes; "
                                 "load the folder save_pretrained wrote, or dequantize_int8_state_dict the export and "
                                 "load_state_dict it into the quantized model")
        missing = [name for name, module in model.named_modules()
                   if isinstance(module, ActivationQuantizer) and (not self.pre_quantized or _ranges_missing(module))]
        for name in missing:
            model.get_submodule(name).reset_activation_range()
        if self.pre_quantized and missing:
            warnings.warn(f"{source}: the checkpoint has no activation range for {len(missing)} 8-bit layers (e.g. "
                          f"{missing[0]!r}): they start uncalibrated, as after quantize_model", stacklevel=2)
        return model

    def dequantize(self, model, dtype=None):
        """``model.dequantize(dtype=None)``: the float model (``dequantize_model``: its float32 master
        weights), in `dtype` when one is given. ``HfQuantizer.dequantize`` would take the config's
        dtype for None, which may name the dtype a checkpoint was saved in, not the weights'."""
        model = self._dequantize(model, dtype=dtype)
        self.remove_quantization_config(model)
        return model

    def _dequantize(self, model, dtype=None):
        from .surgery import dequantize_model

        model = dequantize_model(model)
        return model if dtype is None else model.to(dtype)

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        """8-bit training of the whole model is the point (SPEC 4): ``Trainer`` needs no adapters."""
        return True
