"""The paper's normalisation comparison under label skew (SPEC 5), on digits by default.

Trains the same decentralized setting once per norm with the vision recipe (in this process,
one run after the other) and writes a Markdown table and a PNG plot of the averaged model's test
accuracy over training:

    OMP_NUM_THREADS=1 python benchmarks/vision_norm_comparison.py --skew 0.8 --epochs 20

Runs (``--runs``, ``norm:precision``): the paper's pairing is fp32 for BatchNorm, GroupNorm and
EvoNorm-S0 and 8-bit for Range EvoNorm; ``range_evonorm:fp32`` separates the norm from the
precision. Each run's files land in ``--output-dir/<norm>_<precision>/`` (results.json,
metrics.csv, model/), the table in ``--output-dir/table.md``; ``--skip-existing`` reuses finished
runs (e.g. to redraw the plot) and redoes the runs that were stopped (a results.json left
"running"). Ctrl-C stops with one line; ``--skip-existing`` then goes on where it stopped.

The table's figures go to the record ``vision_norm_comparison_skew<skew>.json`` in
``benchmarks/results/`` (``benchmarks/record.py``; ``LP_BENCHMARK_RESULTS_DIR=FOLDER`` sends it
elsewhere), the plot to ``--plot``, by default ``docs/vision_norm_comparison.png`` of this
repository (wherever the command runs from; with ``LP_BENCHMARK_RESULTS_DIR``, a trial run, that
folder's ``vision_norm_comparison.png``). These defaults hold the published comparison: every
default run, every setting at its default (the record's name carries the skew; the plot is of
the default skew). A run that differs (a subset of ``--runs``, other ``--epochs``, ``--seed``,
...) is refused, before any run, unless it names its own outputs: ``--plot FILE`` for the plot,
``LP_BENCHMARK_RESULTS_DIR=FOLDER`` for the record. Every output is checked before the first run.
"""
from __future__ import annotations

import argparse
import csv
import os
import pathlib
import sys

import record

PROG = os.path.basename(__file__)
ROOT = pathlib.Path(__file__).resolve().parents[1]
#: the published comparison's plot (README, docs/benchmarks.md)
DEFAULT_PLOT = ROOT / "docs" / "vision_norm_comparison.png"
DEFAULT_RUNS = ("batchnorm:fp32", "groupnorm:fp32", "evonorm:fp32", "range_evonorm:int8", "range_evonorm:fp32")
LABELS = {"batchnorm": "BatchNorm", "groupnorm": "GroupNorm", "evonorm": "EvoNorm-S0",
          "range_evonorm": "Range EvoNorm", "range_batchnorm": "Range BatchNorm"}
#: the settings of the published comparison (skew aside), by destination
PUBLISHED = ("runs", "dataset", "arch", "nodes", "topology", "comp", "epochs", "batch_size", "eval_steps", "seed")
#: the settings the record's "setup" holds (the runs' rows hold the runs)
SETUP = ("dataset", "arch", "nodes", "topology", "skew", "comp", "epochs", "batch_size", "eval_steps", "seed")
#: what to do after Ctrl-C stopped the comparison
AFTER_INTERRUPT = "the comparison did not finish: run it again with --skip-existing (finished runs are reused, the " \
                  "stopped one is redone)"


def _recipe_choices(dest: str) -> list[str]:
    """The values the vision recipes allow for ``dest`` (their flag table, no torch)."""
    from lp_decentral_nlp.commands import FLAG_TABLES

    return next(f["allowed"] for f in FLAG_TABLES["vision"]["flags"] if f["dest"] == dest)


