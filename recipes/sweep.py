"""Grid of NLP runs (algorithm x precision x skew x compression) laid out like the paper's NLP table.

    python recipes/sweep.py --data-dir ag_news_6000.csv --skews 0 0.9 --comps 0 99 --output-dir runs/sweep

Every other flag of the NLP recipes (model, epochs, nodes, ...) applies to every run, ``--kernel``
to the 8-bit ones. Writes, under
--output-dir: one folder per run (with its results.json; a run whose results.json says "done" is not
repeated; one done with other settings, or on other rows or another model, is refused, or with
--overwrite_output_dir repeated), ``sweep.json`` (all results; with another graph, faults or another
``--gossip-reference`` also those settings and each point's fault counts), ``sweep.md`` (rows skew/compression;
columns DS, LP-DS, Choco, LP-Choco; a line under it names the graph, faults and reference every run had where not
the default) and ``sweep.png`` (accuracy vs skew; fp32 solid, 8-bit dashed; that line in its title; needs the
``[plot]`` extra, matplotlib: without it a notice says so and the rest is written). Those three hold
this invocation's grid: a smaller grid into the same folder reuses its finished points and writes
only them (``benchmarks/table6_cpu.py`` keeps adding to its table instead).

Ctrl-C stops the sweep with one line; run it again and its finished points are reused, the
stopped ones start afresh.

``--jobs N`` runs N grid points at once, each in its own process (give each one thread:
``OMP_NUM_THREADS=1``); a run's log goes to ``run.log`` in its folder.
"""
import concurrent.futures
import functools
import importlib.util
import itertools
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import textwrap

from lp_decentral_nlp import commands
from lp_decentral_nlp.commands import Range, flag_check_parser, ranged
from lp_decentral_nlp.commands import environment_problem, print_notice, write_json

PROG = "sweep.py"
SWEEP_OUTPUT_DIR_HELP = ("Folder of the grid: one folder per point, sweep.json, sweep.md and sweep.png "
                         "(default: runs/sweep)")
COLUMNS = [("deepsqueeze", False, "DS"), ("deepsqueeze", True, "LP-DS"), ("choco", False, "Choco"), ("choco", True, "LP-Choco")]


def add_grid_flags(parser) -> None:
    """The grid's own flags, on the recipes' parser (and on its torch-free check)."""
    parser.add_argument("--skews", type=ranged(float, Range(0, 1)), nargs="+", default=[0.0, 0.9],
                        help="skews of the grid, each in [0, 1] (default: 0 0.9)")
    parser.add_argument("--comps", type=ranged(float, Range(0, 100, high_open=True)), nargs="+", default=[0.0, 99.0],
                        help="compressions of the grid in percent, each in [0, 100) (default: 0 99)")
    parser.add_argument("--algorithms", nargs="+", choices=["choco", "deepsqueeze"], default=["choco", "deepsqueeze"],
                        help="algorithms of the grid (default: both)")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "int8"], default=["fp32", "int8"],
                        help="precisions of the grid: fp32 or int8 (8-bit training and gossip) (default: both)")
    parser.add_argument("--consensus-lr-compressed", type=ranged(float, Range(0, 1, low_open=True)), default=None,
                        help="gamma of the runs with --comps > 0 (default: --consensus_lr where given, else the "
                             "trainer's default_consensus_lr, from the compressor, algorithm and graph); the runs "
                             "without compression take --consensus_lr, or 1 without it")
    parser.add_argument("--jobs", type=ranged(int, Range(1)), default=1,
                        help="grid points run at once, each in its own process (default: 1, in this process)")


