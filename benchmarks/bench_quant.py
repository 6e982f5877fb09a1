"""fp32 vs 8-bit (SPEC 4) training step of a DistilBERT-base-shaped model, side by side.

Measures, in one process and on the same inputs, for fp32 and the 8-bit model with the simulated
kernel (float fake quantization, the paper's method), the int8 kernel (``kernels.int8_gemm``:
``torch._int_mm`` where it is a real int8 GEMM, fp32 GEMMs of the codes on CPUs without
AVX512-VNNI; the output names the path) and the int8_bf16 kernel (int8 GEMMs, bfloat16
weight-gradient GEMM):

* step time (forward + backward + AdamW step, fused as the recipes' nodes run it: ``trainer_adamw``), the variants' steps interleaved, median of
  ``--repeats``; on the CPU also the process CPU time per step, which other jobs sharing the
  machine disturb far less than the wall clock;
* peak tensor memory of one step: live tensor bytes (parameters, buffers, optimizer state and
  everything allocated during the step), from CUDA's allocator statistics on a GPU and from a
  dispatch-mode tracker of tensor storages on the CPU;
* the share of forward FLOPs run by the quantized layers (the rest -- attention score/context
  matmuls and the classification head -- stays float);
* the checkpoint size, fp32 state dict vs ``export_int8_state_dict`` (without and with 8-bit embedding tables).

The figures also go to ``benchmarks/results/bench_quant.json`` (``bench_quant_layer_sweep.json`` for
``--layer-sweep``; with ``--device cuda`` the same names ending ``_cuda``).

    python benchmarks/bench_quant.py --threads 2                # ~3-4 minutes on 2 CPU cores
    python benchmarks/bench_quant.py --threads 2 --repeats 20   # tighter medians
    python benchmarks/bench_quant.py --threads 2 --layer-sweep  # one Linear per width: where int8 pays
"""
from __future__ import annotations

import copy
import sys
import statistics
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from lp_decentral_nlp import QuantConfig, export_int8_state_dict, quantize_model
from lp_decentral_nlp.commands import (Range, add_default_malloc_flag,
                                       add_device_flag, add_threads_flag, ranged)
from lp_decentral_nlp.utils.cpu_malloc import keep_freed_memory
from lp_decentral_nlp.quant import QuantModule
from lp_decentral_nlp.quant.kernels import int8_gemm_path
from lp_decentral_nlp.quant.export import state_dict_nbytes
from record import benchmark_parser, check_results_dir, device_record_name, load_average, save_results
from timing import add_step_timing_flags, interleaved_times, medians

POSITIVE = ranged(int, Range(1))
SEQ_LEN = ranged(int, Range(1, DistilBertConfig().max_position_embeddings))  # the model's positions


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while active, on top of a given set of existing ones.

    Each new storage is counted once (views share it) and uncounted when it is freed; a oneDNN
    opaque tensor (the int8 convolution's packed weight) has no storage and counts as its own
    ``numel * element_size`` bytes.
    """

    def __init__(self, existing):
        super().__init__()
        self.tracked = weakref.WeakSet(t.untyped_storage() for t in existing)
        self.live = self.peak = 0

    def _free(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_mkldnn:  # a new tensor each time: no views of it here
                self.live += t.numel() * t.element_size()
                weakref.finalize(t, self._free, t.numel() * t.element_size())
            elif isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage not in self.tracked:
                    self.tracked.add(storage)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def resident_tensors(model, optimizer):
    """Tensors a training loop keeps between steps: parameters, buffers, optimizer state."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return list(model.parameters()) + list(model.buffers()) + state


def unique_nbytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def trainer_adamw(model) -> torch.optim.AdamW:
    """The AdamW a recipe's nodes train with: transformers' default ``optim="adamw_torch_fused"``,
    which ``DecentralizedTrainer`` honours per node, builds ``torch.optim.AdamW(fused=True)`` (one
    kernel for all parameters on CPU and CUDA; DistilBERT-base: about 40 ms a step on 2 cores
    against 200 ms for the per-parameter loop, the same in fp32 and 8-bit, so it sets how much of
    the step the 8-bit layers are). ``lr`` 3e-5."""
    return torch.optim.AdamW(model.parameters(), lr=3e-5, fused=True)


def train_step(model, optimizer, loss_fn) -> None:
    """One training step of `model`: ``loss_fn()`` forward, backward, optimizer step, gradients cleared."""
    loss_fn().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def malloc_as_trainer(args, device) -> str:
    """Keep freed memory as ``DecentralizedTrainer`` does on the CPU (``tune_cpu_malloc``) unless
    ``--default-malloc``; says which policy the run measures."""
    if device.type == "cpu" and not args.default_malloc and keep_freed_memory():
        return "freed memory kept (as DecentralizedTrainer with tune_cpu_malloc)"
    return "glibc default"


def peak_step_memory(step, model, optimizer, device):
    """Peak tensor bytes during one training step, resident state included."""
    resident = resident_tensors(model, optimizer)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return unique_nbytes(resident) + torch.cuda.max_memory_allocated() - before
    with LiveTensorBytes(resident) as tracker:
        step()
    return unique_nbytes(resident) + tracker.peak


def quantized_flop_share(config, input_ids) -> float:
    """Share of forward FLOPs counted inside quantized modules of the model built from `config`.

    Eager attention, so the score/context matmuls show up as counted ``bmm`` ops; the simulated
    kernel, whose float GEMMs have the layers' shapes (``FlopCounterMode`` has no formula for
    ``torch._int_mm``: under an int8 kernel the quantized layers would count 0).
    """
    model = DistilBertForSequenceClassification(copy.deepcopy(config))
    model.set_attn_implementation("eager")
    model = quantize_model(model.to(input_ids.device).eval(), QuantConfig(kernel="simulated"))
    root = type(model).__name__
    names = {f"{root}.{n}" for n, m in model.named_modules() if isinstance(m, QuantModule)}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids)
    counts = counter.get_flop_counts()
    total = sum(counts["Global"].values())
    return sum(sum(counts[n].values()) for n in names if n in counts) / total


