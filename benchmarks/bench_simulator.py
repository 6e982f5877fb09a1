"""Cost of the simulated multi-node round versus n plain training steps, and its peak memory.

One process, one model shape (DistilBERT-base by default: 6 layers, dim 768, FFN 3072), seq 128,
batch 8 per node, AdamW:

* a simulated round: ``DecentralizedTrainer(backend="simulated")`` with ``--nodes`` nodes, the
  time between the trainer's ``on_step_begin`` and ``on_step_end`` callbacks (data loading, every
  node's forward/backward and AdamW step, the NaN check, the gossip step);
* the reference, measured in the same repeat: ``--nodes`` plain steps of one model of the same
  precision on one fixed batch, each what a single-node ``transformers.Trainer`` step does:
  forward + backward, gradient clipping (``clip_grad_norm_`` to the trainer's ``max_grad_norm``
  when > 0), AdamW. By default (``--interleave node``) one reference step runs next to each
  node's local step, alternately after and before it, and is not counted in the round's time;
  ``--interleave round`` runs the ``--nodes`` reference steps together, alternately after and
  before the round. The ratio reported is the median over
  repeats of round / reference;
* with ``--distinct-reference``, also ``--nodes`` plain steps of ``--nodes`` distinct copies, one
  step each: what holding n models in one process costs by itself (memory traffic: every step
  touches another model's weights, gradients and optimizer state);
* the round against ``--nodes`` plain steps plus the round's own gossip step: what simulating the
  nodes in one process adds beyond the work each node does anyway (in the distributed backend
  every rank computes its share of the gossip step too);
* where the round's time goes, timed through public hooks only (:class:`TimedTrainer`): each
  node's forward + backward (``compute_loss`` to its parameters' last post-accumulate-grad hook),
  the NaN check and clipping (from there to its optimizer's step pre-hook; against the reference's
  clipping), the optimizer steps (step pre/post hooks) and the gossip engine's ``step``; the
  remainder is data loading and the loop itself. On CUDA the host marks where the backward ends
  without a sync, so its tail can land in the NaN check's share;
* peak memory of the run, fp32 vs 8-bit nodes: the peak resident set size of a fresh subprocess
  running a few rounds (``VmHWM``), and its baseline before the model is built.

The trainer keeps freed memory for the next step on the CPU (``tune_cpu_malloc``, the default;
:mod:`lp_decentral_nlp.utils.cpu_malloc`), and so does the reference, which runs in the same process.
``--default-malloc`` measures both under glibc's default policy instead, where every step
page-faults its activations and gradients in again and the cost drifts with the allocator's
history (the round's own forward/backward then ran 6% faster to 24% slower than the reference's,
from run to run).

    python benchmarks/bench_simulator.py --threads 2              # ~5 minutes on 2 CPU cores
    python benchmarks/bench_simulator.py --threads 2 --small      # 2 layers, dim 256: ~1 minute (bench_simulator_small)

The figures, every repeat's times (seconds) and the peak memory (bytes) go to
``benchmarks/results/bench_simulator.json`` (``benchmarks/record.py``).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

import torch
from datasets import Dataset
from transformers import DistilBertConfig, DistilBertForSequenceClassification, TrainerCallback

from lp_decentral_nlp import QuantConfig
from lp_decentral_nlp.quant import kernel_report
from lp_decentral_nlp.quant.kernels import AUTO, kernel_names
from lp_decentral_nlp.commands import (Range, add_default_malloc_flag,
                                       add_device_flag, add_threads_flag, ranged)
from lp_decentral_nlp.trainer import DecentralizedTrainer, DecentralizedTrainingArguments
from record import benchmark_parser, check_results_dir, load_average, save_results

NUM_LABELS = 4
POSITIVE, NONNEGATIVE = ranged(int, Range(1)), ranged(int, Range(0))
SEQ_LEN = ranged(int, Range(1, DistilBertConfig().max_position_embeddings))  # the model's positions
CHECK = "NaN check + clipping"


def model_config(small: bool) -> DistilBertConfig:
    if small:
        return DistilBertConfig(num_labels=NUM_LABELS, n_layers=2, dim=256, hidden_dim=1024, n_heads=4)
    return DistilBertConfig(num_labels=NUM_LABELS)  # DistilBERT-base shape


def make_dataset(config, rows: int, seq_len: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (rows, seq_len), generator=g)
    return Dataset.from_dict({
        "input_ids": ids.tolist(),
        "attention_mask": torch.ones_like(ids).tolist(),
        "label": (torch.arange(rows) % NUM_LABELS).tolist(),
    })


def build_trainer(args, precision: str, rounds: int, output_dir: str, trainer_class=None, **trainer_kwargs):
    """The simulated run measured: ``trainer_class`` (default :class:`DecentralizedTrainer`) over
    a random-token dataset of exactly ``rounds`` rounds; returns the trainer and the dataset."""
    config = model_config(args.small)
    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(config)
    quant = QuantConfig(kernel=args.kernel) if precision == "8-bit" else None
    targs = DecentralizedTrainingArguments(
        output_dir=output_dir, num_nodes=args.nodes, per_device_train_batch_size=args.batch_size,
        max_steps=rounds, learning_rate=3e-5, optim="adamw_torch", lr_scheduler_type="constant",
        low_precision=precision == "8-bit", algorithm=args.algorithm, compression=args.compression,
        logging_steps=10**6, save_strategy="no", report_to="none", use_cpu=args.device == "cpu",
        dataloader_num_workers=0, seed=0, disable_tqdm=True, tune_cpu_malloc=not args.default_malloc,
    )
    dataset = make_dataset(config, args.nodes * args.batch_size * rounds, args.seq_len)
    trainer = (trainer_class or DecentralizedTrainer)(model=model, args=targs, train_dataset=dataset,
                                                      quant_config=quant, **trainer_kwargs)
    return trainer, dataset


class TimedGossip:
    """A gossip engine whose ``step`` is timed into ``sections["gossip.step"]``; everything else is
    the engine's own."""

    def __init__(self, engine, sections: dict, sync):
        self.engine, self.sections, self.sync = engine, sections, sync

    def step(self, *args, **kwargs):
        self.sync()
        start = time.perf_counter()
        stats = self.engine.step(*args, **kwargs)
        self.sync()
        self.sections["gossip.step"] += time.perf_counter() - start
        return stats

    def __getattr__(self, name):
        return getattr(self.engine, name)


