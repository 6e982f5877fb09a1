"""QGM with Adam/AdamW (SPEC 2 "Quasi-global momentum"): the quasi-global buffer is Adam's first
moment, the second moment stays local."""
import math

import pytest
import torch

from lp_decentral_nlp.gossip import QuasiGlobalAdam, QuasiGlobalMomentum

SHAPES = [(3, 4), (5,)]


def quadratic_grads(params, target):
    return [p - b for p, b in zip(params, target)]  # gradient of 1/2 ||z - b||^2


@pytest.mark.parametrize("weight_decay", [0.0, 0.1, [0.1, 0.0]])
def test_a_lone_node_runs_plain_adam_and_adamw(weight_decay):
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    target = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    mine = [p.clone() for p in start]
    reference = [torch.nn.Parameter(p.clone()) for p in start]
    decays = weight_decay if isinstance(weight_decay, list) else [weight_decay] * len(SHAPES)
    groups = [{"params": [p], "weight_decay": d} for p, d in zip(reference, decays)]  # e.g. no decay on biases
    optimizer = torch.optim.AdamW(groups, lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    qg = QuasiGlobalAdam([mine], betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    for _ in range(20):
        qg.begin_iteration()
        qg.step(0, quadratic_grads(mine, target), lr=0.05)
        qg.end_iteration(lr=0.05)  # no gossip: the whole model change is the local step
        for p, b in zip(reference, target):
            p.grad = (p.detach() - b)
        optimizer.step()
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b.detach(), rtol=1e-9, atol=1e-11)


def test_with_gossip_the_first_moment_moves_toward_the_whole_model_change_and_the_second_stays_local():
    """Two nodes averaging after every local step, against a hand-written reference."""
    lr, beta1, beta2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.01
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(6, generator=g, dtype=torch.float64) for _ in range(2)]
    nodes = [[torch.zeros(6, dtype=torch.float64)] for _ in range(2)]
    qg = QuasiGlobalAdam(nodes, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    z = [torch.zeros(6, dtype=torch.float64) for _ in range(2)]  # the reference
    m = [torch.zeros(6, dtype=torch.float64) for _ in range(2)]
    v = [torch.zeros(6, dtype=torch.float64) for _ in range(2)]
    for c in range(1, 8):
        qg.begin_iteration()
        for k in range(2):
            qg.step(k, [nodes[k][0] - targets[k]], lr=lr)
        mean = (nodes[0][0] + nodes[1][0]) / 2
        for k in range(2):
            nodes[k][0].copy_(mean)  # the gossip step: exact averaging
        qg.end_iteration(lr=lr)

        before = [zk.clone() for zk in z]
        stepped = []
        for k in range(2):
            grad = z[k] - targets[k]
            v[k] = beta2 * v[k] + (1 - beta2) * grad**2
            m[k] = beta1 * m[k] + (1 - beta1) * grad  # Adam's first moment
            denom = (v[k] / (1 - beta2**c)).sqrt() + eps
            stepped.append(z[k] - lr * wd * z[k] - lr * m[k] / (1 - beta1**c) / denom)
        z = [(stepped[0] + stepped[1]) / 2] * 2
        for k in range(2):
            denom = (v[k] / (1 - beta2**c)).sqrt() + eps
            implied = (1 - beta1**c) * denom * ((before[k] - z[k]) / lr - wd * before[k])
            m[k] = beta1 * m[k] + (1 - beta1) * implied  # the whole change enters with weight 1 - beta1
        for k in range(2):
            torch.testing.assert_close(nodes[k][0], z[k], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(qg.exp_avg[k][0], m[k], rtol=1e-7, atol=1e-9)
            torch.testing.assert_close(qg.exp_avg_sq[k][0], v[k], rtol=1e-12, atol=0)
    # the buffers differ from local Adam's: node 0's m carries node 1's pull
    assert not math.isclose(qg.exp_avg[0][0].norm().item(), qg.exp_avg[1][0].norm().item())


def test_a_node_that_skips_keeps_its_moments_and_state_round_trips():
    nodes = [[torch.ones(4)], [torch.ones(4)]]
    qg = QuasiGlobalAdam(nodes)
    qg.begin_iteration()
    qg.step(0, [torch.full((4,), 0.5)], lr=0.1)
    qg.end_iteration(lr=0.1)
    assert torch.equal(qg.exp_avg[1][0], torch.zeros(4)) and torch.equal(nodes[1][0], torch.ones(4))
    saved = qg.state_dict()
    other = QuasiGlobalAdam([[torch.ones(4)], [torch.ones(4)]])
    other.load_state_dict(saved)
    assert other.state_dict()["steps"] == [1, 0]
    assert torch.equal(other.exp_avg[0][0], qg.exp_avg[0][0])
    with pytest.raises(ValueError, match="betas"):
        QuasiGlobalAdam([[torch.ones(4)], [torch.ones(4)]], betas=(0.5, 0.9)).load_state_dict(saved)
    with pytest.raises(ValueError, match="weight_decay must be"):
        QuasiGlobalAdam(nodes, weight_decay=[0.1, 0.1])
    with pytest.raises(ValueError, match="betas must be"):
        QuasiGlobalAdam(nodes, betas=(1.0, 0.9))
    with pytest.raises(RuntimeError, match="begin_iteration"):
        QuasiGlobalAdam(nodes).step(0, [torch.ones(4)], lr=0.1)


def test_gradients_of_the_wrong_kind_are_refused_before_any_state_changes():
    """int64 gradients failed inside the update after v and the step count had changed."""
    nodes = [[torch.ones(4)], [torch.ones(4)]]
    qgm = QuasiGlobalAdam(nodes)
    qgm.begin_iteration()
    before = qgm.state_dict()
    before = {k: [[t.clone() for t in node] for node in v] if k in ("exp_avg", "exp_avg_sq") else v
              for k, v in before.items()}
    for grads, message in (([torch.ones(4, dtype=torch.int64)], r"^grads\[0\] must be a floating-point tensor of "
                                                                 r"shape \(4,\), got torch.int64 of shape \(4,\)$"),
                           ([torch.ones(3)], r"^grads\[0\] must be a floating-point tensor of shape \(4,\), got "
                                             r"torch.float32 of shape \(3,\)$"),
                           (torch.ones(4), r"^grads must hold 1 tensors \(one per parameter\), got Tensor$")):
        with pytest.raises(ValueError, match=message):
            qgm.step(0, grads, lr=0.1)
    after = qgm.state_dict()
    assert after["steps"] == before["steps"]
    assert all(torch.equal(a, b) for k in ("exp_avg", "exp_avg_sq") for x, y in zip(after[k], before[k])
               for a, b in zip(x, y))
    assert torch.equal(nodes[0][0], torch.ones(4))


@pytest.mark.parametrize("cls", [QuasiGlobalMomentum, QuasiGlobalAdam])
def test_nodes_the_momentum_cannot_hold_are_refused_at_construction(cls):
    """Nodes of different shapes and an empty node were accepted; integer tensors failed at the first
    end_iteration (a dtype cast error) and a list of numbers with zeros_like's TypeError."""
    for nodes, error, message in (
            ([[torch.zeros(3)], [torch.zeros(4)]], ValueError, r"^nodes\[1\] holds tensors of shapes \[\(4,\)\], "
                                                               r"nodes\[0\] of \[\(3,\)\]: every node must hold"),
            ([[torch.zeros(3, dtype=torch.long)]], TypeError, r"^nodes\[0\]\[0\] must be a floating-point tensor, got "
                                                              r"a torch.int64 tensor$"),
            ([[1.0]], TypeError, r"^nodes\[0\]\[0\] must be a floating-point tensor, got float$"),
            ([[torch.zeros(3)], []], ValueError, r"^nodes\[1\] must be a non-empty list of tensors$"),
            ([], ValueError, r"^nodes must hold at least one node's parameter list, got none$")):
        with pytest.raises(error, match=message):
            cls(nodes)


def test_quasi_global_momentum_refuses_to_skip_a_node_it_does_not_hold():
    """skip=[7] of one local node was ignored in silence."""
    qgm = QuasiGlobalMomentum([[torch.zeros(3)], [torch.zeros(3)]])
    qgm.begin_iteration()
    with pytest.raises(ValueError, match=r"^node must be a local node index in \[0, 1\], got 7$"):
        qgm.end_iteration(0.1, skip=[7])
