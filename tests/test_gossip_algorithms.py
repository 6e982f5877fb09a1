"""Push-sum gossip algorithms in the simulated backend (SPEC 1-2)."""
import gc
import math
import threading

import pytest
import torch
from helpers import irregular_digraph

from lp_decentral_nlp.gossip import (
    QSGD, SGP, ChocoSGD, Compressor, DeepSqueeze, FaultPlan, Identity, MessageLayout, Quantize, QuasiGlobalMomentum,
    RandomK, SimulatedTransport, TopK, TorchDistributedTransport, average_model, build_gossip, consensus_distance,
    make_topology,
)

SHAPES = [(12, 10), (10,), (3, 4, 5), (300,)]
P = sum(math.prod(s) for s in SHAPES)



def make_nodes(n, seed=0, shapes=SHAPES, dtype=torch.float32):
    nodes = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 * seed + i)
        nodes.append([torch.randn(s, generator=g, dtype=dtype) for s in shapes])
    return nodes


def local_step(nodes, t):
    """A deterministic stand-in for an optimiser step (different on every node)."""
    for i, params in enumerate(nodes):
        for p in params:
            p.sub_(0.05 * torch.sin(p * (i + 1) + t))


def push_sum_mass(gossip, nodes) -> torch.Tensor:
    """sum_i w_i z_i, flattened, in float64."""
    w = gossip.weights.double()
    return sum(w[i] * torch.cat([p.double().flatten() for p in params]) for i, params in enumerate(nodes))


def flat(params) -> torch.Tensor:
    return torch.cat([p.double().flatten() for p in params])


def clone(nodes):
    return [[p.clone() for p in params] for params in nodes]


