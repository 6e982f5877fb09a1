"""The vision recipes' command line (SPEC section 8): decentralized training of a CNN from scratch.

``main(algorithm="choco")`` parses the flags shared with the NLP recipes
(:func:`lp_decentral_nlp.cli.add_decentralized_flags`) plus ``--dataset --data-dir --image-size
--augment --arch --norm --groups --lr --weight-decay --lr-milestones``, trains with
:class:`~lp_decentral_nlp.trainer.DecentralizedTrainer` (SGD, Nesterov momentum 0.9, weight
decay, LR x0.1 at each milestone epoch) and writes, under ``--output-dir``, the files of the NLP
recipes: ``results.json`` (same contract, cost report written at the start), ``metrics.csv`` and
``model/`` (the averaged model, :meth:`ImageClassifier.save_pretrained`: ``model.safetensors`` +
``vision_config.json``; reload with :meth:`ImageClassifier.from_pretrained`).

``--norm auto`` (the default) is the paper's pairing (SPEC 5): Range EvoNorm for 8-bit training,
EvoNorm-S0 with ``--full-precision``; any norm of :data:`~lp_decentral_nlp.vision.NORMS` can be
asked for with either precision (the 8-bit surgery quantizes EvoNorm-S0, Range EvoNorm and Range
BatchNorm; BatchNorm and GroupNorm stay fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from ..cli import _existing_path, _Parser, _ranged, add_decentralized_flags, train_and_report, training_arguments
from .models import ARCHS, NORMS, build_vision_model

__all__ = ["build_vision_parser", "parse_vision_args", "run_vision", "main", "DEFAULT_NORMS", "SGD_OPTIM_ARGS"]

# SPEC 5: Range EvoNorm is the norm of 8-bit training, EvoNorm-S0 the one of fp32 training.
DEFAULT_NORMS = {"int8": "range_evonorm", "fp32": "evonorm"}
# SPEC 8: SGD with Nesterov momentum 0.9 (transformers' "sgd" optimizer reads these optim_args).
SGD_OPTIM_ARGS = "momentum=0.9,nesterov=True"
# Flipping a digit changes what it shows: with the CIFAR augmentation a single-node fp32 ResNet-20
# (EvoNorm) reaches 30% test accuracy on digits after 5 epochs, 95% without it.
NO_AUGMENT_DATASETS = ("digits",)
# SPEC 8: LR x0.1 at epochs 100 and 150 of 200, i.e. at these fractions of the run by default.
DEFAULT_MILESTONE_FRACTIONS = (0.5, 0.75)


def build_vision_parser(algorithm: str) -> argparse.ArgumentParser:
    """The vision recipes' parser; bad flags exit with one line on stderr (status 2)."""
    from .data import VISION_DATASETS

    parser = _Parser(description=f"Decentralized {algorithm} training of a CNN (SPEC 8 optimizer; "
                                 "defaults sized for a CPU run on digits).")
    add_decentralized_flags(parser, algorithm)
    d = parser.add_argument_group("model and data")
    d.add_argument("--dataset", choices=tuple(VISION_DATASETS), default="digits",
                   help="image dataset (default digits: scikit-learn's bundled 8x8 digits, offline)")
    d.add_argument("--data-dir", type=_existing_path, default=None,
                   help="local copy (save_to_disk folder or image folder tree) instead of the hub; not for digits")
    d.add_argument("--image-size", type=_ranged(int, 1, None), default=None,
                   help="side of the square input in pixels (default: the dataset's, 8 for digits, 32 for CIFAR)")
    d.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                   help="random crop + horizontal flip of training images (default: on, off for digits, "
                        "whose classes are not mirror-symmetric)")
    d.add_argument("--arch", choices=tuple(ARCHS), default="resnet20", help="network (default resnet20)")
    d.add_argument("--norm", choices=("auto",) + NORMS, default="auto",
                   help="normalisation; auto = range_evonorm for 8-bit, evonorm with --full-precision (SPEC 5)")
    d.add_argument("--groups", type=_ranged(int, 1, None), default=2,
                   help="groups of groupnorm/evonorm/range_evonorm (default 2)")
    o = parser.add_argument_group("optimizer: SGD with Nesterov momentum 0.9 (SPEC 8)")
    o.add_argument("--lr", type=_ranged(float, 0.0, None, lo_open=True), default=0.1, help="learning rate (default 0.1)")
    o.add_argument("--weight-decay", type=_ranged(float, 0.0, None), default=1e-4)
    o.add_argument("--lr-milestones", type=_ranged(float, 0.0, None, lo_open=True), nargs="*", default=None,
                   metavar="EPOCH", help="epochs at which the LR is multiplied by 0.1 (default: 50%% and 75%% of "
                                         "--epochs, as 100 and 150 of 200 in SPEC 8; the flag alone: constant LR)")
    return parser