def set_grid_help(parser) -> None:
    """The help of the recipe flags whose meaning the grid changes: the output folder, the flags it
    sets at every point (:data:`GRID_SET`, refused), and ``--overwrite_output_dir``."""
    parser.set_help("output_dir", SWEEP_OUTPUT_DIR_HELP)
    for name, grid_flag in GRID_SET.items():
        parser.set_help(name, f"set by the grid at every point: give {grid_flag} instead")
    parser.set_help("overwrite_output_dir", "run again the grid points whose folders hold results of other settings "
                                            "(points finished with these settings are reused) (default: False)")
    for name in ("resume_from_checkpoint", "restore_callback_states_from_checkpoint"):
        parser.set_help(name, f"refused: {NO_RESUME}")
    parser.set_help("enable_jit_checkpoint", f"refused: {NO_JIT_CHECKPOINT}")
    parser.set_help("compressor", f"Message compressor of the runs with --comps > 0: 'topk' or 'randomk' ('qsgd' is "
                                  f"refused: {NO_QSGD}) (default: topk)")
    parser.set_help("qsgd_levels", f"refused: the grid runs top-k or random-k ({NO_QSGD})")


#: why a sweep takes no --resume_from_checkpoint, and no --enable_jit_checkpoint
NO_RESUME = ("each grid point is a run of its own: run the sweep again with the same --output-dir, which reuses the "
             "points it finished")
NO_JIT_CHECKPOINT = "a stopped grid point starts afresh when the sweep runs again"
#: why a sweep takes no QSGD
NO_QSGD = ("the grid's --comps are the percentages top-k and random-k drop, and QSGD's message size is set by its "
           "levels, not by a percentage")


def parse(argv=None):
    """The NLP recipes' flags (``--task`` included) plus the grid's; returns the parsed flags
    (``.training``, ``.recipe``, ``.extras`` with the grid, ``.values``). A bad flag or ``--help``
    is answered from the flag table before torch is imported."""
    description, _, more = __doc__.partition("\n")
    check = flag_check_parser("nlp", description=description, prog=PROG, epilog=more.strip().replace("``", ""),
                              fixed={"algorithm": "the grid sets it at every point: give --algorithms instead"})
    set_grid_help(check)
    add_grid_flags(check)
    argv = sys.argv[1:] if argv is None else argv
    grid_flags = check.parse_args(argv)
    problem = environment_problem()  # as check_flags: OpenMP reads OMP_NUM_THREADS as torch loads, and complains
    if problem:
        check.error(problem)
    for name in ("resume_from_checkpoint", "restore_callback_states_from_checkpoint"):
        resume = check.flag_given(name, argv)
        if resume is not None:  # every point resumed one run's checkpoint and reported its results as its own
            check.error(f"argument {resume}: {NO_RESUME}; drop it")
    jit = check.flag_given("enable_jit_checkpoint", argv)
    if jit is not None:  # its checkpoint would be removed when the sweep runs the point again
        check.error(f"argument {jit}: {NO_JIT_CHECKPOINT}, so the checkpoint SIGTERM writes would not be resumed: "
                    "drop it")
    # the flags are checked with the grid's first algorithm, each grid point with its own (grid())
    parser = commands.build_nlp_parser(None, grid_flags.algorithms[0], prog=PROG, description=description)
    parser.set_defaults(output_dir=os.path.join("runs", "sweep"))
    # the grid sets compression at every point: random-k is checked at its largest
    if getattr(grid_flags, "compressor", None) == "randomk":
        parser.set_defaults(compression=max(grid_flags.comps))
    set_grid_help(parser)
    add_grid_flags(parser)
    parser.add_check(check_grid)
    return parser.parse(argv)


# what may differ between a finished grid point and this sweep without changing its results: the
# grid's own flags (the whole grid is in every run's config), how the run is executed, where its
# folder is (a copied sweep), and what it prints and logs. Not the thread count: it changes the float
# sums' order, which 8-bit training carries into its results (docs/design.md, "One torch thread").
NOT_RESULT_SETTINGS = {"overwrite_output_dir", "consensus_lr_used", "output_dir", "logging_strategy",
                       "logging_steps", "logging_first_step", "log_level", "log_level_replica", "log_on_each_node",
                       "disable_tqdm", "report_to", "run_name", "project", "include_num_input_tokens_seen",
                       "skip_memory_metrics"}