def max_diff(a, b):
    return max((x - y).abs().max().item() for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def test_sgp_push_sum_debiases_to_the_exact_average_on_a_directed_irregular_graph():
    topo = irregular_digraph()
    nodes = make_nodes(5)
    avg = average_model(nodes)
    gossip = SGP(topo)
    for _ in range(300):
        gossip.step(nodes)
    w = gossip.weights
    assert w.sum().item() == pytest.approx(5.0, abs=1e-5)
    assert w.max() - w.min() > 0.2  # push-sum weights really differ on this graph
    for params in nodes:
        for p, a in zip(params, avg):
            torch.testing.assert_close(p, a, atol=2e-6, rtol=0)


def test_one_sgp_step_is_the_push_sum_product_with_W():
    topo = irregular_digraph()
    W = topo.mixing_matrix(0)  # W[i, j]: weight node i gives to what it receives from j
    nodes = make_nodes(5)
    X = torch.stack([torch.cat([p.double().flatten() for p in params]) for params in nodes])
    gossip = SGP(topo)
    gossip.step(nodes)
    w = W @ torch.ones(5, dtype=torch.float64)
    Z = torch.stack([torch.cat([p.double().flatten() for p in params]) for params in nodes])
    torch.testing.assert_close(gossip.weights.double(), w, atol=1e-6, rtol=0)
    torch.testing.assert_close(Z, (W @ X) / w[:, None], atol=1e-5, rtol=0)


def test_exponential_graph_averages_exactly_in_one_period():
    nodes = make_nodes(8)
    avg = average_model(nodes)
    gossip = SGP(make_topology("exponential", 8))
    for _ in range(3):
        gossip.step(nodes)
    assert max_diff(nodes, [avg] * 8) < 1e-6


@pytest.mark.parametrize("topo", [irregular_digraph(), make_topology("torus", 6, rows=2, cols=3)], ids=repr)
def test_choco_and_deepsqueeze_without_compression_and_gamma_1_equal_sgp(topo):
    runs = {}
    for name, gossip in (("sgp", SGP(topo)), ("choco", ChocoSGD(topo, Identity(), gamma=1.0)),
                         ("deepsqueeze", DeepSqueeze(topo, Identity(), gamma=1.0))):
        nodes = make_nodes(topo.num_nodes)
        trace = []
        for t in range(12):
            local_step(nodes, t)
            gossip.step(nodes)
            trace.append((clone(nodes), gossip.weights))
        runs[name] = trace
    for other in ("choco", "deepsqueeze"):
        for (nodes_a, w_a), (nodes_b, w_b) in zip(runs["sgp"], runs[other]):
            assert max_diff(nodes_a, nodes_b) < 1e-5
            torch.testing.assert_close(w_a, w_b, atol=1e-6, rtol=0)


def test_deepsqueeze_equals_sgp_on_a_time_varying_graph():
    topo = make_topology("exponential", 6)
    a, b = make_nodes(6), make_nodes(6)
    sgp, ds = SGP(topo), DeepSqueeze(topo)
    for t in range(7):
        local_step(a, t), local_step(b, t)
        sgp.step(a), ds.step(b)
        assert max_diff(a, b) < 1e-5


ALGORITHMS = {
    "sgp": lambda topo: SGP(topo),
    "choco-top10%": lambda topo: ChocoSGD(topo, TopK(0.1), gamma=0.3),
    "choco-top10%-8bit": lambda topo: ChocoSGD(topo, TopK(0.1, value_bits=8), gamma=0.3),
    "choco-quantize8": lambda topo: ChocoSGD(topo, Quantize(8), gamma=0.8),
    "choco-qsgd": lambda topo: ChocoSGD(topo, QSGD(8, scaled=True), gamma=0.2),
    "choco-randomk": lambda topo: ChocoSGD(topo, RandomK(0.2), gamma=0.1),
    "deepsqueeze-top10%": lambda topo: DeepSqueeze(topo, TopK(0.1), gamma=0.2),
    "deepsqueeze-randomk-8bit": lambda topo: DeepSqueeze(topo, RandomK(0.2, value_bits=8), gamma=0.1),
    "deepsqueeze-quantize4": lambda topo: DeepSqueeze(topo, Quantize(4), gamma=0.5),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_gossip_step_conserves_push_sum_mass(name):
    topo = irregular_digraph()
    gossip = ALGORITHMS[name](topo)
    nodes = make_nodes(5)
    for t in range(15):
        written = clone(nodes)
        local_step(nodes, t)  # changes the mass by sum_i delta_i, unscaled (SPEC 2 step 1); gossip must not
        before = push_sum_mass(gossip, written) + sum(flat(z) - flat(z0) for z, z0 in zip(nodes, written))
        gossip.step(nodes)
        after = push_sum_mass(gossip, nodes)
        # float32 rounding of O(1) values over a few terms; a mixing bug moves the mass by O(0.1)
        assert (after - before).abs().max().item() < 1e-5
        assert gossip.weights.sum().item() == pytest.approx(5.0, abs=1e-5)


@pytest.mark.parametrize("name,topo,steps", [
    ("sgp", make_topology("directed_ring", 8), 400),
    ("choco", make_topology("directed_ring", 8), 400),
    ("deepsqueeze", make_topology("directed_ring", 8), 400),
    ("choco", irregular_digraph(), 400),
    ("deepsqueeze", make_topology("exponential", 8), 60),
    ("choco-quantize8", make_topology("ring", 6), 400),
])
def test_with_zero_gradients_models_converge_to_the_exact_initial_average(name, topo, steps):
    make = {"sgp": lambda: SGP(topo), "choco": lambda: ChocoSGD(topo, gamma=0.7),
            "deepsqueeze": lambda: DeepSqueeze(topo, gamma=0.6),
            # Choco sends differences, which shrink: 8-bit payloads still give the exact average
            "choco-quantize8": lambda: ChocoSGD(topo, Quantize(8), gamma=1.0)}[name]
    gossip = make()
    nodes = make_nodes(topo.num_nodes)
    avg = average_model(nodes)
    for _ in range(steps):
        gossip.step(nodes)
    assert max_diff(nodes, [avg] * topo.num_nodes) < 1e-5


def test_choco_with_top_1_percent_and_gamma_001_still_reaches_consensus():
    topo = make_topology("directed_ring", 4)
    shapes = [(20, 10), (10,), (300,)]  # k = 2, 1, 3 entries per step
    nodes = make_nodes(4, shapes=shapes)
    avg = average_model(nodes)
    start = consensus_distance(nodes).item()
    gossip = ChocoSGD(topo, TopK(0.01), gamma=0.01)
    for _ in range(3000):
        stats = gossip.step(nodes)
    assert consensus_distance(nodes).item() < 1e-8 * start
    assert max_diff(nodes, [avg] * 4) < 1e-4
    assert stats.message_bytes == (2 + 1 + 3) * (4 + 1) + 3 * 1 + 4  # fp32 values + uint8/uint16 indices + w


def test_deepsqueeze_with_8_bit_payloads_reaches_consensus_within_the_quantizer_step():
    # Deep-Squeeze sends whole (error-compensated) models, so its 8-bit grid does not shrink.
    topo = make_topology("directed_ring", 8)
    nodes = make_nodes(8)
    start = consensus_distance(nodes).item()
    gossip = DeepSqueeze(topo, Quantize(8), gamma=0.5)
    for _ in range(300):
        gossip.step(nodes)
    grid = 8.0 / 255  # value range of the models ~ [-4, 4]
    assert consensus_distance(nodes).item() < 1e-5 * start
    assert consensus_distance(nodes).item() / P < grid**2


@pytest.mark.parametrize("topo,fanout", [(make_topology("complete", 4), 3), (make_topology("directed_ring", 4), 1),
                                         (make_topology("exponential", 4), 1), (irregular_digraph(), None)])
def test_bytes_sent_is_the_encoded_message_length_times_out_degree(topo, fanout):
    class RecordingTransport(SimulatedTransport):
        """Records the length of every buffer handed to the transport (what a real one sends)."""

        def __init__(self):
            self.buffer_bytes = []

        def exchange(self, step, outgoing):
            self.buffer_bytes += [m.buffer.numel() for m in outgoing.values()]
            return super().exchange(step, outgoing)

    transport = RecordingTransport()
    gossip = (ChocoSGD(topo, TopK(0.1), gamma=0.5, transport=transport) if topo.period == 1
              else DeepSqueeze(topo, TopK(0.1), transport=transport))
    nodes = make_nodes(topo.num_nodes)
    stats = gossip.step(nodes)
    ks = [12, 1, 6, 30]  # ceil(0.1 * numel); indices uint8 except the 300-entry tensor (uint16)
    expected = sum(k * 4 for k in ks) + 12 + 1 + 6 + 30 * 2 + 4
    assert stats.message_bytes == expected
    assert transport.buffer_bytes == [expected] * topo.num_nodes  # what the transport sends
    outs = [len(topo.out_neighbors(i, 0)) for i in range(topo.num_nodes)]
    assert stats.bytes_sent == [expected * (fanout or o) for o in outs]
    sgp = SGP(topo).step(make_nodes(topo.num_nodes))
    assert sgp.message_bytes == 4 * (P + 1)


def test_float64_models_gossip_in_float64():
    topo = make_topology("ring", 3)
    nodes = make_nodes(3, dtype=torch.float64)
    avg = average_model(nodes)
    gossip = SGP(topo)
    for _ in range(80):
        stats = gossip.step(nodes)
    assert stats.message_bytes == 8 * (P + 1)
    assert max_diff(nodes, [avg] * 3) < 1e-12


@pytest.mark.parametrize("make", [lambda t: ChocoSGD(t, TopK(0.2), gamma=0.4),
                                  lambda t: DeepSqueeze(t, RandomK(0.3, value_bits=8), gamma=0.3),
                                  lambda t: ChocoSGD(t, QSGD(4, scaled=True), gamma=0.1)])
def test_state_dict_resume_reproduces_the_uninterrupted_run(make):
    topo = irregular_digraph()
    nodes = make_nodes(5)
    gossip = make(topo)
    for t in range(4):
        local_step(nodes, t)
        gossip.step(nodes)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in gossip.state_dict().items()}
    at_save = clone(nodes)
    for t in range(4, 8):
        local_step(nodes, t)
        gossip.step(nodes)

    resumed = make(topo)
    resumed.load_state_dict(saved)  # before its first step
    again = clone(at_save)
    for t in range(4, 8):
        local_step(again, t)
        resumed.step(again)
    assert max_diff(nodes, again) == 0
    assert torch.equal(resumed.weights, gossip.weights)
    assert resumed.num_steps == 8
    gossip.load_state_dict(saved)  # into a running object
    assert gossip.num_steps == 4 and torch.equal(gossip.weights, saved["weights"])


class ScaledSign(Compressor):
    """A codec of one's own, by the base class's interface: the signs (one int8 each) times the
    mean magnitude (one float32)."""

    def __init__(self, shrink=1.0):
        self.shrink = shrink

    def fields(self, numel, dtype):
        return [("signs", torch.int8, numel), ("scale", torch.float32, 1)]

    def encode(self, x, out, work, generator):
        out["signs"].copy_(torch.sign(x))
        out["scale"].fill_(float(x.abs().mean()) * self.shrink)

    def decode_add(self, msg, target, alpha, work):
        target.add_(msg["signs"].to(target.dtype) * msg["scale"].to(target.dtype), alpha=alpha)


def test_a_codec_of_ones_own_is_counted_by_its_fields_and_resumes_by_its_settings():
    """The default repr held the object's address, so its state_dict never loaded into a new
    engine (and ranks could not agree on it); and without gamma the error said it must be one of
    the library's compressors."""
    topo = make_topology("directed_ring", 4)
    with pytest.raises(ValueError, match=r"^compressor ScaledSign is not one of this library's .*: pass the consensus "
                                         r"step gamma in \(0, 1\]"):
        ChocoSGD(topo, ScaledSign())
    assert repr(ScaledSign(0.5)) == "ScaledSign(shrink=0.5)"
    cached = ScaledSign(0.5)
    cached._scratch = torch.Generator()  # private state (a cache, a generator) is no part of its identity
    assert repr(cached) == "ScaledSign(shrink=0.5)"
    nodes = make_nodes(4)
    gossip = ChocoSGD(topo, ScaledSign(), gamma=0.2)
    stats = gossip.step(nodes)
    assert stats.message_bytes == sum(math.prod(s) + 4 for s in SHAPES) + 4  # + the push-sum weight
    saved = gossip.state_dict()
    resumed = ChocoSGD(topo, ScaledSign(), gamma=0.2)
    resumed.load_state_dict(saved)
    again = clone(nodes)
    assert max_diff(nodes, again) == 0
    gossip.step(nodes)
    resumed.step(again)
    assert max_diff(nodes, again) == 0
    with pytest.raises(ValueError, match=r"state_dict is for 'ChocoSGD\(compressor=ScaledSign\(shrink=1\.0\)"):
        ChocoSGD(topo, ScaledSign(0.5), gamma=0.2).load_state_dict(saved)


def test_state_dict_rows_are_labelled_by_node():
    gossip = ChocoSGD(make_topology("directed_ring", 3), TopK(0.5), gamma=0.5)
    assert set(gossip.state_dict()) == {"step", "node_ids", "weights", "config", "topology"}
    gossip.step(make_nodes(3))
    sd = gossip.state_dict()
    assert sd["public"].shape == (3, P + 1) and sd["public_nodes"].tolist() == [0, 1, 2]
    assert int(sd["step"]) == 1
    with pytest.raises(ValueError, match="state_dict is for"):
        DeepSqueeze(make_topology("directed_ring", 3)).load_state_dict(sd)


def test_a_state_of_another_graph_or_no_state_at_all_is_refused():
    """A Choco state of a ring loaded into a Choco of a directed ring without complaint, and None
    or a dict without weights gave an AttributeError or a KeyError."""
    gossip = ChocoSGD(make_topology("ring", 4), TopK(0.5), gamma=0.5)
    gossip.step(make_nodes(4))
    sd = gossip.state_dict()
    other = ChocoSGD(make_topology("directed_ring", 4), TopK(0.5), gamma=0.5)
    with pytest.raises(ValueError, match=r"^state_dict is for the graph \"Topology\('ring', num_nodes=4, period=1\) "
                                         r"#[0-9a-f]+\", this object has \"Topology\('directed_ring'"):
        other.load_state_dict(sd)
    parts = [gossip.node_state_dict(i) for i in range(4)]
    with pytest.raises(ValueError, match=r"^state_dict is for the graph"):
        other.load_node_state_dicts(parts)
    ChocoSGD(make_topology("ring", 4), TopK(0.5), gamma=0.5).load_node_state_dicts(parts)  # the same graph
    older = {k: v for k, v in sd.items() if k != "topology"}  # saved before the graph was recorded
    ChocoSGD(make_topology("ring", 4), TopK(0.5), gamma=0.5).load_state_dict(older)
    with pytest.raises(TypeError, match=r"^state_dict must be a dict from state_dict\(\), got NoneType$"):
        other.load_state_dict(None)
    with pytest.raises(ValueError, match=r"^state_dict lacks \['weights'\]: it is not a state_dict\(\) of a gossip"):
        other.load_state_dict({k: v for k, v in sd.items() if k != "weights"})


def state_bytes(gossip, stats) -> int:
    """What a gossip object demonstrably holds after a step: its state buffers (``state_dict``),
    one outgoing message per local node and two ``(P + 1,)`` float32 work vectors."""
    buffers = sum(v.numel() * v.element_size() for k, v in gossip.state_dict().items()
                  if isinstance(v, torch.Tensor) and v.dim() == 2)
    return buffers + len(gossip.node_ids) * stats.message_bytes + 2 * (P + 1) * 4


@pytest.mark.parametrize("make", [
    lambda: ChocoSGD(make_topology("ring", 5), TopK(0.1), gamma=0.5),
    lambda: DeepSqueeze(make_topology("exponential", 8), QSGD(4, scaled=True), gamma=0.5),
    lambda: SGP(make_topology("complete", 3)),
    lambda: DeepSqueeze(irregular_digraph(), Identity(), gamma=1.0),  # push-sum weights leave 1: "written" kept
    lambda: DeepSqueeze(make_topology("directed_ring", 4), RandomK(0.2), gamma=0.5,
                        faults=FaultPlan(drop_prob=0.3, seed=1)),
    # stragglers only delay: no weight leaves 1, no "written" (it was counted anyway)
    lambda: ChocoSGD(make_topology("ring", 4), TopK(0.2), gamma=0.5, faults=FaultPlan(stragglers=((1, 1e-4),))),
], ids=["choco", "deepsqueeze", "sgp", "irregular", "lost-messages", "stragglers"])
def test_memory_bytes_is_what_the_gossip_holds_after_stepping(make):
    gossip = make()
    n = gossip.topology.num_nodes
    before = gossip.memory_bytes([torch.empty(s, device="meta") for s in SHAPES])
    for t in range(6):
        stats = gossip.step(make_nodes(n, seed=t))
    assert before == state_bytes(gossip, stats)


def test_a_rank_counts_its_own_state_and_its_receive_buffers():
    topo = make_topology("ring", 5)  # two in-neighbours per node
    params = [torch.empty(s, device="meta") for s in SHAPES]
    rank = DeepSqueeze(topo, TopK(0.1), gamma=0.5, transport=RankTwoOfFour())
    stats = DeepSqueeze(topo, TopK(0.1), gamma=0.5).step(make_nodes(5))
    assert rank.memory_bytes(params) == (1 + 2) * (P + 1) * 4 + stats.message_bytes  # its error row, work vectors
    layout = MessageLayout([[("values", torch.float32, 10)], [("weight", torch.float32, 1)]])
    assert TorchDistributedTransport().memory_bytes(topo, layout, [2]) == 2 * 44  # one message per in-neighbour


class RankTwoOfFour(SimulatedTransport):
    """Holds node 2 only, as rank 2 of the distributed backend would (no exchange needed here)."""

    def node_ids(self, num_nodes):
        return [2]


def test_a_simulated_checkpoint_loads_into_one_rank_by_node_id():
    topo = make_topology("directed_ring", 4)
    sim = ChocoSGD(topo, TopK(0.3), gamma=0.5)
    for t in range(3):
        sim.step(make_nodes(4, seed=t))
    saved = sim.state_dict()
    rank = ChocoSGD(topo, TopK(0.3), gamma=0.5, transport=RankTwoOfFour())
    rank.load_state_dict(saved)
    mine = rank.state_dict()
    assert mine["node_ids"].tolist() == [2] and mine["public_nodes"].tolist() == [1, 2]  # itself + in-neighbour
    torch.testing.assert_close(mine["public"], saved["public"][[1, 2]])
    torch.testing.assert_close(rank.weights, saved["weights"][[2]])
    assert rank.num_steps == 3


def test_bad_inputs_are_rejected_with_clear_errors():
    ring = make_topology("ring", 3)
    with pytest.raises(ValueError, match="static topology"):
        ChocoSGD(make_topology("exponential", 8), TopK(0.1), gamma=0.1)
    with pytest.raises(ValueError, match="gamma"):
        ChocoSGD(ring, gamma=0)
    with pytest.raises(ValueError, match="gamma"):
        DeepSqueeze(ring, gamma=1.5)
    with pytest.raises(TypeError, match="compressor"):
        ChocoSGD(ring, compressor="topk")
    with pytest.raises(TypeError, match="topology"):
        SGP("ring")
    with pytest.raises(TypeError, match="topology must be a Topology"):
        ChocoSGD("ring")  # was an AttributeError on str.period
    with pytest.raises(TypeError, match="positional argument"):
        SGP(ring, TopK(0.1))  # SGP has no compressor: it took it for the transport
    with pytest.raises(ValueError, match=r"ChocoSGD needs a contraction, and QSGD\(levels=4, scaled=False, bucket_size=1024\) is none"):
        ChocoSGD(ring, QSGD(4, scaled=False), gamma=0.1)
    with pytest.raises(TypeError, match="config must be a GossipConfig, got dict"):
        build_gossip({"num_nodes": 3})
    for summary in (average_model, consensus_distance):
        with pytest.raises(ValueError, match="at least one node"):
            summary([])
        # were torch's "Tensor list must have at least one tensor", a broadcasting error, and
        # "Boolean value of Tensor ... is ambiguous"
        with pytest.raises(ValueError, match=r"^nodes\[0\] must be a non-empty list of tensors$"):
            summary([[]])
        with pytest.raises(ValueError, match=r"^nodes\[1\] holds tensors of shapes \[\(3,\)\], nodes\[0\] of "
                                             r"\[\(2,\)\]: every node must hold the same model, in the same order$"):
            summary([[torch.zeros(2)], [torch.zeros(3)]])
        with pytest.raises(TypeError, match=r"^nodes\[0\]\[0\] must be a floating-point tensor, got a torch.int64 "
                                            r"tensor$"):  # was "result type Float can't be cast"
            summary([[torch.zeros(2, dtype=torch.long)]] * 2)
        with pytest.raises(TypeError, match=r"^nodes must be a list of parameter lists \(one per node\), got Tensor$"):
            summary(torch.zeros(2, 3))
    gossip = SGP(ring)
    with pytest.raises(ValueError, match=r"list of 3 parameter lists \(one per simulated node\), got list of length 2$"):
        gossip.step(make_nodes(2))
    with pytest.MonkeyPatch.context() as env:  # one rank of a launcher's 3 that forgot the transport
        env.setenv("WORLD_SIZE", "3")
        with pytest.raises(ValueError, match=r"got list of length 1; under a launcher, one node per process: build "
                                             r"the gossip with transport=TorchDistributedTransport\(\)$"):
            gossip.step(make_nodes(1))
    bad = make_nodes(3)
    bad[1][0] = torch.randn(5)
    with pytest.raises(ValueError, match="shapes"):
        gossip.step(bad)
    mixed = make_nodes(3)
    mixed[2][1] = mixed[2][1].double()
    with pytest.raises(ValueError, match="dtype"):
        SGP(ring).step(mixed)
    ints = [[torch.ones(3, dtype=torch.int64)] for _ in range(3)]
    with pytest.raises(ValueError, match="floating"):
        SGP(ring).step(ints)


def test_gossip_updates_trainer_parameters_in_place_under_autograd():
    models = [torch.nn.Linear(4, 3) for _ in range(3)]
    nodes = [list(m.parameters()) for m in models]  # leaf tensors with requires_grad
    ids = [id(p) for p in nodes[0]]
    SGP(make_topology("complete", 3)).step(nodes)
    assert [id(p) for p in models[0].parameters()] == ids
    torch.testing.assert_close(models[0].weight, models[1].weight)


def test_consensus_distance_and_average_model():
    nodes = [[torch.zeros(2)], [torch.tensor([2.0, 0.0])]]
    torch.testing.assert_close(average_model(nodes)[0], torch.tensor([1.0, 0.0]))
    assert consensus_distance(nodes).item() == pytest.approx(1.0)


def test_quasi_global_momentum_follows_spec_2():
    beta, lr = 0.8, 0.1
    nodes = make_nodes(1, shapes=[(3,)]) * 2  # SPEC 1: every node starts from the same weights
    nodes = clone(nodes)
    qgm = QuasiGlobalMomentum(nodes, beta=beta)
    gossip = SGP(make_topology("complete", 2))
    grads = [[torch.ones(3)], [2 * torch.ones(3)]]
    for it in range(3):
        before = clone(nodes)
        m_before = [[m.clone() for m in ms] for ms in qgm.momentum]
        qgm.begin_iteration()
        d = [[g.clone() for g in gs] for gs in grads]
        for k in range(2):
            qgm.add_momentum(k, d[k])
            torch.testing.assert_close(d[k][0], grads[k][0] + beta * m_before[k][0])  # d = grad + beta m
            nodes[k][0].sub_(lr * d[k][0])
        gossip.step(nodes)
        qgm.end_iteration(lr)
        for k in range(2):
            expected = beta * m_before[k][0] + (1 - beta) * (before[k][0] - nodes[k][0]) / lr
            torch.testing.assert_close(qgm.momentum[k][0], expected)
    # the buffer is quasi-global: with exact averaging, both nodes' buffers follow the averaged change
    torch.testing.assert_close(qgm.momentum[0][0], qgm.momentum[1][0])
    assert not torch.allclose(qgm.momentum[0][0], grads[0][0])
    state = qgm.state_dict()
    other = QuasiGlobalMomentum(make_nodes(2, shapes=[(3,)]), beta=beta)
    other.load_state_dict(state)
    torch.testing.assert_close(other.momentum[1][0], qgm.momentum[1][0])
    with pytest.raises(RuntimeError, match="begin_iteration"):
        qgm.end_iteration(lr)
    with pytest.raises(ValueError, match=r"node must be a local node index in \[0, 1\], got 2"):
        qgm.add_momentum(2, grads[0])
    with pytest.raises(ValueError, match="grads must hold 1 tensors"):
        qgm.add_momentum(0, grads[0] * 2)
    with pytest.raises(ValueError, match="beta"):
        QuasiGlobalMomentum(nodes, beta=1.0)


@pytest.mark.parametrize("make", [
    lambda topo: ChocoSGD(topo, TopK(0.1), gamma=0.5),
    lambda topo: DeepSqueeze(topo, TopK(0.05, value_bits=8), gamma=0.3),
    lambda topo: ChocoSGD(topo, RandomK(0.2), gamma=0.4),  # stochastic: encodes in order
])
def test_segments_on_the_thread_pool_give_exactly_the_sequential_results(make):
    shapes = [(300, 400), (64,), (400, 300), (5,), (1000, 500), (77, 3)]  # the big ones take the bracket top-k
    topo = make_topology("directed_ring", num_nodes=4)
    runs = []
    threads = torch.get_num_threads()
    for n_threads in (1, 3):
        torch.set_num_threads(n_threads)
        try:
            gossip, nodes = make(topo), make_nodes(4, shapes=shapes)
            for t in range(3):
                local_step(nodes, t)
                sent = gossip.step(nodes).bytes_sent
        finally:
            torch.set_num_threads(threads)
        runs.append((nodes, gossip.weights, sent))
    (a, wa, sa), (b, wb, sb) = runs
    assert sa == sb and torch.equal(wa, wb)
    for pa, pb in zip(a, b):
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)


