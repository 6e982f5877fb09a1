"""Model surgery: swap supported layers for their 8-bit versions and back (SPEC section 4).

Selection follows PEFT: name patterns (see ``config.name_matches``), explicit skips, an error
when a pattern matches nothing, a type -> replacement-class registry others can extend, and an
undo (``dequantize_model``). The applied ``QuantConfig`` is recorded in the model's
``config.json`` under ``lp_quant_config`` (not ``quantization_config``, which ``Trainer`` reads as a
transformers quantizer) so ``load_quantized`` can re-apply it.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import DEFAULT_SKIP, QuantConfig, name_matches
from .kernels import resolve_kernel
from .layers import QuantConv1D, QuantConv2d, QuantEmbedding, QuantLinear, QuantModule

CONFIG_KEY = "lp_quant_config"
logger = logging.getLogger(__name__)

# Exact float module type -> 8-bit replacement class (subclasses are not dispatched: e.g.
# nn.MultiheadAttention's out_proj is a Linear subclass whose forward is never called).
QUANT_LAYERS: dict[type[nn.Module], type[QuantModule]] = {}


def register_quant_layer(float_type: type[nn.Module], quant_type: type[QuantModule]) -> None:
    """Let the surgery replace modules of exactly `float_type` with ``quant_type.from_float``."""
    if not (isinstance(float_type, type) and issubclass(float_type, nn.Module)):
        raise TypeError(f"float_type must be an nn.Module subclass, got {float_type!r}")
    if not (isinstance(quant_type, type) and issubclass(quant_type, QuantModule) and issubclass(quant_type, nn.Module)):
        raise TypeError(f"quant_type must be an nn.Module subclass implementing QuantModule, got {quant_type!r}")
    if float_type in QUANT_LAYERS:
        raise ValueError(f"{float_type.__name__} already maps to {QUANT_LAYERS[float_type].__name__}")
    QUANT_LAYERS[float_type] = quant_type


register_quant_layer(nn.Linear, QuantLinear)
register_quant_layer(Conv1D, QuantConv1D)
register_quant_layer(nn.Conv2d, QuantConv2d)
register_quant_layer(nn.Embedding, QuantEmbedding)  # only with QuantConfig(embeddings=True)


@dataclass(frozen=True)
class LayerDecision:
    name: str
    type_name: str
    quantize: bool
    reason: str


@dataclass
class QuantReport:
    """What ``quantize_model`` does (or would do, with ``dry_run=True``) and why.

    ``layers`` lists every module of a registered float type (or a subclass of one); ``problems``
    lists what makes the real run raise (patterns matching nothing, nothing to quantize).
    """

    layers: list[LayerDecision] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> list[str]:
        return [d.name for d in self.layers if d.quantize]

    @property
    def skipped(self) -> list[str]:
        return [d.name for d in self.layers if not d.quantize]

    def __str__(self) -> str:
        width = max((len(d.name) for d in self.layers), default=4)
        lines = [f"{len(self.quantized)} layers quantized, {len(self.skipped)} kept full precision"]
        lines += [f"  {'8-bit' if d.quantize else 'float'}  {d.name:<{width}}  {d.type_name}: {d.reason}" for d in self.layers]
        lines += [f"ERROR: {p}" for p in self.problems]
        return "\n".join(lines)


def quantize_model(model: nn.Module, config: QuantConfig | None = None, dry_run: bool = False):
    """Replace every selected Linear / Conv1D / Conv2d (and, with ``config.embeddings``, Embedding)
    of `model` with its 8-bit version, in place.

    Args:
        model: any ``nn.Module`` (a Hugging Face ``PreTrainedModel`` also gets ``config.lp_quant_config``).
        config: the ``QuantConfig`` (default ``QuantConfig()``).
        dry_run: change nothing and return the ``QuantReport``.

    Returns:
        `model` (or the report when `dry_run`). Raises ValueError when a pattern matches no layer,
        when nothing would be quantized, or when `model` is already quantized.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = QuantConfig() if config is None else config
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    already = [n for n, m in model.named_modules() if isinstance(m, QuantModule)]
    if already:
        raise ValueError(f"model is already quantized ({len(already)} 8-bit layers, e.g. {already[0]!r}); "
                         "call dequantize_model first to change the QuantConfig")
    report = _plan(model, config)
    if dry_run:
        return report
    if report.problems:
        raise ValueError("quantize_model: " + "; ".join(report.problems) + f"\n{report}")
    selected = {id(model.get_submodule(name)) for name in report.quantized}
    _replace(model, selected, lambda m: QUANT_LAYERS[type(m)].from_float(m, config))
    if hasattr(model, "config") and hasattr(model.config, "to_json_string"):
        setattr(model.config, CONFIG_KEY, config.to_dict())
    return model


def dequantize_model(model: nn.Module) -> nn.Module:
    """Swap every 8-bit layer back for a plain float layer holding its fp32 master weights (in place).

    The activation-range buffers are dropped and ``config.lp_quant_config`` removed.
    """
    selected = {id(m) for m in model.modules() if isinstance(m, QuantModule)}
    if not selected:
        raise ValueError("dequantize_model: model has no quantized layers")
    _replace(model, selected, lambda m: m.to_float())
    if hasattr(model, "config") and hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