def build_parser():
    from lp_decentral_nlp.commands import Range, existing_path, ranged, user_path

    p = record.benchmark_parser(__doc__, prog=PROG)
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS),
                   help=f"norm:precision pairs, each run once (norm in {', '.join(LABELS)}; precision fp32 or int8)")
    p.add_argument("--dataset", default="digits", choices=[d for d in _recipe_choices("dataset") if d != "folder"],
                   help="image dataset of every run (digits: scikit-learn's bundled 8x8 digits, offline; the others "
                        "from the hub, or from --data-dir)")
    p.add_argument("--data-dir", "--data_dir", type=existing_path, default=None,
                   help="a local copy of --dataset for every run, as the vision recipes take it (a save_to_disk "
                        "folder; default: none, the hub)")
    p.add_argument("--arch", default="resnet20", choices=_recipe_choices("arch"), help="network of every run")
    p.add_argument("--nodes", "--num-nodes", "--num_nodes",
                   type=ranged(int, Range(1, 65536)), default=4, help="number of peer nodes")
    p.add_argument("--topology", default="directed_ring", choices=_recipe_choices("topology"),
                   help="communication graph of the nodes")
    p.add_argument("--skew", type=ranged(float, Range(0, 1)), default=0.8,
                   help="degree of label skew of the nodes' shards, in [0, 1] (SPEC 6); the record's name carries it")
    p.add_argument("--comp", "--compression", type=ranged(float, Range(0, 100, high_open=True)), default=0.0,
                   help="percent of entries dropped per tensor by the gossip's compressor, in [0, 100) (0: every "
                        "entry is sent)")
    p.add_argument("--epochs", "--num_train_epochs", type=ranged(float, Range(0, 1e6, low_open=True)), default=20.0,
                   help="training epochs of each run")
    p.add_argument("--batch-size", "--batch_size", "--per_device_train_batch_size",
                   type=ranged(int, Range(1, 2**24)), default=32, help="training batch size per node")
    p.add_argument("--eval-steps", "--eval_steps", type=ranged(int, Range(1)), default=22,
                   help="evaluate (and log) every N steps: the points of the accuracy curve")
    p.add_argument("--seed", type=ranged(int, Range(0, 2**32 - 1)), default=0,
                   help="random seed of every run (shards, initial weights, batches)")
    p.add_argument("--output-dir", "--output_dir", type=user_path, default=None,
                   help="folder of the runs (one <norm>_<precision>/ folder each) and of table.md (default: "
                        "runs/vision_norm_comparison of this repository; with LP_BENCHMARK_RESULTS_DIR, a trial run, "
                        "under that folder)")
    p.add_argument("--plot", type=user_path, default=None,
                   help="PNG file of the accuracy curves (default: docs/vision_norm_comparison.png of this "
                        "repository, which only the published comparison may write: every default run and setting; "
                        "with LP_BENCHMARK_RESULTS_DIR, a trial run, that folder's vision_norm_comparison.png)")
    p.add_argument("--skip-existing", "--skip_existing", action="store_true",
                   help="reuse the runs whose results.json says done with these settings, and redo the runs that "
                        "were stopped (results.json left running)")
    p.add_argument("--overwrite-output-dir", "--overwrite_output_dir", action="store_true",
                   help="run again, over the results in --output-dir, the runs --skip-existing does not reuse")
    return p


def record_path(args) -> pathlib.Path:
    """The record this comparison writes (``benchmarks/record.py``'s folder, read when it writes)."""
    return pathlib.Path(record.RESULTS_DIR) / f"vision_norm_comparison_skew{args.skew:g}.json"


def flag_text(dest: str, value) -> str:
    return f"--{dest.replace('_', '-')} " + (" ".join(value) if isinstance(value, list) else f"{value:g}"
                                               if isinstance(value, float) else str(value))