def test_choco_update_in_column_chunks_equals_the_whole_tensor_update_exactly():
    """Choco's CPU update runs in column chunks of all nodes at once (about 2**18 entries a chunk:
    large tensors split, small ones grouped); non-contiguous parameters cannot be split and take
    whole tensors. Every entry gets the same operations in the same order either way, so the
    results are bit-identical. The (700, 401) tensor (280,700 entries) is split mid-row."""
    shapes = [(30, 40), (64,), (700, 401), (5,), (100, 50), (7, 3)]
    topo = irregular_digraph()
    runs = []
    for contiguous in (True, False):
        nodes = make_nodes(topo.num_nodes, shapes=shapes)
        if not contiguous:  # the same values, held as transposed views
            nodes = [[p.t().contiguous().t() if p.dim() == 2 else p for p in params] for params in nodes]
            assert not all(p.is_contiguous() for p in nodes[0])
        gossip = ChocoSGD(topo, TopK(0.2), gamma=0.6)
        for t in range(3):
            local_step(nodes, t)
            gossip.step(nodes)
        assert not torch.equal(gossip.weights, torch.ones(topo.num_nodes))  # the update rescales too
        runs.append((nodes, gossip.weights))
    (a, wa), (b, wb) = runs
    assert torch.equal(wa, wb)
    assert all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def segment_workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gossip-segments")]