# and, unless the best checkpoint is loaded at the end, when it evaluates and saves checkpoints
EVALUATION_SETTINGS = {"eval_strategy", "eval_steps", "eval_delay", "save_strategy", "save_steps", "save_total_limit",
                       "enable_jit_checkpoint"}


#: the settings naming a file or folder whose content results.json fingerprints (``commands.source_fingerprints``)
FINGERPRINTED_SETTINGS = {"data_dir": "data", "model": "model", "topology": "topology"}


def settings_differing(results: dict, run) -> list[str]:
    """The settings in which a finished grid point's ``results.json`` (``results["config"]``) differs
    from what this sweep would run there, ``"name=saved (this sweep: value)"``, and what it read
    that this sweep would not (:func:`sources_differing`); empty if none."""
    ignored = NOT_RESULT_SETTINGS | set(vars(run.extras))
    if not run.training.load_best_model_at_end:
        ignored |= EVALUATION_SETTINGS
    # where the point recorded what its data, model or graph file held, that content is compared
    # (sources_differing), not where it lay: a sweep moved or copied with its data reuses its points
    recorded = results.get("fingerprints") or {}
    ignored |= {name for name, what in FINGERPRINTED_SETTINGS.items() if recorded.get(what) is not None}
    return commands.config_differences(results["config"], run, ignored, "this sweep") + sources_differing(results, run)


@functools.cache
def model_to_load(model: str) -> str:
    """The path or hub id the runs of ``--model`` load (the default falls back to the packaged
    MiniLM offline), resolved once per sweep."""
    return commands.resolve_model(model, PROG)[0]


@functools.cache
def content_of(path) -> str | None:
    """:func:`~lp_decentral_nlp.commands.source_fingerprint` of ``path``, read once per sweep (every
    grid point reads the same data file and model)."""
    return commands.source_fingerprint(path)


def sources_differing(results: dict, run) -> list[str]:
    """What a finished grid point read that this sweep would not: another model (e.g. the
    default's offline fallback, where this sweep reaches the hub), or other rows, weights or graph
    at the same paths (``results.json``'s ``fingerprints``, where it has them)."""
    model = model_to_load(run.recipe.model)
    recorded = results.get("fingerprints") or {}
    used = results.get("model_used")
    # a local model whose content the point recorded is compared by it (below); a hub id by name
    same = used is None or recorded.get("model") is not None or commands.recorded_path(used) == commands.recorded_path(model)
    differing = [] if same else [f"model_used={used!r} (this sweep: {model!r})"]
    differing += [f"the {what} at {where} holds other content than it read"
                  for what, where in (("data", run.recipe.data_dir), ("model", model),
                                      ("topology", run.training.topology))
                  if recorded.get(what) is not None and recorded[what] != content_of(where)]
    return differing


