"""Model surgery: swap supported layers for their 8-bit versions and back (SPEC section 4).

Selection follows PEFT: name patterns (see ``config.name_matches``), explicit skips, an error
when a pattern matches nothing, a type -> replacement-class registry others can extend, and an
undo (``dequantize_model``). The applied ``QuantConfig`` is recorded as the model's
``config.quantization_config`` (an ``LpQuantizationConfig``, ``quant_method="lp_decentral_nlp"``), so
``save_pretrained`` writes it to ``config.json`` and ``from_pretrained`` re-applies the surgery through
the transformers quantizer registered in ``hf_quantizer.py``.
"""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from ..checks import check_flag
from .config import DEFAULT_SKIP, QuantConfig, name_matches
from .hf_quantizer import QUANT_METHOD, LpHfQuantizer, LpQuantizationConfig
from .kernels import AUTO, describe_kernel, resolve_kernel
from .layers import QuantConv1D, QuantConv2d, QuantEmbedding, QuantGemmLayer, QuantLinear, QuantModule, check_module

CONFIG_KEY = "quantization_config"
# quantize_model warns when more than this share of the weight elements it is asked to quantize
# stays fp32 in modules of no registered type (e.g. the fused experts of a mixture of experts)
FP32_WEIGHT_SHARE_WARNED = 0.1

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

    ``layers`` lists every module of a registered float type (or a subclass of one), and every other
    module holding weights of its own (parameters of 2 or more dimensions, e.g. fused MoE experts),
    which stay fp32; ``other_float`` counts, by type, the remaining modules with parameters of
    their own, all 1-D (norms such as LayerNorm), which stay fp32 too;
    ``problems`` lists what makes the real run raise (patterns matching nothing, nothing to
    quantize, layers to quantize whose parameters are not float32); ``warnings`` what the real run
    warns about (a setting that some layers it asks for cannot follow).
    """

    layers: list[LayerDecision] = field(default_factory=list)
    other_float: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> list[str]:
        """Names of the layers swapped (or to swap) for 8-bit ones."""
        return [d.name for d in self.layers if d.quantize]

    @property
    def skipped(self) -> list[str]:
        """Names of the layers of a registered type that stay float (why: in ``layers``)."""
        return [d.name for d in self.layers if not d.quantize]

    def __str__(self) -> str:
        width = max((len(d.name) for d in self.layers), default=4)
        lines = [f"{len(self.quantized)} layers quantized, {len(self.skipped)} kept full precision"]
        lines += [f"  {'8-bit' if d.quantize else 'float'}  {d.name:<{width}}  {d.type_name}: {d.reason}" for d in self.layers]
        if self.other_float:
            counts = ", ".join(f"{n} {type_name}" for type_name, n in self.other_float.items())
            lines.append(f"  float  also {counts}: 1-D parameters only (scales, shifts) and no registered 8-bit "
                         "version, so fp32")
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines += [f"ERROR: {p}" for p in self.problems]
        return "\n".join(lines)


def quantize_model(model: nn.Module, config: QuantConfig | None = None, dry_run: bool = False):
    """Replace every selected Linear / Conv1D / Conv2d (and, with ``config.embeddings``, Embedding)
    of `model` with its 8-bit version, in place.

    Args:
        model: any ``nn.Module`` (a Hugging Face ``PreTrainedModel`` also gets ``config.quantization_config``,
            an ``LpQuantizationConfig``, which ``save_pretrained`` stores and ``from_pretrained`` re-applies,
            and the ``hf_quantizer`` a model loaded 8-bit has, so ``model.dequantize()`` undoes the surgery).
            A part of a task model, such as ``model.bert``, shares its config object with the task
            model (``model.bert.config is model.config``) and nothing tells the part it has a
            parent, so the config it records is the task model's: ``from_pretrained`` of the saved
            task model applies it to the whole model, head included. To quantize part of a model
            you will save, pass the whole model and select the part with ``target`` (e.g.
            ``QuantConfig(target=("bert",))``), which reloads as it was saved. For the same reason a
            base model records it on the config object it holds, which any other model built from
            that object shares (``BertModel(config)`` does not copy it; a task model records it on a
            copy): build the others from ``copy.deepcopy(config)`` or with ``from_config``. A module of
            your own holding transformers models records nothing on them (its patterns name its own
            layers), so their ``save_pretrained`` saves them float, which it warns of: quantize a
            transformers model itself to save it 8-bit.
        config: the ``QuantConfig`` (default ``QuantConfig()``).
        dry_run: change nothing and return the ``QuantReport``.

    Names. A layer matches a pattern by its name in `model` or a parent's. A transformers base
    model (``BertModel``; its ``base_model`` is itself) also answers to the names its task models
    give it, under ``base_model_prefix``: ``target=("bert",)`` selects all of it, as in
    ``BertForSequenceClassification``, so a task checkpoint reloads as its base model too.

    Swapped layers keep the forward and backward hooks registered on them. A layer whose weight
    or bias a hook or parametrization recomputes (pruning, weight_norm, spectral_norm) stays float,
    with a warning, as any layer the selection asks for but cannot swap. A task model records the
    quantization on a copy of its config, so other models built from the same config object stay
    float; the base model of its architecture (``AutoModel``'s class: ``BertModel``) records it on
    the config it shares with its task model, so that the task model saves it.

    Returns:
        `model` (or the report when `dry_run`). Raises ValueError when a pattern matches no layer
        or only layers kept float, when nothing would be quantized, or when `model` is already
        quantized (by us or by another transformers quantization method).
    """
    return _quantize(model, config, dry_run, reloading=False)


def _quantize(model: nn.Module, config: QuantConfig | None, dry_run: bool, reloading: bool):
    """:func:`quantize_model`; ``reloading`` (``from_pretrained`` of a saved 8-bit model) allows
    patterns matching nothing and does not warn: both were checked and said on the model saved
    (which may be of another class: a task checkpoint loaded as its base model lacks its head)."""
    check_module(model)
    config = QuantConfig() if config is None else config
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    dry_run = check_flag("dry_run", dry_run)
    already = [n for n, m in model.named_modules() if isinstance(m, QuantModule)]
    if already:
        raise ValueError(f"model is already quantized ({len(already)} 8-bit layers, e.g. {already[0]!r}); "
                         "call dequantize_model first to change the QuantConfig")
    # ours as an LpQuantizationConfig or as the dict transformers keeps from from_pretrained(...,
    # quantization_config={"quant_method": "lp_decentral_nlp", ...}): replaced by `config` below
    other = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    method = other.get("quant_method") if isinstance(other, dict) else getattr(other, "quant_method", other)
    if other is not None and method != QUANT_METHOD:
        raise ValueError(f"model carries a quantization_config of quant_method {method!r}: 8-bit training needs "
                         "the float model (load it without quantization_config)")
    report = _plan(model, config, check_patterns=not reloading)
    if dry_run:
        return report
    if report.problems:
        raise ValueError("quantize_model: " + "; ".join(report.problems) + " (quantize_model(model, config, "
                         "dry_run=True) gives every layer's decision)")
    for message in () if reloading else report.warnings:
        warnings.warn(message, stacklevel=3)

    def build(module: nn.Module) -> nn.Module:
        layer = QUANT_LAYERS[type(module)].from_float(module, config)
        if not reloading and isinstance(layer, QuantGemmLayer) and not layer.weight.is_meta:
            layer.fallback_told()  # the plan's warnings said why a named kernel falls back: not again at the first call
        return layer

    selected = {id(model.get_submodule(name)) for name in report.quantized}
    _replace(model, selected, build)
    _hold_torch_fused_paths(model, hold=True)
    owner = _config_owner(model)
    if hasattr(owner, "config") and hasattr(owner.config, "to_json_string"):
        hf_config = LpQuantizationConfig.from_quant_config(config)
        if not _may_be_a_part(owner):  # a base model's config is its task model's too
            _own_config(owner)
        setattr(owner.config, CONFIG_KEY, hf_config)
        if hasattr(owner, "dequantize"):  # a PreTrainedModel: as after from_pretrained, model.dequantize() undoes it
            owner.hf_quantizer = LpHfQuantizer(hf_config, pre_quantized=False)
    elif not reloading:
        _warn_unrecorded_parts(model)
    return model


def _warn_unrecorded_parts(model: nn.Module) -> None:
    """Warn when `model`, a module of no transformers config, holds transformers models with 8-bit
    layers (a user's wrapper around ``AutoModel.from_pretrained(...)``): nothing records the surgery
    on them, so their ``save_pretrained`` writes a float model's config.json and ``from_pretrained``
    loads them float. Recording `model`'s QuantConfig on them would be wrong: its patterns name
    layers in `model`, not in them."""
    parts = []
    for name, module in model.named_modules():
        if (name and hasattr(getattr(module, "config", None), "to_json_string") and hasattr(module, "save_pretrained")
                and not any(name.startswith(f"{outer}.") for outer, _ in parts)
                and any(isinstance(m, QuantModule) for m in module.modules())):
            parts.append((name, type(module).__name__))
    if parts:
        named = ", ".join(f"{name!r} ({cls})" for name, cls in parts)
        warnings.warn(f"{named} of this {type(model).__name__} hold 8-bit layers that their save_pretrained will not "
                      "record (the quantization is recorded on the transformers model quantize_model is given): "
                      "from_pretrained would load them float. To save one as an 8-bit transformers model, call "
                      "quantize_model on it; the whole module's state_dict keeps everything", stacklevel=4)


def _may_be_a_part(model: nn.Module) -> bool:
    """Whether `model` is the base model of its config's architecture (``AutoModel``'s class:
    ``BertModel``, ``FunnelModel``/``FunnelBaseModel``), which a task model holds as a part sharing
    its config object, so that the task model saves the quantization recorded on it (a base model
    used alone, e.g. ``CLIPModel``, records on the object it was built with too). A task model
    (``T5ForConditionalGeneration``, whose ``base_model`` is itself) is not; a class transformers
    does not map, by ``base_model``."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        mapped = MODEL_MAPPING[type(model.config)]
    except (KeyError, ValueError, AttributeError):
        return getattr(model, "base_model", None) is model
    return type(model) in (mapped if isinstance(mapped, tuple) else (mapped,))  # Funnel maps to two classes


def _own_config(model: nn.Module) -> None:
    """Give `model` and its submodules a copy of the config object they hold, so recording the
    quantization on it leaves other models built from the same object (``Cls(config)`` does not
    copy it, ``from_pretrained``/``from_config`` do) float. Submodules holding a part of it
    (``config.text_config``) get that part of the copy."""
    copies: dict[int, object] = {}
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in copies and copies[id(held)] is not held:
            module.config = copies[id(held)]


def _config_owner(model: nn.Module) -> nn.Module:
    """The model whose config records the quantization: `model`, or the transformers model a wrapper
    holds (PEFT's ``PeftModel``, through ``get_base_model()``). The wrapper forwards ``config`` and
    ``dequantize`` to it, but a quantizer set on the wrapper stays there: the merged model of
    ``merge_and_unload()`` lacked it, and deleting it from the wrapper failed."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    return base if isinstance(base, nn.Module) else model


def dequantize_model(model: nn.Module) -> nn.Module:
    """Swap every 8-bit layer back for a plain float layer holding its fp32 master weights (in place).

    The activation-range buffers are dropped and ``config.quantization_config`` removed (with the
    transformers quantizer state of a model ``from_pretrained`` loaded 8-bit; ``model.dequantize()``
    does the same).

    Raises:
        ValueError: no 8-bit layer in ``model``, or ``model`` is a transformers model inside the one
            :func:`quantize_model` was given (``model.bert`` of a quantized ``BertForSequenceClassification``):
            the record and the quantizer belong to that one, whose other 8-bit layers would stay 8-bit
            under a config saying float.
    """
    check_module(model)
    selected = {id(m) for m in model.modules() if isinstance(m, QuantModule)}
    if not selected:
        raise ValueError("dequantize_model: model has no quantized layers")
    owner = _config_owner(model)
    quantizer = owner.__dict__.get("hf_quantizer")  # its own, not one a wrapper forwards
    recorded = getattr(getattr(owner, "config", None), CONFIG_KEY, None)
    if hasattr(owner, "dequantize") and isinstance(recorded, LpQuantizationConfig) and quantizer is None:
        raise ValueError(f"dequantize_model: this {type(owner).__name__} is part of the model quantize_model was "
                         "given, which holds the quantization record: call dequantize_model on that model")
    _replace(model, selected, lambda m: m.to_float())
    _hold_torch_fused_paths(model, hold=False)
    if isinstance(quantizer, LpHfQuantizer):
        quantizer.remove_quantization_config(owner)
    elif isinstance(getattr(getattr(owner, "config", None), CONFIG_KEY, None), LpQuantizationConfig):
        delattr(owner.config, CONFIG_KEY)
    return model


def _plan(model: nn.Module, config: QuantConfig, check_patterns: bool = True) -> QuantReport:
    supported = tuple(QUANT_LAYERS)
    report = QuantReport()
    # a transformers base model is also named under its prefix ("bert") in its task models
    prefix = getattr(model, "base_model_prefix", "") if getattr(model, "base_model", None) is model else ""
    head = _output_embeddings(model) if "lm_head" in config.skip else None
    skip_used, target_used, not_float32, float_tables, cannot = set(), set(), [], [], []
    skip_switched = {}  # skip pattern -> (a layer it met, the switch that keeps that layer float anyway)
    target_kept: dict[str, LayerDecision] = {}  # a target pattern's first layer kept float
    tables_quantized = False  # an embedding table selected (QuantConfig(embeddings=True))
    quantized_elements, fp32_weights = 0, []  # weight elements of the 8-bit layers; (name, type, elements) kept fp32
    fallbacks: dict[str, list[str]] = {}  # why a kernel named in the config cannot run a layer -> those layers

    def patterns(name: str) -> tuple[list[str], list[str] | None, bool]:
        """The skip and target patterns the module called `name` matches (targets None: no target
        list), and whether the selection asks for it (no skip, and a target if there are any)."""
        chain = _names(name, prefix)
        skips = [p for p in config.skip if any(name_matches(p, n) for n in chain)]
        targets = None if config.target is None else [p for p in config.target if any(name_matches(p, n) for n in chain)]
        return skips, targets, not skips and (targets is None or bool(targets))

    for name, module in model.named_modules():
        if isinstance(module, parametrize.ParametrizationList):
            continue  # holds the originals of a parametrized weight: its layer's decision says why it stays fp32
        if not isinstance(module, supported):
            unreplaced = _unreplaced_weights(module)
            if unreplaced:
                report.layers.append(LayerDecision(name, type(module).__name__, False, unreplaced))
                if patterns(name)[2] and _gemm_weight_elements(module):  # not a module of token tables alone
                    fp32_weights.append((name, type(module).__name__, _gemm_weight_elements(module)))
            elif next(module.parameters(recurse=False), None) is not None:
                type_name = type(module).__name__
                report.other_float[type_name] = report.other_float.get(type_name, 0) + 1
            continue
        if not name:
            continue
        skips, targets, selected = patterns(name)
        quant_type = QUANT_LAYERS.get(type(module))
        switch = getattr(quant_type, "enabled_by", None)
        switched_off = switch is not None and not getattr(config, switch)
        unsupported = quant_type.unsupported(module) if quant_type is not None else None
        if not switched_off:  # a pattern that only meets switched-off layers selects nothing
            skip_used.update(skips)
        elif skips:
            skip_switched.setdefault(skips[0], (name, switch))
        met = targets if quant_type is not None and targets else ()
        asked = selected and module is not head
        quantize = False
        if quant_type is None and parametrize.is_parametrized(module):
            reason = (f"its {', '.join(module.parametrizations)} is computed by a parametrization (torch.nn.utils."
                      "parametrize: weight_norm, spectral_norm, orthogonal, ...), which the 8-bit layer would not run: "
                      "remove it first (parametrize.remove_parametrizations)")
            if asked:
                cannot.append(f"{name} ({reason})")
        elif quant_type is None:
            reason = f"subclass of {module.__class__.__mro__[1].__name__} with no registered 8-bit replacement"
            if config.embeddings and isinstance(module, nn.Embedding) and not skips:
                float_tables.append(f"{name} ({type(module).__name__})")
        elif switched_off:
            reason = f"off by default (QuantConfig({switch}=True) quantizes it)"
        elif unsupported:
            reason = unsupported
            if asked:
                cannot.append(f"{name} ({reason})")
        elif skips:
            reason = f"matches skip pattern {skips[0]!r}"
        elif module is head:
            reason = "the model's output embeddings (get_output_embeddings()), kept float while skip holds 'lm_head'"
        elif targets is not None and not targets:
            reason = "matches no target pattern"
        else:
            quantize = True
            reason = "supported layer" if targets is None else f"matches target pattern {targets[0]!r}"
            target_used.update(targets or ())
            quantized_elements += module.weight.numel()
        if quantize:
            not_float32 += [(name, p, t.dtype) for p, t in module.named_parameters(recurse=False)
                            if t.dtype != torch.float32]
            tables_quantized = tables_quantized or switch == "embeddings"
        gemm_type = getattr(quant_type, "gemm_type", None)
        if quantize and gemm_type is not None:
            groups = getattr(module, "groups", 1)
            reason += "; " + describe_kernel(config.kernel, gemm_type, module.weight, groups)
            fallback = None if config.kernel == AUTO or module.weight.is_meta else resolve_kernel(
                config.kernel, gemm_type, module.weight, groups)[1]  # meta: decided, and warned, at the first call
            if fallback is not None:  # (under auto a fallback is the rule, not a setting left unused)
                fallbacks.setdefault(fallback, []).append(name)
        decision = LayerDecision(name, type(module).__name__, quantize, reason)
        report.layers.append(decision)
        for p in () if quantize else met:
            target_kept.setdefault(p, decision)

    for p in (config.skip if check_patterns else ()):
        if p not in skip_used and p in skip_switched and p not in DEFAULT_SKIP:
            name, switch = skip_switched[p]
            report.problems.append(f"skip pattern {p!r} matches only layers kept float without it (e.g. {name!r}: off "
                                   f"by default, QuantConfig({switch}=True) quantizes it): drop it")
        elif p not in skip_used and p not in DEFAULT_SKIP:
            report.problems.append(f"skip pattern {p!r} matches no quantizable layer")
    for p in (config.target or ()) if check_patterns else ():
        if p in target_kept and p not in target_used:
            kept = target_kept[p]
            report.problems.append(f"target pattern {p!r} matches only layers kept float (e.g. {kept.name!r}: "
                                   f"{kept.reason})")
        elif p not in target_used:
            report.problems.append(f"target pattern {p!r} matches no quantizable layer")
    fp32_elements = sum(n for _, _, n in fp32_weights)
    if fp32_elements > FP32_WEIGHT_SHARE_WARNED * (fp32_elements + quantized_elements):
        name, type_name, _ = max(fp32_weights, key=lambda w: w[2])
        report.warnings.append(
            f"{fp32_elements / (fp32_elements + quantized_elements):.0%} of the weights the selection asks for stay fp32 "
            f"in modules of no registered 8-bit type (e.g. {name!r}, {type_name}: {len(fp32_weights)} module(s)); "
            "quantize_model(model, config, dry_run=True) lists them")
    for fallback, names in fallbacks.items():
        report.warnings.append(f"QuantConfig(kernel={config.kernel!r}) cannot run {len(names)} layer(s) (e.g. "
                               f"{names[0]!r}): {fallback}; they run the simulated kernel (kernel_report(model) "
                               "names the kernel of each)")
    if cannot:
        report.warnings.append(f"{len(cannot)} layer(s) the selection asks for stay fp32: {'; '.join(cannot)}")
    subclass_tables = (f"{len(float_tables)} embedding table(s) fp32: {', '.join(float_tables)}: subclasses of "
                       "nn.Embedding, whose forward may do more than a lookup (a scale, positions), have no registered "
                       "8-bit replacement (register_quant_layer)")
    if check_patterns and config.embeddings and not tables_quantized:
        tables = [d for d in report.layers if d.type_name == "Embedding"]
        report.problems.append("QuantConfig(embeddings=True) quantizes no embedding table: " + (
            "it leaves " + subclass_tables if float_tables else
            f"each stays float (e.g. {tables[0].name!r}: {tables[0].reason})" if tables else
            "the model has no nn.Embedding"))
    elif float_tables:
        report.warnings.append("QuantConfig(embeddings=True) leaves " + subclass_tables)
    if not_float32:
        layer, param, dtype = not_float32[0]
        report.problems.append(f"{len(not_float32)} parameters of the layers to quantize are not float32 (e.g. "
                               f"{layer}.{param} of dtype {dtype}): the 8-bit layers keep float32 master weights "
                               "(SPEC 4); call model.float() first")
    if not report.quantized and not report.problems:
        kinds = ", ".join(t.__name__ for t in QUANT_LAYERS)
        if isinstance(model, supported):  # the swap replaces a child of its parent: the root has none
            report.problems.append(f"the model is itself a {type(model).__name__}, which cannot be swapped in place: "
                                   "quantize a module that holds it, e.g. nn.Sequential(layer)")
        else:
            report.problems.append(f"no layer to quantize (supported types: {kinds})")
    return report


def _names(name: str, prefix: str) -> list[str]:
    """The names a module called `name` answers to in patterns: its own and its parents', also under
    a base model's `prefix` (see ``quantize_model``)."""
    parts = name.split(".") if name else []
    chain = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return chain + [prefix] + [f"{prefix}.{n}" for n in chain] if prefix else chain


def _gemm_weight_elements(module: nn.Module) -> int:
    """Elements of `module`'s own parameters of 2 or more dimensions that are GEMM operands (see
    ``_unreplaced_weights``: not those of leading dim 1, added to the activations)."""
    return sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2 and p.shape[0] != 1)