def test_the_segment_pool_belongs_to_the_gossip_object_and_leaves_nothing_behind():
    """The pool that encodes the tensors concurrently is started by the object's first step,
    shut down by close(), by leaving a with block, or by garbage collection; the caller's torch
    thread count is never changed."""
    shapes = [(30, 40), (64,), (40, 30), (5,)]
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        before = set(segment_workers())
        with ChocoSGD(make_topology("ring", 3), TopK(0.2), gamma=0.5) as gossip:
            gossip.step(make_nodes(3, shapes=shapes))
            assert torch.get_num_threads() == 3
            assert len(set(segment_workers()) - before) == 3
        assert set(segment_workers()) == before
        gossip.step(make_nodes(3, shapes=shapes))  # usable after close: a new pool
        assert len(set(segment_workers()) - before) == 3
        gossip.close()
        gossip.close()  # idempotent
        assert set(segment_workers()) == before

        dropped = DeepSqueeze(make_topology("ring", 3), TopK(0.2), gamma=0.5)
        dropped.step(make_nodes(3, shapes=shapes))
        assert len(set(segment_workers()) - before) == 3
        del dropped
        gc.collect()
        for worker in set(segment_workers()) - before:
            worker.join(timeout=30)
        assert set(segment_workers()) == before
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("compressor", [TopK(0.3), TopK(0.1, value_bits=8), Quantize(8), Identity()])
def test_choco_on_a_regular_graph_keeps_weights_at_exactly_1_and_its_shortcuts_change_no_bit(compressor, monkeypatch):
    """With w_i == 1 (regular graphs keep it exactly), Choco encodes x~ - x^ from the parameters
    themselves instead of scaling by w first, and TopK reads the parameters and the public copies
    without writing the difference (the large tensors take the bracket scan). Against the paths
    that write the difference (a codec without a difference path; non-contiguous parameters, whose
    difference is written tensor by tensor) the results must be bit-identical."""
    from lp_decentral_nlp.gossip.compressors import Compressor

    topo = make_topology("ring", num_nodes=5)
    shapes = [(300, 400), (64,), (0,), (500, 90), (7, 3)]
    runs, fused = [], []
    original = type(compressor).encode_difference
    for path in ("fused", "difference written", "non-contiguous"):
        if path == "difference written":  # the base class: no difference path, so the difference is written
            monkeypatch.setattr(type(compressor), "encode_difference", Compressor.encode_difference)
        else:
            monkeypatch.setattr(type(compressor), "encode_difference",
                                lambda self, *a: fused.append(original(self, *a)) or fused[-1])
        nodes = make_nodes(5, shapes=shapes)
        if path == "non-contiguous":  # the same values, held as transposed views
            nodes = [[p.t().contiguous().t() if p.dim() == 2 else p for p in params] for params in nodes]
        gossip = ChocoSGD(topo, compressor, gamma=0.7)
        offered = len(fused)
        for t in range(4):
            local_step(nodes, t)
            gossip.step(nodes)
        if path == "non-contiguous":
            assert len(fused) == offered  # the difference was written, never offered to the codec
        assert torch.equal(gossip.weights, torch.ones(5))
        runs.append(nodes)
    assert any(fused) == isinstance(compressor, TopK)  # (Identity is one segment: written, never offered)
    assert all(torch.equal(x, y) for other in runs[1:] for pa, pb in zip(runs[0], other) for x, y in zip(pa, pb))