def number(value: float) -> str:
    """A grid value as folder names, the table and the plot write it: short (``0.9``, ``99``), but
    every digit where the short form would round it (two values one folder, ``99.99999`` read ``100``)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


# recipe flags the grid sets at every point, by field name: -> the grid flag that does
GRID_SET = {"skew": "--skews", "compression": "--comps", "low_precision": "--precisions"}


def check_grid_flags(parser, sweep) -> None:
    """Refuse a recipe flag the grid would override at every point, a flag that applies to no point
    of this grid, and a value a grid flag lists twice (that point would run twice into one folder)."""
    grid_flags = sweep.extras
    for name, grid_flag in GRID_SET.items():
        flag = parser.flag_given(name)
        if flag is not None:
            parser.error(f"argument {flag}: the grid sets it at every point: give {grid_flag} instead")
    if sweep.training.num_nodes == 1:  # one node sends nothing and holds all the data: said in the grid's flags
        for grid_flag, values in (("--comps", grid_flags.comps), ("--skews", grid_flags.skews)):
            if any(values):
                parser.error(f"argument {parser.flag_of('num_nodes')}: one node has no neighbour to gossip with and "
                             f"holds all the data, and {grid_flag} {' '.join(map(number, values))} holds values "
                             f"above 0: set {parser.flag_of('num_nodes')} >= 2, or give {grid_flag} 0")
    for grid_flag, values in (("--skews", grid_flags.skews), ("--comps", grid_flags.comps),
                              ("--algorithms", grid_flags.algorithms), ("--precisions", grid_flags.precisions)):
        repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
        if repeated:
            parser.error(f"argument {grid_flag}: {', '.join(map(str, repeated))} given more than once: give each "
                         "value once")
    if "int8" not in grid_flags.precisions and sweep.training.quant_kernel != "auto":
        parser.error(f"argument {parser.flag_of('quant_kernel')}: the kernel of the 8-bit runs, and --precisions "
                     "holds no int8: drop one of them")
    if grid_flags.consensus_lr_compressed is not None and not any(c > 0 for c in grid_flags.comps):
        parser.error("argument --consensus-lr-compressed: the gamma of the runs with --comps > 0, and --comps holds "
                     "none: drop one of them")
    if sweep.training.compressor == "qsgd":
        parser.error(f"argument {parser.flag_of('compressor')}: {NO_QSGD}: sweep topk or randomk")
    out = sweep.values["output_dir"]
    for name in ("sweep.json", "sweep.md", "sweep.png"):  # written after the last point: checked before the first
        if os.path.isdir(os.path.join(out, name)):
            parser.error(f"argument {parser.flag_of('output_dir')}: {os.path.join(out, name)} is a folder; the sweep "
                         "writes a file there: remove it or choose another folder")


def check_grid(parser, sweep) -> None:
    """Refuse a grid whose points' settings do not go together (one line naming the setting), and
    a grid folder whose finished results were made with other settings (a sweep reuses a finished
    grid point as it is): the one-line error of ``--output-dir``, unless ``--overwrite_output_dir``
    (those points run again)."""
    check_grid_flags(parser, sweep)
    content_of.cache_clear()  # this sweep's reads (its check, then its run)
    try:
        runs = grid(sweep)
    except ValueError as err:  # a grid point's algorithm refuses the other flags (e.g. Choco on a time-varying graph)
        parser.error(str(err))
    overwrite = sweep.values["overwrite_output_dir"]
    for run in runs:
        try:
            results = commands.finished_results(run.training.output_dir, overwrite)
        except ValueError as err:
            parser.error(f"argument {parser.flag_of('output_dir')}: {err}, or pass --overwrite_output_dir to run the "
                         "point again")
        differing = settings_differing(results, run) if results is not None and not overwrite else []
        if differing:
            threads = commands.saved_thread_count(results["config"], differing)
            reuse = "" if threads is None else f"give --threads {threads} to reuse it, "
            parser.error(f"argument {parser.flag_of('output_dir')}: {run.training.output_dir} holds finished results "
                         f"of other settings ({', '.join(differing)}): {reuse}pass --overwrite_output_dir to run it "
                         f"again, or choose another {parser.flag_of('output_dir')}")


def grid(sweep) -> list:
    """The parsed flags of each grid point. The sweep owns their folders: a point it runs starts
    afresh (``overwrite_output_dir``: what a stopped or other run left there, its checkpoints
    included, is removed first, with a notice; other files stay)."""
    grid_flags = sweep.extras
    threads = commands.threads_to_use(sweep.recipe)  # (recorded as run: compared with a finished point's)
    runs = []
    for algorithm, precision, skew, comp in itertools.product(grid_flags.algorithms, grid_flags.precisions,
                                                              grid_flags.skews, grid_flags.comps):
        changes = dict(algorithm=algorithm, low_precision=precision == "int8", skew=skew, compression=comp,
                       overwrite_output_dir=True, threads=threads,
                       output_dir=os.path.join(sweep.values["output_dir"],
                                               f"{algorithm}_{precision}_skew{number(skew)}_comp{number(comp)}"))
        if comp > 0 and grid_flags.consensus_lr_compressed is not None:
            changes["consensus_lr"] = grid_flags.consensus_lr_compressed
        if precision == "fp32":  # --kernel is for the 8-bit runs
            changes["quant_kernel"] = "auto"
        if comp == 0:  # --compressor picks the entries a compressed point drops; this one sends them all
            changes["compressor"] = "topk"
        runs.append(sweep.replace(**changes))
    return runs


#: what to do after Ctrl-C stopped the sweep (a stopped point's checkpoints are not resumed)
AFTER_INTERRUPT = "run the sweep again: its finished points are reused, the stopped ones start afresh"


def quiet_on_interrupt() -> None:
    """A worker process's start: Ctrl-C before its run (starting up, waiting for a point) ends it
    quietly, with no traceback of the pool's internals; :func:`run_logged` hands Ctrl-C back to
    the run, which stops with its results saved."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))


