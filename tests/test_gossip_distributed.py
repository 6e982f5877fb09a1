"""The torch.distributed backend under torchrun (gloo): same numbers as the simulation, clear failures.

Each test launches ``torchrun`` as a subprocess (bounded by a subprocess timeout) running
``tests/dist_gossip_worker.py``.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import dist_gossip_worker as worker

from lp_decentral_nlp.gossip import SGP, make_topology

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(__file__).resolve().parent / "dist_gossip_worker.py"


def torchrun(nproc: int, mode: str, out_dir: pathlib.Path, timeout: float = 300) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKER), mode, str(out_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_gossip")
    torchrun(4, "equivalence", out)
    return out


def simulate(name):
    topo, make = worker.configs()[name]
    gossip = make(topo, None)
    nodes = [worker.initial_params(i) for i in range(topo.num_nodes)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' reduction order
    try:
        sent = worker.run(gossip, nodes)
    finally:
        torch.set_num_threads(threads)
    return gossip, nodes, sent


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(worker.configs()))
def test_simulated_and_distributed_backends_give_the_same_results(distributed_runs, name):
    gossip, nodes, sent = simulate(name)
    sim_state = gossip.state_dict()
    for rank in range(4):
        got = torch.load(distributed_runs / f"{name}-{rank}.pt")
        for p_dist, p_sim in zip(got["params"], nodes[rank]):
            torch.testing.assert_close(p_dist, p_sim, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["weights"], gossip.weights[rank:rank + 1], rtol=1e-6, atol=1e-7)
        assert [b[0] for b in got["bytes"]] == [b[rank] for b in sent]
        # the rank's state rows are the simulation's rows of the same nodes
        state = got["state"]
        assert state["node_ids"].tolist() == [rank]
        buffers = [key for key in sim_state if f"{key}_nodes" in sim_state]  # state_dict's row-keyed buffers
        assert sorted(buffers) == sorted(key for key in state if f"{key}_nodes" in state)
        for key in buffers:
            rows = state[f"{key}_nodes"].tolist()
            assert rank in rows
            torch.testing.assert_close(state[key], sim_state[key][rows], rtol=1e-5, atol=1e-6)
        assert int(state["step"]) == worker.STEPS


@pytest.mark.distributed
def test_misconfiguration_and_a_silent_peer_fail_with_errors_naming_the_peer(tmp_path):
    torchrun(3, "failures", tmp_path, timeout=180)
    r = [json.loads((tmp_path / f"failures-{rank}.json").read_text()) for rank in range(3)]
    for report in r:
        assert "3 ranks but the topology has 4 nodes" in report["world_size"]
    # different mixing weights on rank 2: caught by the pre-flight handshake on every edge to it
    assert "rank 0: pre-flight check before step 0 failed: rank 2 disagrees on the topology" in r[0]["preflight"]
    assert "rank 1: pre-flight check before step 0 failed: rank 2 disagrees on the topology" in r[1]["preflight"]
    assert "rank 2: pre-flight check before step 0 failed: rank 0 disagrees on the topology" in r[2]["preflight"]
    assert [report["preflight_error"] for report in r] == [["GossipMismatchError", 2], ["GossipMismatchError", 2],
                                                          ["GossipMismatchError", 0]]
    # a setting that differs is named with this rank's value (the shapes hold as many elements)
    assert "rank 2 disagrees on the gamma (this rank's gamma: 0.3)" in r[0]["preflight_gamma"]
    assert "rank 0 disagrees on the gamma (this rank's gamma: 0.4)" in r[2]["preflight_gamma"]
    assert "rank 2 disagrees on the reference (this rank's reference: '" in r[0]["preflight_reference"]
    assert "rank 2 disagrees on the parameter dtype (this rank's parameter dtype: torch.float32)" in r[1]["preflight_dtype"]
    assert "rank 2 disagrees on the parameter shapes" in r[0]["preflight_shapes"]
    # a peer that stops gossiping: a timeout naming it, not a hang
    assert "rank 0: gossip step 1: timed out after 5 s receiving from rank 2" in r[0]["timeout"]
    assert r[0]["timeout_peer"] == 2 and r[0]["waited_s"] < 60
    # send/receive schedules that do not match: the pre-flight names the peer that never sends
    assert "rank 0: pre-flight check before step 0: timed out after 5 s receiving from rank 2" in r[0]["schedule"]
    # rank 2 waits for rank 0 longer; gloo closes rank 0's timed-out pair, either way rank 0 is named
    assert "rank 2: pre-flight check before step 0:" in r[2]["schedule"]
    assert "receiving from rank 0" in r[2]["schedule"]


@pytest.mark.parametrize("broken", ["isend", "irecv"])
def test_a_connection_already_closed_when_posting_names_the_peer(monkeypatch, broken):
    """gloo raises while *posting* an op on a pair whose peer has exited (the race the dead-peer test
    can hit): the error is a GossipPeerError naming that peer, like a failure while waiting. Rank 3
    of 4 on a directed ring (process group calls stood in for): its first step's pre-flight posts."""
    from lp_decentral_nlp.gossip.transport import GossipPeerError, TorchDistributedTransport

    for name, value in (("is_available", True), ("is_initialized", True), ("get_world_size", 4), ("get_rank", 3),
                        ("get_backend", "gloo")):
        monkeypatch.setattr(torch.distributed, name, lambda *args, value=value, **kwargs: value)

    def closed(tensor, dst_or_src, group=None):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:12345")

    posted = []

    def fine(tensor, dst_or_src, group=None):
        posted.append(dst_or_src)
        return None

    monkeypatch.setattr(torch.distributed, "isend", closed if broken == "isend" else fine)
    monkeypatch.setattr(torch.distributed, "irecv", closed if broken == "irecv" else fine)
    gossip = SGP(make_topology("directed_ring", 4), transport=TorchDistributedTransport(timeout=5))
    assert gossip.node_ids == [3]
    peer = 0 if broken == "isend" else 2  # rank 3 of a directed ring sends to 0, receives from 2
    doing = "sending to" if broken == "isend" else "receiving from"
    with pytest.raises(GossipPeerError, match=f"rank 3: pre-flight check before step 0: {doing} "
                                              f"rank {peer} failed .*Connection closed") as info:
        gossip.step([[torch.zeros(4)]])
    assert info.value.peer == peer
    assert posted == ([] if broken == "isend" else [0])  # sends are posted first