def parse_vision_args(algorithm: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; resolve ``--norm auto``, ``--image-size`` and ``--lr-milestones``.

    Errors that need two flags together (a milestone order, ``--data-dir`` with digits, an input
    too small for the network, groups that do not divide the channels) exit like a bad flag.
    """
    from .data import vision_dataset_spec

    parser = build_vision_parser(algorithm)
    args = parser.parse_args(argv)
    if args.dataset == "digits" and args.data_dir is not None:
        parser.error("argument --data-dir: digits is bundled with scikit-learn and takes no --data-dir")
    if args.norm == "auto":
        args.norm = DEFAULT_NORMS["fp32" if args.full_precision else "int8"]
    spec = vision_dataset_spec(args.dataset)
    args.image_size = args.image_size or spec.image_size
    if args.augment is None:
        args.augment = args.dataset not in NO_AUGMENT_DATASETS
    args.num_classes = spec.num_classes
    if args.lr_milestones is None:
        args.lr_milestones = [f * args.epochs for f in DEFAULT_MILESTONE_FRACTIONS]
    elif args.lr_milestones != sorted(set(args.lr_milestones)):
        parser.error(f"argument --lr-milestones: epochs must be strictly increasing, got {args.lr_milestones}")
    try:
        net = build_vision_model(args.arch, args.num_classes, args.norm, args.groups)
    except ValueError as err:
        parser.error(f"argument --groups/--norm: {err}")
    min_size = getattr(net, "min_size", 1)
    if args.image_size < min_size:
        parser.error(f"argument --image-size: {args.arch} needs images of at least {min_size}x{min_size}, "
                     f"got {args.image_size} (pass --image-size {min_size})")
    return args


def run_vision(args: argparse.Namespace) -> dict:
    """Train, evaluate and save one vision run; returns the results written to ``results.json``."""
    from transformers import set_seed

    from .classifier import ImageClassifier
    from .data import load_vision_dataset, vision_transform, with_vision_transforms

    start = time.time()
    if args.output_dir is None:
        args.output_dir = os.path.join(
            "runs", f"{args.dataset}_{args.arch}_{args.norm}_{args.algorithm}_skew{args.skew}_comp{args.comp}")
    try:
        raw = load_vision_dataset(args.dataset, data_dir=args.data_dir, seed=args.seed)
    except (ConnectionError, OSError) as err:
        if args.data_dir is not None:
            raise
        raise SystemExit(f"error: could not load {args.dataset!r} from the hub ({err.__class__.__name__}); "
                         "pass --data-dir with a local copy") from None
    data = with_vision_transforms(raw, args.dataset, args.image_size)
    if not args.augment:  # the evaluation transform (resize, normalise) for training too
        data["train"] = raw["train"].with_transform(vision_transform(args.dataset, False, args.image_size))
    set_seed(args.seed)
    model = ImageClassifier(args.arch, args.num_classes, args.norm, args.groups)
    model_used = f"{args.arch} ({args.norm}, {args.num_classes} classes, random init)"
    targs = training_arguments(
        args, learning_rate=args.lr, weight_decay=args.weight_decay, optim="sgd", optim_args=SGD_OPTIM_ARGS,
        lr_scheduler_type="constant", lr_milestones=args.lr_milestones or None,
        remove_unused_columns=False,  # the transform needs the raw 'image' column
    )
    return train_and_report(args, model, targs, data, model_used, (3, args.image_size, args.image_size), start)


def main(algorithm: str, argv: list[str] | None = None) -> dict:
    """Entry point of the vision recipes."""
    results = run_vision(parse_vision_args(algorithm, argv))
    print(json.dumps({k: results[k] for k in ("accuracy", "node_accuracy", "bytes_sent_per_node", "consensus_distance")}))
    return results
