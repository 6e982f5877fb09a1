"""lp_decentral_nlp: low-precision decentralized training for Hugging Face models.

Subpackages:
    quant   -- 8-bit layers (gradient bifurcation) and the model surgery; importing the package
               registers the surgery as a transformers quantizer ("lp_decentral_nlp"), so saved
               8-bit models reload with from_pretrained / pipeline.
    gossip  -- graphs, push-sum, compressors, Choco-SGD / Deep-Squeeze, transports.
    data    -- tasks and skewed (non-IID) shards.
    vision  -- ResNet/VGG with EvoNorm and Range EvoNorm.

The package is lazy: a public name imports its subpackage on first use, so ``import
lp_decentral_nlp`` (and a recipe's flag check) imports neither torch nor transformers. The quantizer
is registered as soon as transformers' quantizer registry exists: at once if it is loaded, else when
transformers loads it (:func:`register_quantizer_when_transformers_loads`).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

from .utils.lazy import lazy_namespace

__version__ = "0.1.0"

__all__ = ["DEFAULT_SKIP", "LpQuantizationConfig", "QuantConfig", "dequantize_int8_state_dict", "dequantize_model",
           "export_int8_state_dict", "kernel_report", "load_int8_export", "load_quantized", "quantize_model",
           "save_int8_export", "saved_tensor_bytes"]
__getattr__, __dir__ = lazy_namespace(__name__, dict.fromkeys(__all__, ".quant"),
                                      subpackages=("checks", "commands", "cost", "data", "gossip", "quant", "trainer",
                                                   "utils", "vision"))

#: the transformers package whose loading registers the quantizer (it holds the registry and HfQuantizer)
TRANSFORMERS_QUANTIZERS = "transformers.quantizers"
_HF_QUANTIZER = "lp_decentral_nlp.quant.hf_quantizer"


class _RegisterAfterLoading:
    """The loader of ``transformers.quantizers``, then the import of our quantizer (which registers it)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        importlib.import_module(_HF_QUANTIZER)

    def __getattr__(self, name):  # get_source, is_package, resource readers: the wrapped loader's
        return getattr(self.loader, name)


class _QuantizerRegistration:
    """A ``sys.meta_path`` finder: finds ``transformers.quantizers`` with the other finders and wraps its loader in
    :class:`_RegisterAfterLoading`; removes itself once used."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRANSFORMERS_QUANTIZERS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterLoading(spec.loader)
        return spec


def register_quantizer_when_transformers_loads() -> None:
    """Register the 8-bit surgery as transformers quantizer ``"lp_decentral_nlp"``
    (:mod:`lp_decentral_nlp.quant.hf_quantizer`): now if transformers' quantizer registry is loaded,
    else right after transformers loads it (the first ``from_pretrained`` or ``pipeline`` does)."""
    if TRANSFORMERS_QUANTIZERS in sys.modules:
        importlib.import_module(_HF_QUANTIZER)
    elif not any(isinstance(finder, _QuantizerRegistration) for finder in sys.meta_path):
        sys.meta_path.insert(0, _QuantizerRegistration())


register_quantizer_when_transformers_loads()