class TimedTrainer(DecentralizedTrainer):
    """A :class:`DecentralizedTrainer` whose round is split into sections through public hooks:
    ``compute_loss`` (Trainer's loss hook: a node's forward starts), every parameter's
    ``register_post_accumulate_grad_hook`` (its backward ends), the optimizer's step pre/post hooks
    (``create_optimizer``: the NaN check and clipping end, the update ends) and the gossip engine
    (:class:`TimedGossip`). ``node_hooks``: an object with ``before_node(k)`` / ``after_node(k)``
    run as local node ``k``'s step starts and ends (outside the sections: the interleaved
    reference steps). Gradient accumulation 1 (one ``compute_loss`` per node and round)."""

    def __init__(self, *args, sync, node_hooks, **kwargs):
        self.sync, self.node_hooks = sync, node_hooks
        self.sections, self.rounds = defaultdict(float), []
        super().__init__(*args, **kwargs)
        self.gossip = TimedGossip(self.gossip, self.sections, sync)
        self.current_node, self.forward_start, self.grads_done, self.update_start = None, 0.0, 0.0, 0.0
        for node in self.nodes:
            for parameter in node.parameters():
                if parameter.requires_grad:
                    parameter.register_post_accumulate_grad_hook(self.mark_gradient)

    def compute_loss(self, model, inputs, *args, **kwargs):
        k = next(k for k, node in enumerate(self.nodes) if node is model)
        self.current_node = k
        self.node_hooks.before_node(k)
        self.sync()
        self.forward_start = self.grads_done = time.perf_counter()
        return super().compute_loss(model, inputs, *args, **kwargs)

    def mark_gradient(self, parameter) -> None:
        self.grads_done = time.perf_counter()

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        optimizer.register_step_pre_hook(self.before_update)
        optimizer.register_step_post_hook(self.after_update)
        return optimizer

    def before_update(self, *_):
        self.sync()
        self.update_start = time.perf_counter()
        self.sections["forward+backward"] += self.grads_done - self.forward_start
        self.sections[CHECK] += self.update_start - self.grads_done

    def after_update(self, *_):
        self.sync()
        self.sections["optimizer step"] += time.perf_counter() - self.update_start
        self.node_hooks.after_node(self.current_node)

    def end_round(self) -> None:
        self.rounds.append(dict(self.sections))
        self.sections.clear()


