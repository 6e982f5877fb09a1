"""torchrun worker for tests/test_gossip_distributed.py (a helper script, not a test module).

    torchrun --standalone --nproc_per_node 4 tests/dist_gossip_worker.py equivalence OUT_DIR
    torchrun --standalone --nproc_per_node 3 tests/dist_gossip_worker.py failures OUT_DIR

``equivalence`` runs every configuration of :func:`configs` for a few steps, one node per rank,
and saves each rank's parameters, push-sum weight, bytes and state to ``OUT_DIR``; the test
replays the same runs in the simulated backend and compares. ``failures`` records the errors of
a wrong world size, disagreeing graphs, a silent peer and mismatched send/receive schedules in
``OUT_DIR/failures-<rank>.json``.
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from lp_decentral_nlp.gossip import (
    QSGD, SGP, ChocoSGD, DeepSqueeze, GossipTimeoutError, Quantize, RandomK, TopK, Topology,
    TorchDistributedTransport, make_topology,
)

SHAPES = [(16, 12), (12,), (3, 5, 7), (300,)]
STEPS = 5


def irregular4() -> Topology:
    edges = {0: [1, 2], 1: [2], 2: [3], 3: [0, 1]}
    W = np.zeros((4, 4))
    for i, outs in edges.items():
        W[[i, *outs], i] = 1 / (len(outs) + 1)
    return Topology.from_matrix(W, name="irregular4")


def configs():
    """name -> (topology, factory(topology, transport) -> gossip)."""
    return {
        "sgp-exponential": (make_topology("exponential", 4), lambda t, tr: SGP(t, transport=tr)),
        "choco-topk-directed_ring": (make_topology("directed_ring", 4),
                                     lambda t, tr: ChocoSGD(t, TopK(0.25), gamma=0.3, transport=tr)),
        "choco-quantize8-torus": (make_topology("torus", 4, rows=2, cols=2),
                                  lambda t, tr: ChocoSGD(t, Quantize(8), gamma=0.5, transport=tr)),
        "choco-qsgd-irregular": (irregular4(),
                                 lambda t, tr: ChocoSGD(t, QSGD(8, scaled=True), gamma=0.2, transport=tr, seed=7)),
        "deepsqueeze-randomk8-exponential": (make_topology("exponential", 4),
                                             lambda t, tr: DeepSqueeze(t, RandomK(0.3, value_bits=8), gamma=0.2,
                                                                       transport=tr, seed=3)),
        "deepsqueeze-topk8-ring": (make_topology("ring", 4),
                                   lambda t, tr: DeepSqueeze(t, TopK(0.2, value_bits=8), gamma=0.3, transport=tr)),
        # messages relative to a model every rank holds alike (gossip_reference="initial")
        "choco-topk-ring-reference": (make_topology("ring", 4),
                                      lambda t, tr: ChocoSGD(t, TopK(0.25), gamma=0.3, transport=tr,
                                                             reference=[3 * p for p in initial_params(99)])),
    }


def initial_params(node: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + node)
    return [torch.randn(s, generator=g) for s in SHAPES]


def local_step(params, node: int, t: int) -> None:
    """A deterministic stand-in for an optimiser step, different on every node."""
    for p in params:
        p.sub_(0.05 * torch.sin(p * (node + 1) + t))


def run(gossip, nodes) -> list[list[int]]:
    """STEPS iterations (local step, gossip step) on the local nodes; returns bytes_sent per step."""
    sent = []
    for t in range(STEPS):
        for params, i in zip(nodes, gossip.node_ids):
            local_step(params, i, t)
        sent.append(gossip.step(nodes).bytes_sent)
    return sent


def equivalence(out_dir: str) -> None:
    rank = dist.get_rank()
    for name, (topo, make) in configs().items():
        gossip = make(topo, TorchDistributedTransport(timeout=120))
        nodes = [initial_params(rank)]
        sent = run(gossip, nodes)
        torch.save({"params": nodes[0], "weights": gossip.weights, "bytes": sent,
                    "state": gossip.state_dict()}, os.path.join(out_dir, f"{name}-{rank}.pt"))


def failures(out_dir: str) -> None:
    """Three ranks: wrong world size, disagreeing graphs, a silent peer, mismatched schedules."""
    rank = dist.get_rank()
    # The schedule-mismatch case leaves unmatched messages behind: give it its own group.
    schedule_group = dist.new_group([0, 1, 2])
    report = {}
    try:
        SGP(make_topology("ring", 4), transport=TorchDistributedTransport(timeout=5))
    except ValueError as exc:
        report["world_size"] = str(exc)

    # Pre-flight: every rank has a complete 3-node graph, rank 2 with other weights.
    W = np.full((3, 3), 1 / 3) if rank < 2 else np.array([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])
    gossip = SGP(Topology.from_matrix(W), transport=TorchDistributedTransport(timeout=30))
    try:
        gossip.step([initial_params(rank)])
    except ValueError as exc:
        report["preflight"] = str(exc)
        report["preflight_error"] = [type(exc).__name__, getattr(exc, "peer", None)]
    # Rank 2 with another gamma, parameter dtype, or shapes of the same sizes: the setting is named.
    ring = make_topology("ring", 3)
    mismatches = {"gamma": (ChocoSGD, {"gamma": 0.3 if rank < 2 else 0.4}, torch.float32, False),
                  # another initial model on rank 2 (gossip_reference="initial")
                  "reference": (ChocoSGD, {"gamma": 0.3, "reference": initial_params(7 if rank < 2 else 8)},
                                torch.float32, False),
                  "dtype": (SGP, {}, torch.float32 if rank < 2 else torch.bfloat16, False),
                  "shapes": (SGP, {}, torch.float32, rank == 2)}
    for case, (algorithm, kwargs, dtype, transposed) in mismatches.items():
        params = [p.to(dtype).t().contiguous() if transposed and p.dim() == 2 else p.to(dtype)
                  for p in initial_params(rank)]
        try:
            algorithm(ring, transport=TorchDistributedTransport(timeout=30), **kwargs).step([params])
        except ValueError as exc:
            report[f"preflight_{case}"] = str(exc)

    # A silent peer: one good step together on the directed ring 0 -> 1 -> 2 -> 0, then only
    # rank 0 calls step() again and waits for rank 2.
    timeout = 5.0  # the first, joint step must also fit in it on a loaded machine
    gossip = SGP(make_topology("directed_ring", 3), transport=TorchDistributedTransport(timeout=timeout))
    params = [initial_params(rank)]
    gossip.step(params)
    start = time.monotonic()
    if rank == 0:
        try:
            gossip.step(params)
        except GossipTimeoutError as exc:
            report["timeout"] = str(exc)
            report["timeout_peer"] = exc.peer
            report["waited_s"] = time.monotonic() - start
    # everyone (silent ranks included) waits until well after rank 0 gave up, then goes on together
    time.sleep(max(0.0, start + timeout + 4 - time.monotonic()))

    # Mismatched schedules: rank 0 builds the ring 0 -> 1 -> 2 -> 0, ranks 1 and 2 the reverse.
    # Rank 0 gives up first (a timed-out gloo pair may be closed, so the others may see that instead).
    ring = make_topology("directed_ring", 3)
    topo = ring if rank == 0 else Topology.from_matrix(ring.mixing_matrix().T.contiguous())
    gossip = SGP(topo, transport=TorchDistributedTransport(timeout=5 if rank == 0 else 10, group=schedule_group))
    try:
        gossip.step([initial_params(rank)])
    except (GossipTimeoutError, ValueError, RuntimeError) as exc:
        report["schedule"] = str(exc)

    with open(os.path.join(out_dir, f"failures-{rank}.json.tmp"), "w") as f:
        json.dump(report, f)
    os.replace(os.path.join(out_dir, f"failures-{rank}.json.tmp"), os.path.join(out_dir, f"failures-{rank}.json"))
    # Stay alive until every rank has its report (a rank that exits closes its peers' connections),
    # then skip the process group's teardown: unmatched sends to silent peers are still posted.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(out_dir, f"failures-{r}.json")) for r in range(dist.get_world_size())):
        time.sleep(0.2)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    {"equivalence": equivalence, "failures": failures}[mode](out)
    dist.destroy_process_group()
