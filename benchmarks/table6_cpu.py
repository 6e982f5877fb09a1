"""Table 6 (the paper's NLP table) at CPU scale: SPEC section 8's NLP grid on the packaged MiniLM.

    python benchmarks/table6_cpu.py --jobs 2            # the whole grid: 48 runs, hours on a CPU
    LP_BENCHMARK_RESULTS_DIR=/tmp/trial python benchmarks/table6_cpu.py --cells 'ag_news/*/skew0/comp0' --max-steps 5

Every cell is one run of the NLP recipe (``lp_decentral_nlp.commands.run_nlp``): the packaged
all-MiniLM-L6-v2 fine-tuned on the 6,000-row AG News sample (the loader holds out a stratified
20% as test), or on the Sentlen task built from that sample's sentences (``build_sentlen``); a
4-node directed ring, max length 64 tokens, batch 16 per node, 3 epochs, Adam lr 1e-4, betas
(0.9, 0.9), and the trainer's default consensus step (``default_consensus_lr``: 1 without
compression, 0.05 for Choco and 0.015 for Deep-Squeeze at 99%; none is set here). Grid: task {ag_news,
sentlen} x skew {0, 0.5, 0.9} x compression {0, 99} % x
{DS, LP-DS, Choco, LP-Choco} (LP: 8-bit training and gossip; DS: Deep-Squeeze), each cell run once per
seed of ``--seeds`` (default: seed 0 only; ``--seed`` of the recipe, which also deals the skewed
shards anew). A cell run with several seeds is reported as the mean over them with its range.

Writes ``benchmarks/results/table6_cpu.json`` (``record.save_results``: every cell's accuracy of the
averaged model, per-node accuracy, consensus distance, bytes sent per node, wall time and the
recipe command that reproduces it), ``docs/table6_cpu.md`` (the table, laid out like the paper's)
and ``docs/table6_cpu.png`` (accuracy vs skew), both with the project's goals for the table checked
against the cells run (``check_goals``). Each run keeps its folder under ``--output-dir``. A run is
finished, and reused instead of run again, when its folder's ``results.json`` finished with the same
settings, or when the JSON written before records it with the same settings (its recipe command,
thread count and output folder aside, and the consensus step it ran with): the committed JSON is the
table's record, so a fresh checkout renders and extends it without the run folders, wherever its data
file and packaged model lie (they are matched by content, ``source_fingerprint``). An invocation that runs
nothing keeps the record's command, date and machine, those of the last one that ran cells. ``--cells`` and
``--seeds`` choose what runs; the table written is always every finished run of the grid with these
settings (the ones just run and any finished before, whatever their seed), so running a few cells
adds them to the table instead of replacing it.

``--max-steps``, ``--limit-rows`` and ``--cells`` shrink the grid for a quick check; a run with
``--max-steps`` or ``--limit-rows`` is not Table 6 and is written as ``table6_cpu_shrunk`` instead
(its runs, table and plot under the trial folder's ``runs/table6_cpu_shrunk`` by default, apart from the real grid's
and from ``docs/``), a trial run whose record goes to ``LP_BENCHMARK_RESULTS_DIR`` (refused
without it: the published records are Table 6's).
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import itertools
import json
import os
import pathlib
import re
import shlex
import sys
from typing import NamedTuple

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "recipes")]

import record  # noqa: E402
from sweep import COLUMNS, markdown_table, run_pending  # noqa: E402

from lp_decentral_nlp.commands import (ParsedFlags, Range, build_nlp_parser,  # noqa: E402
                                      changed_settings, finished_results, is_packaged_model, model_flag_problem,
                                      output_dir_problem, packaged_model_path, ranged, run_config, source_fingerprint,
                                      stop_on_interrupt, user_path)
from lp_decentral_nlp.data import check_enough_rows  # noqa: E402

TASKS = ("ag_news", "sentlen")
SKEWS = (0.0, 0.5, 0.9)
COMPRESSIONS = (0.0, 99.0)
# SPEC section 8 at CPU scale; the consensus step is left to the trainer.
SETTINGS = {"nodes": 4, "topology": "directed_ring", "max_length": 64, "batch_size": 16, "epochs": 3,
            "lr": 1e-4}
# recorded in a cell's results.json and reused whatever these were: the folder, and the thread count, which
# changes the float sums' order (an 8-bit run's results move as on another CPU; docs/design.md, "One torch
# thread"): a cell's seeds may have run at other counts, each recorded in its command
IGNORED_WHEN_REUSING = ("threads", "output_dir")
RECIPES = {("ag_news", "choco"): "agnews_choco.py", ("ag_news", "deepsqueeze"): "agnews_deepsqueeze.py",
           ("sentlen", "choco"): "sentlen_choco.py", ("sentlen", "deepsqueeze"): "sentlen_deepsqueeze.py"}
# The paper's AG News row (DistilBERT on the full set, 5 epochs; SPEC section 8), accuracy in %.
PAPER_AG_NEWS = {(0.0, 0.0): (94.18, 93.99, 94.21, 94.12), (0.9, 0.0): (92.19, 91.35, 91.56, 91.49),
                 (0.0, 99.0): (93.88, 93.55, 94.54, 94.04), (0.9, 99.0): (91.93, 91.21, 92.33, 91.80)}
# The sample beside the checkout (../shared), or under $LPDN_SHARED as the tests read it.
DEFAULT_DATA = pathlib.Path(os.environ.get("LPDN_SHARED", REPO.parent / "shared")) / "data" / "ag_news" / "ag_news_6000.csv"


# Goals of the table (issue #22), in accuracy points of the averaged model.
LOW_PRECISION_TOLERANCE = 1.0  # every 8-bit cell within this of its fp32 cell
SKEW_GAP_GOAL = 3.0  # Choco at skew 0.9 / 99% within this of Choco at skew 0 / 0%
DEEP_SQUEEZE_FLOOR = 80.0  # Deep-Squeeze at skew 0.9 / 99% at least this (no collapse)
SKEW_NOISE = 1.0  # accuracy non-increasing in skew, up to this much noise


def cell_id(task: str, column: str, skew: float, comp: float, seed: int = 0) -> str:
    """The name ``--cells`` matches, e.g. ``ag_news/LP-Choco/skew0.5/comp99/seed0``."""
    return f"{task}/{column}/skew{skew:g}/comp{comp:g}/seed{seed}"


def all_cells(seeds=(0,)) -> list[dict]:
    """The 48 cells of the grid times ``seeds``, in table order (the seeds of a cell together)."""
    return [{"task": task, "column": column, "algorithm": algorithm, "low_precision": low_precision,
             "skew": skew, "comp": comp, "seed": seed, "id": cell_id(task, column, skew, comp, seed)}
            for task, skew, comp, (algorithm, low_precision, column), seed
            in itertools.product(TASKS, SKEWS, COMPRESSIONS, COLUMNS, seeds)]


def matches(cell: dict, pattern: str) -> bool:
    """Whether ``--cells`` ``pattern`` selects ``cell``: a shell pattern over the id; one that names
    no seed (``ag_news/Choco/skew0.9/comp99``) selects every seed of ``--seeds``."""
    return fnmatch.fnmatchcase(cell["id"], pattern) or fnmatch.fnmatchcase(cell["id"], pattern + "/seed*")


def cell_folder(cell: dict) -> str:
    """The run's folder name under ``--output-dir``: the id without its seed for seed 0
    (``ag_news_Choco_skew0.9_comp99``), with ``_seed<N>`` appended for the others."""
    name = f"{cell['task']}_{cell['column']}_skew{cell['skew']:g}_comp{cell['comp']:g}"
    return name if cell["seed"] == 0 else f"{name}_seed{cell['seed']}"


def user_path_object(text: str) -> pathlib.Path:
    """argparse type: a ``pathlib.Path``, ``~`` expanded (``commands.user_path``)."""
    return pathlib.Path(user_path(text))


def parse(argv=None) -> argparse.Namespace:
    parser = record.benchmark_parser(__doc__, prog="table6_cpu.py")
    parser.add_argument("--data-dir", type=user_path_object, default=DEFAULT_DATA,
                        help=f"the AG News CSV (default {DEFAULT_DATA})")
    parser.add_argument("--model", type=user_path, default=None, help="model folder (default: the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--output-dir", type=user_path, default=None,
                        help="one folder per run under it (default: runs/table6_cpu of this repository; with "
                             "LP_BENCHMARK_RESULTS_DIR, a trial run, runs/table6_cpu or, with --max-steps or "
                             "--limit-rows, runs/table6_cpu_shrunk under that folder)")
    parser.add_argument("--docs-dir", type=user_path_object, default=None,
                        help="where the Markdown table and the plot go (default docs/; with "
                             "LP_BENCHMARK_RESULTS_DIR, a trial run, that folder; with --max-steps or --limit-rows "
                             "--output-dir: a shrunk table is no docs page)")
    parser.add_argument("--jobs", type=ranged(int, Range(1)), default=1,
                        help="cells run at once, each in its own process with cores/jobs threads (default 1)")
    parser.add_argument("--cells", nargs="+", default=None, metavar="PATTERN",
                        help="run only the cells whose id matches one of these shell patterns (default: every cell); ids are "
                             "TASK/COLUMN/skewS/compC/seedN, e.g. 'ag_news/LP-Choco/skew0.5/comp99/seed1' or "
                             "'sentlen/*/skew0/*'; a pattern that names no seed selects every seed of --seeds")
    parser.add_argument("--seeds", nargs="+", type=ranged(int, Range(0, 2**32 - 1)), default=[0], metavar="SEED",
                        help="run every selected cell once per seed (the recipe's --seed, which also draws the "
                             "held-out rows and deals the shards); the table reports the mean and range over them (default: 0)")
    parser.add_argument("--finished-only", action="store_true",
                        help="run nothing: render the table from the runs finished under --output-dir with "
                             "these settings (e.g. while the grid runs elsewhere)")
    parser.add_argument("--max-steps", type=ranged(int, Range(1)), default=None,
                        help="shrink: stop every run after this many steps (default: none, 3 epochs)")
    parser.add_argument("--limit-rows", type=ranged(int, Range(1)), default=None,
                        help="shrink: train on a seeded subset of this many rows and test on at most this many (default: "
                             "none, every row)")
    args = parser.parse_args(argv)
    record.check_results_dir(parser)
    if not args.data_dir.is_file():
        parser.error(f"argument --data-dir: {str(args.data_dir)!r} is not a file (the AG News CSV sample)")
    args.data_dir = args.data_dir.resolve()  # one spelling per file, so a finished cell is found reusable
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"argument --seeds: {args.seeds} repeats a seed")
    args.selected = all_cells(args.seeds)
    if args.cells is not None:
        unmatched = [p for p in args.cells if not any(matches(c, p) for c in args.selected)]
        if unmatched:
            parser.error(f"argument --cells: {unmatched} match no cell; ids look like "
                         f"{args.selected[0]['id']!r} (tasks {list(TASKS)}, columns {[c[2] for c in COLUMNS]}, "
                         f"skews {[f'{s:g}' for s in SKEWS]}, compressions {[f'{c:g}' for c in COMPRESSIONS]}, "
                         f"seeds {args.seeds} from --seeds)")
        args.selected = [c for c in args.selected if any(matches(c, p) for p in args.cells)]
    if args.limit_rows is not None:
        try:
            check_enough_rows(args.limit_rows, SETTINGS["nodes"], SETTINGS["batch_size"], "--limit-rows")
        except ValueError as err:
            parser.error(f"argument {err}")
    if args.model is None:
        args.model = packaged_model_path()
    problem = model_flag_problem(str(args.model))  # said as this program's, not as the first cell's recipe
    if problem:
        parser.error(f"argument --model: {problem}")
    local_model = pathlib.Path(args.model).exists()  # else a hub id
    if local_model:
        args.model = pathlib.Path(args.model).resolve()
    args.fingerprints = {"data_fingerprint": source_fingerprint(args.data_dir),
                         "model_fingerprint": source_fingerprint(args.model) if local_model else None}
    args.name = "table6_cpu" if args.max_steps is None and args.limit_rows is None else "table6_cpu_shrunk"
    if args.name == "table6_cpu_shrunk" and not record.trial_run():  # the published folder holds Table 6 only
        parser.error(f"argument {'--max-steps' if args.max_steps is not None else '--limit-rows'}: a shrunk run is "
                     f"not Table 6, and its record would join the published ones in {record.PUBLISHED_DIR}: set "
                     f"{record.RESULTS_DIR_VARIABLE} to a folder for this trial run")
    if args.name == "table6_cpu" and not record.trial_run():
        published = recorded_runs(args)
        for flag, key, what in (("--data-dir", "data_fingerprint", "data file"), ("--model", "model_fingerprint", "model")):
            if published.cells and published.fingerprints.get(key) not in (None, args.fingerprints[key]):
                parser.error(f"argument {flag}: the published Table 6 ({len(published.cells)} runs) ran on another "
                             f"{what} than {getattr(args, flag[2:].replace('-', '_'))}, and this run's record would "
                             f"replace it: set {record.RESULTS_DIR_VARIABLE} to a folder for this trial run")
    if args.output_dir is None:  # a shrunk or trial run must not write over the real grid's finished runs
        args.output_dir = record.runs_dir(args.name)
    # said as this program's, not a cell's recipe
    problem = output_dir_problem(str(args.output_dir), overwrite=True, run_folder=False)
    if problem:
        parser.error(f"argument --output-dir: {problem}")
    args.output_dir = pathlib.Path(args.output_dir)
    if args.docs_dir is None and args.name != "table6_cpu":  # a shrunk table is no docs page
        args.docs_dir = args.output_dir
    elif args.docs_dir is None:  # a trial run's (LP_BENCHMARK_RESULTS_DIR) goes with its record
        args.docs_dir = record.output_path(REPO / "docs" / f"{args.name}.md").parent
    # the table and plot are written last
    problem = output_dir_problem(str(args.docs_dir), overwrite=True, run_folder=False)
    if problem:
        parser.error(f"argument --docs-dir: {problem}")
    record.check_plotting(parser)
    return args


def recipe_argv(args: argparse.Namespace, cell: dict) -> list[str]:
    """The NLP recipe's arguments that run ``cell``: the table owns the cells' folders (a cell run
    again with other settings writes over its folder, hence ``--overwrite_output_dir``), and each of
    the ``--jobs`` runs at once gets an equal share of the cores (``--threads``)."""
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    argv = ["--model", str(args.model), "--data-dir", str(args.data_dir),
            "--output-dir", str(args.output_dir / cell_folder(cell)), "--overwrite_output_dir",
            "--threads", str(threads), "--seed", str(cell["seed"]),
            "--skew", f"{cell['skew']:g}", "--comp", f"{cell['comp']:g}"]
    argv += [token for key, value in SETTINGS.items() if not (key == "epochs" and args.max_steps is not None)
             for token in (f"--{key.replace('_', '-')}", str(value))]  # --max-steps sets the length instead
    if not cell["low_precision"]:
        argv.append("--full-precision")
    if args.max_steps is not None:
        argv += ["--max-steps", str(args.max_steps)]
    if args.limit_rows is not None:
        argv += ["--max-train-samples", str(args.limit_rows), "--max-eval-samples", str(args.limit_rows)]
    return argv


def recipe_script(cell: dict) -> str:
    """The recipe that runs ``cell``, relative to the checkout."""
    return f"recipes/{RECIPES[cell['task'], cell['algorithm']]}"


def recipe_run(args: argparse.Namespace, cell: dict) -> tuple[ParsedFlags, str]:
    """The recipe's parsed flags of ``cell`` (``RecipeParser.parse``) and the command line that runs it."""
    argv = recipe_argv(args, cell)
    script = recipe_script(cell)
    run = build_nlp_parser(cell["task"], cell["algorithm"], prog=script).parse(argv)
    return run, shlex.join(["python", script, *argv])


