"""The headline run's whole round, 8-bit against ``--full-precision``, side by side.

    python benchmarks/bench_round.py                 # ~10 minutes on 2 CPU cores
    python benchmarks/bench_round.py --repeats 2 --rounds 3    # a quick look (bench_round_quick)

The run measured is the one users start with, ``recipes/agnews_choco.py --skew 0.9 --comp 99``, at
the CPU scale of ``benchmarks/table6_cpu.py``: the packaged all-MiniLM-L6-v2, batch 16 x 64 tokens
per node, 4 nodes on a directed ring, Choco-SGD with 99% top-k, on the AG News sample. The recipe's
own parser builds the training arguments from those flags (plus ``--full-precision`` for the fp32
side), and :func:`lp_decentral_nlp.commands.prepare_nlp_run` loads the data and model as the recipe
does; every other setting (optimizer, kernel, threads, gossip) is the recipe's default.

A round is one step of :class:`DecentralizedTrainer`: from the trainer's ``on_step_begin`` to its
``on_step_end`` callback, i.e. every node's batch, forward, backward and optimizer step, the NaN
check and the gossip step (logging and evaluation come after it and are not counted). Each repeat
trains both precisions for ``--warmup`` + ``--rounds`` rounds from the same start, in alternating
order (8-bit first in even repeats, fp32 first in odd ones), and the ratio reported is the median
over repeats of (median 8-bit round) / (median fp32 round).

After the timed repeats on the CPU, one more fp32 training profiles its round after the warm-up
(``torch.profiler``, CPU) for the floor fp32 weight gradients put under any 8-bit round
(``timing.weight_gradient_floor``: the round's op time less two thirds of its Linear GEMMs). On a
GPU (the trainer's device where torch sees one) the CPU profiler sees only kernel launches, so no
floor is computed there.

Writes ``benchmarks/results/bench_round.json`` (``bench_round_cuda.json`` on a GPU; ``record.save_results``
and ``record.device_record_name``): the settings, the kernel
each 8-bit layer ran, every round's seconds, the per-repeat ratios, their median, whether it
meets the goal of 0.6, and on the CPU the floor.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import os
import pathlib
import statistics
import tempfile
import time

from record import benchmark_parser, check_results_dir, device_record_name, load_average, save_results
from table6_cpu import DEFAULT_DATA  # the AG News sample Table 6 runs on
from timing import weight_gradient_floor

from lp_decentral_nlp.commands import (Range, add_threads_flag,
                                       build_nlp_parser, packaged_model_path, prepare_nlp_run, ranged)

HEADLINE = ["--skew", "0.9", "--comp", "99"]
CPU_SCALE = ["--batch-size", "16", "--max-length", "64"]
PRECISIONS = ("8-bit", "fp32")
GOAL = 0.6  # issue #23: the headline round in 8-bit at most 0.6x the --full-precision one
POSITIVE, NONNEGATIVE = ranged(int, Range(1)), ranged(int, Range(0))


def round_timer():
    """A trainer callback keeping the wall seconds of every round (``on_step_begin`` to ``on_step_end``)
    in its ``seconds`` list."""
    from transformers import TrainerCallback

    class RoundTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.start)

    return RoundTimer()


def round_profiler(profiled_round: int):
    """A trainer callback profiling round `profiled_round` (0-based) with ``torch.profiler`` (CPU);
    its ``events`` are the op averages (``key_averages()``) once that round ends."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class RoundProfiler(TrainerCallback):
        def __init__(self):
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.events = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == profiled_round:
                self.profiler.start()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == profiled_round + 1:  # the trainer counts the round before this call
                self.profiler.stop()
                self.events = self.profiler.key_averages()

    return RoundProfiler()