@pytest.mark.parametrize("make", [
    lambda topo: SGP(topo),
    lambda topo: ChocoSGD(topo, TopK(0.1), gamma=0.5),
    lambda topo: DeepSqueeze(topo, TopK(0.1), gamma=0.5),
], ids=["sgp", "choco", "deepsqueeze"])
def test_a_refused_step_changes_nothing_and_the_corrected_call_runs(make):
    """The first step set itself up from node 0 before checking the others, so a wrong node 0 was
    blamed on node 1 and the corrected call was refused for good; later steps checked shapes only,
    so an int64 node was truncated (SGP) or failed half-way after node 0 and the state had changed."""
    topo = make_topology("ring", 3)
    gossip = make(topo)
    wrong_first = make_nodes(3)
    wrong_first[0] = wrong_first[0][:2]
    with pytest.raises(ValueError, match=r"^nodes\[1\] holds tensors of shapes \[\(12, 10\), \(10,\), \(3, 4, 5\), "
                                         r"\(300,\)\], nodes\[0\] of \[\(12, 10\), \(10,\)\]: every node must hold the "
                                         r"same model"):
        gossip.step(wrong_first)
    with pytest.raises(TypeError, match=r"^nodes\[2\] must be a non-empty list of tensors, got str at \[1\]"):
        gossip.step(make_nodes(3)[:2] + [[torch.zeros(12, 10), "b"]])
    # a NumPy array has a shape, a dtype and a device: it reached "'Float64DType' object has no attribute"
    with pytest.raises(TypeError, match=r"^nodes\[0\] must be a non-empty list of tensors, got ndarray at \[0\]"):
        gossip.step([[p.numpy() for p in params] for params in make_nodes(3)])
    reference = make(topo)
    nodes, same = make_nodes(3), make_nodes(3)
    gossip.step(nodes), reference.step(same)  # the corrected call runs, as on a fresh object
    assert all(torch.equal(a, b) for x, y in zip(nodes, same) for a, b in zip(x, y))

    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in gossip.state_dict().items()}
    bad = [[p.clone() for p in params] for params in nodes]
    bad[1][3] = bad[1][3].to(torch.float64)
    before = [[p.clone() for p in params] for params in bad]
    with pytest.raises(ValueError, match=r"^all parameters must share one floating dtype, got \['torch.float32', "
                                         r"'torch.float64'\]"):
        gossip.step(bad)
    as_int = [[p.to(torch.int64) for p in params] for params in nodes]
    with pytest.raises(ValueError, match=r"^all parameters must share one floating dtype, got \['torch.int64'\]"):
        gossip.step(as_int)
    as_double = [[p.double() for p in params] for params in nodes]
    with pytest.raises(ValueError, match=r"^the parameters must keep the first step's dtype torch.float32 and device "
                                         r"cpu, got torch.float64 on cpu"):
        gossip.step(as_double)
    assert all(torch.equal(a, b) for x, y in zip(bad, before) for a, b in zip(x, y)), "the user's tensors"
    after = gossip.state_dict()
    assert after.keys() == state.keys() and gossip.num_steps == 1
    assert all(torch.equal(after[k], v) if isinstance(v, torch.Tensor) else after[k] == v for k, v in state.items())