def _unreplaced_weights(module: nn.Module) -> str | None:
    """Why the parameters of 2 or more dimensions a module of no registered type holds itself stay
    fp32; None when it holds none. Those of leading dim 1 broadcast over the batch: a class token or
    a position table added to the activations (ViT's ``cls_token``, ``position_embeddings``), no
    GEMM operand. The others are weights no 8-bit layer computes with, e.g. the 3-D expert tensors
    of a fused mixture-of-experts block."""
    described = [(f"{n} {tuple(p.shape)}", p.shape[0] == 1) for n, p in module.named_parameters(recurse=False)
                 if p.dim() >= 2]
    weights = [text for text, broadcast in described if not broadcast]
    tables = [text for text, broadcast in described if broadcast]
    reasons = []
    if weights:
        reasons.append(f"holds {', '.join(weights)}, which stay fp32: no 8-bit version of {type(module).__name__} is "
                       "registered (register_quant_layer)")
    if tables:
        reasons.append(f"{'holds' if not weights else 'and'} {', '.join(tables)}, which stay fp32: a leading dim of 1 "
                       "broadcasts over the batch (a token or position table added to the activations, like an "
                       "embedding table, not a GEMM weight)")
    return "; ".join(reasons) or None


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """The module a transformers model's ``get_output_embeddings()`` returns (its LM head), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def _run_the_layers_own_forward(module, args):
    """A forward pre-hook whose presence keeps ``nn.TransformerEncoderLayer`` off torch's fused
    path (:func:`_hold_torch_fused_paths`); it refuses a nested tensor, which an
    ``nn.TransformerEncoder`` outside the quantized model packs for that path alone."""
    if args and getattr(args[0], "is_nested", False):
        raise ValueError("an nn.TransformerEncoderLayer holding 8-bit layers got a nested tensor, which its "
                         "nn.TransformerEncoder packs a padded batch into for torch's fused path (use_nested_tensor), "
                         "the path that would bypass the 8-bit layers: quantize the whole encoder, or set its "
                         "use_nested_tensor = False")


def _hold_torch_fused_paths(model: nn.Module, hold: bool) -> None:
    """Keep torch's fused Transformer kernels from bypassing the 8-bit layers (``hold``), or let
    them run again (after :func:`dequantize_model`).

    In eval mode under ``no_grad``, ``nn.TransformerEncoderLayer`` runs one fused kernel that reads
    ``linear1``/``linear2``'s weights itself, so their 8-bit forward never ran: the model evaluated
    in float. A forward hook on the layer is one of torch's conditions for its module path, so an
    encoder layer holding an 8-bit layer gets one that does nothing; an ``nn.TransformerEncoder`` of
    such layers stops packing a padded batch into a nested tensor (``use_nested_tensor``), which
    only its layers' fused path reads. Undone as it was done."""
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer):
            hooks = module._forward_pre_hooks
            ours = [key for key, hook in hooks.items() if hook is _run_the_layers_own_forward]
            if hold and not ours and any(isinstance(m, QuantModule) for m in module.modules()):
                module.register_forward_pre_hook(_run_the_layers_own_forward)
            for key in ours if not hold else ():
                del hooks[key]
        elif isinstance(module, nn.TransformerEncoder):
            if hold and getattr(module, "use_nested_tensor", False) and any(
                    isinstance(m, QuantModule) for m in module.modules()):
                module.use_nested_tensor, module.nested_tensor_held_for_8bit = False, True
            elif not hold and module.__dict__.pop("nested_tensor_held_for_8bit", False):
                module.use_nested_tensor = True