def parse(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--data-dir", type=pathlib.Path, default=DEFAULT_DATA, help="the AG News CSV (default %(default)s)")
    parser.add_argument("--model", default=None, help="hub id or model folder (default: the packaged "
                                                      "all-MiniLM-L6-v2)")
    parser.add_argument("--repeats", type=POSITIVE, default=4, help="trainings per precision (default %(default)s)")
    parser.add_argument("--rounds", type=POSITIVE, default=8, help="timed rounds per training (default %(default)s)")
    parser.add_argument("--warmup", type=NONNEGATIVE, default=2, help="untimed first rounds (default %(default)s)")
    add_threads_flag(parser, None, "torch threads (default: the recipe's, OMP_NUM_THREADS or 1)")
    args = parser.parse_args(argv)
    # fewer repeats or rounds than the defaults are a quick look: their own record, never the published one
    quick = args.repeats < parser.get_default("repeats") or args.rounds < parser.get_default("rounds")
    args.record_name = "bench_round_quick" if quick else "bench_round"
    check_results_dir(parser)
    if not args.data_dir.is_file():
        parser.error(f"argument --data-dir: {args.data_dir} is not a file; give the AG News sample CSV")
    return args


def recipe_flags(args, precision: str, output_dir: str) -> list[str]:
    """The headline recipe's command line for `precision`, stopping after the warm-up and timed rounds."""
    flags = [*HEADLINE, *CPU_SCALE, "--model", args.model or packaged_model_path(), "--data-dir", str(args.data_dir),
             "--max-steps", str(args.warmup + args.rounds), "--output-dir", output_dir, "--disable-tqdm", "true"]
    flags += ["--threads", str(args.threads)] * (args.threads is not None)
    return flags + ["--full-precision"] * (precision == "fp32")


def main(argv=None):
    args = parse(argv)
    import torch

    from lp_decentral_nlp.trainer import DecentralizedTrainer, TrainingKernelsCallback

    parser = build_nlp_parser("ag_news", "choco")
    with tempfile.TemporaryDirectory() as out:
        parsed = {p: parser.parse(recipe_flags(args, p, os.path.join(out, p))) for p in PRECISIONS}
        model, data, tokenizer, model_path = prepare_nlp_run(parsed["8-bit"], parser.prog)
        threads = torch.get_num_threads()
        print(f"headline run {' '.join(HEADLINE + CPU_SCALE)}, {parsed['8-bit'].training.num_nodes} nodes, "
              f"torch threads {threads}, {args.repeats} repeats x {args.rounds} rounds (+{args.warmup} warm-up), "
              f"load average {load_average()}", flush=True)
        rounds = {p: [] for p in PRECISIONS}
        ratios, kernels = [], None
        for repeat in range(args.repeats):
            order = PRECISIONS if repeat % 2 == 0 else PRECISIONS[::-1]
            medians = {}
            for precision in order:
                timer = round_timer()
                trainer = DecentralizedTrainer(model=copy.deepcopy(model), args=parsed[precision].training,
                                               train_dataset=data["train"], processing_class=tokenizer,
                                               callbacks=[timer])
                kernels_callback = TrainingKernelsCallback(trainer.nodes[0])
                trainer.add_callback(kernels_callback)
                trainer.train()
                if precision == "8-bit":  # what the layers trained with
                    kernels = dict(collections.Counter(kernels_callback.kernels.values()))
                timed = timer.seconds[args.warmup:]
                rounds[precision].append(timed)
                medians[precision] = statistics.median(timed)
                del trainer
            ratios.append(medians["8-bit"] / medians["fp32"])
            print(f"repeat {repeat + 1}: 8-bit {medians['8-bit']:.3f} s, fp32 {medians['fp32']:.3f} s per round, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        device = parsed["fp32"].training.device
        floor = None
        if device.type == "cpu":
            profiler = round_profiler(args.warmup)
            fp32_args = dataclasses.replace(parsed["fp32"].training, max_steps=args.warmup + 1)
            DecentralizedTrainer(model=copy.deepcopy(model), args=fp32_args, train_dataset=data["train"],
                                 processing_class=tokenizer, callbacks=[profiler]).train()
            floor = weight_gradient_floor(profiler.events)
    ratio = statistics.median(ratios)
    results = {
        # the model trained (a hub id the machine cannot reach falls back to the packaged MiniLM, with a notice)
        "settings": {"recipe": "recipes/agnews_choco.py", "flags": HEADLINE + CPU_SCALE, "model": str(model_path),
                     "data": str(args.data_dir),
                     "nodes": parsed["8-bit"].training.num_nodes, "device": str(device), "threads": threads,
                     "repeats": args.repeats, "rounds": args.rounds, "warmup": args.warmup},
        "kernels_8bit": kernels,
        "round_s": {p: statistics.median(statistics.median(r) for r in rounds[p]) for p in PRECISIONS},
        "ratio_8bit_over_fp32": ratio,
        "goal": GOAL,
        "met": ratio <= GOAL,
        "ratio_per_repeat": ratios,
        # every timed round in order, ``--rounds`` per repeat
        "per_round_s": {p: [s for repeat in rounds[p] for s in repeat] for p in PRECISIONS},
    }
    if floor is not None:  # one profiled fp32 round (CPU): its op time, its Linear GEMMs, and the best
        results["fp32_weight_gradient_floor"] = floor  # 8-bit / fp32 ratio with fp32 weight gradients
    print(f"8-bit / --full-precision round: {ratio:.3f} (median of {args.repeats} repeats; "
          f"8-bit kernels {kernels})")
    if floor is not None:
        print(f"fp32 round in the profiler {floor['step_s']:.2f} s, Linear GEMMs {floor['linear_gemm_s']:.2f} s: "
              f"with fp32 weight gradients no 8-bit round beats {floor['floor_ratio']:.2f}x fp32")
    print(f"results: {save_results(device_record_name(args.record_name, device), results)}")
    return results


if __name__ == "__main__":
    main()