def test_a_transport_or_memory_query_of_the_wrong_kind_is_named():
    """A string transport gave "'str' object has no attribute 'node_ids'"; memory_bytes([]) an
    IndexError, memory_bytes(nodes) (the list of lists step takes) an AttributeError, and a tensor
    was read as a list of rows."""
    ring = make_topology("ring", 3)
    with pytest.raises(TypeError, match=r"^transport must be a SimulatedTransport or TorchDistributedTransport "
                                        r"\(or None; one of your own needs node_ids, prepare, exchange, "
                                        r"memory_bytes\), got str$"):
        ChocoSGD(ring, transport="x")
    gossip = ChocoSGD(ring, TopK(0.1))
    for params, got in (([], "an empty list"), (make_nodes(3), "a list holding list"), (torch.randn(3), "Tensor"),
                        ([torch.zeros(3, dtype=torch.int64)], "a list holding torch.int64")):
        with pytest.raises(TypeError, match=rf"^params must be one node's non-empty list of floating-point tensors "
                                            rf"\(meta tensors will do\), got {got}$"):
            gossip.memory_bytes(params)


def pretrained_like_nodes(n, scale=5.0):
    """``n`` nodes holding one large common model plus a small per-node part, as fine-tuning starts
    from a pretrained model (the reference is the common part)."""
    common = [scale * p for p in make_nodes(1, seed=7)[0]]
    nodes = [[c + 0.01 * p for c, p in zip(common, params)] for params in make_nodes(n)]
    return nodes, common