def run_settings(run: ParsedFlags, consensus_lr_used: float) -> dict:
    """What a run computes, as compared when reusing it (``changed_settings``, less
    ``IGNORED_WHEN_REUSING``): its ``run_config`` with the consensus step it ran with. The step
    counts: a cell run under an older default step is stale."""
    return {**run_config(run), "consensus_lr_used": consensus_lr_used}


#: what to do after Ctrl-C stopped the grid (a stopped cell's checkpoints are not resumed)
AFTER_INTERRUPT = "run it again: its finished cells are reused, the stopped ones start afresh"


#: the recipe flags whose paths a recorded command may give otherwise than this checkout, with
#: the ``settings`` key fingerprinting what they name (``--output-dir`` is not compared at all)
MOVABLE_PATHS = {"--model": "model_fingerprint", "--data-dir": "data_fingerprint", "--output-dir": None}


class RecordedGrid(NamedTuple):
    """What the JSON written before (``benchmarks/results/<name>.json``) holds of this grid."""

    cells: dict[str, dict]
    """Its runs by cell id: the cell with its figures and ``command``."""
    fingerprints: dict[str, str | None]
    """``MOVABLE_PATHS``' keys: the ``fingerprint`` of the data and model they ran on (None in a
    record written before they were kept)."""


def recorded_runs(args: argparse.Namespace) -> RecordedGrid:
    """The runs of this grid that the JSON written before holds, and what they ran on; no cells
    when there is none."""
    path = record.RESULTS_DIR / f"{args.name}.json"
    if not path.is_file():
        return RecordedGrid({}, {})
    results = json.loads(path.read_text())["results"]
    return RecordedGrid({cell["id"]: cell for cell in results["cells"]},
                        {key: results["settings"].get(key) for key in MOVABLE_PATHS.values() if key})


