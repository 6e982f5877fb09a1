"""The default consensus step (docs/consensus_step.md): derived from the compressor, the algorithm,
and for Choco the graph and the message loss."""
import math
import re

import pytest
import torch

from lp_decentral_nlp.gossip import QSGD, ChocoSGD, DeepSqueeze, Identity, Quantize, RandomK, TopK, Topology, \
    consensus_distance, make_topology
from lp_decentral_nlp.gossip import GossipConfig, build_gossip, compression_quality, default_consensus_lr
from lp_decentral_nlp.gossip.faults import FaultPlan


@pytest.mark.parametrize("compressor, algorithm, gamma", [
    (None, "choco", 1.0), (Identity(), "deepsqueeze", 1.0), (Quantize(8), "choco", 1.0),
    (TopK(0.1), "choco", 0.2), (TopK(0.1, value_bits=8), "deepsqueeze", 0.15),
    (TopK(0.01), "choco", 0.02), (RandomK(0.01, value_bits=8), "deepsqueeze", 0.005), (RandomK(0.1), "choco", 0.05),
    (TopK(0.5), "choco", 1.0), (TopK(0.01), "dpsgd", 1.0),
])
def test_the_default_step_is_proportional_to_the_compression_quality(compressor, algorithm, gamma):
    assert default_consensus_lr(compressor, algorithm) == pytest.approx(gamma)


def test_choco_takes_a_larger_step_only_on_the_graph_where_it_was_measured_stable():
    ring4 = make_topology("directed_ring", 4)
    assert default_consensus_lr(TopK(0.01), "choco", ring4) == pytest.approx(0.05)
    assert default_consensus_lr(TopK(0.1), "choco", ring4) == pytest.approx(0.5)
    assert default_consensus_lr(TopK(0.01), "deepsqueeze", ring4) == pytest.approx(0.015)
    for other in (make_topology("directed_ring", 8), make_topology("ring", 4), make_topology("complete", 4),
                  make_topology("torus", 9), Topology.from_matrix(make_topology("ring", 4).mixing_matrix(),
                                                                  name="directed_ring")):
        assert default_consensus_lr(TopK(0.01), "choco", other) == pytest.approx(0.02)
    # the recipes' default run keeps its step: 4 nodes on a directed ring at 99%
    assert GossipConfig(compression=99.0).gamma == pytest.approx(0.05)
    assert GossipConfig(compression=99.0, num_nodes=8).gamma == pytest.approx(0.02)
    # measured with top-k only: random-k and QSGD keep the factor of any graph there
    assert default_consensus_lr(RandomK(0.1), "choco", ring4) == pytest.approx(0.05)
    assert default_consensus_lr(QSGD(16, scaled=True), "choco", ring4) == default_consensus_lr(QSGD(16, scaled=True),
                                                                                              "choco")


def test_under_message_loss_chocos_step_shrinks_with_the_chance_that_a_message_is_committed():
    """A compressed Choco message is committed only when it reached every out-neighbour: with
    out-degree d it is, with probability (1 - drop_prob) ** d."""
    loss = FaultPlan(drop_prob=0.3)
    torus = make_topology("torus", 9)  # 4 out-neighbours
    assert default_consensus_lr(TopK(0.1), "choco", torus, loss) == pytest.approx(0.2 * 0.7**4)
    assert default_consensus_lr(TopK(0.1), "choco", make_topology("directed_ring", 4), loss) == pytest.approx(0.35)
    assert GossipConfig(compression=90.0, topology="torus", num_nodes=9, faults=loss).gamma == pytest.approx(0.2 * 0.7**4)
    # dense messages return an uncommitted share to its sender; Deep-Squeeze's lost shares return too
    assert default_consensus_lr(Quantize(8), "choco", torus, loss) == 1.0
    assert default_consensus_lr(TopK(0.1), "deepsqueeze", torus, loss) == pytest.approx(0.15)
    assert default_consensus_lr(TopK(0.1), "choco", torus, FaultPlan(absences=((1, 2, 5),))) == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"^the default Choco step under message loss needs the topology"):
        default_consensus_lr(TopK(0.1), "choco", None, loss)
    with pytest.raises(TypeError, match=r"^faults must be a FaultPlan or None, got float$"):
        default_consensus_lr(TopK(0.1), "choco", torus, 0.3)
    with pytest.raises(TypeError, match=r"^topology must be a Topology or None, got str$"):
        default_consensus_lr(TopK(0.1), "choco", "torus")