@pytest.mark.parametrize("make", [lambda t, **kw: ChocoSGD(t, TopK(0.1), gamma=0.2, **kw),
                                  lambda t, **kw: DeepSqueeze(t, TopK(0.1), gamma=0.15, **kw)])
def test_a_reference_keeps_compressed_gossip_together_when_push_sum_weights_move(make):
    """An absent node moves the push-sum weights, so the numerators x_i = w_i z_i differ by
    (w_i - 1) times the common model, which top-k messages deliver a tenth per step: the nodes flew
    apart (consensus distance ~1e3 here). Gossiping the offsets from the common model keeps them
    together, and the push-sum mass stays exact."""
    topo = make_topology("directed_ring", 4)
    faults = FaultPlan(absences=[(1, 2, 6)])
    spread = {}
    for name, reference in (("without", None), ("with", "common")):
        nodes, common = pretrained_like_nodes(4)
        gossip = make(topo, faults=faults, reference=common if reference else None)
        mass = push_sum_mass(gossip, nodes)
        for t in range(20):
            if t % 5 == 0:
                local_step(nodes, t)
                gossip.step(nodes)
                continue
            before = push_sum_mass(gossip, nodes)  # (with a local step, x~ = x + delta is not w * z~)
            gossip.step(nodes)
            assert torch.allclose(push_sum_mass(gossip, nodes), before, rtol=0, atol=1e-3)
        assert not torch.equal(mass, push_sum_mass(gossip, nodes))  # the local steps moved it
        assert gossip.weights.min() < 0.99  # the absence moved the weights
        spread[name] = float(consensus_distance(nodes))
    assert spread["without"] > 10.0
    assert spread["with"] < spread["without"] / 100


