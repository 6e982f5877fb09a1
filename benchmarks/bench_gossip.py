"""Gossip engine speed for DistilBERT-sized models on 8 simulated nodes.

    python benchmarks/bench_gossip.py --threads 1     # about 3 minutes on a 2-core CPU
    python benchmarks/bench_gossip.py --passes 3 --rounds 2

On a machine shared with other busy processes, pass ``--threads 1``: with more OpenMP threads
than free cores, torch's parallel kernels wait on descheduled threads, and both the local steps
and the gossip steps get several times slower and erratic. The load average is printed.
Like the trainer on the CPU (``tune_cpu_malloc``), the benchmark keeps freed memory for the next
step (:func:`lp_decentral_nlp.utils.cpu_malloc.keep_freed_memory`); ``--default-malloc`` measures under
glibc's default policy, where the training round's steps and large codec buffers page-fault their
memory in again every time.

1. Gossip step: one ``gossip.step(nodes)`` of 8 nodes on a directed ring, each node holding
   DistilBERT's 104 parameter tensors (66.96M parameters, real shapes), per algorithm/compressor.
   Configurations are run one after the other in every pass (only one holds memory at a time);
   the median over passes is reported, with the bytes each node sends.
2. Compression throughput: encoding and decoding one node's parameters (GB/s of fp32 input).
3. Training round: 8 DistilBERT replicas each doing forward + backward + Adam on a batch of
   8 x 128 tokens, then one gossip step. Reports the measured share of the gossip step in the
   round (for the configuration given by ``--round-config``) and, for every configuration, the
   share its step time from part 1 would take in a round with the measured local steps.

Everything is measured in the same process, so the ratios are side by side.
"""
from __future__ import annotations

import copy
import gc
import os
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from lp_decentral_nlp.commands import Range, add_default_malloc_flag, add_threads_flag, ranged
from lp_decentral_nlp.utils.cpu_malloc import keep_freed_memory
from lp_decentral_nlp.gossip import (
    QSGD, SGP, ChocoSGD, DeepSqueeze, Identity, Quantize, RandomK, TopK, make_topology,
)
from lp_decentral_nlp.gossip import Message, MessageLayout
from record import benchmark_parser, check_results_dir, load_average, save_results

NUM_NODES = 8

CONFIGS = {
    "SGP (fp32, exact)": lambda t: SGP(t),
    "Choco Quantize(8)": lambda t: ChocoSGD(t, Quantize(8), gamma=1.0),
    "Choco TopK(1%)": lambda t: ChocoSGD(t, TopK(0.01), gamma=0.01),
    "Choco TopK(1%, 8-bit values)": lambda t: ChocoSGD(t, TopK(0.01, value_bits=8), gamma=0.01),
    "Choco RandomK(1%)": lambda t: ChocoSGD(t, RandomK(0.01), gamma=0.01),
    "Choco QSGD(16, scaled)": lambda t: ChocoSGD(t, QSGD(16, scaled=True), gamma=0.1),
    "DeepSqueeze TopK(1%)": lambda t: DeepSqueeze(t, TopK(0.01), gamma=0.01),
}
COMPRESSORS = {
    "Identity": Identity(), "Quantize(8)": Quantize(8), "TopK(1%)": TopK(0.01),
    "TopK(1%, 8-bit values)": TopK(0.01, value_bits=8), "RandomK(1%)": RandomK(0.01), "QSGD(16)": QSGD(16),
}


def distilbert() -> DistilBertForSequenceClassification:
    torch.manual_seed(0)
    return DistilBertForSequenceClassification(DistilBertConfig(num_labels=4))


def gossip_steps(shapes, passes: int) -> dict[str, dict]:
    """Part 1: median time of one 8-node gossip step per configuration."""
    topo = make_topology("directed_ring", NUM_NODES)
    results = {name: {"times": []} for name in CONFIGS}
    progress = tqdm(total=passes * len(CONFIGS), desc="part 1: gossip steps", unit="step", file=sys.stderr)
    for _ in range(passes):
        for name, make in CONFIGS.items():
            progress.set_postfix_str(name)
            nodes = [[torch.randn(s) * 0.05 for s in shapes] for _ in range(NUM_NODES)]
            gossip = make(topo)
            stats = gossip.step(nodes)  # first step: allocation of buffers and state
            start = time.perf_counter()
            gossip.step(nodes)
            results[name]["times"].append(time.perf_counter() - start)
            results[name]["message_bytes"] = stats.message_bytes
            del nodes, gossip
            gc.collect()
            progress.update()
    progress.close()
    for r in results.values():
        r["median"] = statistics.median(r["times"])
    return results


