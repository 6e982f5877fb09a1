"""From settings to a running gossip algorithm: graph, compressor, algorithm (SPEC 1-3).

The only place that turns user-facing settings into a :class:`~.topology.Topology`, a
:class:`~.compressors.Compressor` and a :class:`~.push_sum.PushSumGossip`. The trainer's
arguments and the cost command line both describe their run with a :class:`GossipConfig` and call
:func:`build_gossip`, so the two cannot drift apart::

    config = GossipConfig(num_nodes=8, topology="torus", algorithm="choco", compression=99.0)
    gossip = build_gossip(config)
    stats = gossip.step(nodes)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..checks import check_choice, check_fields, check_flags, check_topology_name_or_file, path_text
from .choco import ChocoSGD
from .deepsqueeze import DeepSqueeze
from .push_sum import PushSumGossip
from .sgp import SGP
from .compressors import QSGD, Compressor, Identity, Quantize, RandomK, TopK
from .faults import FaultPlan
from .step_size import ALGORITHMS, default_consensus_lr
from .topology import TOPOLOGIES, Topology, make_topology

COMPRESSORS = ("topk", "randomk", "qsgd")
#: what the messages are compressed relative to: "zero" (SPEC 2 as written: the numerators
#: themselves) or "initial" (the nodes' common initial model: the offsets from it)
REFERENCES = ("zero", "initial")


@dataclass(frozen=True)
class GossipConfig:
    """What decides the gossip of a run (SPEC 1-3); checked on construction (ValueError naming the field).

    Attributes:
        num_nodes: number of peer nodes ``n >= 1``; with one node the gossip settings below (and
            ``faults``' ``drop_prob``) must stay at their defaults, since nothing is sent.
        topology: one of ``TOPOLOGIES`` (``directed_ring``, ``ring``, ``torus``, ``exponential``,
            ``complete``), or the path of a ``.npy`` or ``.json`` file of a graph of your own: its
            mixing matrix ``(num_nodes, num_nodes)``, or ``(T, num_nodes, num_nodes)`` for one that
            cycles through ``T`` (:meth:`~.topology.Topology.from_file`, which checks them).
        torus_rows: rows of a torus (must divide ``num_nodes``); None: the most square shape.
        algorithm: ``"choco"`` (Choco-SGD), ``"deepsqueeze"`` (Deep-Squeeze / Sparse-Push) or
            ``"dpsgd"`` (uncompressed push-sum SGP).
        compression: percent of entries the sparsifier drops per tensor, ``0 <= compression < 100``
            (``99`` keeps 1%, SPEC 3); 0 sends every entry.
        compressor: ``"topk"`` or ``"randomk"`` (the sparsifier when ``compression > 0``; random-k
            needs it), or
            ``"qsgd"`` (QSGD with ``qsgd_levels`` levels, whose size the levels set:
            ``compression`` stays 0).
        qsgd_levels: QSGD levels ``s`` in ``[1, 127]``, for ``compressor="qsgd"``.
        low_precision: 8-bit values on the wire (SPEC 3, "Low-precision payloads"); QSGD's codes
            have at most 8 bits either way, so with ``compressor="qsgd"`` the messages are the same
            (the trainer's ``low_precision`` still switches 8-bit training).
        consensus_lr: the consensus step ``gamma`` in ``(0, 1]``; None: :func:`default_consensus_lr`
            (``"dpsgd"`` mixes exactly: None or 1 only).
        seed: base seed of stochastic compressors and message loss.
        faults: a :class:`~.faults.FaultPlan` (None: no faults).
        gossip_reference: one of ``REFERENCES``: ``"zero"`` (SPEC 2 as written, the paper's rule: the
            messages compress the push-sum numerators) or ``"initial"`` (they compress the
            offsets from the nodes' common initial model, which :func:`build_gossip` then
            takes: ``PushSumGossip``'s ``reference``). The same algorithm without compression;
            with it, ``"initial"`` keeps a fine-tuned model's nodes together when faults move
            the push-sum weights (docs/design.md, Faults).
    """

    num_nodes: int = 4
    topology: str = "directed_ring"
    torus_rows: int | None = None
    algorithm: str = "choco"
    compression: float = 0.0
    compressor: str = "topk"
    qsgd_levels: int = 16
    low_precision: bool = True
    consensus_lr: float | None = None
    seed: int = 0
    faults: FaultPlan | None = None
    gossip_reference: str = "zero"

    def __post_init__(self):
        check_fields(self, ("num_nodes", "compression", "qsgd_levels", "consensus_lr", "seed", "torus_rows"))
        if isinstance(self.topology, Topology) or hasattr(self.topology, "shape"):  # settings are text: saved, compared
            raise ValueError(f"topology must be one of {TOPOLOGIES} or a file, got a {type(self.topology).__name__}: "
                             "save a graph of your own to a file (numpy.save(path, W), W[i, j] the weight node i "
                             "gives to node j's message) and give its path")
        object.__setattr__(self, "topology", path_text(self.topology))  # frozen: as check_fields stores its values
        check_topology_name_or_file("topology", self.topology, TOPOLOGIES)
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("compressor", self.compressor, COMPRESSORS)
        check_choice("gossip_reference", self.gossip_reference, REFERENCES)
        qsgd = self.compressor == "qsgd"
        if qsgd and self.compression > 0:
            raise ValueError(f"compression={self.compression!r} is the percent top-k and random-k drop; QSGD's message "
                             "size is set by qsgd_levels: leave compression at 0 with compressor='qsgd'")
        if self.compressor == "randomk" and self.compression == 0:
            raise ValueError("compressor='randomk' chooses which entries compression > 0 drops, and compression=0 "
                             "sends every entry: set compression > 0 or leave compressor at 'topk'")
        if not qsgd and self.qsgd_levels != GossipConfig.qsgd_levels:
            raise ValueError(f"qsgd_levels={self.qsgd_levels!r} applies to compressor='qsgd' only, got "
                             f"compressor={self.compressor!r}")
        if self.algorithm == "dpsgd" and (self.compression > 0 or qsgd):
            raise ValueError(f"{'compressor=qsgd' if qsgd else 'compression > 0'} needs algorithm 'choco' or "
                             "'deepsqueeze'; 'dpsgd' sends exact models")
        if self.algorithm == "dpsgd" and self.consensus_lr not in (None, 1.0):
            raise ValueError(f"consensus_lr={self.consensus_lr!r} is the consensus step of 'choco' and 'deepsqueeze'; "
                             "'dpsgd' mixes exactly (gamma 1): drop consensus_lr or choose another algorithm")
        check_flags(self, ("low_precision",))
        if self.faults is not None and not isinstance(self.faults, FaultPlan):
            raise ValueError(f"faults must be a FaultPlan or None, got {type(self.faults).__name__}")
        if self.torus_rows is not None and (self.topology != "torus" or self.num_nodes % self.torus_rows):
            raise ValueError(f"torus_rows must divide num_nodes={self.num_nodes} and needs topology='torus', "
                             f"got torus_rows={self.torus_rows!r} with topology={self.topology!r}")
        graph = self.graph  # a file's matrices are read and checked here
        if graph.num_nodes != self.num_nodes:
            raise ValueError(f"topology: {self.topology!r} holds a graph of {graph.num_nodes} nodes, and "
                             f"num_nodes={self.num_nodes}: give a file of ({self.num_nodes}, {self.num_nodes}) "
                             f"matrices or set num_nodes={graph.num_nodes}")
        if (self.algorithm == "choco" or (self.algorithm == "dpsgd" and self.low_precision)) \
                and graph.period != 1:  # the exponential graph of 1 or 2 nodes: one neighbour, a static graph
            uses = ("algorithm='choco'" if self.algorithm == "choco"
                    else "algorithm='dpsgd' with low_precision (8-bit Choco messages)")
            raise ValueError(f"topology={self.topology!r} changes every step (period {graph.period}), but {uses} "
                             "needs a static graph: use algorithm='deepsqueeze' (or 'dpsgd' with "
                             "low_precision=False) or a static topology")
        if self.gossip_reference == "initial" and not self.compresses:
            raise ValueError("gossip_reference='initial' changes what compressed messages carry, and these are exact "
                             "(float32 values, compression=0): the same algorithm at the cost of a model copy; leave "
                             "gossip_reference at 'zero', or compress (low_precision or compression > 0)")
        if self.faults is not None:
            self.faults.check_nodes(self.num_nodes)
        if self.num_nodes == 1:
            self._refuse_gossip_settings_of_one_node()

    def _refuse_gossip_settings_of_one_node(self):
        """A single node sends nothing: a gossip setting other than its default is refused, not ignored."""
        fields = type(self).__dataclass_fields__
        given = [(name, getattr(self, name), fields[name].default)
                 for name in ("topology", "torus_rows", "compression", "compressor", "qsgd_levels", "consensus_lr",
                              "gossip_reference")]
        if self.faults is not None:
            given.append(("drop_prob", self.faults.drop_prob, 0.0))
            given += [(name, list(getattr(self.faults, name)), []) for name in ("stragglers", "absences")]
        for name, value, default in given:
            if value != default:
                leave = "it empty" if default == [] else f"{name} at {default!r}"
                raise ValueError(f"{name}={value!r} is a setting of the gossip, and num_nodes=1 has no neighbour to "
                                 f"send to: set num_nodes >= 2, or leave {leave}")

    @functools.cached_property
    def graph(self) -> Topology:
        """The graph of these settings, built once (a file is read once: a run does not depend on
        it afterwards); a torus uses ``torus_rows`` or the most square ``rows x cols``."""
        if self.topology not in TOPOLOGIES:
            return Topology.from_file(self.topology)
        if self.topology != "torus":
            return make_topology(self.topology, num_nodes=self.num_nodes)
        return make_topology("torus", num_nodes=self.num_nodes, rows=self.torus_rows)

    @property
    def compresses(self) -> bool:
        """Whether the messages are compressed (sparsified, QSGD or 8-bit values): not the exact
        float32 models, :func:`build_compressor` gives a codec."""
        return build_compressor(self) is not None

    @property
    def gamma(self) -> float:
        """Consensus step size: ``consensus_lr`` if set, else :func:`default_consensus_lr` of this
        run's compressor, algorithm, graph and message loss (1.0 without sparsification)."""
        if self.consensus_lr is not None:
            return self.consensus_lr
        return default_consensus_lr(build_compressor(self), self.algorithm, build_topology(self), self.faults)


def build_topology(config: GossipConfig) -> Topology:
    """The graph of ``config`` (:attr:`GossipConfig.graph`; a file's is read by
    :meth:`~.topology.Topology.from_file`)."""
    return config.graph


def build_compressor(config: GossipConfig) -> Compressor | None:
    """The message codec of ``config`` (SPEC 3), or None for exact full-precision messages.

    Low precision sends 8-bit values: ``Quantize(8)`` without sparsification, top-k/random-k with
    8-bit values with it. QSGD (codes of at most 8 bits in either precision) is scaled by
    ``1 / (1 + omega)`` so Choco/Deep-Squeeze stay stable with its variance.
    """
    if config.compressor == "qsgd":
        return QSGD(levels=config.qsgd_levels)
    value_bits = 8 if config.low_precision else None
    if config.compression == 0:
        return Quantize(bits=8) if value_bits else None
    keep = (100.0 - config.compression) / 100.0
    if config.compressor == "topk":
        return TopK(keep, value_bits=value_bits)
    return RandomK(keep, value_bits=value_bits)


def build_gossip(config: GossipConfig, transport=None, initial_model=None) -> PushSumGossip:
    """The gossip algorithm of ``config`` over ``transport`` (default: all nodes simulated here).

    ``dpsgd`` is plain SGP (push-sum D-PSGD); with low precision its messages are 8-bit model
    differences (Choco-style with ``gamma=1``), the only way to put 8-bit values on the wire
    without a drifting error. ``initial_model``: with ``config.gossip_reference="initial"``, the nodes'
    common initial model (one node's list of parameter tensors, as gossiped; copied), which the
    messages are compressed relative to; ValueError without it, and with another reference.
    """
    if not isinstance(config, GossipConfig):
        raise TypeError(f"config must be a GossipConfig, got {type(config).__name__}")
    if (initial_model is None) == (config.gossip_reference == "initial"):
        raise ValueError("gossip_reference='initial' compresses the offsets from the nodes' common initial model: pass "
                         "it as initial_model (one node's parameter tensors)" if initial_model is None else
                         f"initial_model is read with gossip_reference='initial' only, got "
                         f"gossip_reference={config.gossip_reference!r}")
    topology = build_topology(config)
    compressor = build_compressor(config)
    faults = config.faults if config.faults is not None and config.faults.active else None
    kwargs = {"transport": transport, "seed": config.seed, "faults": faults, "reference": initial_model}
    if config.algorithm == "dpsgd":
        if compressor is None:
            return SGP(topology, **kwargs)
        return ChocoSGD(topology, compressor=compressor, gamma=1.0, **kwargs)
    cls = ChocoSGD if config.algorithm == "choco" else DeepSqueeze
    return cls(topology, compressor=compressor or Identity(), gamma=config.gamma, **kwargs)