def here_paths(args: argparse.Namespace, cell: dict, recorded: dict, fingerprints: dict) -> list[str]:
    """The recorded command's arguments with its paths made this checkout's (``MOVABLE_PATHS``):
    the output folder always (not compared), the data file and model where what this run reads
    has the fingerprint recorded (``fingerprints``, ``RecordedGrid``'s). The JSON is the table's
    record, so a checkout elsewhere, whose data and packaged model lie at other paths, still finds
    its cells finished."""
    here = {"--model": str(args.model), "--data-dir": str(args.data_dir),
            "--output-dir": str(args.output_dir / cell_folder(cell))}
    argv = shlex.split(recorded["command"])[2:]
    for i, token in enumerate(argv[:-1]):
        key = MOVABLE_PATHS.get(token, "")
        if key is None or (key and fingerprints.get(key) is not None and fingerprints[key] == args.fingerprints[key]):
            argv[i + 1] = here[token]
    return argv


def recorded_settings(args: argparse.Namespace, cell: dict, recorded: RecordedGrid) -> dict:
    """``run_settings`` of the run that ``recorded`` (the JSON written before) holds for ``cell``:
    its recipe command parsed again (with this checkout's paths, ``here_paths``), with the
    consensus step it ran with.

    Raises:
        ValueError: the command does not parse here (e.g. its data file is elsewhere on this
            machine and holds other rows), with the recipe parser's one-line error.
    """
    run_record = recorded.cells[cell["id"]]
    script = shlex.split(run_record["command"])[1]
    argv = here_paths(args, cell, run_record, recorded.fingerprints)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):  # the parser prints its error, then exits
            run = build_nlp_parser(cell["task"], cell["algorithm"], prog=script).parse(argv)
    except SystemExit:
        raise ValueError(errors.getvalue().strip()) from None
    return run_settings(run, run_record["gamma"])


