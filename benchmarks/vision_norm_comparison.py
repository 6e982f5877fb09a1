"""The paper's normalisation comparison under label skew (SPEC 5), on digits by default.

Trains the same decentralized setting once per norm with the vision recipe (in this process,
one run after the other) and writes a Markdown table and a PNG plot of the averaged model's test
accuracy over training:

    OMP_NUM_THREADS=1 python benchmarks/vision_norm_comparison.py --skew 0.8 --epochs 20 \
        --plot docs/vision_norm_comparison.png

Runs (``--runs``, ``norm:precision``): the paper's pairing is fp32 for BatchNorm, GroupNorm and
EvoNorm-S0 and 8-bit for Range EvoNorm; ``range_evonorm:fp32`` separates the norm from the
precision. Each run's files land in ``--output-dir/<norm>_<precision>/`` (results.json,
metrics.csv, model/); ``--skip-existing`` reuses finished runs (e.g. to redraw the plot). The table's
figures go to ``benchmarks/results/vision_norm_comparison_skew<skew>.json`` (``benchmarks/record.py``).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

from record import save_results

DEFAULT_RUNS = ("batchnorm:fp32", "groupnorm:fp32", "evonorm:fp32", "range_evonorm:int8", "range_evonorm:fp32")
LABELS = {"batchnorm": "BatchNorm", "groupnorm": "GroupNorm", "evonorm": "EvoNorm-S0",
          "range_evonorm": "Range EvoNorm", "range_batchnorm": "Range BatchNorm"}


def parse_args(argv=None) -> argparse.Namespace:
    from lp_decentral_nlp.commands import DefaultsHelpFormatter, OneLineParser, output_dir_problem

    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="norm:precision pairs (precision fp32|int8)")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--arch", default="resnet20")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--topology", default="directed_ring")
    p.add_argument("--skew", type=float, default=0.8)
    p.add_argument("--comp", type=float, default=0.0)
    p.add_argument("--epochs", type=float, default=20.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-steps", type=int, default=22, help="evaluate every N steps (the accuracy curve)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=os.path.join("runs", "vision_norm_comparison"))
    p.add_argument("--plot", default=os.path.join("docs", "vision_norm_comparison.png"))
    p.add_argument("--skip-existing", action="store_true", help="reuse runs whose results.json says done")
    p.add_argument("--overwrite-output-dir", "--overwrite_output_dir", action="store_true",
                   help="run again, over the results in --output-dir, the runs --skip-existing does not reuse")
    args = p.parse_args(argv)
    for run in args.runs:
        norm, _, precision = run.partition(":")
        if norm not in LABELS or precision not in ("fp32", "int8"):
            p.error(f"argument --runs: {run!r} is not norm:precision with norm in {tuple(LABELS)} "
                    "and precision fp32 or int8")
    plot_folder = os.path.dirname(os.path.abspath(args.plot))
    if os.path.isdir(args.plot) or output_dir_problem(plot_folder, overwrite=True):
        p.error(f"argument --plot: cannot write {args.plot!r} "
                f"({output_dir_problem(plot_folder, overwrite=True) or 'a folder'})")
    return args


def recipe_argv(args, norm: str, precision: str, out: str) -> list[str]:
    argv = ["--dataset", args.dataset, "--arch", args.arch, "--norm", norm, "--nodes", str(args.nodes),
            "--topology", args.topology, "--skew", str(args.skew), "--comp", str(args.comp),
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--eval-steps", str(args.eval_steps), "--logging-steps", str(args.eval_steps), "--output-dir", out]
    return (argv + (["--full-precision"] if precision == "fp32" else [])
            + (["--overwrite_output_dir"] if args.overwrite_output_dir else []))


def accuracy_curve(run_dir: str) -> tuple[list[float], list[float]]:
    """(epochs, averaged-model test accuracy) of every evaluation in metrics.csv."""
    with open(os.path.join(run_dir, "metrics.csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("eval_accuracy")]
    by_epoch = {float(r["epoch"]): float(r["eval_accuracy"]) for r in rows}  # the final evaluation may repeat one
    return list(by_epoch), list(by_epoch.values())


def markdown_table(entries: list[dict]) -> str:
    lines = ["| norm | precision | test accuracy (averaged model) | mean node accuracy | consensus distance | wall time (s) |",
             "|---|---|---|---|---|---|"]
    for e in entries:
        r = e["results"]
        node_mean = sum(r["node_accuracy"]) / len(r["node_accuracy"])
        lines.append(f"| {LABELS[e['norm']]} | {'8-bit' if e['precision'] == 'int8' else 'fp32'} | "
                     f"{100 * r['accuracy']:.1f}% | {100 * node_mean:.1f}% | {r['consensus_distance']:.3g} | "
                     f"{r['wall_time_s']:.0f} |")
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
    None when it has not finished. A run finished with other settings, or a damaged results.json,
    runs again with ``--overwrite-output-dir`` and is the one-line error of ``--skip-existing``
    (exit 2) without it."""
    from lp_decentral_nlp.commands import config_differences, finished_results
    from lp_decentral_nlp.commands.run import exit_with_error
    from lp_decentral_nlp.vision.recipe import parse_vision_args

    def refuse(problem: str):
        exit_with_error(os.path.basename(__file__), problem, "--skip-existing")

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
    differing = config_differences(results["config"], wanted, ("overwrite_output_dir", "threads", "consensus_lr_used"))
    if differing and not args.overwrite_output_dir:
        refuse(f"{out} holds a run of other settings ({', '.join(differing)}): pass --overwrite-output-dir to run it "
               "again, or choose another --output-dir")
    return None if differing else results


def main(argv=None) -> str:
    from lp_decentral_nlp.vision.recipe import main as recipe_main

    args = parse_args(argv)
    entries = []
    for run in args.runs:
        norm, _, precision = run.partition(":")
        out = os.path.join(args.output_dir, f"{norm}_{precision}")
        results = reusable_results(args, norm, precision, out)
        if results is None:
            results = recipe_main("choco", recipe_argv(args, norm, precision, out))
        entries.append({"norm": norm, "precision": precision, "dir": out, "results": results})
    table = markdown_table(entries)
    with open(os.path.join(args.output_dir, "table.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)
    setup = {k: v for k, v in vars(args).items() if k not in ("runs", "output_dir", "plot", "skip_existing")}
    rows = [{"norm": LABELS[e["norm"]], "precision": "8-bit" if e["precision"] == "int8" else "fp32",
             "accuracy": e["results"]["accuracy"],
             "mean_node_accuracy": sum(e["results"]["node_accuracy"]) / len(e["results"]["node_accuracy"]),
             "node_accuracy": e["results"]["node_accuracy"], "consensus_distance": e["results"]["consensus_distance"],
             "wall_time_s": e["results"]["wall_time_s"]} for e in entries]
    command = [__file__, *(sys.argv[1:] if argv is None else argv)]
    path = save_results(f"vision_norm_comparison_skew{args.skew:g}", {"setup": setup, "runs": rows}, command)
    print(f"results: {path}")
    plot(entries, args, args.plot)
    print(f"plot: {args.plot}")
    return table


if __name__ == "__main__":
    main()
