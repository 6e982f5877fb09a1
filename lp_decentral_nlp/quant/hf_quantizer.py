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
checkpoint quantizes it on load (the activation ranges start uncalibrated, as after ``quantize_model``).
"""
from __future__ import annotations

import torch
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .config import QuantConfig

QUANT_METHOD = "lp_decentral_nlp"
# State-dict keys of the activation-range buffers of the 8-bit layers (``layers.ActivationQuantizer``).
ACTIVATION_RANGE_KEYS = r"\.act_(running_min|running_max|num_batches)$"


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
                             "are float32 (SPEC 4); load it with dtype=torch.float32 (or no dtype)")
        return torch.float32

    def _process_model_before_weight_loading(self, model, **kwargs):
        from .surgery import _quantize

        _quantize(model, self.quantization_config.to_quant_config(), dry_run=False, reloading=True)
        if not self.pre_quantized:  # a float checkpoint has no activation ranges: not worth a warning
            model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or ()) | {
                ACTIVATION_RANGE_KEYS}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """Start uncalibrated ranges when the checkpoint was a float one (``quantization_config`` passed
        to ``from_pretrained``), as ``quantize_model`` does."""
        from .layers import ActivationQuantizer

        if not self.pre_quantized:
            for module in model.modules():
                if isinstance(module, ActivationQuantizer):
                    module.reset_activation_range()
        return model

    def _dequantize(self, model, dtype=None):
        from .surgery import dequantize_model

        return dequantize_model(model)

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        """8-bit training of the whole model is the point (SPEC 4): ``Trainer`` needs no adapters."""
        return True
