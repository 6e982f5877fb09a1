"""fp32 vs 8-bit (SPEC 4) training step of a DistilBERT-base-shaped model, side by side.

Measures, in one process and on the same inputs:

* step time (forward + backward + AdamW step), fp32 and 8-bit steps interleaved, median of
  ``--repeats``; on the CPU also the process CPU time per step, which other jobs sharing the
  machine disturb far less than the wall clock;
* peak tensor memory of one step: live tensor bytes (parameters, buffers, optimizer state and
  everything allocated during the step), from CUDA's allocator statistics on a GPU and from a
  dispatch-mode tracker of tensor storages on the CPU;
* the share of forward FLOPs run by the quantized layers (the rest -- attention score/context
  matmuls and the classification head -- stays float);
* the checkpoint size, fp32 state dict vs ``export_int8_state_dict``.

    python benchmarks/bench_quant.py                 # default: ~2-3 minutes on 2 CPU cores
    python benchmarks/bench_quant.py --repeats 20    # tighter medians
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from lp_decentral_nlp import QuantConfig, export_int8_state_dict, quantize_model
from lp_decentral_nlp.quant import QuantModule
from lp_decentral_nlp.quant.export import state_dict_nbytes


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while active, on top of a given set of existing ones.

    Each new storage is counted once (views share it) and uncounted when it is freed.
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
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
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

    Eager attention, so the score/context matmuls show up as counted ``bmm`` ops.
    """
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    model = quantize_model(DistilBertForSequenceClassification(config).to(input_ids.device).eval())
    root = type(model).__name__
    names = {f"{root}.{n}" for n, m in model.named_modules() if isinstance(m, QuantModule)}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids)
    counts = counter.get_flop_counts()
    total = sum(counts["Global"].values())
    return sum(sum(counts[n].values()) for n in names if n in counts) / total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for name in ("repeats", "warmup", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = torch.device(args.device)

    torch.manual_seed(0)
    config = DistilBertConfig(num_labels=4)  # DistilBERT-base: 6 layers, dim 768, FFN 3072
    fp32 = DistilBertForSequenceClassification(config).to(device)
    int8 = quantize_model(copy.deepcopy(fp32), QuantConfig())
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device),
        "labels": torch.randint(0, 4, (args.batch_size,), device=device),
    }
    variants = {}
    for name, model in (("fp32", fp32), ("8-bit", int8)):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)

        def step(model=model, optimizer=optimizer):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        variants[name] = {"step": step, "model": model, "optimizer": optimizer, "times": [], "cpu_times": []}

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.repeats):  # interleaved: both variants see the same machine load
        for v in variants.values():
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            v["step"]()
            sync()
            v["times"].append(time.perf_counter() - start)
            v["cpu_times"].append(time.process_time() - cpu_start)
    for v in variants.values():
        v["median_s"] = statistics.median(v["times"])
        v["median_cpu_s"] = statistics.median(v["cpu_times"])
        v["peak_bytes"] = peak_step_memory(v["step"], v["model"], v["optimizer"], device)

    f, q = variants["fp32"], variants["8-bit"]
    share = quantized_flop_share(config, batch["input_ids"])
    fp32_state, int8_state = fp32.state_dict(), export_int8_state_dict(int8)
    fp32_ckpt, int8_ckpt = state_dict_nbytes(fp32_state), state_dict_nbytes(int8_state)
    layer_weights = [f"{n}.weight" for n, m in int8.named_modules() if isinstance(m, QuantModule)]
    fp32_layers = state_dict_nbytes({k: fp32_state[k] for k in layer_weights})
    int8_layers = state_dict_nbytes({k: int8_state[k] for k in layer_weights})
    mib = 2**20
    print(f"DistilBERT-base shape, batch {args.batch_size} x seq {args.seq_len}, AdamW, device {device}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} interleaved repeats")
    print(f"step time   fp32 {f['median_s'] * 1e3:8.1f} ms   8-bit {q['median_s'] * 1e3:8.1f} ms   "
          f"8-bit/fp32 {q['median_s'] / f['median_s']:.2f}x (wall clock, medians)")
    if device.type == "cpu":  # CPU seconds of this process: less sensitive to other load on the machine
        print(f"step CPU    fp32 {f['median_cpu_s'] * 1e3:8.1f} ms   8-bit {q['median_cpu_s'] * 1e3:8.1f} ms   "
              f"8-bit/fp32 {q['median_cpu_s'] / f['median_cpu_s']:.2f}x (process CPU time, medians)")
    print(f"peak memory fp32 {f['peak_bytes'] / mib:8.1f} MiB  8-bit {q['peak_bytes'] / mib:8.1f} MiB  "
          f"8-bit/fp32 {q['peak_bytes'] / f['peak_bytes']:.2f}x")
    print(f"checkpoint  fp32 {fp32_ckpt / mib:8.1f} MiB  int8 export {int8_ckpt / mib:6.1f} MiB  "
          f"fp32/int8 {fp32_ckpt / int8_ckpt:.2f}x (embeddings and head stay fp32)")
    print(f"quantized layers' weights fp32 {fp32_layers / mib:6.1f} MiB  int8 {int8_layers / mib:6.1f} MiB  "
          f"fp32/int8 {fp32_layers / int8_layers:.2f}x")
    print(f"forward FLOPs in quantized layers {share:.1%}; float (attention matmuls, head) {1 - share:.1%}")


if __name__ == "__main__":
    main()