def run_logged(run, prog: str = "", on_interrupt: str = AFTER_INTERRUPT) -> dict:
    """One grid point in a worker process, everything it prints (Python, C, progress bars) in ``run.log``:
    the worker's output stays there until its next point (a progress bar a failed run left open is
    closed later, and wrote over the sweep's own lines)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.makedirs(run.training.output_dir, exist_ok=True)
    sys.stdout.flush(), sys.stderr.flush()
    with open(os.path.join(run.training.output_dir, "run.log"), "w") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
    try:
        return commands.run_nlp(run, prog, on_interrupt=on_interrupt)
    finally:
        sys.stdout.flush(), sys.stderr.flush()


def describe(run) -> str:
    t = run.training
    return f"{t.algorithm} {'int8' if t.low_precision else 'fp32'} skew={number(t.skew)} comp={number(t.compression)}"


def remove_log_only_folders(folders) -> None:
    """Remove the grid points' folders a refused sweep created and left holding only ``run.log``."""
    for folder in folders:
        if os.path.isdir(folder) and set(os.listdir(folder)) <= {"run.log"}:
            shutil.rmtree(folder, ignore_errors=True)


def run_pending(runs, todo: list[int], jobs: int, names: list[str], progs: list[str] | None = None,
                on_interrupt: str = AFTER_INTERRUPT) -> dict[int, dict]:
    """Run ``runs[i]`` (:meth:`RecipeParser.parse` results) for every ``i`` in ``todo``: one after
    the other in this process when ``jobs == 1``, else ``jobs`` at a time in fresh (spawned)
    processes, each printing into its output folder's ``run.log``. Prints ``[k/n] name: running``
    before each run in this process and ``[k/n] name: accuracy`` after each (``names[i]``;
    ``progs[i]``: the recipe named in its errors; `on_interrupt`: what a run stopped by Ctrl-C
    advises). Returns ``{i: results}``. A run that stops (an error, a bad input, Ctrl-C) stops the
    others: Ctrl-C runs no point not yet started, and a failed run in a worker is told as its own
    one-line error (the last line of its ``run.log``) naming the point, with its exit status."""
    progs = progs or [""] * len(runs)
    results = {}

    def report(done: int, i: int) -> None:
        print(f"[{done}/{len(todo)}] {names[i]}: accuracy {percent(results[i]['accuracy'])}%", file=sys.stderr)

    if jobs == 1:
        for done, i in enumerate(todo, 1):
            print(f"[{done}/{len(todo)}] {names[i]}: running", file=sys.stderr)
            results[i] = commands.run_nlp(runs[i], progs[i], on_interrupt=on_interrupt)
            report(done, i)
    elif todo:
        context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
        new_folders = [runs[i].training.output_dir for i in todo if not os.path.exists(runs[i].training.output_dir)]
        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=quiet_on_interrupt)
        waiting, running = iter(todo), {}

        def start_next() -> None:  # one point per free worker: the pool queues none that a stop could not drop
            i = next(waiting, None)
            if i is not None:
                running[pool.submit(run_logged, runs[i], progs[i], on_interrupt)] = i

        try:
            for _ in range(jobs):
                start_next()
            while running:
                finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    i = running.pop(future)
                    try:
                        results[i] = future.result()
                    except BaseException as err:
                        pool.shutdown(wait=True, cancel_futures=True)
                        stop = worker_failure(err, os.path.join(runs[i].training.output_dir, "run.log"), names[i],
                                              progs[i])
                        if stop.code == 2:  # a bad input: nothing ran
                            remove_log_only_folders(new_folders)
                        raise stop from None
                    report(len(results), i)
                    start_next()
        finally:  # Ctrl-C here: no other point starts, the running ones stop (they got it too)
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def worker_failure(err: BaseException, log: str, name: str, prog: str) -> SystemExit:
    """The exit of a sweep whose grid point ``name`` failed in a worker with ``err``: its one-line
    error (the last line of the point's ``run.log`` that ``prog`` wrote) printed with the point's
    name, the exit status the run gave (1 for an exception that reached the worker, which the log
    then holds whole)."""
    code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1
    try:
        # (the line may follow a progress bar's, which has no newline); what the worker wrote, in Python's own
        # text encoding (UTF-8 but on older Windows setups): undecodable bytes are replaced, not an error
        with open(log, encoding=sys.stderr.encoding or "utf-8", errors="replace") as fh:
            said = re.findall(rf"{re.escape(prog)}: (?:error|interrupted)\b[^\r\n]*", fh.read())
    except OSError:
        said = []
    last = said[-1] if said else ""
    if not isinstance(err, SystemExit) or not last:
        last = f"{prog}: error: {type(err).__name__}: {err} (its log: {log})"
    print(f"{last} [{name}]", file=sys.stderr)
    return SystemExit(code)