def unpublished(parser, args) -> list[tuple[str, str]]:
    """(flag, flag with its value) of each setting in which ``args`` differ from the published
    comparison's (:data:`PUBLISHED`; the order of ``--runs`` aside)."""
    differing = []
    for dest in PUBLISHED:
        value, default = getattr(args, dest), parser.get_default(dest)
        if (sorted(value) != sorted(default)) if dest == "runs" else value != default:
            differing.append((f"--{dest.replace('_', '-')}", flag_text(dest, value)))
    return differing


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (one line, exit 2) before any run: the runs, the outputs of a comparison
    that is not the published one (module docstring), and that the plot, the record and the table
    can be written."""
    from lp_decentral_nlp.commands import output_dir_problem, output_file_problem

    p = build_parser()
    args = p.parse_args(argv)
    record.check_results_dir(p)
    for run in args.runs:
        norm, _, precision = run.partition(":")
        if norm not in LABELS or precision not in ("fp32", "int8"):
            p.error(f"argument --runs: {run!r} is not norm:precision with norm in {tuple(LABELS)} "
                    "and precision fp32 or int8")
    if len(set(args.runs)) < len(args.runs):
        p.error(f"argument --runs: {' '.join(args.runs)} names a run twice: give each once")
    if args.data_dir is not None and args.dataset == "digits":
        p.error("argument --data-dir: digits is bundled with scikit-learn and takes no data directory: drop "
                "--data-dir, or name its --dataset")
    differing = unpublished(p, args)
    trial = record.trial_run()  # its default plot goes to the trial's folder
    taken = [("--plot FILE", DEFAULT_PLOT)] if args.plot is None and not trial else []
    taken += [("LP_BENCHMARK_RESULTS_DIR=FOLDER", record_path(args))] if not trial else []
    if differing and taken:
        p.error(f"argument {differing[0][0]}: {', '.join(text for _, text in differing)} is not the published "
                f"comparison, whose outputs are the defaults: name this run's own with "
                f"{' and '.join(how for how, _ in taken)}, or it would replace "
                f"{' and '.join(str(file) for _, file in taken)}")
    if args.plot is None and not trial and args.skew != p.get_default("skew"):
        p.error(f"argument --skew: the default --plot {DEFAULT_PLOT} is the published comparison at skew "
                f"{p.get_default('skew'):g}: name a --plot FILE for skew {args.skew:g}")
    if args.plot is None:
        args.plot = str(record.output_path(DEFAULT_PLOT))
    problem = output_file_problem(args.plot)
    if problem:
        p.error(f"argument --plot: cannot write {args.plot!r} ({problem})")
    problem = output_file_problem(str(record_path(args)))
    if problem:
        p.error(f"cannot write the record {record_path(args)} ({problem}): set LP_BENCHMARK_RESULTS_DIR to a "
                "folder that can be written")
    if args.output_dir is None:
        args.output_dir = str(record.runs_dir("vision_norm_comparison"))
    problem = output_dir_problem(args.output_dir, overwrite=True, run_folder=False)
    if problem:
        p.error(f"argument --output-dir: {problem}")
    record.check_plotting(p)
    return args


def recipe_argv(args, norm: str, precision: str, out: str) -> list[str]:
    argv = ["--dataset", args.dataset, "--arch", args.arch, "--norm", norm, "--nodes", str(args.nodes),
            "--topology", args.topology, "--skew", str(args.skew), "--comp", str(args.comp),
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--eval-steps", str(args.eval_steps), "--logging-steps", str(args.eval_steps), "--output-dir", out]
    return (argv + (["--data-dir", args.data_dir] if args.data_dir is not None else [])
            + (["--full-precision"] if precision == "fp32" else [])
            + (["--overwrite_output_dir"] if args.overwrite_output_dir else []))


def accuracy_curve(run_dir: str) -> tuple[list[float], list[float]]:
    """(epochs, averaged-model test accuracy) of every evaluation in metrics.csv."""
    with open(os.path.join(run_dir, "metrics.csv"), encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("eval_accuracy")]
    by_epoch = {float(r["epoch"]): float(r["eval_accuracy"]) for r in rows}  # the final evaluation may repeat one
    return list(by_epoch), list(by_epoch.values())


def markdown_table(entries: list[dict]) -> str:
    lines = ["| norm | precision | test accuracy (averaged model) | mean node accuracy | consensus distance | wall time (s) |",
             "|---|---|---|---|---|---|"]
    for e in entries:
        r = e["results"]
        node_mean = sum(r["node_accuracy"]) / len(r["node_accuracy"])
        distance = r["consensus_distance"]  # null in results.json where a run diverged (NaN)
        lines.append(f"| {LABELS[e['norm']]} | {'8-bit' if e['precision'] == 'int8' else 'fp32'} | "
                     f"{100 * r['accuracy']:.1f}% | {100 * node_mean:.1f}% | "
                     f"{'diverged' if distance is None else f'{distance:.3g}'} | {r['wall_time_s']:.0f} |")
    return "\n".join(lines)


def plot(entries: list[dict], args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for e in entries:
        epochs, acc = accuracy_curve(e["dir"])
        style = "-" if e["precision"] == "int8" else "--"
        ax.plot(epochs, [100 * a for a in acc], style, marker="o", markersize=3,
                label=f"{LABELS[e['norm']]} ({'8-bit' if e['precision'] == 'int8' else 'fp32'})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy of the averaged model (%)")
    ax.set_title(f"{args.arch} on {args.dataset}, {args.nodes} nodes ({args.topology}), skew {args.skew}, "
                 f"comp {args.comp:g}%", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def reusable_results(args, norm: str, precision: str, out: str) -> dict | None:
    """With ``--skip-existing``, the finished results in ``out`` of the run these flags ask for;
    None when it has not finished (no results.json, or one a stopped run left "running"). A run
    finished with other settings, or a damaged results.json, runs again with
    ``--overwrite-output-dir`` and is the one-line error of ``--skip-existing`` (exit 2) without it."""
    from lp_decentral_nlp.commands import (config_differences, exit_with_error, finished_results, saved_thread_count,
                                           threads_to_use)
    from lp_decentral_nlp.vision.recipe import parse_vision_args

    def refuse(problem: str):
        exit_with_error(PROG, problem, "--skip-existing")

    if not args.skip_existing:
        return None
    try:
        results = finished_results(out, args.overwrite_output_dir)
    except ValueError as err:
        refuse(str(err))
    if results is None:
        return None
    argv = recipe_argv(args, norm, precision, out)  # parsed as for a run over `out`, which holds results
    wanted = parse_vision_args("choco", argv if args.overwrite_output_dir else [*argv, "--overwrite_output_dir"])
    # the thread count it would run with, compared: it changes an 8-bit run's results (docs/design.md)
    wanted = wanted.replace(threads=threads_to_use(wanted.recipe))
    differing = config_differences(results["config"], wanted, ("overwrite_output_dir", "consensus_lr_used"))
    if differing and not args.overwrite_output_dir:
        threads = saved_thread_count(results["config"], differing)  # (the runs take OMP_NUM_THREADS's)
        reuse = "" if threads is None else f"set OMP_NUM_THREADS={threads} to reuse it, "
        refuse(f"{out} holds a run of other settings ({', '.join(differing)}): {reuse}pass --overwrite-output-dir to "
               "run it again, or choose another --output-dir")
    return None if differing else results


def plan(args) -> list[dict]:
    """Each run's norm, precision, folder, and either its reused ``results`` or the recipe ``argv``
    to run it with, every refusal made before any run: a folder holding results is reused
    (``--skip-existing``), redone (a stopped run with ``--skip-existing``, or
    ``--overwrite-output-dir``) or refused (one line naming ``--output-dir``)."""
    from lp_decentral_nlp.commands import exit_with_error, output_dir_problem, run_outputs_in

    runs = []
    for run in args.runs:
        norm, _, precision = run.partition(":")
        out = os.path.join(args.output_dir, f"{norm}_{precision}")
        results = reusable_results(args, norm, precision, out)
        argv = recipe_argv(args, norm, precision, out)
        # what the recipe would refuse in the folder whatever --overwrite-output-dir says (files no run recorded, a
        # broken link), refused now, not at its turn after the runs before it
        problem = output_dir_problem(out, overwrite=True)
        if problem:
            exit_with_error(PROG, problem, "--output-dir")
        found = run_outputs_in(pathlib.Path(out))
        if results is None and found and not args.overwrite_output_dir:
            if args.skip_existing and "results.json" in found:  # not finished (reusable_results): a stopped run
                argv.append("--overwrite_output_dir")
            elif args.skip_existing:
                exit_with_error(PROG, f"{out} holds files of a run but no results.json ({', '.join(found)}): pass "
                                      "--overwrite-output-dir to run it again, or choose another --output-dir",
                                "--output-dir")
            else:
                exit_with_error(PROG, f"{out} already holds a run's results ({', '.join(found)}): pass --skip-existing "
                                      "to reuse the finished runs of these settings (and redo stopped ones), "
                                      "--overwrite-output-dir to run them again, or choose another --output-dir",
                                "--output-dir")
        runs.append({"norm": norm, "precision": precision, "dir": out, "results": results,
                     "argv": None if results is not None else argv})
    return runs


def run_vision(argv: list[str]) -> dict:
    """One run of the vision recipe (Choco-SGD) in this process. Ctrl-C in its training stops with
    this comparison's advice (:data:`AFTER_INTERRUPT`), not the recipe's (its ``--save_steps``)."""
    from lp_decentral_nlp.vision.recipe import main as vision_main

    return vision_main("choco", argv, on_interrupt=AFTER_INTERRUPT)


def main(argv=None) -> str:
    from lp_decentral_nlp.commands import stop_on_interrupt

    args = parse_args(argv)
    with stop_on_interrupt(PROG, AFTER_INTERRUPT):
        entries = plan(args)
        for entry in entries:
            if entry["results"] is None:
                entry["results"] = run_vision(entry.pop("argv"))
        table = markdown_table(entries)
        with open(os.path.join(args.output_dir, "table.md"), "w", encoding="utf-8") as fh:
            fh.write(table + "\n")
        print(table)
        setup = {k: getattr(args, k) for k in SETUP}
        rows = [{"norm": LABELS[e["norm"]], "precision": "8-bit" if e["precision"] == "int8" else "fp32",
                 "accuracy": e["results"]["accuracy"],
                 "mean_node_accuracy": sum(e["results"]["node_accuracy"]) / len(e["results"]["node_accuracy"]),
                 "node_accuracy": e["results"]["node_accuracy"],
                 "consensus_distance": e["results"]["consensus_distance"],
                 "wall_time_s": e["results"]["wall_time_s"]} for e in entries]
        command = [__file__, *(sys.argv[1:] if argv is None else argv)]
        path = record.save_results(record_path(args).stem, {"setup": setup, "runs": rows}, command)
        print(f"results: {path}")
        plot(entries, args, args.plot)
        print(f"plot: {args.plot}")
    return table


if __name__ == "__main__":
    main()