class Interleaved(TrainerCallback):
    """Times each round and ``nodes`` plain steps of a reference model next to it.

    ``per_node=False``: the ``nodes`` reference steps run together, after the round in even
    repeats and before it in odd ones, so neither side always inherits the other's allocator state.
    ``per_node=True``: one reference step runs next to each node's local step (after it in even
    repeats, before it in odd ones; :class:`TimedTrainer` calls :meth:`before_node` /
    :meth:`after_node`), so the two sides of a repeat are measured within a second or two of each
    other rather than ~10 s apart, and a drift of the machine's speed moves both alike. The
    reference steps are not counted in the round's time."""

    def __init__(self, reference_step, nodes, sync, distinct, per_node):
        self.reference_step, self.nodes, self.sync = reference_step, nodes, sync
        self.distinct, self.per_node = distinct, per_node
        self.round_s, self.plain_s, self.plain_sections, self.distinct_s = [], [], [], []

    @property
    def _reference_first(self) -> bool:
        return len(self.round_s) % 2 == 1

    def on_step_begin(self, args, state, control, **kw):
        self._plain, self._distinct, self._sections, self._inside = 0.0, 0.0, defaultdict(float), 0.0
        if not self.per_node and self._reference_first:
            self._reference_steps(range(self.nodes))
        self.sync()
        self._start = time.perf_counter()

    def before_node(self, k: int) -> None:
        if self.per_node and self._reference_first:
            self._inside += self._reference_steps([k])

    def after_node(self, k: int) -> None:
        if self.per_node and not self._reference_first:
            self._inside += self._reference_steps([k])

    def on_step_end(self, args, state, control, **kw):
        self.sync()
        self.round_s.append(time.perf_counter() - self._start - self._inside)
        if not self.per_node and len(self.round_s) % 2:  # this repeat's reference comes after the round
            self._reference_steps(range(self.nodes))
        self.plain_s.append(self._plain)
        self.plain_sections.append(self._sections)
        if self.distinct:
            self.distinct_s.append(self._distinct)

    def _reference_steps(self, copies) -> float:
        """One reference step per entry of ``copies`` (and, with distinct copies, one step of each of
        those copies); adds their times to this repeat's; returns the wall seconds spent."""
        self.sync()
        start = time.perf_counter()
        for _ in copies:
            self.reference_step(self._sections)
        middle = time.perf_counter()
        self._plain += middle - start
        if self.distinct:
            for i in copies:
                self.reference_step(defaultdict(float), i)
            self._distinct += time.perf_counter() - middle
        return time.perf_counter() - start


class EndRound(TrainerCallback):
    """Closes :class:`TimedTrainer`'s sections of a round (registered after :class:`Interleaved`,
    whose reference steps after the round are not in them)."""

    def __init__(self, trainer: TimedTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kw):
        self.trainer.end_round()