def run_grid(sweep) -> list[dict]:
    runs = grid(sweep)
    finished = {i: commands.finished_results(run.training.output_dir, sweep.values["overwrite_output_dir"])
                for i, run in enumerate(runs)}
    results = {i: r for i, r in finished.items() if r is not None and not settings_differing(r, runs[i])}
    todo = [i for i in range(len(runs)) if i not in results]
    if results:
        print(f"{len(results)} of {len(runs)} grid points finished before with these settings: reused "
              f"({', '.join(describe(runs[i]) for i in sorted(results))})", file=sys.stderr)
    restarted = [i for i in todo if os.path.isfile(os.path.join(runs[i].training.output_dir, "results.json"))]
    if restarted:  # what they left (checkpoints, results) is removed when each starts
        print(f"starting afresh, stopped before or run with other settings: "
              f"{', '.join(describe(runs[i]) for i in restarted)}", file=sys.stderr)
    results.update(run_pending(runs, todo, sweep.extras.jobs, [describe(run) for run in runs], [PROG] * len(runs)))
    return [{"algorithm": run.training.algorithm, "low_precision": run.training.low_precision,
             "skew": run.training.skew, "comp": run.training.compression,
             "gamma": results[i]["config"]["consensus_lr_used"], "accuracy": results[i]["accuracy"],
             "wall_time_s": results[i]["wall_time_s"], **common_settings(run.training),
             # bytes_sent_per_node, and the counts of the faults in use (lost_messages_per_node, ...)
             **{key: value for key, value in results[i].items() if key.endswith("_per_node")}}
            for i, run in enumerate(runs)]


def common_settings(training) -> dict:
    """Settings every point shares that change its results and the table does not show: a graph
    other than the default, the faults in use (``trainer.fault_settings``) and a gossip reference
    other than ``"zero"``."""
    from lp_decentral_nlp.trainer import fault_settings  # (it imports torch: not before the flags are checked)

    settings = {} if training.topology == "directed_ring" else {"topology": str(training.topology)}
    faults = fault_settings(training)
    if faults:
        settings["faults"] = faults
    if training.gossip_reference != "zero":
        settings["gossip_reference"] = training.gossip_reference
    return settings