def finished_run(args: argparse.Namespace, cell: dict, recorded: RecordedGrid) -> tuple[dict | None, list[str]]:
    """``(record, [])`` if ``cell`` has finished with these settings: its folder's ``results.json``
    (which, when it has finished, is the only say: it holds the run its folder name refers to), else
    its entry in the JSON written before (``recorded``); the record is the cell with its figures,
    command and folder. ``(None, changed)`` if it finished only with other settings, ``changed``
    naming them; ``(None, [])`` if it has not finished."""
    run, command = recipe_run(args, cell)
    settings = run_settings(run, run.training.gamma)
    try:
        done = finished_results(run.training.output_dir)
    except ValueError as err:  # a damaged results.json: the run has not finished
        return None, [str(err)]
    if done is not None:
        changed = changed_settings(settings, done["config"], IGNORED_WHEN_REUSING)
        if not changed:
            return {**cell, **{k: done[k] for k in ("accuracy", "node_accuracy", "consensus_distance",
                                                    "bytes_sent_per_node", "wall_time_s", "steps")},
                    "gamma": done["config"]["consensus_lr_used"], "command": command,
                    "output_dir": run.training.output_dir}, []
        return None, changed  # the folder holds another run than the one the JSON may record
    if cell["id"] not in recorded.cells:
        return None, []
    try:
        changed = changed_settings(settings, recorded_settings(args, cell, recorded), IGNORED_WHEN_REUSING)
    except ValueError as err:
        return None, [f"its recorded command does not parse here: {err}"]
    return (None, changed) if changed else ({**recorded.cells[cell["id"]], **cell}, [])


