"""Side-by-side timing for the benchmarks: every candidate runs once per round, rounds repeated.

Interleaving gives every candidate the same machine load (another job, frequency changes) in each
round, so ratios of their medians are far steadier than timings taken one candidate after another.
:func:`weight_gradient_floor` reads from a profiled fp32 step the best ratio an 8-bit step with fp32
weight gradients could reach.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch

from lp_decentral_nlp.commands import Range, ranged

POSITIVE = ranged(int, Range(1))


def add_step_timing_flags(parser) -> None:
    """``--repeats`` (timed steps per variant, default 5) and ``--warmup`` (untimed steps first, at
    least one), the flags of the benchmarks that time training steps side by side."""
    parser.add_argument("--repeats", type=POSITIVE, default=5, help="timed steps per variant (default %(default)s)")
    parser.add_argument("--warmup", type=POSITIVE, default=1,
                        help="untimed steps per variant first, at least one: the first step compiles or loads the "
                             "fused passes (numba) and fills the allocator's caches")


def interleaved_times(steps: dict[str, Callable[[], object]], repeats: int, warmup: int,
                      device: torch.device) -> dict[str, dict[str, list[float]]]:
    """Time each of ``steps`` ``repeats`` times, interleaved, after ``warmup`` untimed calls each.

    Args:
        steps: name -> a callable running one unit of work (e.g. one training step).
        repeats: timed rounds; each round calls every step once, in order.
        warmup: untimed calls of each step first (allocator, caches, compiled kernels).
        device: where the work runs (CUDA work is synchronized around every call).
    Returns:
        ``{"wall_s": {name: [seconds per call]}, "cpu_s": {name: [process CPU seconds per call]}}``.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps.values():
        for _ in range(warmup):
            step()
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            step()
            sync()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
    return {"wall_s": wall, "cpu_s": cpu}


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Median of each candidate's times (seconds)."""
    return {name: statistics.median(values) for name, values in times.items()}


LINEAR_GEMM_OPS = ("aten::mm", "aten::addmm")  # a float Linear's forward (addmm) and backward (mm) GEMMs


def weight_gradient_floor(events: Iterable) -> dict[str, float]:
    """How fast an 8-bit run can get while its weight gradients stay fp32 GEMMs (SPEC 4's
    bifurcation, and ``kernel="auto"`` matching the simulated kernel up to fp32 rounding).

    Args:
        events: the op averages of one profiled fp32 step or round (``torch.profiler``'s
            ``key_averages()``, CPU).
    Returns:
        ``step_s``: the op time profiled (seconds, self times summed); ``linear_gemm_s``: its
        Linear GEMMs (``LINEAR_GEMM_OPS``); ``floor_ratio``: a Linear runs three GEMMs of equal
        FLOPs (forward, layer gradient, weight gradient), so were the other two and every
        quantization pass free, the work would still take ``step_s - 2/3 linear_gemm_s``, this
        fraction of fp32.
    """
    events = list(events)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    gemm = sum(e.self_cpu_time_total for e in events if e.key in LINEAR_GEMM_OPS) / 1e6
    return {"step_s": total, "linear_gemm_s": gemm, "floor_ratio": (total - 2 * gemm / 3) / total}