def _plan(model: nn.Module, config: QuantConfig) -> QuantReport:
    supported = tuple(QUANT_LAYERS)
    report = QuantReport()
    skip_used, target_used = set(), set()
    for name, module in model.named_modules():
        if not name or not isinstance(module, supported):
            continue
        parts = name.split(".")
        chain = [".".join(parts[: i + 1]) for i in range(len(parts))]  # the layer and its parents
        skips = [p for p in config.skip if any(name_matches(p, n) for n in chain)]
        targets = None if config.target is None else [p for p in config.target if any(name_matches(p, n) for n in chain)]
        quant_type = QUANT_LAYERS.get(type(module))
        switch = getattr(quant_type, "enabled_by", None)
        switched_off = switch is not None and not getattr(config, switch)
        unsupported = quant_type.unsupported(module) if quant_type is not None else None
        if not switched_off:  # a pattern that only meets switched-off layers selects nothing
            skip_used.update(skips)
            if quant_type is not None and targets:
                target_used.update(targets)
        quantize = False
        if quant_type is None:
            reason = f"subclass of {module.__class__.__mro__[1].__name__} with no registered 8-bit replacement"
        elif switched_off:
            reason = f"off by default (QuantConfig({switch}=True) quantizes it)"
        elif unsupported:
            reason = unsupported
        elif skips:
            reason = f"matches skip pattern {skips[0]!r}"
        elif targets is not None and not targets:
            reason = "matches no target pattern"
        else:
            quantize = True
            reason = "supported layer" if targets is None else f"matches target pattern {targets[0]!r}"
        gemm_type = getattr(quant_type, "gemm_type", None)
        if quantize and gemm_type is not None:
            kernel, fallback = resolve_kernel(config.kernel, gemm_type, module.weight, getattr(module, "groups", 1))
            reason += f"; kernel {kernel.name}" + (f" ({config.kernel} falls back: {fallback})" if fallback else "")
        report.layers.append(LayerDecision(name, type(module).__name__, quantize, reason))

    for p in config.skip:
        if p not in skip_used and p not in DEFAULT_SKIP:
            report.problems.append(f"skip pattern {p!r} matches no quantizable layer")
    for p in config.target or ():
        if p not in target_used:
            report.problems.append(f"target pattern {p!r} matches no quantizable layer")
    if not report.quantized and not report.problems:
        kinds = ", ".join(t.__name__ for t in QUANT_LAYERS)
        report.problems.append(f"no layer to quantize (supported types: {kinds})")
    return report


def _replace(model: nn.Module, selected: set[int], build) -> None:
    """Replace each module whose id is in `selected` by ``build(module)``, under every name it has."""
    built: dict[int, nn.Module] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) in selected:
            if id(module) not in built:
                built[id(module)] = build(module)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, built[id(module)])


def load_quantized(path: str | os.PathLike, auto_class=None, **from_pretrained_kwargs) -> nn.Module:
    """Load a model saved (``save_pretrained``) after ``quantize_model``, re-apply the surgery and
    restore the activation-range buffers.

    Args:
        path: local folder or hub repo id.
        auto_class: e.g. ``AutoModelForSequenceClassification`` (default ``AutoModel``).
        **from_pretrained_kwargs: passed to ``auto_class.from_pretrained``.
    """
    import transformers
    from transformers.utils import logging as hf_logging

    auto_class = transformers.AutoModel if auto_class is None else auto_class
    folder = _local_folder(path, from_pretrained_kwargs.get("revision"))
    with open(folder / "config.json", encoding="utf-8") as f:
        saved = json.load(f).get(CONFIG_KEY)
    if saved is None:
        raise ValueError(f"{folder / 'config.json'} has no {CONFIG_KEY!r}: it was not saved from a quantize_model "
                         "model; load it with from_pretrained and call quantize_model")
    # The checkpoint holds our buffers, which the float model does not expect: keep transformers'
    # load report quiet and report the other discrepancies ourselves.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto_class.from_pretrained(folder, output_loading_info=True, **from_pretrained_kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    quantize_model(model, QuantConfig.from_dict(saved))

    buffer_keys = [f"{name}.{b}" for name, m in model.named_modules() if isinstance(m, QuantModule)
                   for b, _ in m.named_buffers(recurse=False)]
    tensors, found = _read_checkpoint(folder, buffer_keys, getattr(model, "base_model_prefix", ""))
    missing = [k for k in buffer_keys if k not in tensors]
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks {len(missing)} quantization buffers, e.g. {missing[:3]}")
    model.load_state_dict(tensors, strict=False)
    other_unexpected = sorted(set(info["unexpected_keys"]) - found)
    for kind, keys in (("missing", sorted(info["missing_keys"])), ("unexpected", other_unexpected),
                       ("mismatched", sorted(info["mismatched_keys"]))):
        if keys:
            logger.warning("load_quantized(%s): %d %s keys, e.g. %s", path, len(keys), kind, keys[:5])
    return model


def _local_folder(path, revision) -> Path:
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path), revision=revision, allow_patterns=["*.json", "*.safetensors"]))


def _read_checkpoint(folder: Path, keys: list[str], prefix: str) -> tuple[dict, set[str]]:
    """Tensors of `keys` from the safetensors checkpoint in `folder` (keys may carry the base-model
    `prefix` or lack it there). Returns ``{model key: tensor}`` and the checkpoint keys read."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no safetensors checkpoint (model.safetensors or its index) in {folder}")
    tensors, found = {}, set()
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            available = set(f.keys())
            for key in keys:
                candidates = [key, f"{prefix}.{key}"] + ([key[len(prefix) + 1:]] if key.startswith(prefix + ".") else [])
                hit = next((c for c in candidates if c in available), None)
                if hit is not None:
                    tensors[key] = f.get_tensor(hit)
                    found.add(hit)
    return tensors, found