def recorded_seeds(args: argparse.Namespace, recorded: RecordedGrid) -> set[int]:
    """The seeds of the runs with a folder under ``--output-dir`` (``cell_folder``'s names) or an
    entry in the JSON written before, and seed 0."""
    found = {0} | {cell["seed"] for cell in recorded.cells.values()}
    if args.output_dir.is_dir():
        found |= {int(m.group(1)) for f in args.output_dir.iterdir() if (m := re.search(r"_seed(\d+)$", f.name))}
    return found


def run_selected(args: argparse.Namespace, recorded: RecordedGrid) -> int:
    """Run every selected run that has not finished with these settings (``--finished-only``: none);
    a finished run is reused, one finished with other settings runs again. ``recorded``:
    ``recorded_runs``. Returns how many ran."""
    todo = []
    for i, cell in enumerate(args.selected):
        done, changed = finished_run(args, cell, recorded)
        if done is None:
            todo.append(i)
            if changed and not args.finished_only:
                print(f"note: {cell['id']} was run with other settings ({', '.join(changed)}): running it again",
                      file=sys.stderr)
    n = len(args.selected)
    if args.finished_only:
        print(f"{n} runs: {n - len(todo)} finished, {len(todo)} left out (--finished-only)", file=sys.stderr)
        return 0
    print(f"{n} runs: {n - len(todo)} reused, {len(todo)} to run", file=sys.stderr)
    run_pending([recipe_run(args, cell)[0] for cell in args.selected], todo, args.jobs,
                [cell["id"] for cell in args.selected], [recipe_script(cell) for cell in args.selected],
                AFTER_INTERRUPT)
    return len(todo)