@pytest.mark.parametrize("collective", ["gather", "sum", "barrier", "gather_objects"])
def test_a_collective_broken_by_an_exited_rank_is_a_peer_error(monkeypatch, collective):
    """A rank that never exchanges gossip with the one that died (rank 3 of a directed ring, whose
    only in-neighbour is rank 2) meets the loss in a collective of every rank (the logging gather,
    the averaged model's sum): a CollectiveError, a GossipPeerError, which the trainer gives the
    checkpoint to resume from, not gloo's bare RuntimeError (process group calls stood in for)."""
    from lp_decentral_nlp.gossip import GossipPeerError
    from lp_decentral_nlp.trainer import CollectiveError, NodeGroup

    for name, value in (("is_available", True), ("is_initialized", True), ("get_world_size", 4), ("get_rank", 3),
                        ("get_backend", "gloo")):
        monkeypatch.setattr(torch.distributed, name, lambda *args, value=value, **kwargs: value)

    def closed(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13726\nmore")

    for name in ("all_gather", "all_reduce", "barrier", "all_gather_object"):
        monkeypatch.setattr(torch.distributed, name, closed)
    group = NodeGroup(4, "distributed")
    call = {"gather": lambda: group.gather(torch.zeros(1)), "sum": lambda: group.sum([[torch.zeros(2)]]),
            "barrier": group.barrier, "gather_objects": lambda: group.gather_objects("x")}[collective]
    with pytest.raises(CollectiveError, match=r"^rank 3: .* with every rank failed \(has another rank exited or "
                                              r"stopped answering\?\): \[\.\./gloo/transport/tcp/pair\.cc:553\] "
                                              r"Connection closed by peer \[127\.0\.0\.1\]:13726$") as info:
        call()
    assert isinstance(info.value, GossipPeerError) and info.value.peer is None
