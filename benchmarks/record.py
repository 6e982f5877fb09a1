"""Benchmark results as data: one ``benchmarks/results/<name>.json`` per benchmark.

Every benchmark ends with ``save_results("<name>", results)``. The file holds the command that
produced it, the machine, the date and the benchmark's own ``results`` dict; re-running the
benchmark replaces it. ``benchmarks/render.py`` turns the files into ``docs/benchmarks.md``.
A trial run that must leave the records alone writes elsewhere:
``LP_BENCHMARK_RESULTS_DIR=/tmp/trial python benchmarks/bench_round.py``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import sys

import psutil

#: the published records' folder, benchmarks/results/ (docs/benchmarks.md is rendered from it)
PUBLISHED_DIR = pathlib.Path(__file__).resolve().parent / "results"
#: the environment variable that sends the records of a trial run elsewhere
RESULTS_DIR_VARIABLE = "LP_BENCHMARK_RESULTS_DIR"
#: where the records go: benchmarks/results/, or the folder LP_BENCHMARK_RESULTS_DIR names
RESULTS_DIR = pathlib.Path(os.environ.get(RESULTS_DIR_VARIABLE) or PUBLISHED_DIR)


def check_results_dir(parser, writing: bool = True) -> None:
    """Refuse, as a bad flag (``parser.error``: one line, exit 2), before any work: an
    ``LP_BENCHMARK_RESULTS_DIR`` set but empty (a trial run that would write over the published
    records), and when ``writing``, a results folder that cannot be made or written (the record
    is saved after the work)."""
    given = os.environ.get(RESULTS_DIR_VARIABLE)
    if given is not None and not given.strip():
        parser.error(f"environment variable {RESULTS_DIR_VARIABLE} is empty: set it to a folder for a trial run, or "
                     f"unset it to write the published records ({PUBLISHED_DIR})")
    if writing:
        from lp_decentral_nlp.commands import output_dir_problem

        problem = output_dir_problem(str(RESULTS_DIR), overwrite=True, run_folder=False)
        if problem:
            parser.error(f"cannot write the benchmark record in {RESULTS_DIR_VARIABLE}: {problem}" if trial_run()
                         else f"cannot write the benchmark record: {problem} (set {RESULTS_DIR_VARIABLE} to a folder "
                              "that can be written)")


def check_plotting(parser) -> None:
    """Refuse, as a bad flag, before any work, a benchmark that draws its figure last when
    matplotlib is not installed (it trained everything, then stopped on an import traceback)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        parser.error('matplotlib is not installed, and this benchmark draws its figure after its runs: pip install '
                     '"lp-decentral-nlp[plot]"')


def benchmark_parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """A benchmark's command line: one-line errors (``OneLineParser``), its whole module docstring
    ``doc`` as the ``--help`` text (what it measures and in which units, how long it takes, what it
    writes; reST literals shown plain) and each flag's default."""
    from lp_decentral_nlp.commands import DefaultsHelpFormatter, OneLineParser

    class DocstringHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    return OneLineParser(description=doc.replace("``", ""), formatter_class=DocstringHelpFormatter, **kwargs)


def trial_run() -> bool:
    """Whether this is a trial run: ``LP_BENCHMARK_RESULTS_DIR`` sends the records elsewhere than the
    published folder, and a benchmark's docs page or plot then goes there too, by default."""
    return RESULTS_DIR.resolve() != PUBLISHED_DIR.resolve()


def runs_dir(name: str) -> pathlib.Path:
    """Where a benchmark that trains keeps its runs' folders by default: ``runs/<name>`` of this
    checkout, or in a trial run (:func:`trial_run`) ``runs/<name>`` of the trial's folder, so a trial
    never writes over the published runs."""
    return (RESULTS_DIR if trial_run() else PUBLISHED_DIR.parent.parent) / "runs" / name


def output_path(published: pathlib.Path) -> pathlib.Path:
    """Where a benchmark writes a page or plot it publishes at `published` (under docs/): there, or in
    a trial run (:func:`trial_run`) the file of that name in the trial's folder."""
    return RESULTS_DIR / published.name if trial_run() else published
# /proc/cpuinfo flags recorded with each result: fp32 GEMMs (AVX2, AVX-512), int8 dot products
# (AVX512-VNNI: oneDNN's int8 GEMM and convolution), bfloat16 (AVX512-BF16) and AMX tiles
SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def machine() -> dict:
    """The machine a benchmark ran on: CPU model, cores, memory, accelerator, library versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as fh:
            info = {}
            for line in fh:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
        cpu = info.get("model name", cpu)
        flags = set(info.get("flags", "").split())
    except OSError:
        pass
    mem_gib = psutil.virtual_memory().total / 2**30
    return {
        "cpu": cpu,
        # the vector extensions the kernels' speed depends on (one CPU model name covers several)
        "simd": " ".join(f for f in SIMD_FLAGS if f in flags) or None,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages as text (``"n/a"`` where the OS keeps none: Windows):
    how busy the machine was, printed and recorded beside a benchmark's timings."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def device_record_name(name: str, device) -> str:
    """The record name of benchmark `name` run on `device`: `name` on the CPU, ``<name>_<device
    type>`` elsewhere (``bench_8bit_cuda``), so a GPU run keeps the CPU record and renders beside it."""
    import torch

    kind = torch.device(device).type
    return name if kind == "cpu" else f"{name}_{kind}"


def save_results(name: str, results: dict, argv: list[str] | None = None,
                 provenance: dict | None = None) -> pathlib.Path:
    """Write ``results`` to ``benchmarks/results/<name>.json`` with the command, machine and date.

    Args:
        name: the benchmark's name (file stem), e.g. ``"bench_quant"``.
        results: JSON-serialisable figures (ratios, medians in seconds, bytes...).
        argv: the command's arguments (default ``sys.argv``).
        provenance: an earlier record whose ``command``, ``date`` and ``machine`` to keep instead
            (a command that only re-rendered figures measured then).
    Returns:
        The path written.
    """
    argv = sys.argv if argv is None else argv
    record = {
        "benchmark": name,
        "command": "python " + shlex.join(["benchmarks/" + pathlib.Path(argv[0]).name, *argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": machine(),
        "results": results,
    }
    if provenance is not None:
        record.update({key: provenance[key] for key in ("command", "date", "machine")})
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
