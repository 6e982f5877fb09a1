"""Exact push-sum (SPEC 2 step 1): the local update goes into the numerator unscaled, so where the
push-sum weights differ from 1 (irregular digraphs, lost messages) decentralized gradient descent
still minimises the unweighted mean loss ``1/n sum_i f_i``, for every algorithm."""
import pytest
import torch
from helpers import irregular_digraph

from lp_decentral_nlp.gossip import SGP, ChocoSGD, DeepSqueeze, FaultPlan, TopK, average_model, make_topology

SHAPES = [(6, 4), (5,)]

ALGORITHMS = {
    "sgp": lambda topo, faults: SGP(topo, faults=faults),
    "choco": lambda topo, faults: ChocoSGD(topo, gamma=1.0, faults=faults),
    "deepsqueeze": lambda topo, faults: DeepSqueeze(topo, gamma=1.0, faults=faults),
    "choco-topk10": lambda topo, faults: ChocoSGD(topo, TopK(0.1), gamma=0.3, faults=faults),
}


def flat(params) -> torch.Tensor:
    return torch.cat([p.flatten() for p in params])


def descend_quadratics(gossip, steps, lr):
    """Node i minimises f_i(z) = 1/2 ||z - b_i||^2 by plain SGD (step ``lr(t)``) and gossips after
    every step; all nodes start from 0. Returns (mean_i z_i, mean_i b_i, push-sum weights)."""
    n = gossip.topology.num_nodes
    g = torch.Generator().manual_seed(0)
    targets = [[torch.randn(s, generator=g, dtype=torch.float64) + i for s in SHAPES] for i in range(n)]
    nodes = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(n)]
    spread = []
    for t in range(steps):
        for params, b in zip(nodes, targets):
            for z, b_part in zip(params, b):
                z.sub_(lr(t) * (z - b_part))  # gradient of f_i at z_i is z_i - b_i
        gossip.step(nodes)
        spread.append((gossip.weights.max() - gossip.weights.min()).item())
    return flat(average_model(nodes)), flat(average_model(targets)), max(spread)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_on_an_irregular_digraph_the_nodes_minimise_the_unweighted_mean_loss(name):
    gossip = ALGORITHMS[name](irregular_digraph(), None)
    mean_z, mean_b, weight_spread = descend_quadratics(gossip, steps=400, lr=lambda t: 0.2)
    assert weight_spread > 0.5  # push-sum weights really differ from 1 on this graph (0.71 .. 1.43)
    # scaling the update by w_i would converge to the w-weighted mean of b_i, 7% away here
    assert (mean_z - mean_b).norm() <= 1e-3 * mean_b.norm()


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_with_lost_messages_the_nodes_minimise_the_unweighted_mean_loss(name):
    gossip = ALGORITHMS[name](make_topology("directed_ring", 5), FaultPlan(drop_prob=0.3, seed=1))
    mean_z, mean_b, _ = descend_quadratics(gossip, steps=1200, lr=lambda t: 0.2 / (1 + t / 10))
    assert (mean_z - mean_b).norm() <= 1e-3 * mean_b.norm()


def nudge(nodes, t):
    for i, params in enumerate(nodes):
        for p in params:
            p.sub_(0.05 * torch.sin(p * (i + 1) + t))


def test_per_node_checkpoints_keep_the_written_models_and_resume_exactly():
    make = lambda: DeepSqueeze(irregular_digraph(), TopK(0.3), gamma=0.5)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    nodes = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(5)]
    gossip = make()
    for t in range(3):
        nudge(nodes, t)
        gossip.step(nodes)
    parts = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in gossip.node_state_dict(i).items()}
             for i in range(5)]
    assert parts[2]["written_nodes"].tolist() == [2]
    assert torch.equal(parts[2]["written"][0], flat(nodes[2]))  # z_2 as the engine wrote it back
    again = [[p.clone() for p in params] for params in nodes]
    for t in range(3, 6):
        nudge(nodes, t)
        gossip.step(nodes)
    resumed = make()
    resumed.load_node_state_dicts(parts)
    for t in range(3, 6):
        nudge(again, t)
        resumed.step(again)
    assert all(torch.equal(a, b) for pa, pb in zip(nodes, again) for a, b in zip(pa, pb))

    without = {k: v for k, v in gossip.state_dict().items() if not k.startswith("written")}
    with pytest.raises(ValueError, match="no 'written' rows"):
        make().load_state_dict(without)


def test_while_every_weight_is_1_no_written_models_are_kept():
    gossip = ChocoSGD(make_topology("directed_ring", 4), TopK(0.5), gamma=0.5)
    gossip.step([[torch.randn(s) for s in SHAPES] for _ in range(4)])
    assert torch.equal(gossip.weights, torch.ones(4)) and "written" not in gossip.state_dict()


@pytest.mark.parametrize("algorithm", [ChocoSGD, DeepSqueeze])
def test_tensors_that_cannot_take_their_own_update_are_refused_before_anything_is_written(algorithm):
    """A tensor listed twice in a node (a tied weight from state_dict()) took every update twice: both
    algorithms diverged 1e44-fold in 200 steps, silently. An inference tensor or an expand() view
    failed with torch's RuntimeError in the middle of the step, after other nodes were written."""
    topo = make_topology("ring", 4)
    shared = [torch.randn(6, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(ValueError, match=r"^nodes\[0\]\[0\] and nodes\[0\]\[1\] share memory \(a tied weight listed "
                                         r"twice\?\)"):
        algorithm(topo).step([[t, t] for t in shared])
    with torch.inference_mode():
        frozen = torch.randn(6, dtype=torch.float64)
    for bad, message in ((frozen, r"^nodes\[3\]\[0\] is an inference tensor"),
                         (torch.randn(1, dtype=torch.float64).expand(6), r"^nodes\[3\]\[0\] is a view that holds one "
                                                                         r"entry at several places")):
        nodes = [[torch.randn(6, dtype=torch.float64)] for _ in range(3)] + [[bad]]
        before = [node[0].clone() for node in nodes]
        with pytest.raises(ValueError, match=message):
            algorithm(topo).step(nodes)
        assert all(torch.equal(node[0], b) for node, b in zip(nodes, before))  # nothing was written
    matrix = torch.randn(4, 6, dtype=torch.float64)  # rows of one matrix, one per node; halves of one tensor in a node
    halves = torch.randn(12, dtype=torch.float64)
    algorithm(topo).step([[matrix[0]], [matrix[1]], [matrix[2]], [matrix[3]]])
    algorithm(topo).step([[halves[:6], torch.randn(6, dtype=torch.float64)]] +
                         [[torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)] for _ in range(3)])