# torch.nn.Module's registries of the hooks ``register_forward_pre_hook``, ``register_forward_hook``
# and ``register_full_backward(_pre)_hook`` add to one module (the last: which kind its backward hooks are)
_HOOK_REGISTRIES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook")


def _replace(model: nn.Module, selected: set[int], build) -> None:
    """Replace each module whose id is in `selected` by ``build(module)``, under every name it has.
    Every replacement is built before any is set: a build that raises leaves `model` as it was.
    The replacement takes over the module's forward and backward hooks (the same registries, so the
    handles ``register_*_hook`` returned still remove them)."""
    named = [(name, module) for name, module in model.named_modules(remove_duplicate=False) if id(module) in selected]
    originals = {id(module): module for _, module in named}
    built = {module_id: build(module) for module_id, module in originals.items()}
    for module_id, module in originals.items():
        for registry in _HOOK_REGISTRIES:
            if registry in module.__dict__:
                setattr(built[module_id], registry, module.__dict__[registry])
    for name, module in named:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, built[id(module)])


_LOCATION_KWARGS = ("revision", "subfolder", "cache_dir", "token", "local_files_only", "force_download", "proxies",
                    "trust_remote_code", "code_revision")


def load_quantized(path: str | os.PathLike, auto_class=None, **from_pretrained_kwargs) -> nn.Module:
    """Load a model saved (``save_pretrained``) after ``quantize_model``: the 8-bit layers with their
    fp32 master weights and activation ranges. A shortcut for ``auto_class.from_pretrained(path)``
    (which does the same once ``lp_decentral_nlp`` is imported) that refuses a checkpoint without our
    ``quantization_config`` instead of loading it as a float model.

    Args:
        path: local folder or hub repo id.
        auto_class: e.g. ``AutoModelForSequenceClassification`` or your own ``PreTrainedModel``
            subclass; default: the transformers class ``config.json`` names (``architectures``, as
            saved: a classifier with its head), ``AutoModel`` if it names none. A class transformers
            does not define (your own, or remote code) is a ValueError asking for ``auto_class``.
        **from_pretrained_kwargs: passed to ``auto_class.from_pretrained`` (those locating the files
            and allowing remote code, e.g. ``revision``, ``trust_remote_code``, also to
            ``AutoConfig.from_pretrained``).

    Raises:
        FileNotFoundError: `path` is a local path (absolute, ``./``, ``../``, ``~`` or more than
            one ``/``: no hub id) that does not exist (transformers would read it as a malformed
            repo id).
        ValueError: a local folder without ``config.json``, no ``lp_decentral_nlp``
            quantization_config in it, a class to name (above), or weights that cannot be read
            (naming `path`).
    """
    import transformers

    text = os.fspath(path)
    local = (os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1
             or (os.sep != "/" and os.sep in text))
    path = os.path.expanduser(text)  # transformers takes '~/x' for a malformed hub id
    if local and not os.path.exists(path):
        raise FileNotFoundError(f"{text}: no such folder (a hub id is 'name' or 'namespace/name')")
    if os.path.isfile(path):
        raise ValueError(f"{text} is a file: give the folder save_pretrained wrote (it holds config.json)")
    if os.path.isfile(os.path.join(path, "model", "config.json")) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json but its model/ folder has: a recipe's run folder? load "
                         f"{os.path.join(path, 'model')}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json: it is not a transformers model's save_pretrained folder "
                         "(a vision recipe's model folder loads with lp_decentral_nlp.vision.ImageClassifier."
                         "from_pretrained)")
    location = {k: v for k, v in from_pretrained_kwargs.items() if k in _LOCATION_KWARGS}
    config = transformers.AutoConfig.from_pretrained(path, **location)
    saved = getattr(config, CONFIG_KEY, None)
    method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
    if method != QUANT_METHOD:
        raise ValueError(f"config.json of {path} has no quantization_config with quant_method {QUANT_METHOD!r} "
                         f"(found {method!r}): it was saved float, or from a transformers model inside a module of your "
                         "own that quantize_model was given, which records nothing on it; load it with from_pretrained "
                         "and call quantize_model")
    if auto_class is not None and not callable(getattr(auto_class, "from_pretrained", None)):
        raise TypeError(f"auto_class must be a transformers model class (e.g. AutoModelForSequenceClassification or "
                        f"your PreTrainedModel subclass), got {auto_class!r}")
    if auto_class is None:
        saved_as = (getattr(config, "architectures", None) or ["AutoModel"])[0]
        auto_class = getattr(transformers, saved_as, None)
        if auto_class is None:  # falling back to AutoModel would drop the head silently
            raise ValueError(f"config.json of {path} names the class {saved_as!r}, which transformers does not "
                             "define (your own model class, or remote code): pass it as auto_class, e.g. "
                             f"load_quantized(path, auto_class={saved_as})")
    from safetensors import SafetensorError

    try:
        loaded = auto_class.from_pretrained(path, **from_pretrained_kwargs)
    except SafetensorError as err:  # its message names no file
        raise ValueError(f"the weights of {path} cannot be read ({err}): the file is truncated or not a "
                         "safetensors file; save the model again with save_pretrained") from err
    model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True: (model, info)
    if not any(isinstance(m, QuantModule) for m in model.modules()):  # e.g. CLIPVisionModel of a CLIPModel folder
        saved_as = (getattr(config, "architectures", None) or [None])[0]
        whole = f"load {saved_as}, the saved class, and take the part from it" if saved_as else "load the saved class"
        raise ValueError(f"{getattr(auto_class, '__name__', auto_class)} loaded from {path} has no 8-bit layer: the "
                         f"quantization_config is the whole saved model's, whose part this class reads as a float "
                         f"model; {whole}")
    return loaded
