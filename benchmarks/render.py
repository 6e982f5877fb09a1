"""Render every ``benchmarks/results/*.json`` into ``docs/benchmarks.md``.

    python benchmarks/render.py
    python benchmarks/render.py --results-dir path/to/results --output path/to/benchmarks.md

With ``LP_BENCHMARK_RESULTS_DIR`` set (a trial run, ``benchmarks/record.py``) the defaults are that
folder's records and its ``benchmarks.md``; with ``--results-dir`` another folder, the page goes to
that folder's ``benchmarks.md``: the published page stays as it is (the published records,
``--results-dir benchmarks/results``, render to the published page, never into their folder).

Each results file is a record written by ``benchmarks/record.py``: a JSON object with
``benchmark`` (its name, a string), ``command``, ``date``, ``machine`` (an object) and ``results``
(an object). Every file becomes one section: what the benchmark measures (for the benchmarks
named in :data:`BENCHMARKS`), the command, machine and date, then its figures, one entry of
``results`` after the other. Each entry is laid out from its shape alone, so a benchmark this
script does not know renders too:

* a list of dicts is a table (one row per dict, the union of their keys as columns);
* a dict of plain values is a two-column table; a dict holding lists or dicts gets one
  sub-section per such key;
* a list of numbers is summarised (its size, median and range) unless it is short; NaN values
  are counted apart (``5 values, 1 NaN; the other 4: median ...``);
* any other value is one line.

A file that is no such record, or whose ``results`` hold an empty list or object (at any depth:
an empty table or section), stops the page with one line naming the file; the page is written
only when every record renders (``--output``, checked before any record is read).

Column names come from the keys, with the unit read from the suffix (``_s`` seconds, ``_gb_s``
GB/s, ``_bytes``, ``_mib``); fractions under keys holding ``share`` or ``accuracy`` are shown as
percentages.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics

import record
from lp_decentral_nlp.commands import output_file_problem, user_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = record.RESULTS_DIR  # benchmarks/results/, or a trial's folder
OUTPUT = record.output_path(ROOT / "docs" / "benchmarks.md")

#: name (or name prefix) -> (title, what the benchmark measures), in the order the page lists them
BENCHMARKS = {
    "bench_8bit": (
        "8-bit training against fp32",
        "One training step, fp32 against the default 8-bit model (`QuantConfig()`, kernel `auto`) and the "
        "simulated kernel, steps interleaved: DistilBERT-base shape (batch 8 x 128, fused AdamW as the NLP "
        "recipes' nodes run it), ResNet-20 and VGG-11 (batch 32 at 32 x 32, SGD; EvoNorm-S0 fp32 against Range "
        "EvoNorm 8-bit) and ResNet-20 at 8 x 8 (the vision recipes' default digits). Also "
        "the bytes autograd holds for backward after one forward, the whole step's peak tensor memory, the "
        "kernel each 8-bit layer ran, `saved_bytes_floor`: the bytes fp32 DistilBERT keeps outside its Linear "
        "layers, which 8-bit Linear layers cannot shrink (the least an 8-bit model whose Linear layers kept "
        "nothing would save), and `fp32_weight_gradient_floor`: from one profiled fp32 step, the time "
        "in the Linear GEMMs and the ratio to fp32 below which no 8-bit step can go while its weight "
        "gradients stay fp32 GEMMs (the step less two thirds of those GEMMs). `conv_sweep`: one 3x3 Conv2d per "
        "width and input size (`w@s`, batch 32, with its forward multiply-adds; simulated and int8 against fp32), "
        "the data behind `kernel=\"auto\"`'s thresholds for convolutions (16 channels, 2**26 multiply-adds)."),
    "bench_8bit_cuda": None,  # below: bench_8bit's, and what its default ran
    "bench_quant": (
        "8-bit training step",
        "Time and peak tensor memory of one training step (forward, backward, fused AdamW) of a "
        "DistilBERT-base-shaped model, fp32 against the 8-bit kernels (`simulated`, `int8`, `int8_bf16`), "
        "the variants' steps interleaved; and the size of the int8 export against fp32."),
    "bench_quant_layer_sweep": (
        "Kernel layer sweep: where int8 pays",
        "Forward + backward of one square Linear per width (1,024 rows), fp32 against the simulated, int8 and "
        "int8_bf16 kernels, interleaved medians: each kernel's time relative to fp32. The data behind the width "
        "from which `kernel=\"auto\"` takes int8 (`kernels.AUTO_MIN_FEATURES`) on hardware with an int8 GEMM; "
        "`int8_gemm` names the GEMM the int8 kernels ran."),
    "bench_gossip": (
        "Gossip engine",
        "One gossip step of 8 simulated nodes on a directed ring, each holding DistilBERT's parameter "
        "tensors, per algorithm and compressor, with the bytes each node sends; the codecs' encode and "
        "decode+add throughput on one node's parameters (GB/s of fp32 input); and the share of the gossip "
        "step in a training round of 8 local DistilBERT steps."),
    "bench_round": (
        "The headline run's round: 8-bit against full precision",
        "One round of `recipes/agnews_choco.py --skew 0.9 --comp 99` at CPU scale (packaged MiniLM, 4 nodes, "
        "batch 16 x 64 per node; every node's step and the gossip step), the recipe's defaults against the "
        "same run with `--full-precision`, trainings of both alternated: the median over repeats of the "
        "ratio of their median round times, the kernel the 8-bit layers ran, and `fp32_weight_gradient_floor`: "
        "from one profiled fp32 round, as for `bench_8bit`, the ratio below which no 8-bit round can go while its "
        "weight gradients stay fp32 GEMMs."),
    "bench_round_cuda": None,  # below: bench_round's, and what its 8-bit round ran
    "bench_simulator": (
        "Simulated decentralized round",
        "A `DecentralizedTrainer` round of n simulated nodes (local steps, NaN check, gossip) against n plain "
        "steps of one model measured in the same repeats: the median of the per-repeat ratios round / plain "
        "with its quartiles and 95% bootstrap interval, where the round's time goes, every repeat's times, "
        "and the peak resident memory of a fresh process running the round."),
    "bench_export": (
        "int8 export: size and fidelity",
        "State-dict size of the int8 inference export (with and without 8-bit embedding tables) against "
        "fp32, and how close the reloaded export stays to the 8-bit model: cosine of mean-pooled sentence "
        "embeddings and leave-one-out 5-nearest-neighbour label accuracy on held-out AG News texts."),
    "vision_norm_comparison": (
        "Normalisation under label skew (vision)",
        "The same decentralized vision run once per normalisation layer (BatchNorm, GroupNorm, EvoNorm-S0, "
        "Range EvoNorm in 8-bit and fp32): test accuracy of the averaged model, mean node accuracy and "
        "consensus distance. The file name carries the skew; the accuracy over training is plotted in "
        "[vision_norm_comparison.png](vision_norm_comparison.png)."),
    "table6_cpu": (
        "Table 6 at CPU scale: the NLP grid",
        "The paper's NLP table (task x skew x compression x DS / LP-DS / Choco / LP-Choco) at CPU scale, "
        "[table6_cpu.md](table6_cpu.md) laid out like the paper: each cell's accuracy of the averaged model, "
        "per-node accuracy, consensus distance, bytes sent and wall time. Cells are added by the runs that "
        "finish, so the command above is the last invocation (which may have run a few cells); each cell's own "
        "command is in its `command`."),
}
#: the CUDA records were measured while ``auto`` still chose int8 on CUDA (it runs the simulated
#: kernel off the CPU since): what their "default" ran, said beside bench_8bit's and bench_round's text
_BEFORE_AUTO_ON_CUDA = (" On CUDA this record predates `auto` running the simulated kernel there: its {what} ran the "
                        "int8 kernel (`torch._int_mm`, see `kernels`), which is not today's CUDA default{today}.")
BENCHMARKS["bench_8bit_cuda"] = (BENCHMARKS["bench_8bit"][0], BENCHMARKS["bench_8bit"][1] + _BEFORE_AUTO_ON_CUDA.format(
    what="`default` DistilBERT", today=" (that is its `simulated` column; the convolutional networks' `default` "
                                       "ran the simulated kernel, as their `kernels` say)"))
BENCHMARKS["bench_round_cuda"] = (BENCHMARKS["bench_round"][0], BENCHMARKS["bench_round"][1] + _BEFORE_AUTO_ON_CUDA.format(
    what="8-bit round", today="; the simulated kernel's round on CUDA is not measured"))

_UNITS = (("_gb_s", "GB/s"), ("_mib", "MiB"), ("_bytes", "bytes"), ("_s", "s"))


def label(key: str) -> str:
    """Column or row name of ``key``: underscores to spaces, the unit suffix in parentheses."""
    for suffix, unit in _UNITS:
        if key.endswith(suffix) and len(key) > len(suffix):
            return f"{key[: -len(suffix)].replace('_', ' ')} ({unit})"
    return key.replace("_", " ")


def _number(value: float, percent: bool = False) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan, inf, -inf (not "nan%")
    if percent and isinstance(value, float):
        return f"{100 * value:.2f}%"
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.3e}"
    return f"{value:.4g}"


def cell(key: str, value) -> str:
    """One value as Markdown table text."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    percent = "share" in key or "accuracy" in key
    if isinstance(value, (int, float)):
        return _number(value, percent)
    if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        if len(value) <= 3:
            return ", ".join(_number(v, percent) for v in value)
        numbers = [v for v in value if v == v]  # NaN would make the median and range meaningless
        if not numbers:
            return f"{len(value)} values, all NaN"
        summary = (f"median {_number(statistics.median(numbers), percent)}, "
                   f"{_number(min(numbers), percent)} to {_number(max(numbers), percent)}")
        if len(numbers) == len(value):
            return f"{len(value)} values: {summary}"
        return f"{len(value)} values, {len(value) - len(numbers)} NaN; the other {len(numbers)}: {summary}"
    if isinstance(value, (list, dict)):
        text = json.dumps(value, separators=(", ", ": "))
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _is_rows(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def table(rows: list[dict]) -> list[str]:
    """A Markdown table of ``rows``: one column per key, in order of first appearance."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(label(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(c, row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def block(key: str, value, level: int) -> list[str]:
    """Markdown for one entry of a benchmark's ``results`` (heading ``level`` for its sub-sections)."""
    if _is_rows(value):
        return [f"{'#' * level} {label(key)}", "", *table(value), ""]
    if isinstance(value, dict):
        plain = {k: v for k, v in value.items() if not (_is_rows(v) or isinstance(v, dict))}
        lines = [f"{'#' * level} {label(key)}", ""]
        if plain:
            lines += ["| name | value |", "| --- | --- |"]
            lines += [f"| {label(k)} | {cell(k, v)} |" for k, v in plain.items()]
            lines.append("")
        for k, v in value.items():
            if k not in plain:
                lines += block(k, v, min(level + 1, 6))
        return lines
    return [f"**{label(key)}**: {cell(key, value)}", ""]


def describe(name: str) -> tuple[str, str | None]:
    """(title, what it measures) of benchmark ``name``: the longest entry of :data:`BENCHMARKS` that
    ``name`` starts with, or the name itself and None for a benchmark not listed there."""
    known = [k for k in BENCHMARKS if name == k or name.startswith(k + "_")]
    if not known:
        return name, None
    return BENCHMARKS[max(known, key=len)]


def empty_part(value, where: str = "results") -> str | None:
    """Where in ``value`` (``results["a"][0]`` ...) an empty list or object lies, which would render as
    an empty table, section or value; None if there is none."""
    if isinstance(value, (list, dict)) and not value:
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = empty_part(item, f"{where}[{json.dumps(key)}]")
        if found:
            return found
    return None


def load_records(results_dir: pathlib.Path) -> list[dict]:
    """Every ``*.json`` record in ``results_dir``, known benchmarks first (in :data:`BENCHMARKS` order),
    then the rest by name. A file that is not valid JSON or not a record (see the module's
    docstring: its keys, a string ``benchmark``, objects ``machine`` and ``results``, no empty list
    or object in ``results``) is a ValueError naming it."""
    results_dir = pathlib.Path(results_dir)
    # the folder named by LP_BENCHMARK_RESULTS_DIR (a trial run) when it is the default one
    source = (record.RESULTS_DIR_VARIABLE if record.trial_run() and results_dir.resolve() == RESULTS_DIR.resolve()
              else "argument --results-dir")
    if not results_dir.is_dir():
        raise FileNotFoundError(f"{source}: {results_dir} is not a directory: run a benchmark first (each one "
                                f"writes <name>.json in {results_dir})")
    records = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({type(err).__name__}: {err})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: not a benchmark record (benchmarks/record.py): a JSON object is expected")
        missing = [k for k in ("benchmark", "command", "date", "machine", "results") if k not in entry]
        if missing:
            raise ValueError(f"{path}: not a benchmark record (benchmarks/record.py): it lacks {missing}")
        if not isinstance(entry["machine"], dict) or not isinstance(entry["results"], dict):
            raise ValueError(f"{path}: not a benchmark record (benchmarks/record.py): its machine and results are "
                             "JSON objects")
        if not isinstance(entry["benchmark"], str) or not entry["benchmark"].strip():
            raise ValueError(f"{path}: not a benchmark record (benchmarks/record.py): its benchmark is a name (a "
                             f"non-empty string), got {json.dumps(entry['benchmark'])}")
        empty = empty_part(entry["results"])
        if empty:
            raise ValueError(f"{path}: {empty} is empty: a benchmark record's results hold figures (no empty list or "
                             "object)")
        records.append(entry)
    if not records:
        raise FileNotFoundError(f"{source}: no *.json results in {results_dir}: run a benchmark first")
    order = list(BENCHMARKS)

    def rank(entry):
        known = [i for i, k in enumerate(order) if entry["benchmark"] == k or entry["benchmark"].startswith(k + "_")]
        return (known[-1] if known else len(order), entry["benchmark"])

    return sorted(records, key=rank)


def machine_text(machine: dict) -> str:
    """One line describing the machine of a record."""
    parts = [str(machine.get("cpu") or "unknown CPU")]
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB memory")
    parts.append(f"GPU {machine['gpu']}" if machine.get("gpu") else "no GPU")
    parts += [f"{lib} {machine[lib]}" for lib in ("python", "torch") if machine.get(lib)]
    extra = {k: v for k, v in machine.items() if k not in ("cpu", "cores", "memory_gib", "gpu", "python", "torch")}
    parts += [f"{label(k)} {cell(k, v)}" for k, v in extra.items()]
    return ", ".join(parts)


def render(results_dir: pathlib.Path = RESULTS_DIR) -> str:
    """The Markdown page of every record in ``results_dir``."""
    lines = ["# Benchmarks", "",
             "Generated by `python benchmarks/render.py` from `benchmarks/results/*.json` (written by each "
             "benchmark through `benchmarks/record.py`); do not edit by hand. Compare figures only within one "
             "section: each was measured on the machine and date it names.", ""]
    for entry in load_records(results_dir):
        title, what = describe(entry["benchmark"])
        lines += [f"## {title} (`{entry['benchmark']}`)", ""]
        if what:
            lines += [what, ""]
        lines += [f"- command: `{entry['command']}`", f"- machine: {machine_text(entry['machine'])}",
                  f"- date: {entry['date']}", ""]
        for key, value in entry["results"].items():  # a JSON object (load_records)
            lines += block(key, value, 3)
    return "\n".join(lines).rstrip("\n") + "\n"


def folder_name(text: str) -> pathlib.Path:
    """argparse type of ``--results-dir``: a non-empty name (``pathlib.Path("")`` is the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the folder name is empty")
    return pathlib.Path(text)


def default_output(results_dir: pathlib.Path) -> pathlib.Path:
    """The page the records in ``results_dir`` render to without ``--output``: the default folder's
    page (``OUTPUT``), the published page for the published records, else ``benchmarks.md`` in
    ``results_dir``: another folder's records never replace the page of these, and a page never
    goes among the published records."""
    folder = results_dir.resolve()
    if folder == pathlib.Path(RESULTS_DIR).resolve():
        return OUTPUT
    return ROOT / "docs" / "benchmarks.md" if folder == record.PUBLISHED_DIR.resolve() else results_dir / "benchmarks.md"


def main(argv=None) -> pathlib.Path:
    parser = record.benchmark_parser(__doc__)
    parser.add_argument("--results-dir", type=folder_name, default=RESULTS_DIR,
                        help="folder of the benchmark records, every *.json in it (default: %(default)s)")
    parser.add_argument("--output", type=user_path, help=f"the Markdown page to write, replaced if it exists (default: {OUTPUT} for "
                                         "the default --results-dir, docs/benchmarks.md for the published records, "
                                         "else benchmarks.md in --results-dir)")
    args = parser.parse_args(argv)
    record.check_results_dir(parser, writing=False)
    if args.output is None:
        args.output = str(default_output(args.results_dir))
    problem = output_file_problem(args.output)  # before any record is read
    if problem:
        parser.error(f"argument --output: {problem}" if not args.output.strip()
                     else f"argument --output: cannot write {args.output} ({problem})")
    output = pathlib.Path(args.output)
    try:
        page = render(args.results_dir)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(page, encoding="utf-8")
    except OSError as err:  # e.g. the disk filled up since the check
        parser.error(f"argument --output: cannot write {output} ({type(err).__name__}: {err.strerror or err})")
    print(f"wrote {output}")
    return output


if __name__ == "__main__":
    main()