def table_cells(args: argparse.Namespace, recorded: RecordedGrid) -> list[dict]:
    """What the table shows: every run of the grid finished with these settings (``finished_run``:
    the ones just run, any finished before under ``--output-dir``, and those the JSON written
    before records, ``recorded``), whatever its seed, in table order; one record per run. Finished
    runs with other settings are left out, with a note naming them."""
    records, stale = [], []
    for cell in all_cells(sorted(set(args.seeds) | recorded_seeds(args, recorded))):
        done, changed = finished_run(args, cell, recorded)
        if done is not None:
            records.append(done)
        elif changed:
            stale.append(f"{cell['id']} ({', '.join(changed)})")
    if stale:
        print(f"note: left out of the table, finished with other settings: {'; '.join(stale)}", file=sys.stderr)
    if not records:
        print(f"table6_cpu.py: error: argument --finished-only: no run has finished with these settings, "
              f"under {args.output_dir} or in {record.RESULTS_DIR / (args.name + '.json')}", file=sys.stderr)
        raise SystemExit(2)
    return records


def summarise(cells: list[dict]) -> list[dict]:
    """One row per cell of the table (task, column, skew, compression) from its runs (``cells``, in
    table order): ``accuracy`` is the mean over its seeds, ``accuracy_min``/``accuracy_max`` their
    range, ``seeds`` the seeds run and ``accuracy_by_seed`` each one's; accuracies are fractions in [0, 1]."""
    rows = []
    for _, group in itertools.groupby(cells, key=lambda c: (c["task"], c["column"], c["skew"], c["comp"])):
        group = list(group)
        accuracies = [c["accuracy"] for c in group]
        rows.append({**{k: group[0][k] for k in ("task", "column", "algorithm", "low_precision", "skew", "comp")},
                     "accuracy": sum(accuracies) / len(accuracies), "accuracy_min": min(accuracies),
                     "accuracy_max": max(accuracies), "seeds": [c["seed"] for c in group],
                     "accuracy_by_seed": {c["seed"]: c["accuracy"] for c in group}})
    return rows


