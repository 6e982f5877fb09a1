"""`QuantConfig`: what the 8-bit training surgery does to a model (SPEC section 4)."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..checks import Number, check_flags, check_number
from .kernels import kernel_names

# Task heads of Hugging Face models (classification, question answering, multiple choice, MLM
# transforms, distillation and LM heads). They stay full precision by default (SPEC 4); while
# "lm_head" is in `skip`, so does the model's output embeddings module, whatever its name
# (`surgery.quantize_model`). These well-known names are applied wherever they exist; any other
# `skip` pattern must match.
DEFAULT_SKIP = ("classifier", "pre_classifier", "score", "lm_head", "qa_outputs", "classification_head", "cls",
                "predictions", "vocab_transform", "vocab_projector", "generator_predictions", "generator_lm_head",
                "discriminator_predictions", "sequence_summary", "logits_proj", "multiple_choice_head",
                "cls_classifier", "distillation_classifier", "classifier_distill")
GRAD_GRANULARITIES = ("tensor", "sample")
MIN_BITS, MAX_BITS = 2, 8


@dataclass(frozen=True)
class QuantConfig:
    """Settings of the 8-bit layers and of the module selection.

    Attributes:
        bits: bits of the forward operands (weights and input activations), in [2, 8].
        grad_bits: bits of the layer gradient (gradient w.r.t. the layer input), in [2, 8].
        stochastic_grad_rounding: round the layer gradient stochastically (unbiased) in training;
            nearest rounding otherwise. Eval mode always rounds to nearest.
        grad_granularity: range of the layer-gradient quantizer: ``"tensor"`` (min/max of the whole
            output-gradient tensor, SPEC 4) or ``"sample"`` (one min/max per sample, dim 0).
        act_momentum: momentum of the running activation range, PyTorch convention:
            ``running = (1 - m) * running + m * batch``.
        skip: module-name patterns kept full precision (a layer is skipped when the pattern matches
            its name or the name of one of its parents). A pattern matches a name when it equals it,
            is a dot-separated suffix of it, or fully matches it as a regular expression. The
            default, ``DEFAULT_SKIP``, names the common Hugging Face task heads (``classifier``,
            ``pre_classifier``, ``score``, ``lm_head``, ``qa_outputs``, ``classification_head``,
            ``cls`` (BERT's pre-training heads), ``predictions`` (ALBERT's MLM head),
            ``vocab_transform``, ``vocab_projector``, ELECTRA's
            ``generator_predictions``, ``generator_lm_head``, ``discriminator_predictions``, the
            sequence summaries of XLNet/XLM/ELECTRA's multiple choice ``sequence_summary`` and
            ``logits_proj``, GPT-2's ``multiple_choice_head``, and the distilled vision models'
            ``cls_classifier``, ``distillation_classifier``, ``classifier_distill``); while
            ``skip`` holds ``"lm_head"`` (the default, or ``DEFAULT_SKIP + (...)``) the module the
            model's ``get_output_embeddings()`` returns (its LM head, whatever its name) stays full
            precision too. The default names need not exist in the model; any other pattern must
            match a layer.
        target: ``None`` quantizes every supported layer not skipped; otherwise only layers whose
            name (or a parent's) matches one of these patterns.
        kernel: how the quantized GEMMs run: ``"auto"`` (the default: int8 where it is faster, i.e. a
            wide enough Linear/Conv1D layer on a CPU where ``torch._int_mm`` is a real int8 GEMM
            (AVX512-VNNI) and a large enough Conv2d call where oneDNN's int8 convolution runs;
            simulated elsewhere, CUDA included, where int8 measured slower; see
            ``kernels.resolve_kernel``; the two compute the same
            products up to fp32 rounding, per layer: a whole run ends close, not equal),
            ``"simulated"`` (float fake quantization, the paper's method), ``"int8"`` (int8
            GEMMs), ``"int8_bf16"`` (int8 GEMMs and a bfloat16 weight-gradient GEMM) or another
            registered kernel. A layer the kernel cannot run falls back to ``"simulated"``;
            ``quantize_model`` warns why (one warning per reason), its ``dry_run=True`` report says
            it per layer, and ``kernel_report(model)`` names the kernel each layer ran.
        embeddings: also quantize ``nn.Embedding`` tables (SPEC 4 keeps them full precision by
            default): the rows a forward looks up are put on the table's 8-bit grid (per-tensor
            min/max, nearest rounding, straight-through estimator), see ``layers.QuantEmbedding``.
    """

    bits: int = 8
    grad_bits: int = 8
    stochastic_grad_rounding: bool = True
    grad_granularity: str = "tensor"
    act_momentum: float = 0.1
    skip: tuple[str, ...] = DEFAULT_SKIP
    target: tuple[str, ...] | None = None
    kernel: str = "auto"
    embeddings: bool = False

    def __post_init__(self):
        for name in ("bits", "grad_bits"):
            object.__setattr__(self, name, check_number(name, getattr(self, name),
                                                        Number(integer=True, low=MIN_BITS, high=MAX_BITS)))
        check_flags(self, ("stochastic_grad_rounding", "embeddings"))
        if self.grad_granularity not in GRAD_GRANULARITIES:
            raise ValueError(f"grad_granularity must be one of {GRAD_GRANULARITIES}, got {self.grad_granularity!r}")
        object.__setattr__(self, "act_momentum", float(check_number(
            "act_momentum", self.act_momentum, Number(low=0, low_open=True, high=1))))
        object.__setattr__(self, "skip", _patterns("skip", self.skip))
        if self.target is not None:
            object.__setattr__(self, "target", _patterns("target", self.target))
            if not self.target:
                raise ValueError("target must be None (every supported layer) or a non-empty list of patterns")
        if self.kernel not in kernel_names():
            raise ValueError(f"kernel must be one of {kernel_names()}, got {self.kernel!r}")

    def to_dict(self) -> dict:
        """JSON-serialisable form (stored under ``lp_quant_config`` in a model's ``config.json``)."""
        d = dataclasses.asdict(self)
        d["skip"] = list(self.skip)
        d["target"] = None if self.target is None else list(self.target)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        """The config :meth:`to_dict` gave; ValueError naming any key that is no field."""
        if not isinstance(d, Mapping):
            raise TypeError(f"QuantConfig.from_dict takes the dict that to_dict() gives, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown QuantConfig keys {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**d)


def _patterns(field: str, value) -> tuple[str, ...]:
    """Validate a list of module-name patterns (each a plain name, dotted suffix or regex)."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise TypeError(f"{field} must be a tuple or list of pattern strings (e.g. ('classifier',)), got {value!r}")
    for p in value:
        if not isinstance(p, str) or not p:
            raise TypeError(f"{field} patterns must be non-empty strings, got {p!r}")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"{field} pattern {p!r} is not a valid regular expression: {e}") from None
    return tuple(value)


def name_matches(pattern: str, name: str) -> bool:
    """Whether `pattern` selects the module called `name` (exact, dotted suffix, or full regex)."""
    return name == pattern or name.endswith("." + pattern) or re.fullmatch(pattern, name) is not None