def settings_caption(rows) -> str:
    """A line under the table naming :func:`common_settings` (empty without any)."""
    settings = {}
    for key in ("topology", "faults", "gossip_reference"):  # common_settings' keys; faults: a dict of its own
        value = rows[0].get(key)
        settings.update(value if isinstance(value, dict) else {} if value is None else {key: value})
    if not settings:
        return ""
    return "\nEvery run: " + "; ".join(f"{key} {value}" for key, value in settings.items()) + ".\n"


def percent(accuracy) -> str:
    """An accuracy fraction as the table and the log show it: ``"n/a"`` for none (a model whose
    logits were not numbers: NaN, ``null`` in results.json)."""
    return "n/a" if accuracy is None or math.isnan(accuracy) else f"{100 * accuracy:.2f}"


def accuracy_text(row: dict) -> str:
    """A table cell: the accuracy in %, with the range over seeds (``accuracy_min``/``accuracy_max``)
    where the row has several ``seeds``."""
    text = percent(row["accuracy"])
    if len(row.get("seeds", ())) > 1:
        text += f" ({percent(row['accuracy_min'])}-{percent(row['accuracy_max'])}, {len(row['seeds'])} seeds)"
    return text


def markdown_table(rows) -> str:
    """Rows skew / compression, columns DS, LP-DS, Choco, LP-Choco (those present); ``-`` where a cell is missing."""
    by_cell = {(r["algorithm"], r["low_precision"], r["skew"], r["comp"]): r for r in rows}
    cols = [c for c in COLUMNS if any(k[:2] == c[:2] for k in by_cell)]
    lines = ["| skew | compression | " + " | ".join(c[2] for c in cols) + " |",
             "| --- | --- |" + " --- |" * len(cols)]
    for skew, comp in sorted({(r["skew"], r["comp"]) for r in rows}):
        cells = [accuracy_text(by_cell[(a, lp, skew, comp)]) if (a, lp, skew, comp) in by_cell else "-"
                 for a, lp, _ in cols]
        lines.append(f"| {number(skew)} | {number(comp)}% | " + " | ".join(cells) + " |")
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
        ax.plot([r["skew"] for r in group], [math.nan if r["accuracy"] is None else 100 * r["accuracy"] for r in group],
                marker="o",
                linestyle="--" if lp else "-", label=f"{'LP-' if lp else ''}{name}, comp {number(comp)}%")
    ax.set_xlabel("skew")
    ax.set_ylabel("accuracy of the averaged model (%)")
    caption = textwrap.fill(settings_caption(rows).strip(), 90)  # (wrapped: a long one ran off the figure)
    title = "Accuracy vs skew (fp32 solid, 8-bit dashed)"
    if caption:
        ax.set_title(f"{title}\n{caption}", fontsize=8)
    else:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    with commands.stop_on_interrupt(PROG, AFTER_INTERRUPT):  # from the flags' check (it imports torch) to the plot
        sweep = parse(argv)
        plotting = importlib.util.find_spec("matplotlib") is not None
        if not plotting:  # said before the grid trains, not after it (the plot is the last step)
            print_notice('notice: matplotlib is not installed: the sweep writes sweep.json and sweep.md but no '
                         'sweep.png (pip install "lp-decentral-nlp[plot]")')
        rows = run_grid(sweep)
        out = sweep.training.output_dir
        os.makedirs(out, exist_ok=True)
        write_json(out, "sweep.json", rows)
        table = markdown_table(rows) + settings_caption(rows)
        with open(os.path.join(out, "sweep.md"), "w", encoding="utf-8") as fh:
            fh.write(table)
        if plotting:
            plot(rows, os.path.join(out, "sweep.png"))
    print(table)


if __name__ == "__main__":
    main()