def test_a_reference_is_the_same_algorithm_without_compression():
    """SPEC 2 on the offsets z - r: in exact arithmetic the same models, here equal to float rounding."""
    topo = irregular_digraph()  # weights leave 1 without faults
    runs = []
    for reference in (None, make_nodes(1, seed=3)[0]):
        nodes = make_nodes(5)
        gossip = ChocoSGD(topo, Identity(), gamma=1.0, reference=reference)
        for t in range(6):
            local_step(nodes, t)
            gossip.step(nodes)
        runs.append(nodes)
    assert max_diff(*runs) < 1e-5


def test_a_reference_is_part_of_the_gossip_state_and_checked():
    topo = make_topology("directed_ring", 3)
    reference = make_nodes(1, seed=3)[0]
    gossip = ChocoSGD(topo, TopK(0.5), gamma=0.5, reference=reference)
    reference[0].zero_()  # copied: changing the caller's tensors later changes nothing
    nodes = make_nodes(3)
    gossip.step(nodes)
    saved = gossip.state_dict()
    again = ChocoSGD(topo, TopK(0.5), gamma=0.5, reference=make_nodes(1, seed=3)[0])
    again.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"state_dict is for 'ChocoSGD\(compressor=TopK\(keep=0\.5, value_bits=None\), "
                                         r"gamma=0\.5, seed=0, reference=#[0-9a-f]{16}\)', this object is "
                                         r"'ChocoSGD\(compressor=TopK\(keep=0\.5, value_bits=None\), gamma=0\.5, seed=0\)'"):
        ChocoSGD(topo, TopK(0.5), gamma=0.5).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"^reference holds tensors of shapes \[\(12, 10\)\], the nodes of \[\(12, 10\), "
                                         r"\(10,\), \(3, 4, 5\), \(300,\)\]: it must be shaped as one node's parameters$"):
        ChocoSGD(topo, TopK(0.5), gamma=0.5, reference=reference[:1]).step(make_nodes(3))
    with pytest.raises(TypeError, match=r"^reference must be None or one node's non-empty list of floating-point"):
        ChocoSGD(topo, TopK(0.5), gamma=0.5, reference=torch.zeros(3))
    one = make_nodes(1)[0]  # the reference's copy is counted, meta tensors will do for it
    with_reference = ChocoSGD(topo, TopK(0.5), gamma=0.5, reference=[p.to("meta") for p in one]).memory_bytes(one)
    assert with_reference - ChocoSGD(topo, TopK(0.5), gamma=0.5).memory_bytes(one) == 4 * P
    half = make_nodes(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^reference needs float32 \(or wider\) parameters: the parameters are "
                                         r"torch\.bfloat16"):
        ChocoSGD(topo, TopK(0.5), gamma=0.5, reference=make_nodes(1, seed=3)[0]).step(half)
    assert max_diff(half, make_nodes(3, dtype=torch.bfloat16)) == 0  # refused before anything was written