def throughput(shapes, passes: int) -> dict[str, tuple[float, float]]:
    """Part 2: encode and decode GB/s (fp32 input bytes / time) for one node's parameters."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    total = sum(numels)
    x = torch.randn(total) * 0.05
    work = torch.zeros(total)  # resident, like the engine's reused scratch (a fresh buffer page-faults in its first user)
    target = torch.zeros(total)
    times = {name: ([], []) for name in COMPRESSORS}
    for _ in range(passes):
        for name, comp in COMPRESSORS.items():
            segs, off = [], 0
            for n in (numels if comp.layerwise else [total]):
                segs.append((off, n))
                off += n
            msg = Message(MessageLayout([comp.fields(n, x.dtype) for _, n in segs]), x.device)
            gen = torch.Generator().manual_seed(0) if comp.stochastic else None
            start = time.perf_counter()
            for (o, n), fields in zip(segs, msg.fields):
                comp.encode(x[o:o + n], fields, work[o:o + n], gen)
            mid = time.perf_counter()
            for (o, n), fields in zip(segs, msg.fields):
                comp.decode_add(fields, target[o:o + n], 0.5, work[o:o + n])
            end = time.perf_counter()
            times[name][0].append(mid - start)
            times[name][1].append(end - mid)
    gb = 4 * total / 1e9
    return {name: (gb / statistics.median(enc), gb / statistics.median(dec)) for name, (enc, dec) in times.items()}


def training_round(config: str, rounds: int) -> dict:
    """Part 3: 8 local DistilBERT steps (batch 8 x 128, Adam) + one gossip step per round."""
    base = distilbert()
    models = [copy.deepcopy(base) for _ in range(NUM_NODES)]
    del base
    optims = [torch.optim.Adam(m.parameters(), lr=3e-5, betas=(0.9, 0.9), weight_decay=1e-4) for m in models]
    nodes = [[p.detach() for p in m.parameters()] for m in models]
    gossip = CONFIGS[config](make_topology("directed_ring", NUM_NODES))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 30522, (8, 128), generator=gen), torch.randint(0, 4, (8,), generator=gen))
               for _ in range(NUM_NODES)]

    def local_step(k):
        ids, labels = batches[k]
        loss = models[k](input_ids=ids, labels=labels).loss
        loss.backward()
        optims[k].step()
        optims[k].zero_grad(set_to_none=True)

    local_step(0)  # warm-up (kernels, allocator); node 0's Adam state exists from here on
    gossip.step(nodes)  # allocation of the gossip state
    local, gossip_times, rounds_s = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for k in range(NUM_NODES):
            t0 = time.perf_counter()
            local_step(k)
            local.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gossip.step(nodes)
        gossip_times.append(time.perf_counter() - t0)
        rounds_s.append(time.perf_counter() - start)
    return {"local_median": statistics.median(local), "gossip": statistics.median(gossip_times),
            "round": statistics.median(rounds_s)}


ROUND_CONFIG = "Choco TopK(1%, 8-bit values)"  # part 3's default: the headline recipe's gossip


def main():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--passes", type=ranged(int, Range(1)), default=2,
                        help="passes over the configurations in parts 1-2 (default 2)")
    parser.add_argument("--rounds", type=ranged(int, Range(1)), default=1, help="timed training rounds in part 3 (default 1)")
    parser.add_argument("--round-config", default=ROUND_CONFIG, choices=list(CONFIGS), metavar="CONFIG",
                        help=(f"the gossip configuration of part 3's training round, one of part 1's "
                              f"({', '.join(repr(name) for name in CONFIGS)}; default {ROUND_CONFIG!r})"
                              ).replace("%", "%%"))  # argparse formats help with %
    parser.add_argument("--skip-round", action="store_true", help="skip part 3 (the training round)")
    add_threads_flag(parser, None, "torch intra-op threads (default: torch's)")
    add_default_malloc_flag(parser)
    args = parser.parse_args()
    check_results_dir(parser)
    if args.skip_round:  # part 3's own flags would be ignored
        for flag in filter(None, (parser.flag_given("rounds", sys.argv[1:]),
                                  parser.flag_given("round_config", sys.argv[1:]))):
            parser.error(f"argument {flag}: a setting of part 3, which --skip-round skips: drop one of them")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    malloc = "glibc default"
    if not args.default_malloc and keep_freed_memory():
        malloc = "freed memory kept"

    shapes = [tuple(p.shape) for p in distilbert().parameters()]
    params = sum(int(torch.Size(s).numel()) for s in shapes)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
          f"{load_average()}; DistilBERT: {len(shapes)} tensors, {params / 1e6:.2f}M parameters; "
          f"{NUM_NODES} nodes, directed ring; malloc: {malloc}\n")

    steps = gossip_steps(shapes, args.passes)
    fp32_bytes = 4 * (params + 1)
    print(f"1. One simulated gossip step, {NUM_NODES} nodes (median of {args.passes})")
    print("| configuration | step (s) | per node (s) | bytes sent per node | vs fp32 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in steps.items():
        print(f"| {name} | {r['median']:.2f} | {r['median'] / NUM_NODES:.3f} | {r['message_bytes']:,} | "
              f"{fp32_bytes / r['message_bytes']:.1f}x fewer bytes |")

    results = {
        "setup": {"nodes": NUM_NODES, "graph": "directed_ring", "tensors": len(shapes), "parameters": params,
                  "torch_threads": torch.get_num_threads(), "malloc": malloc, "passes": args.passes},
        "gossip_step": [{"configuration": name, "step_s": r["median"], "per_node_s": r["median"] / NUM_NODES,
                         "bytes_per_node": r["message_bytes"],
                         "fewer_bytes_than_fp32": fp32_bytes / r["message_bytes"], "times_s": r["times"]} for name, r in steps.items()],
    }
    tp = throughput(shapes, args.passes)
    print(f"\n2. Compression throughput, one node ({params / 1e6:.1f}M fp32 parameters, median of {args.passes})")
    print("| compressor | encode (GB/s) | decode+add (GB/s) |")
    print("| --- | ---: | ---: |")
    for name, (enc, dec) in tp.items():
        print(f"| {name} | {enc:.2f} | {dec:.2f} |")
    results["throughput"] = [{"compressor": name, "encode_gb_s": enc, "decode_add_gb_s": dec}
                             for name, (enc, dec) in tp.items()]

    if args.skip_round:
        print(f"results: {save_results('bench_gossip', results)}")
        return
    gc.collect()
    rnd = training_round(args.round_config, args.rounds)
    local_round = NUM_NODES * rnd["local_median"]
    print(f"\n3. Training round: {NUM_NODES} x DistilBERT forward+backward+Adam (batch 8, seq 128) + gossip")
    print(f"local step per node (median): {rnd['local_median']:.2f} s; round with {args.round_config}: "
          f"{rnd['round']:.1f} s, of which gossip {rnd['gossip']:.2f} s = {100 * rnd['gossip'] / rnd['round']:.1f}%")
    print("| configuration | gossip step (s) | share of round (8 local steps + gossip) |")
    print("| --- | ---: | ---: |")
    for name, r in steps.items():
        print(f"| {name} | {r['median']:.2f} | {100 * r['median'] / (local_round + r['median']):.1f}% |")
    print(f"\nload average at the end: {load_average()}")
    results["training_round"] = {"configuration": args.round_config, "rounds": args.rounds,
                                 "local_step_s": rnd["local_median"], "round_s": rnd["round"],
                                 "gossip_s": rnd["gossip"], "gossip_share": rnd["gossip"] / rnd["round"]}
    results["round_share"] = [{"configuration": name, "gossip_step_s": r["median"],
                               "share_of_round": r["median"] / (local_round + r["median"])}
                              for name, r in steps.items()]
    print(f"results: {save_results('bench_gossip', results)}")


if __name__ == "__main__":
    main()