def median_interval(values: list[float], level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values`` (fixed seed: the same values give
    the same interval): where the median of this many repeats would lie on another run of equal noise."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = round((1 - level) / 2 * resamples)
    return medians[tail], medians[resamples - 1 - tail]


def measure_time(args, precision):
    rounds = args.warmup + args.repeats
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as out:
        callback = Interleaved(None, args.nodes, sync, args.distinct_reference, per_node=args.interleave == "node")
        trainer, dataset = build_trainer(args, precision, rounds, out, TimedTrainer, sync=sync, node_hooks=callback)
        copies = args.nodes if args.distinct_reference else 1
        references = [copy.deepcopy(trainer.nodes[0]).to(device).train() for _ in range(copies)]
        optimizers = [torch.optim.AdamW(r.parameters(), lr=3e-5) for r in references]
        batch = {k: torch.tensor(dataset[: args.batch_size][k], device=device) for k in ("input_ids", "attention_mask")}
        batch["labels"] = torch.tensor(dataset[: args.batch_size]["label"], device=device)
        max_grad_norm = trainer.args.max_grad_norm

        def reference_step(sections, copy_index=0):
            reference, optimizer = references[copy_index], optimizers[copy_index]
            start = time.perf_counter()
            reference(**batch).loss.backward()
            sync()
            backward = time.perf_counter()
            if max_grad_norm > 0:  # as a single-node Trainer does
                torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
            sync()
            clip = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            sections["forward+backward"] += backward - start
            sections[CHECK] += clip - backward
            sections["optimizer step"] += time.perf_counter() - clip

        callback.reference_step = reference_step
        trainer.add_callback(callback)
        trainer.add_callback(EndRound(trainer))
        trainer.train()
    keep = slice(args.warmup, None)
    round_s, plain_s = callback.round_s[keep], callback.plain_s[keep]
    sections = {k: statistics.median(r.get(k, 0.0) for r in trainer.rounds[keep])
                for k in {k for r in trainer.rounds for k in r}}
    plain_sections = {k: statistics.median(r[k] for r in callback.plain_sections[keep])
                      for k in callback.plain_sections[0]}
    ratios = [r / p for r, p in zip(round_s, plain_s)]
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    gossip_s = [r.get("gossip.step", 0.0) for r in trainer.rounds[keep]]
    own_work_ratios = [r / (p + g) for r, p, g in zip(round_s, plain_s, gossip_s)]
    distinct_s = callback.distinct_s[keep]
    per_repeat = dict(round_s=round_s, plain_s=plain_s, gossip_s=gossip_s, distinct_s=distinct_s or None)
    return dict(round_s=statistics.median(round_s), plain_s=statistics.median(plain_s), per_repeat=per_repeat,
                ratio=statistics.median(ratios), ratio_quartiles=(quartiles[0], quartiles[2]),
                ratio_interval=median_interval(ratios), own_work_ratio=statistics.median(own_work_ratios),
                sections=sections, plain_sections=plain_sections,
                kernel=ran_kernels(args.kernel, trainer.nodes[0]) if precision == "8-bit" else "-",
                distinct_s=statistics.median(distinct_s) if distinct_s else None,
                distinct_ratio=statistics.median(d / p for d, p in zip(distinct_s, plain_s)) if distinct_s else None)


def ran_kernels(asked: str, model) -> str:
    """The ``--kernel`` asked for and what the 8-bit layers of ``model`` ran, e.g.
    ``"auto: 36 int8, 1 simulated"`` (``kernel_report``)."""
    counts = Counter(kernel_report(model).values())
    return f"{asked}: " + ", ".join(f"{n} {kernel}" for kernel, n in counts.most_common())


def measure_memory(args, precision) -> dict:
    """Peak RSS of a fresh process that builds the trainer and runs `--memory-rounds` rounds."""
    cmd = [sys.executable, __file__, "--_memory-child", precision, "--nodes", str(args.nodes),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--threads", str(args.threads),
           "--kernel", args.kernel, "--algorithm", args.algorithm, "--compression", str(args.compression),
           "--device", args.device, "--repeats", str(args.memory_rounds), "--warmup", "0"]
    cmd += ["--small"] * args.small + ["--default-malloc"] * args.default_malloc
    child = subprocess.run(cmd, capture_output=True, text=True)
    if child.returncode != 0:  # the child's own last words, not only its exit status
        tail = "\n".join(child.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"the {precision} peak-memory process failed (exit {child.returncode}):\n{tail}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def peak_rss() -> int:
    """Peak resident set size of this process in bytes: Linux ``VmHWM`` (``ru_maxrss`` survives
    ``exec`` and would report the parent's peak), ``ru_maxrss`` on other Unix systems, the peak
    working set on Windows (which has no ``resource`` module)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    try:
        import resource
    except ImportError:
        import psutil

        return psutil.Process().memory_info().peak_wset
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def memory_child(args, precision):
    baseline = peak_rss()
    with tempfile.TemporaryDirectory() as out:
        trainer, _ = build_trainer(args, precision, args.repeats, out)
        trainer.train()
    peak = peak_rss()
    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    print(json.dumps({"baseline_rss": baseline, "peak_rss": peak, "cuda_peak": cuda_peak}))


def main(argv=None):
    p = benchmark_parser(__doc__)
    p.add_argument("--nodes", type=ranged(int, Range(2)), default=4,
                   help="simulated nodes in the round, at least 2: a node gossips with its neighbours "
                        "(default %(default)s)")
    p.add_argument("--repeats", type=POSITIVE, default=5, help="timed rounds per precision (default %(default)s)")
    p.add_argument("--warmup", type=NONNEGATIVE, default=1, help="untimed rounds per precision first")
    p.add_argument("--batch-size", type=POSITIVE, default=8, help="per node")
    p.add_argument("--seq-len", type=SEQ_LEN, default=128,
                   help="tokens per sequence (at most DistilBERT's 512 positions; default %(default)s)")
    add_threads_flag(p, torch.get_num_threads(), "torch.set_num_threads (default: torch's, here %(default)s)")
    p.add_argument("--kernel", default=AUTO, choices=(AUTO, *(name for name in kernel_names() if name != AUTO)),
                   help="QuantConfig.kernel of the 8-bit nodes (default %(default)s, the library's)")
    p.add_argument("--algorithm", default="choco", choices=("choco", "deepsqueeze"),
                   help="gossip algorithm of the round (default %(default)s)")
    p.add_argument("--compression", type=ranged(float, Range(0, 100, high_open=True)), default=90.0,
                   help="top-k: percent dropped, in [0, 100) (default %(default)s)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "8-bit"], choices=["fp32", "8-bit"],
                   help="precisions timed, each against plain steps of one model (default: both)")
    p.add_argument("--memory-rounds", type=NONNEGATIVE, default=2, help="rounds of the peak-memory subprocess (0: skip)")
    p.add_argument("--small", action="store_true", help="2 layers, dim 256 instead of DistilBERT-base")
    p.add_argument("--interleave", choices=["node", "round"], default="node",
                   help="where the reference steps run: one next to each node's local step (node, the default) "
                        "or all together next to the round (round, the runs before the node mode existed)")
    p.add_argument("--distinct-reference", action="store_true",
                   help="also time plain steps of --nodes distinct model copies (needs their memory)")
    add_device_flag(p)
    add_default_malloc_flag(p)
    p.add_argument("--_memory-child", dest="memory_child", choices=["fp32", "8-bit"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_results_dir(p)
    if len(set(args.precisions)) < len(args.precisions):
        p.error(f"argument --precisions: {args.precisions} repeats a precision: give each once")
    if args.kernel != AUTO and "8-bit" not in args.precisions:
        p.error("argument --kernel: the kernel of the 8-bit nodes, and --precisions holds no 8-bit: drop one of them")
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args, args.memory_child)

    load = load_average()
    shape = "2 layers, dim 256, FFN 1024" if args.small else "DistilBERT-base (6 layers, dim 768, FFN 3072)"
    print(f"{shape}, {args.nodes} simulated nodes, batch {args.batch_size}/node x seq {args.seq_len}, AdamW, "
          f"{args.algorithm} top-k {args.compression:g}%, device {args.device}, torch threads {args.threads}, "
          f"{args.repeats} repeats interleaved {'node by node' if args.interleave == 'node' else 'round by round'}, "
          f"load average {load}, "
          f"malloc {'glibc default' if args.default_malloc else 'tune_cpu_malloc (freed memory kept)'}")
    mib = 2**20
    # memory first, from a parent that holds no model yet (4 DistilBERT nodes peak near 7 GiB)
    memory = {precision: measure_memory(args, precision) for precision in args.precisions} if args.memory_rounds else {}
    results = {"settings": {k: v for k, v in vars(args).items() if k != "memory_child"},
               "load_average": load, "rounds": [], "sections": [], "per_repeat": {}}
    if memory:  # --memory-rounds 0 measures none: a record holds no empty list
        results["memory"] = [{"precision": precision, "baseline_rss_bytes": m["baseline_rss"],
                              "peak_rss_bytes": m["peak_rss"], "cuda_peak_bytes": m["cuda_peak"]}
                             for precision, m in memory.items()]
    for precision in args.precisions:
        r = measure_time(args, precision)
        results["rounds"].append({
            "precision": precision, "kernel": r["kernel"], "round_s": r["round_s"], "plain_s": r["plain_s"],
            "ratio": r["ratio"], "ratio_quartiles": r["ratio_quartiles"], "ratio_interval": r["ratio_interval"],
            "own_work_ratio": r["own_work_ratio"], "gossip_s": r["sections"].get("gossip.step", 0.0),
            "distinct_s": r["distinct_s"], "distinct_ratio": r["distinct_ratio"]})
        results["sections"] += [{"precision": precision, "section": name, "round_s": r["sections"].get(name, 0.0),
                                 "plain_s": r["plain_sections"].get(name, 0.0)}
                                for name in sorted(set(r["sections"]) | set(r["plain_sections"]))]
        results["per_repeat"][precision] = r["per_repeat"]
        gc.collect()  # the trainer holds reference cycles: free its models before the next precision
        kernel = f" (kernel {r['kernel']})" if precision == "8-bit" else ""
        print(f"\n{precision}{kernel}: round {r['round_s']:.3f} s, {args.nodes} plain steps {r['plain_s']:.3f} s, "
              f"round / plain = {r['ratio']:.3f} (median of per-repeat ratios, 95% bootstrap interval "
              f"{r['ratio_interval'][0]:.3f}-{r['ratio_interval'][1]:.3f}, quartiles {r['ratio_quartiles'][0]:.3f}-"
              f"{r['ratio_quartiles'][1]:.3f}; overhead {r['ratio'] - 1:+.1%})")
        print(f"  {'section':<28}{'round s':>9}{'plain s':>9}")
        for name in sorted(set(r["sections"]) | set(r["plain_sections"])):
            print(f"  {name:<28}{r['sections'].get(name, 0.0):9.3f}{r['plain_sections'].get(name, 0.0):9.3f}")
        rest = r["round_s"] - sum(r["sections"].values())
        print(f"  {'rest (data, loop)':<28}{rest:9.3f}")
        print(f"  round / (plain steps + gossip step) = {r['own_work_ratio']:.3f}: what running the nodes in one "
              f"process adds to their own work (each node computes its gossip share in the distributed backend too)")
        if r["distinct_s"] is not None:
            print(f"  {args.nodes} plain steps of {args.nodes} distinct copies: {r['distinct_s']:.3f} s, "
                  f"{r['distinct_ratio']:.3f}x one model's (holding {args.nodes} models alone); "
                  f"round / distinct = {r['round_s'] / r['distinct_s']:.3f}")
    # the small model is no DistilBERT-base figure: its own record, never over the published one
    print(f"results: {save_results('bench_simulator_small' if args.small else 'bench_simulator', results)}")
    if memory:
        print()
        for precision, m in memory.items():
            extra = f", CUDA peak allocated {m['cuda_peak'] / mib:.0f} MiB" if m["cuda_peak"] else ""
            print(f"peak memory {precision:>5}, {args.nodes} nodes: peak RSS {m['peak_rss'] / mib:.0f} MiB "
                  f"(process baseline before the model {m['baseline_rss'] / mib:.0f} MiB){extra}")


if __name__ == "__main__":
    main()
