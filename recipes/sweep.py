"""Grid of NLP runs (algorithm x precision x skew x compression) laid out like the paper's NLP table.

    python recipes/sweep.py --data-dir ../shared/data/ag_news/ag_news_6000.csv \
        --skews 0 0.9 --comps 0 99 --output-dir runs/sweep

Every other flag of the NLP recipes (model, epochs, nodes, ...) applies to every run. Writes, under
--output-dir: one folder per run (with its results.json; a run whose results.json exists is not
repeated), ``sweep.json`` (all results), ``sweep.md`` (rows skew/compression; columns DS, LP-DS,
Choco, LP-Choco) and ``sweep.png`` (accuracy vs skew; fp32 solid, 8-bit dashed).
"""
import argparse
import itertools
import json
import os
import sys

from lp_decentral_nlp.cli import build_nlp_parser, run_nlp

COLUMNS = [("deepsqueeze", False, "DS"), ("deepsqueeze", True, "LP-DS"), ("choco", False, "Choco"), ("choco", True, "LP-Choco")]


def parse(argv=None):
    parser = build_nlp_parser("ag_news", "choco")
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--task", default="ag_news", choices=["ag_news", "sentlen"])
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.9])
    parser.add_argument("--comps", type=float, nargs="+", default=[0.0, 99.0])
    parser.add_argument("--algorithms", nargs="+", choices=["choco", "deepsqueeze"], default=["choco", "deepsqueeze"])
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "int8"], default=["fp32", "int8"])
    parser.add_argument("--consensus-lr-compressed", type=float, default=None,
                        help="gamma of the runs with --comps > 0 (default: the trainer's, 0.01); "
                             "runs without compression keep gamma 1")
    args = parser.parse_args(argv)
    if args.consensus_lr_compressed is not None and not 0 < args.consensus_lr_compressed <= 1:
        parser.error(f"argument --consensus-lr-compressed: must be in (0, 1], got {args.consensus_lr_compressed}")
    for s in args.skews:
        if not 0 <= s <= 1:
            parser.error(f"argument --skews: each value must be in [0, 1], got {s}")
    for c in args.comps:
        if not 0 <= c < 100:
            parser.error(f"argument --comps: each value must be in [0, 100), got {c}")
    if args.output_dir is None:
        args.output_dir = os.path.join("runs", f"sweep_{args.task}")
    return args


def run_grid(args) -> list[dict]:
    rows = []
    for algorithm, precision, skew, comp in itertools.product(args.algorithms, args.precisions, args.skews, args.comps):
        run = argparse.Namespace(**vars(args))
        run.algorithm, run.full_precision, run.skew, run.comp = algorithm, precision == "fp32", skew, comp
        if comp > 0 and args.consensus_lr_compressed is not None:
            run.consensus_lr = args.consensus_lr_compressed
        run.output_dir = os.path.join(args.output_dir, f"{algorithm}_{precision}_skew{skew:g}_comp{comp:g}")
        done = os.path.join(run.output_dir, "results.json")
        if os.path.exists(done):
            with open(done) as fh:
                result = json.load(fh)
        else:
            print(f"== {algorithm} {precision} skew={skew:g} comp={comp:g}", file=sys.stderr)
            result = run_nlp(run)
        rows.append({"algorithm": algorithm, "low_precision": precision == "int8", "skew": skew, "comp": comp,
                     "gamma": result["config"]["consensus_lr_used"],
                     "accuracy": result["accuracy"], "bytes_sent_per_node": result["bytes_sent_per_node"],
                     "wall_time_s": result["wall_time_s"]})
    return rows


def markdown_table(rows) -> str:
    acc = {(r["algorithm"], r["low_precision"], r["skew"], r["comp"]): r["accuracy"] for r in rows}
    cols = [c for c in COLUMNS if any(k[:2] == c[:2] for k in acc)]
    lines = ["| skew | compression | " + " | ".join(c[2] for c in cols) + " |",
             "| --- | --- |" + " --- |" * len(cols)]
    for skew, comp in sorted({(r["skew"], r["comp"]) for r in rows}):
        cells = [f"{100 * acc[(a, lp, skew, comp)]:.2f}" if (a, lp, skew, comp) in acc else "-" for a, lp, _ in cols]
        lines.append(f"| {skew:g} | {comp:g}% | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (algorithm, lp, comp), group in itertools.groupby(
            sorted(rows, key=lambda r: (r["algorithm"], r["low_precision"], r["comp"], r["skew"])),
            key=lambda r: (r["algorithm"], r["low_precision"], r["comp"])):
        group = list(group)
        name = {"choco": "Choco", "deepsqueeze": "DS"}[algorithm]
        ax.plot([r["skew"] for r in group], [100 * r["accuracy"] for r in group], marker="o",
                linestyle="--" if lp else "-", label=f"{'LP-' if lp else ''}{name}, comp {comp:g}%")
    ax.set_xlabel("skew")
    ax.set_ylabel("accuracy of the averaged model (%)")
    ax.set_title("Accuracy vs skew (fp32 solid, 8-bit dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse(argv)
    rows = run_grid(args)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "sweep.json"), "w") as fh:
        json.dump(rows, fh, indent=2)
    table = markdown_table(rows)
    with open(os.path.join(args.output_dir, "sweep.md"), "w") as fh:
        fh.write(table)
    plot(rows, os.path.join(args.output_dir, "sweep.png"))
    print(table)


if __name__ == "__main__":
    main()
