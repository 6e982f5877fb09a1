"""The model card of a decentralized run: Trainer's draft (``transformers.modelcard.TrainingSummary``)
of the averaged model, with the decentralized setting among its hyperparameters, a description
saying how to load it, and the per-node evaluation figures left to the logs."""
from __future__ import annotations

import re
from pathlib import Path

from transformers.modelcard import TrainingSummary

from ..gossip.factory import build_compressor, build_topology
from ..quant.layers import QuantModule

# the pretty names TrainingSummary gives per-node metrics ("Loss Node 0", "Bytes Sent Node 3")
_PER_NODE = re.compile(r" Node \d+$")
#: the tags of every card (beside Trainer's ``generated_from_trainer`` and the user's)
LIBRARY_TAGS = ("decentralized", "lp_decentral_nlp")
# the pretty name of the metric the card shows in four significant digits (TrainingSummary rounds to
# four decimals: a converging run's 6e-07 read 0.0)
_SIGNIFICANT = "Consensus Distance"
# the draft's placeholder that :func:`model_description` replaces
_DESCRIPTION_PLACEHOLDER = "\n## Model description\n\nMore information needed\n"


def fault_settings(args, max_steps: int | None = None) -> dict:
    """The injected faults and the non-finite guard of ``args`` that are on, by card name
    (``absences``' iterations count from 0: iteration t is logged as step t + 1; with the run's
    `max_steps`, an absence ending after the run is said to last to its end)."""
    plan, settings = args.fault_plan, {}
    if plan.drop_prob:
        settings["message_drop_prob"] = plan.drop_prob
    if plan.stragglers:
        settings["stragglers"] = ", ".join(f"node {node} waits {seconds:g} s per send" for node, seconds in plan.stragglers)
    if plan.absences:
        settings["absences"] = ", ".join(
            f"node {node} away from iteration {start} to the run's end" if max_steps and end > max_steps
            else f"node {node} away for iterations {start} to {end - 1}" for node, start, end in plan.absences)
    if args.skip_nonfinite:
        settings["skip_nonfinite"] = True
    return settings


def decentralized_hyperparameters(args, max_steps: int | None = None) -> dict:
    """The setting of SPEC 1-3 and 6 as model-card hyperparameters, the batch over every node and
    the :func:`fault_settings` in use (``args``: :class:`~lp_decentral_nlp.trainer.DecentralizedTrainingArguments`;
    `max_steps`: the run's, where known)."""
    config = args.gossip_config
    settings = {"num_nodes": args.num_nodes, "topology": build_topology(config).name, "algorithm": args.algorithm,
                # the default step is computed: 0.04000000000000001 reads 0.04
                "compressor": repr(build_compressor(config)), "consensus_step_size": float(f"{args.gamma:.6g}"),
                "precision": "8-bit (weights, activations, layer gradients)" if args.low_precision else "float32",
                "quasi_global_momentum": args.qgm, "label_skew": args.skew,
                "total_train_batch_size": (args.per_device_train_batch_size * args.gradient_accumulation_steps
                                           * args.num_nodes)}
    if args.mixed_precision != "no":
        settings["mixed_precision_training"] = f"Native AMP ({args.mixed_precision} autocast per node)"
    if args.low_precision:
        settings["quant_kernel"] = args.quant_kernel
    if args.data_seed is not None:
        settings["data_seed"] = args.data_seed
    if args.final_merge:
        settings["final_merge"] = True
    if args.gossip_reference != "zero":
        settings["gossip_reference"] = args.gossip_reference
    return {**settings, **fault_settings(args, max_steps)}