def check_goals(rows: list[dict]) -> list[dict]:
    """The issue's goals for the table, checked on ``summarise``'s rows (means over seeds; an 8-bit
    cell against its fp32 cell on the seeds both ran), for each task whose cells for a goal have
    been run: ``{"task", "goal", "met", "detail"}``, figures in accuracy points. A goal whose cells
    are missing is left out."""
    acc = {(r["task"], r["column"], r["skew"], r["comp"]): 100 * r["accuracy"] for r in rows}
    by_seed = {(r["task"], r["column"], r["skew"], r["comp"]): r["accuracy_by_seed"] for r in rows}

    def low_precision_gap(task, column, skew, comp):
        """8-bit minus fp32 in points, on the seeds both cells ran (None if they share none)."""
        lp, fp32 = by_seed[task, f"LP-{column}", skew, comp], by_seed[task, column, skew, comp]
        common = sorted(lp.keys() & fp32.keys())
        return 100 * sum(lp[s] - fp32[s] for s in common) / len(common) if common else None

    goals = []
    for task in TASKS:
        pairs = [(column, skew, comp, low_precision_gap(task, column, skew, comp))
                 for column in ("DS", "Choco") for skew in SKEWS for comp in COMPRESSIONS
                 if (task, column, skew, comp) in acc and (task, f"LP-{column}", skew, comp) in acc]
        pairs = [pair for pair in pairs if pair[3] is not None]
        if pairs:
            outside = [f"LP-{column} {diff:+.2f} at skew {skew:g} / {comp:g}%"
                       for column, skew, comp, diff in pairs
                       if abs(diff) > LOW_PRECISION_TOLERANCE + 1e-9]  # 1e-9: float rounding of the means
            goals.append({"task": task, "goal": f"every 8-bit cell within {LOW_PRECISION_TOLERANCE:g} point of its fp32 cell",
                          "met": not outside,
                          "detail": f"{len(pairs) - len(outside)} of {len(pairs)} pairs within, each on the seeds both ran"
                                    + (f"; outside: {', '.join(outside)}" if outside else "")})
        if (task, "Choco", 0.0, 0.0) in acc and (task, "Choco", 0.9, 99.0) in acc:
            gap = acc[task, "Choco", 0.0, 0.0] - acc[task, "Choco", 0.9, 99.0]
            goals.append({"task": task, "goal": f"Choco at skew 0.9 / 99% within {SKEW_GAP_GOAL:g} points of skew 0 / 0%",
                          "met": gap <= SKEW_GAP_GOAL,
                          "detail": f"{acc[task, 'Choco', 0.9, 99.0]:.2f} vs {acc[task, 'Choco', 0.0, 0.0]:.2f}: "
                                    f"{gap:.2f} points"})
        if (task, "DS", 0.9, 99.0) in acc:
            goals.append({"task": task, "goal": f"Deep-Squeeze at skew 0.9 / 99% at least {DEEP_SQUEEZE_FLOOR:g}%",
                          "met": acc[task, "DS", 0.9, 99.0] >= DEEP_SQUEEZE_FLOOR,
                          "detail": f"{acc[task, 'DS', 0.9, 99.0]:.2f}%"})
        series = [(column, comp, [(skew, acc[task, column, skew, comp]) for skew in SKEWS
                                  if (task, column, skew, comp) in acc])
                  for _, _, column in COLUMNS for comp in COMPRESSIONS]
        series = [s for s in series if len(s[2]) > 1]
        if series:
            rises = [f"{column} {comp:g}% skew {a[0]:g} -> {b[0]:g}: {b[1] - a[1]:+.2f}"
                     for column, comp, points in series for a, b in zip(points, points[1:])
                     if b[1] > a[1] + SKEW_NOISE]
            goals.append({"task": task, "goal": f"accuracy non-increasing in skew (within {SKEW_NOISE:g} point)",
                          "met": not rises,
                          "detail": f"{len(series)} series of two or more skews"
                                    + (f"; rising: {', '.join(rises)}" if rises else "")})
    return goals