def test_scaled_qsgd_quality_is_one_over_one_plus_omega_and_unscaled_qsgd_is_refused():
    omega = min(1024 / 16**2, math.sqrt(1024) / 16)  # at its bucket size, whatever the tensor's
    assert compression_quality(QSGD(16, scaled=True)) == pytest.approx(1 / (1 + omega))
    assert compression_quality(QSGD(16, scaled=True, bucket_size=256)) == pytest.approx(1 / (1 + 1))
    with pytest.raises(ValueError, match="not a contraction, so it has no default consensus step .*: use "
                                         r"QSGD\(levels\), scaled=True by default \(QSGD's docstring\)$"):
        default_consensus_lr(QSGD(16, scaled=False), "choco")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        default_consensus_lr(TopK(0.1), "sgd")


@pytest.mark.parametrize("algorithm, end", [("choco", 1e-2), ("deepsqueeze", 50.0)])
def test_the_default_qsgd_step_holds_the_nodes_of_a_large_model_together(algorithm, end):
    """QSGD's quality was taken at a 1024 x 1024 tensor and applied to every tensor: nearly equal
    nodes (a fine-tuned model) of a 2**20-entry tensor drifted apart at the default step (Choco
    500-fold, Deep-Squeeze 3000-fold, growing); an embedding table is ten times larger. Per
    bucket, the quality and the step are those of any size (docs/consensus_step.md, "QSGD")."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1 << 20, generator=g) * 0.05
    nodes = [[base + 1e-3 * torch.randn(1 << 20, generator=g)] for _ in range(4)]
    start = consensus_distance(nodes).item()
    gossip = build_gossip(GossipConfig(algorithm=algorithm, compressor="qsgd"))
    for _ in range(100):
        gossip.step(nodes)
    assert consensus_distance(nodes).item() < end * start


def consensus_trajectory(gossip, steps, every):
    """The consensus distance of gossip alone (no gradients) every `every` steps, relative to its
    start (1000 N(0, 1) entries per node)."""
    g = torch.Generator().manual_seed(0)
    nodes = [[torch.randn(1000, generator=g)] for _ in range(gossip.topology.num_nodes)]
    start, out = consensus_distance(nodes).item(), []
    for step in range(1, steps + 1):
        gossip.step(nodes)
        if step % every == 0:
            out.append(consensus_distance(nodes).item() / start)
    return out


@pytest.mark.parametrize("topology, num_nodes", [("torus", 9), ("complete", 8), ("ring", 4), ("directed_ring", 8)])
def test_chocos_default_step_converges_on_graphs_other_than_the_4_node_directed_ring(topology, num_nodes):
    """At 5 delta, measured best on the 4-node directed ring, Choco's consensus grew on these graphs
    (top-10%, 8-bit values, 400 steps: 5e4, 1.7e6 and 0.13 times its start; the 8-node directed
    ring 0.065, on its way up again)."""
    gossip = build_gossip(GossipConfig(num_nodes=num_nodes, topology=topology, compression=90.0))
    assert gossip.gamma == pytest.approx(0.2)
    assert consensus_trajectory(gossip, 400, 400)[-1] < 1e-4


@pytest.mark.parametrize("algorithm", ["choco", "deepsqueeze"])
def test_the_default_step_with_random_k_messages_converges(algorithm):
    """Random-k at the top-k step (2 delta for Choco, 1.5 delta for Deep-Squeeze) diverged:
    Choco 1e33-fold and Deep-Squeeze 6e8-fold in 3000 steps on the 4-node directed ring at 10%."""
    config = GossipConfig(algorithm=algorithm, compression=90.0, compressor="randomk")
    gossip = build_gossip(config)
    assert gossip.gamma == pytest.approx(0.05)
    halfway, end = consensus_trajectory(gossip, 600, 300)
    assert end < 0.2 and end <= 1.05 * halfway  # Choco converges; Deep-Squeeze settles at its floor (0.06)


@pytest.mark.parametrize("topology, num_nodes, drop_prob", [("directed_ring", 4, 0.5), ("torus", 9, 0.3)])
def test_chocos_default_step_converges_under_message_loss(topology, num_nodes, drop_prob):
    """Without the commit factor the 4-node directed ring at 50% loss grew 75,000-fold in 400 steps."""
    gossip = build_gossip(GossipConfig(num_nodes=num_nodes, topology=topology, compression=90.0,
                                       faults=FaultPlan(drop_prob=drop_prob, seed=1)))
    halfway, end = consensus_trajectory(gossip, 600, 300)
    assert end < 0.05 and end <= halfway


def test_gossip_config_uses_the_default_unless_consensus_lr_is_given():
    assert GossipConfig(compression=90.0, algorithm="choco").gamma == pytest.approx(0.5)
    assert GossipConfig(compression=99.0, algorithm="deepsqueeze").gamma == pytest.approx(0.015)
    assert GossipConfig(compression=0.0).gamma == 1.0
    assert GossipConfig(compression=90.0, consensus_lr=0.2).gamma == 0.2
    assert GossipConfig(algorithm="dpsgd", consensus_lr=1.0).gamma == 1.0  # what dpsgd runs


@pytest.mark.parametrize("kwargs, message", [
    (dict(algorithm="dpsgd", consensus_lr=0.5), r"consensus_lr=0.5 is the consensus step of 'choco' and "
                                                r"'deepsqueeze'; 'dpsgd' mixes exactly"),
    (dict(low_precision="False"), r"low_precision must be True or False, got 'False'"),
    (dict(seed=-1), r"seed must be an integer in \[0, 4294967295\], got -1"),
    (dict(faults="none"), r"faults must be a FaultPlan or None, got str"),
    # QSGD's size is its levels: a percentage given with it was ignored
    (dict(compressor="qsgd", compression=50.0), r"compression=50.0 is the percent top-k and random-k drop; QSGD's "
                                                r"message size is set by qsgd_levels: leave compression at 0"),
    (dict(qsgd_levels=4, compression=90.0), r"qsgd_levels=4 applies to compressor='qsgd' only, got compressor='topk'"),
    (dict(algorithm="dpsgd", compressor="qsgd"), r"compressor=qsgd needs algorithm 'choco' or 'deepsqueeze'"),
    # one node sends nothing: the gossip's settings are refused, as the trainer refuses them
    (dict(num_nodes=1, compression=99.0), r"compression=99.0 is a setting of the gossip, and num_nodes=1 has no "
                                          r"neighbour to send to: set num_nodes >= 2, or leave compression at 0.0$"),
    (dict(num_nodes=1, consensus_lr=0.3), r"consensus_lr=0.3 is a setting of the gossip, .* leave consensus_lr at None$"),
    (dict(num_nodes=1, topology="ring"), r"topology='ring' is a setting of the gossip"),
    (dict(num_nodes=1, faults=FaultPlan(drop_prob=0.5)), r"drop_prob=0.5 is a setting of the gossip, .* leave "
                                                         r"drop_prob at 0.0$"),
    # a lone node sleeping for peers it does not have, or away at every step: nothing trained
    (dict(num_nodes=1, faults=FaultPlan(stragglers=[(0, 1.0)])), r"stragglers=\[\(0, 1.0\)\] is a setting of "
                                                                 r"the gossip, .* leave it empty$"),
    (dict(num_nodes=1, faults=FaultPlan(absences=[(0, 0, 2)])), r"absences=\[\(0, 0, 2\)\] is a setting of the "
                                                                r"gossip"),
])
def test_gossip_config_refuses_settings_it_would_ignore_or_misread(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        GossipConfig(**kwargs)


def consensus_after(gossip, steps):
    g = torch.Generator().manual_seed(0)
    nodes = [[torch.randn(2000, generator=g)] for _ in range(gossip.topology.num_nodes)]
    start = consensus_distance(nodes).item()
    for _ in range(steps):
        gossip.step(nodes)
    return consensus_distance(nodes).item() / start


@pytest.mark.parametrize("algorithm", ["choco", "deepsqueeze"])
def test_the_default_step_mixes_top_10_percent_far_faster_than_the_old_001(algorithm):
    cls = ChocoSGD if algorithm == "choco" else DeepSqueeze
    topo, codec = make_topology("directed_ring", 4), TopK(0.1, value_bits=8)
    default = consensus_after(cls(topo, codec, gamma=default_consensus_lr(codec, algorithm, topo)), 60)
    old = consensus_after(cls(topo, codec, gamma=0.01), 60)
    assert default < 0.05 and old > 0.4  # measured: choco 0.006, deepsqueeze 0.027; both 0.47 with 0.01


@pytest.mark.parametrize("cls, algorithm", [(ChocoSGD, "choco"), (DeepSqueeze, "deepsqueeze")])
def test_an_algorithm_built_by_hand_takes_the_default_step_and_converges(cls, algorithm):
    """Built by hand without gamma, Choco and Deep-Squeeze took gamma = 1 whatever the compressor,
    and with 1% top-k both diverged without a word (4-node directed ring, 8-bit values, 2000
    entries: Choco's consensus distance grew 76-fold in 600 steps, Deep-Squeeze's 2e17-fold)."""
    topo, codec = make_topology("directed_ring", 4), TopK(0.01, value_bits=8)
    gossip = cls(topo, codec)
    assert gossip.gamma == default_consensus_lr(codec, algorithm, topo) == pytest.approx(
        0.05 if algorithm == "choco" else 0.015)
    assert cls(topo).gamma == 1.0 and cls(topo, Quantize(8)).gamma == 1.0
    assert consensus_after(gossip, 200) < 0.5  # measured: choco 0.09, deepsqueeze 0.11
    assert consensus_after(cls(topo, codec, gamma=1.0), 200) > 1.0  # the old default: 9.5 and 1e14


@pytest.mark.parametrize("cls", [ChocoSGD, DeepSqueeze])
def test_unbiased_random_k_is_refused_by_both_compressed_algorithms(cls):
    """Scaled by 1 / keep it is no contraction: both went to NaN within 2000 steps at any gamma
    down to 0.002 (4-node directed ring, top-10%)."""
    topo = make_topology("directed_ring", 4)
    with pytest.raises(ValueError, match=rf"^{cls.__name__} needs a contraction, and RandomK\(keep=0.1, unbiased=True, "
                                         r"value_bits=None\) is none: .* use RandomK\(keep\)$"):
        cls(topo, RandomK(0.1, unbiased=True), gamma=0.01)
    with pytest.raises(ValueError, match=r"^compressor RandomK\(keep=0.1, unbiased=True, value_bits=None\) is not a "
                                         r"contraction"):
        default_consensus_lr(RandomK(0.1, unbiased=True), cls.algorithm)


@pytest.mark.parametrize("cls", [ChocoSGD, DeepSqueeze])
def test_unscaled_qsgd_is_refused_by_both_compressed_algorithms(cls):
    """Deep-Squeeze accepted it (then QSGD's default) and diverged: 6e16-fold in 300 steps at gamma
    0.0058. Both refused QSGD's default until it became the scaled QSGD both take."""
    topo = make_topology("ring", 4)
    with pytest.raises(ValueError, match=rf"^{cls.__name__} needs a contraction, and QSGD\(levels=4, scaled=False, bucket_size=1024\) "
                                         r"is none: .* use QSGD\(levels\), scaled=True by default"):
        cls(topo, QSGD(4, scaled=False), gamma=0.1)
    with pytest.raises(ValueError, match=rf"^{cls.__name__} needs a contraction"):
        cls(topo, QSGD(4, scaled=False))
    assert QSGD(4).scaled and cls(topo, QSGD(4)).gamma == default_consensus_lr(QSGD(4, scaled=True), cls.algorithm, topo)


@pytest.mark.parametrize("cls", [ChocoSGD, DeepSqueeze])
def test_one_bit_quantization_is_refused_and_two_bits_take_a_smaller_step(cls):
    """Quantize(1) maps every value to its tensor's min or max: both algorithms diverged at every
    gamma from 1 to 0.05 (8-node rings); Quantize(2) took gamma 1, at which Choco diverged on the
    ring (its worst node 1.7e7 times the average's norm from it after 300 steps) while 0.5 reaches
    the average."""
    topo = make_topology("ring", 8)
    with pytest.raises(ValueError, match=rf"^{cls.__name__} needs a contraction, and Quantize\(bits=1\) is none: .* "
                                         r"use Quantize\(bits\) with 2, 4 or 8 bits$"):
        cls(topo, Quantize(1), gamma=0.05)
    assert ChocoSGD(topo, Quantize(2)).gamma == 0.5 and ChocoSGD(topo, Quantize(4)).gamma == 1.0
    torch.manual_seed(0)
    nodes = [[torch.randn(2000, dtype=torch.float64)] for _ in range(8)]
    average = sum(node[0] for node in nodes) / 8
    with cls(topo, Quantize(2)) as gossip:
        for _ in range(300):
            gossip.step(nodes)
    error = max((node[0] - average).norm() / average.norm() for node in nodes)
    assert error < (1e-6 if cls is ChocoSGD else 1.0)  # measured: 5e-14; Deep-Squeeze stays apart, 0.4


def test_an_exponential_graph_of_two_nodes_is_static_and_takes_choco():
    """It was refused by name, though with one neighbour it never changes (period 1), and
    ChocoSGD accepts it. (One node takes no graph at all.)"""
    config = GossipConfig(num_nodes=2, topology="exponential", algorithm="choco", compression=90.0)
    assert isinstance(build_gossip(config), ChocoSGD)
    with pytest.raises(ValueError, match=r"^topology='exponential' changes every step"):
        GossipConfig(num_nodes=3, topology="exponential", algorithm="choco")


def test_reference_initial_takes_the_initial_model_and_only_then():
    params = [torch.randn(3, 2), torch.randn(4), torch.tensor(1.5)]  # a scalar one too (CLIP's logit_scale)
    gossip = build_gossip(GossipConfig(compression=90.0, gossip_reference="initial"), initial_model=params)
    assert re.fullmatch(r"ChocoSGD\(.*, reference=#[0-9a-f]{16}\)", gossip.state_dict()["config"])
    assert gossip.reference_fingerprint == gossip.state_dict()["config"][-17:-1]
    assert repr(gossip).endswith(f", reference=#{gossip.reference_fingerprint})")  # print(trainer.gossip) says it
    gossip.step([[p.clone() for p in params] for _ in range(4)])
    with pytest.raises(ValueError, match=r"^gossip_reference='initial' compresses the offsets from the nodes' common "
                                         r"initial model: pass it as initial_model"):
        build_gossip(GossipConfig(gossip_reference="initial"))
    with pytest.raises(ValueError, match=r"^initial_model is read with gossip_reference='initial' only, got "
                                         r"gossip_reference='zero'"):
        build_gossip(GossipConfig(), initial_model=params)
    with pytest.raises(ValueError, match=r"^gossip_reference must be one of \('zero', 'initial'\)"):
        GossipConfig(gossip_reference="start")
    with pytest.raises(ValueError, match=r"^gossip_reference='initial' is a setting of the gossip, and num_nodes=1 has "
                                         r"no neighbour"):
        GossipConfig(num_nodes=1, gossip_reference="initial")
    with pytest.raises(ValueError, match=r"^topology must be one of \(.*\), got None$"):  # no advice for a non-graph
        GossipConfig(topology=None)


def test_a_graph_of_ones_own_in_the_settings_says_to_save_it_to_a_file():
    """A Topology was refused as "must be one of (...)" with no way forward, and a matrix failed
    with numpy's "truth value of an array ... is ambiguous"."""
    import numpy as np

    for graph, kind in ((make_topology("ring", 4), "Topology"), (np.full((4, 4), 0.25), "ndarray")):
        with pytest.raises(ValueError, match=rf"^topology must be one of \(.*\) or a file, got a {kind}: save a graph "
                                             r"of your own to a file \(numpy\.save\(path, W\)"):
            GossipConfig(topology=graph)
    with pytest.raises(ValueError, match=r"^algorithm must be one of \('choco', 'deepsqueeze', 'dpsgd'\), got array"):
        GossipConfig(algorithm=np.array(["choco", "dpsgd"]))


def test_a_graph_from_a_file_runs_as_the_same_graph_by_name(tmp_path):
    """The settings (and so the trainer and the recipes) take a graph of one's own as a file; the
    same matrices as a named graph give the same gossip, default step included (Choco's larger
    step on the 4-node directed ring is the graph's, whatever its name)."""
    import numpy as np

    np.save(tmp_path / "ring4.npy", make_topology("directed_ring", 4).mixing_matrix().numpy())
    by_file = GossipConfig(topology=str(tmp_path / "ring4.npy"), compression=99.0)
    assert by_file.gamma == GossipConfig(compression=99.0).gamma == pytest.approx(0.05)
    params = [torch.randn(6, 3), torch.randn(5)]
    runs = []
    for config in (by_file, GossipConfig(compression=99.0)):
        nodes = [[p + i for p in params] for i in range(4)]
        gossip = build_gossip(config)
        for _ in range(5):
            gossip.step(nodes)
        runs.append(nodes)
    assert all(torch.equal(a, b) for x, y in zip(*runs) for a, b in zip(x, y))
    with pytest.raises(ValueError, match=r"^topology: '.*ring4\.npy' holds a graph of 4 nodes, and num_nodes=5: give a "
                                         r"file of \(5, 5\) matrices or set num_nodes=4$"):
        GossipConfig(topology=str(tmp_path / "ring4.npy"), num_nodes=5)
    np.save(tmp_path / "exp8.npy", np.stack([make_topology("exponential", 8).mixing_matrix(t).numpy() for t in range(3)]))
    with pytest.raises(ValueError, match=r"^topology='.*exp8\.npy' changes every step \(period 3\), but "
                                         r"algorithm='choco' needs a static graph"):
        GossipConfig(topology=str(tmp_path / "exp8.npy"), num_nodes=8)
    assert build_gossip(GossipConfig(topology=str(tmp_path / "exp8.npy"), num_nodes=8,
                                     algorithm="deepsqueeze")).topology.period == 3
    with pytest.raises(ValueError, match=r"^topology: no file 'ring9\.npy' \(a graph of your own: a \.npy or \.json file"):
        GossipConfig(topology="ring9.npy")
    with pytest.raises(ValueError, match=r"^topology must be one of \(.*\) or a \.npy or \.json file of mixing "
                                         r"matrices \(a graph of your own\), got 'rings'$"):
        GossipConfig(topology="rings")


def test_a_graph_files_path_is_kept_as_text_as_the_trainers_is(tmp_path, monkeypatch):
    """GossipConfig kept a pathlib.Path as given: unequal to the same path as text, and not JSON
    (its settings are saved and compared); DecentralizedTrainingArguments stored the text."""
    import dataclasses
    import json
    import pathlib

    import numpy as np

    np.save(tmp_path / "ring4.npy", make_topology("directed_ring", 4).mixing_matrix().numpy())
    monkeypatch.setenv("HOME", str(tmp_path))
    for given in (tmp_path / "ring4.npy", pathlib.Path("~/ring4.npy"), "~/ring4.npy"):
        config = GossipConfig(topology=given)
        assert config == GossipConfig(topology=str(tmp_path / "ring4.npy")) and type(config.topology) is str
        json.dumps({field.name: getattr(config, field.name) for field in dataclasses.fields(config)})


def test_reference_initial_with_exact_messages_is_refused_as_inert():
    """Exact float32 messages mix x - w z0 exactly as x: the same run, one model copy more."""
    for algorithm in ("choco", "deepsqueeze", "dpsgd"):
        with pytest.raises(ValueError, match=r"^gossip_reference='initial' changes what compressed messages carry, and "
                                             r"these are exact \(float32 values, compression=0\)"):
            GossipConfig(algorithm=algorithm, low_precision=False, gossip_reference="initial")
    assert GossipConfig(algorithm="dpsgd", gossip_reference="initial").gossip_reference == "initial"  # 8-bit values