def layer_sweep(args, device, widths=(64, 128, 256, 512, 768, 1024)):
    """Forward + backward of one square Linear (``batch * seq`` rows) per width, fp32 vs simulated
    vs int8 kernels, interleaved medians: the data behind ``kernels.AUTO_MIN_FEATURES``. Written to
    ``benchmarks/results/bench_quant_layer_sweep.json``: per width the fp32 time (s) and each
    kernel's time relative to it."""
    int8_path = int8_gemm_path(device)
    print(f"one Linear(w, w), {args.batch_size * args.seq_len} rows, forward + backward, device {device}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} interleaved repeats, int8 GEMM: {int8_path}")
    rows = []
    for width in widths:
        base = torch.nn.Linear(width, width).to(device)
        layers = {"fp32": base}
        for kernel in ("simulated", "int8", "int8_bf16"):
            layers[kernel] = quantize_model(torch.nn.Sequential(copy.deepcopy(base)), QuantConfig(kernel=kernel))
        x = torch.randn(args.batch_size * args.seq_len, width, device=device, requires_grad=True)
        med = medians(interleaved_times({name: (lambda layer=layer: layer(x).sum().backward())
                                         for name, layer in layers.items()}, args.repeats, args.warmup, device)["wall_s"])
        rows.append({"width": width, "fp32_s": med["fp32"],
                     **{f"{kernel}_ratio": med[kernel] / med["fp32"] for kernel in ("simulated", "int8", "int8_bf16")}})
        print(f"width {width:5d}: fp32 {med['fp32'] * 1e3:7.2f} ms   simulated {med['simulated'] / med['fp32']:.2f}x"
              f"   int8 {med['int8'] / med['fp32']:.2f}x   int8_bf16 {med['int8_bf16'] / med['fp32']:.2f}x fp32")
    results = {"settings": {"rows": args.batch_size * args.seq_len, "repeats": args.repeats, "device": str(device),
                            "threads": torch.get_num_threads(), "int8_gemm": int8_path},
               "widths": rows}
    print(f"wrote {save_results(device_record_name('bench_quant_layer_sweep', device), results)}")