def render_markdown(args: argparse.Namespace, cells: list[dict], json_path: pathlib.Path) -> str:
    """The Markdown page: settings, one table per task (rows skew/compression, columns as the
    paper's; mean over seeds with their range where a cell has several), the goals checked, the
    paper's AG News row for reference, and every run's details."""
    rows = summarise(cells)
    settings = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in SETTINGS.items())
    lines = [f"# Table 6 at CPU scale ({args.name})", "",
             f"{'Packaged all-MiniLM-L6-v2' if is_packaged_model(args.model) else f'`{args.model}`'} on "
             f"`{args.data_dir.name}` (stratified 20% held out as test); {settings}; "
             "Adam betas (0.9, 0.9); the trainer's default consensus step (docs/consensus_step.md). "
             "Accuracy (%) of the averaged model on the test split. "
             + ("" if args.name == "table6_cpu" else
                f"**Shrunk run, not Table 6:** max steps {args.max_steps}, limit rows {args.limit_rows}. ")
             + ("" if len(rows) == len(all_cells()) else
                f"**Part of the grid:** the {len(rows)} cells finished so far; the other "
                f"{len(all_cells()) - len(rows)} have not been run (`python benchmarks/table6_cpu.py` with "
                "this run's other flags and no `--cells` runs them and reuses these). ")
             + ("" if all(r["seeds"] == [0] for r in rows) else
                f"Seeds {', '.join(map(str, sorted({s for r in rows for s in r['seeds']})))} (`--seeds`) where run: "
                "a cell with several is the mean over them, its range in brackets (a seed draws the held-out rows too, "
                "as well as the node shards, the new head and the batches). ")
             + f"Every figure and the command of every cell: `{json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path}`.",
             ""]
    for task in TASKS:
        task_rows = [r for r in rows if r["task"] == task]
        if task_rows:
            lines += [f"## {task}", "", markdown_table(task_rows)]
    lines += ["## Goals", "", "The issue's goals for this table, on the cells run (means over seeds):", ""]
    goals = check_goals(rows)
    lines += [f"- {g['task']}: {g['goal']}: **{'met' if g['met'] else 'not met'}** ({g['detail']})"
              for g in goals] or ["- none of the goals' cells have been run"]
    lines.append("")
    if any(c["task"] == "ag_news" for c in cells):
        lines += ["Reference: the paper's AG News row (DistilBERT, full 120k/7.6k set, 5 epochs):", "",
                  "| skew | compression | " + " | ".join(c[2] for c in COLUMNS) + " |",
                  "| --- | --- |" + " --- |" * len(COLUMNS)]
        lines += [f"| {skew:g} | {comp:g}% | " + " | ".join(f"{a:.2f}" for a in accs) + " |"
                  for (skew, comp), accs in sorted(PAPER_AG_NEWS.items())]
        lines.append("")
    lines += ["## Every run", "",
              "| cell | accuracy % | node accuracy % (min-max) | consensus distance | MB sent per node | gamma | steps "
              "| wall time s |", "| --- |" + " --- |" * 7]
    for c in cells:
        nodes = [100 * a for a in c["node_accuracy"]]
        distance = c["consensus_distance"]  # null in results.json where a run diverged (NaN)
        lines.append(f"| {c['id']} | {100 * c['accuracy']:.2f} | {min(nodes):.2f}-{max(nodes):.2f} "
                     f"| {'diverged' if distance is None else f'{distance:.4g}'} "
                     f"| {max(c['bytes_sent_per_node']) / 1e6:.2f} | {c['gamma']:g} "
                     f"| {c['steps']} | {c['wall_time_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Accuracy vs skew from ``summarise``'s rows, one panel per task; one colour per algorithm and
    compression, fp32 solid and 8-bit dashed in it; circles 0%, squares 99% compression; bars span
    the seeds' range where a cell has several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    colours = {key: f"C{i}" for i, key in enumerate(itertools.product(("deepsqueeze", "choco"), COMPRESSIONS))}
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for (column, comp), group in itertools.groupby(
                sorted((r for r in rows if r["task"] == task), key=lambda r: (r["column"], r["comp"], r["skew"])),
                key=lambda r: (r["column"], r["comp"])):
            group = list(group)
            means = [100 * r["accuracy"] for r in group]
            spans = [[m - 100 * r["accuracy_min"] for m, r in zip(means, group)],
                     [100 * r["accuracy_max"] - m for m, r in zip(means, group)]]
            ax.errorbar([r["skew"] for r in group], means, yerr=spans, capsize=3,
                        linestyle="--" if group[0]["low_precision"] else "-", marker="s" if comp else "o",
                        color=colours[group[0]["algorithm"], comp], label=f"{column}, comp {comp:g}%")
        ax.set_title(task)
        ax.set_xticks(SKEWS)
        ax.set_xlabel("skew")
        ax.set_ylabel("test accuracy of the averaged model (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> pathlib.Path:
    """Run the grid, save the JSON, render the Markdown and the plot; returns the JSON's path."""
    args = parse(argv)
    recorded = recorded_runs(args)  # read before this invocation writes the JSON anew
    with stop_on_interrupt("table6_cpu.py", AFTER_INTERRUPT):
        ran = run_selected(args, recorded)
    previous = record.RESULTS_DIR / f"{args.name}.json"
    # nothing run: the record keeps the command, date and machine that measured its cells, and that
    # command's selection of cells and seeds
    provenance = json.loads(previous.read_text()) if not ran and previous.is_file() else None
    selection = {"cells": args.cells, "seeds": args.seeds}
    if provenance is not None:
        selection = {key: provenance["results"]["settings"].get(key) for key in selection}
    cells = table_cells(args, recorded)
    rows = summarise(cells)
    json_path = record.save_results(args.name, {
        "settings": {**SETTINGS, "adam_betas": [0.9, 0.9], "data": str(args.data_dir), "model": str(args.model),
                     **args.fingerprints,
                     "max_steps": args.max_steps, "limit_rows": args.limit_rows, **selection},
        "runs_wall_time_s": sum(c["wall_time_s"] for c in cells),  # the runs' own, whenever they ran
        "table": rows,
        **({"goals": goals} if (goals := check_goals(rows)) else {}),  # a record holds no empty list
        "cells": cells,
    }, argv=[__file__, *(sys.argv[1:] if argv is None else argv)], provenance=provenance)
    args.docs_dir.mkdir(parents=True, exist_ok=True)
    (args.docs_dir / f"{args.name}.md").write_text(render_markdown(args, cells, json_path), encoding="utf-8")
    plot(rows, args.docs_dir / f"{args.name}.png")
    print(f"wrote {json_path}, {args.docs_dir / (args.name + '.md')} and {args.docs_dir / (args.name + '.png')}",
          file=sys.stderr)
    return json_path


if __name__ == "__main__":
    main()