def local_checkpoint(model) -> Path | None:
    """The local folder `model` was loaded from (its config's ``_name_or_path``), else None (a hub
    id, a model built from a config, a model without a transformers config)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "")
    return Path(name) if name and Path(name).is_dir() else None


def base_model_of(folder: Path) -> str | None:
    """The one ``base_model`` the model card ``folder/README.md`` names in its metadata (a card this
    library or ``Trainer`` wrote for a fine-tuned hub model), else None (no card, no such entry,
    several, or a card whose metadata does not parse)."""
    import yaml
    from huggingface_hub import metadata_load

    try:
        metadata = metadata_load(folder / "README.md") if (folder / "README.md").is_file() else None
    except (ValueError, OSError, yaml.YAMLError):
        return None
    base = (metadata or {}).get("base_model")
    base = base[0] if isinstance(base, list) and len(base) == 1 else base
    return base if isinstance(base, str) and base else None


def training_summary(trainer, **card_fields) -> TrainingSummary:
    """``TrainingSummary.from_trainer(trainer, **card_fields)`` (the fields of
    ``Trainer.create_model_card``) with :func:`decentralized_hyperparameters` added
    (``train_batch_size`` stays the batch of one node) and the averaged model's evaluation
    results only. A model without a transformers ``config`` (an ``ImageClassifier``) is trained
    from scratch unless ``finetuned_from`` says otherwise (``from_trainer`` reads the config's
    name); a model loaded from a local folder (which ``from_trainer`` also takes for training from
    scratch) is a fine-tuned version of the base model its folder's card names, if one."""
    folder = local_checkpoint(trainer.model)
    base = base_model_of(folder) if card_fields.get("finetuned_from") is None and folder is not None else None
    if base is not None:
        card_fields = {**card_fields, "finetuned_from": base}
    from_scratch = getattr(trainer.model, "config", None) is None and card_fields.get("finetuned_from") is None
    if from_scratch:
        card_fields = {**card_fields, "finetuned_from": ""}  # not None: from_trainer skips the config
    tags = card_fields.get("tags")
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    card_fields = {**card_fields, "tags": tags + [tag for tag in LIBRARY_TAGS if tag not in tags]}
    summary = TrainingSummary.from_trainer(trainer, **card_fields)
    if from_scratch:
        summary.finetuned_from = None
    summary.hyperparameters.update(decentralized_hyperparameters(trainer.args, trainer.state.max_steps or None))
    if summary.eval_results is not None:  # None before any evaluation
        summary.eval_results = _averaged_model_figures(summary.eval_results)
    if summary.eval_lines is not None:
        summary.eval_lines = [_averaged_model_figures(line) for line in summary.eval_lines]
    return summary


def _averaged_model_figures(figures: dict) -> dict:
    """``figures`` (pretty name -> value) without the per-node ones, the consensus distance in four
    significant digits."""
    return {name: f"{value:.4g}" if name == _SIGNIFICANT and isinstance(value, float) else value
            for name, value in figures.items() if not _PER_NODE.search(name)}


def model_description(trainer) -> str:
    """The card's "Model description": what the saved model is and, for an 8-bit transformers
    model, how to load it (transformers alone loads its float weights, with a warning)."""
    args = trainer.args
    text = (f"The averaged model of {args.num_nodes} nodes trained by decentralized {args.algorithm} with "
            "lp_decentral_nlp (hyperparameters below)")
    transformers_model = hasattr(getattr(trainer.model, "config", None), "to_json_string")
    cls = type(trainer.model)  # the public path of the library's classes (lp_decentral_nlp.vision.ImageClassifier)
    where = ".".join(cls.__module__.split(".")[:2]) if cls.__module__.startswith("lp_decentral_nlp.") else cls.__module__
    own_loader = (f" `{where}.{cls.__name__}.from_pretrained(path)` loads it."
                  if not transformers_model and callable(getattr(trainer.model, "from_pretrained", None)) else "")
    if not any(isinstance(m, QuantModule) for m in trainer.model.modules()):
        return text + ", in float32." + (" `from_pretrained` loads it as any transformers model."
                                         if transformers_model else own_loader)
    text += (", in 8-bit: weights, activations and layer gradients on an 8-bit grid, the fp32 master weights and "
             "activation ranges saved.")
    text += own_loader
    if transformers_model:
        text += (" Load it with lp_decentral_nlp installed: `lp_decentral_nlp.load_quantized(path)`, or "
                 "`import lp_decentral_nlp` before `from_pretrained` (which registers the 8-bit quantization; "
                 "transformers alone loads the float master weights, with a warning of an unknown quantization "
                 "type).")
    return text


def write_model_card(trainer, folder, **card_fields) -> None:
    """Write the :func:`training_summary` card of `trainer` to ``folder/README.md`` (creating
    `folder`): ``output_dir`` for :meth:`DecentralizedTrainer.create_model_card`, the saved model's
    folder for the recipes. Its "Model description" is :func:`model_description`'s; a model from a
    local folder whose card names no base model is "a fine-tuned version of the local checkpoint
    `<parent>/<folder>`", not "trained from scratch"."""
    summary = training_summary(trainer, **card_fields)
    text = summary.to_model_card().replace(_DESCRIPTION_PLACEHOLDER,
                                           f"\n## Model description\n\n{model_description(trainer)}\n", 1)
    if not hasattr(getattr(trainer.model, "config", None), "to_json_string"):  # transformers cannot load it
        text = text.replace("\nlibrary_name: transformers\n", "\nlibrary_name: lp_decentral_nlp\n", 1)
    checkpoint = local_checkpoint(trainer.model)
    if summary.finetuned_from is None and checkpoint is not None:
        text = text.replace("This model was trained from scratch on ",
                            "This model is a fine-tuned version of the local checkpoint "
                            f"`{'/'.join(checkpoint.resolve().parts[-2:])}` on ", 1)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "README.md").write_text(text, encoding="utf-8")
