"""Side-by-side timing for the benchmarks: every candidate runs once per round, rounds repeated.

Interleaving gives every candidate the same machine load (another job, frequency changes) in each
round, so ratios of their medians are far steadier than timings taken one candidate after another.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


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