def main(argv=None):
    p = benchmark_parser(__doc__)
    add_step_timing_flags(p)
    p.add_argument("--batch-size", type=POSITIVE, default=8, help="sequences per step (default %(default)s)")
    p.add_argument("--seq-len", type=SEQ_LEN, default=128,
                   help="tokens per sequence (at most DistilBERT's 512 positions; default %(default)s)")
    add_device_flag(p)
    add_threads_flag(p, torch.get_num_threads(),
                     "torch intra-op threads (torch.set_num_threads; default: torch's, here %(default)s)")
    p.add_argument("--layer-sweep", action="store_true", help="time single Linear layers of several widths instead")
    add_default_malloc_flag(p)
    args = p.parse_args(argv)
    check_results_dir(p)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    malloc = malloc_as_trainer(args, device)
    if args.layer_sweep:
        return layer_sweep(args, device)

    torch.manual_seed(0)
    config = DistilBertConfig(num_labels=4)  # DistilBERT-base: 6 layers, dim 768, FFN 3072
    fp32 = DistilBertForSequenceClassification(config).to(device)
    simulated = quantize_model(copy.deepcopy(fp32), QuantConfig(kernel="simulated"))
    int8 = quantize_model(copy.deepcopy(fp32), QuantConfig(kernel="int8"))
    int8_bf16 = quantize_model(copy.deepcopy(fp32), QuantConfig(kernel="int8_bf16"))
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device),
        "labels": torch.randint(0, 4, (args.batch_size,), device=device),
    }
    variants = {}
    for name, model in (("fp32", fp32), ("simulated", simulated), ("int8", int8), ("int8_bf16", int8_bf16)):
        model.train()
        optimizer = trainer_adamw(model)

        def step(model=model, optimizer=optimizer):
            train_step(model, optimizer, lambda: model(**batch).loss)

        variants[name] = {"step": step, "model": model, "optimizer": optimizer}

    print(f"timing {len(variants)} variants, {args.repeats} interleaved repeats ...", file=sys.stderr, flush=True)
    times = interleaved_times({name: v["step"] for name, v in variants.items()}, args.repeats, args.warmup, device)
    for name, v in variants.items():
        v["times"], v["cpu_times"] = times["wall_s"][name], times["cpu_s"][name]
        v["median_s"] = statistics.median(v["times"])
        v["median_cpu_s"] = statistics.median(v["cpu_times"])
        v["peak_bytes"] = peak_step_memory(v["step"], v["model"], v["optimizer"], device)

    f = variants["fp32"]
    share = quantized_flop_share(config, batch["input_ids"])
    fp32_state, int8_state = fp32.state_dict(), export_int8_state_dict(int8)
    fp32_ckpt, int8_ckpt = state_dict_nbytes(fp32_state), state_dict_nbytes(int8_state)
    int8_tables_ckpt = state_dict_nbytes(export_int8_state_dict(int8, embeddings=True))
    layer_weights = [f"{n}.weight" for n, m in int8.named_modules() if isinstance(m, QuantModule)]
    fp32_layers = state_dict_nbytes({k: fp32_state[k] for k in layer_weights})
    int8_layers = state_dict_nbytes({k: int8_state[k] for k in layer_weights})
    mib = 2**20
    load = load_average()
    print(f"DistilBERT-base shape, batch {args.batch_size} x seq {args.seq_len}, AdamW, device {device}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} interleaved repeats, load average {load}, "
          f"malloc {malloc}, int8 GEMM: {int8_gemm_path(device)}")
    rows = [("step time", "median_s", "wall clock, medians")]
    if device.type == "cpu":  # CPU seconds of this process: less sensitive to other load on the machine
        rows.append(("step CPU", "median_cpu_s", "process CPU time, medians"))
    for label, key, note in rows:
        print(f"{label:<11} fp32 {f[key] * 1e3:8.1f} ms" + "".join(
            f"   {n} {v[key] * 1e3:8.1f} ms ({v[key] / f[key]:.2f}x fp32)" for n, v in variants.items() if n != "fp32"
        ) + f"   ({note})")
    print(f"peak memory fp32 {f['peak_bytes'] / mib:8.1f} MiB" + "".join(
        f"   {n} {v['peak_bytes'] / mib:8.1f} MiB ({v['peak_bytes'] / f['peak_bytes']:.2f}x)"
        for n, v in variants.items() if n != "fp32"
    ))
    print(f"checkpoint  fp32 {fp32_ckpt / mib:8.1f} MiB  int8 export {int8_ckpt / mib:6.1f} MiB  "
          f"fp32/int8 {fp32_ckpt / int8_ckpt:.2f}x (embeddings and head stay fp32)")
    print(f"checkpoint  fp32 {fp32_ckpt / mib:8.1f} MiB  int8 export with 8-bit embedding tables "
          f"(embeddings=True) {int8_tables_ckpt / mib:6.1f} MiB  fp32/int8 {fp32_ckpt / int8_tables_ckpt:.2f}x")
    print(f"quantized layers' weights fp32 {fp32_layers / mib:6.1f} MiB  int8 {int8_layers / mib:6.1f} MiB  "
          f"fp32/int8 {fp32_layers / int8_layers:.2f}x")
    print(f"forward FLOPs in quantized layers {share:.1%}; float (attention matmuls, head) {1 - share:.1%}")
    results = {
        "settings": {"batch_size": args.batch_size, "seq_len": args.seq_len, "repeats": args.repeats,
                     "warmup": args.warmup,
                     "device": str(device), "threads": torch.get_num_threads(), "malloc": malloc, "load": load,
                     "int8_gemm": int8_gemm_path(device)},
        "median_s": {n: v["median_s"] for n, v in variants.items()},
        "median_cpu_s": {n: v["median_cpu_s"] for n, v in variants.items()},
        "peak_step_bytes": {n: v["peak_bytes"] for n, v in variants.items()},
        "time_ratio": {n: v["median_s"] / f["median_s"] for n, v in variants.items() if n != "fp32"},
        "checkpoint_bytes": {"fp32": fp32_ckpt, "int8": int8_ckpt, "int8_embeddings": int8_tables_ckpt},
        "quantized_layer_weight_bytes": {"fp32": fp32_layers, "int8": int8_layers},
        "quantized_flop_share": share,
    }
    print(f"wrote {save_results(device_record_name('bench_quant', device), results)}")


if __name__ == "__main__":
    main()
