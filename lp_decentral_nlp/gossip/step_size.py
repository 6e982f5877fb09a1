"""The consensus step ``gamma`` of Choco-SGD and Deep-Squeeze (SPEC 2 step 5): the default is
proportional to the compressor's contraction quality, never one constant for all, and for Choco
also follows the graph and the message loss (docs/consensus_step.md has the measurements).
:class:`~.push_sum.PushSumGossip` takes it when no ``gamma`` is given, and
:class:`~.factory.GossipConfig` when no ``consensus_lr`` is."""
from __future__ import annotations

from ..checks import check_choice
from .compressors import QSGD, Compressor, Identity, Quantize, RandomK, TopK
from .faults import FaultPlan
from .topology import Topology, make_topology

ALGORITHMS = ("choco", "deepsqueeze", "dpsgd")

#: gamma / (compression quality delta) with top-k messages, per algorithm, on any graph
#: (docs/consensus_step.md): Choco's is the largest factor its consensus stayed stable with on
#: every graph measured over thousands of steps (directed rings, rings, tori and complete graphs of
#: 2 to 36 nodes, top-1% and top-10%); Deep-Squeeze's is its fastest measured consensus, stable on
#: all of them
CONSENSUS_LR_PER_QUALITY = {"choco": 2.0, "deepsqueeze": 1.5}

#: the same with random-k messages, whose error is not the smallest a k-entry message can leave:
#: both algorithms diverged at 1.5 delta (top-10% and top-1%) on most graphs measured and were
#: stable at 0.5 delta on all of them (docs/consensus_step.md, "Random-k")
RANDOM_K_CONSENSUS_LR_PER_QUALITY = {"choco": 0.5, "deepsqueeze": 0.5}

#: a larger factor with top-k messages where it was measured stable over those horizons and
#: trained better: ``(algorithm, make_topology name, nodes) -> factor``. The 4-node directed ring
#: is the recipes' default graph; on every torus, ring, complete graph and longer directed ring
#: measured Choco's consensus diverged at 5 delta, at top-10% or top-1% (docs/consensus_step.md,
#: "Stability over long runs")
CONSENSUS_LR_PER_QUALITY_ON = {("choco", "directed_ring", 4): 5.0}

#: the same with scaled QSGD messages (per bucket, :class:`~.compressors.QSGD`): gossip alone of 4
#: nodes on the directed ring, tensors of 1e5 and 1e6 entries, 16 levels, 1024-entry buckets,
#: nodes apart (N(0, 1)) and nearly equal (a fine-tuned model): Choco reached the average (1e-9 of
#: its start) by step 300 at 0.5 and 1 delta and slowed at 2; Deep-Squeeze's floor grows with the
#: step (1.6e-3 of a random start at 0.25 delta, 7e-3 at 0.5, 4e-2 at 1), reached in 100 steps
#: (docs/consensus_step.md, "QSGD")
QSGD_CONSENSUS_LR_PER_QUALITY = {"choco": 0.5, "deepsqueeze": 0.25}

#: quality of ``Quantize(bits)`` messages. 2 bits: Choco-SGD diverged at gamma 1 on an 8-node ring
#: (2,000 float64 entries per node, 300 steps) and reached the average at 0.5, so it takes the
#: quality that gives it 0.5; 4 and 8 bits reached it at gamma 1 on rings and directed rings
QUANTIZE_QUALITY = {2: 0.25, 4: 1.0, 8: 1.0}


def contraction_fix(compressor: Compressor | None) -> str | None:
    """What to use instead of ``compressor`` when it is no contraction (its error is not below
    ``||x||^2``, so Choco-SGD and Deep-Squeeze diverge with it whatever ``gamma``), else None:
    unscaled QSGD and unbiased random-k (their values are scaled up), and 1-bit ``Quantize``
    (every value becomes its tensor's min or max: both diverged at every gamma from 1 to 0.05)."""
    if isinstance(compressor, QSGD) and not compressor.scaled:
        return "QSGD(levels), scaled=True by default (QSGD's docstring)"
    if isinstance(compressor, RandomK) and compressor.unbiased:
        return "RandomK(keep)"
    if isinstance(compressor, Quantize) and compressor.bits == 1:
        return "Quantize(bits) with 2, 4 or 8 bits"
    return None


def compression_quality(compressor: Compressor | None) -> float:
    """The contraction quality ``delta`` in (0, 1] of ``compressor`` (Koloskova et al. 2019,
    ``E||C(x) - x||^2 <= (1 - delta) ||x||^2``): 1 for exact messages, :data:`QUANTIZE_QUALITY`
    for quantized ones (1 at 4 and 8 bits: their error is negligible next to sparsification),
    ``keep`` for top-k and random-k (whatever their value bits), ``1 / (1 + omega)`` for scaled
    QSGD at its bucket size (a smaller tensor's is larger). A compressor that is no contraction
    (:func:`contraction_fix`), or one of the user's own (a ``Compressor`` subclass of no known
    quality), is a ValueError."""
    fix = contraction_fix(compressor)
    if fix is not None:
        raise ValueError(f"compressor {compressor!r} is not a contraction, so it has no default consensus step (and "
                         f"Choco-SGD and Deep-Squeeze diverge with it whatever the step): use {fix}")
    if compressor is None or isinstance(compressor, Identity):
        return 1.0
    if isinstance(compressor, Quantize):
        return QUANTIZE_QUALITY[compressor.bits]
    if isinstance(compressor, (TopK, RandomK)):
        return compressor.keep
    if isinstance(compressor, QSGD):
        return 1.0 / (1.0 + compressor.omega(compressor.bucket_size))
    if isinstance(compressor, Compressor):  # one of the user's own
        raise ValueError(f"compressor {type(compressor).__name__} is not one of this library's (Identity, Quantize, "
                         "TopK, RandomK, QSGD), whose quality the default consensus step is measured for: pass the "
                         "consensus step gamma in (0, 1] (docs/consensus_step.md says how the defaults were found)")
    raise TypeError(f"compressor must be None, Identity, Quantize, TopK, RandomK or QSGD, got "
                    f"{type(compressor).__name__}")


def default_consensus_lr(compressor: Compressor | None, algorithm: str, topology: Topology | None = None,
                         faults: FaultPlan | None = None) -> float:
    """The default consensus step ``gamma`` (SPEC 2 step 5): ``min(1, c * delta) * p_commit``.

    * ``delta``: the compressor's :func:`compression_quality`.
    * ``c``: with top-k messages 1.5 for ``"deepsqueeze"``; for ``"choco"`` 2, or 5 on the 4-node
      directed ring (:data:`CONSENSUS_LR_PER_QUALITY`, :data:`CONSENSUS_LR_PER_QUALITY_ON`; without
      a `topology`, the factor of any graph). With random-k messages 0.5 for both
      (:data:`RANDOM_K_CONSENSUS_LR_PER_QUALITY`); with scaled QSGD 0.5 for ``"choco"`` and 0.25
      for ``"deepsqueeze"`` (:data:`QSGD_CONSENSUS_LR_PER_QUALITY`).
    * ``p_commit``: for Choco with compressed messages (``delta < 1``) under message loss, the
      chance ``(1 - drop_prob) ** d`` that a message reaches all ``d`` out-neighbours of the node
      with the most of them, and is committed (:mod:`.faults`); 1 otherwise.
    * ``"dpsgd"`` (exact or 8-bit SGP) takes 1.0.

    Measured on the consensus distance of gossip alone (docs/consensus_step.md). The fastest
    ``gamma`` scales with ``delta`` (top-k at 10% and 1%, 8-bit or fp32 values): about 2.5 delta
    for Choco and 1.5 delta for Deep-Squeeze. Deep-Squeeze settles at its floor with 1.5 delta on
    every graph measured. Over thousands of steps Choco's consensus diverged at 5 delta on every
    torus, ring and complete graph measured and on directed rings of 8 and 16 nodes (at top-10%),
    and at 2.5 delta on complete graphs of 8 or more nodes, while 2 delta converged on all of them.
    On the 4-node directed ring 5 delta stayed stable and trained better at 1% top-k (digits +3 to
    +17 points over 2.5 delta, AG News at skew 0.9 +1.6 points over three seeds). A Choco message
    that misses one out-neighbour is committed nowhere, so under loss the public copies follow the
    models at ``p_commit`` times the rate. Without the factor Choco's consensus diverged at 30%
    loss on two or three of five graphs measured and at 50% loss on four or five (top-1%, top-10%);
    with it, it converged on all of them. Random-k leaves a larger error than top-k of the same
    size: with it both algorithms diverged at 1.5 delta (top-10% and top-1%) on a 4-node directed
    ring, a 4x4 torus and an 8-node complete graph, and were stable at 0.5 delta on those and the
    4-node ring.

    Args:
        compressor: the message codec (None: exact messages).
        algorithm: ``"choco"``, ``"deepsqueeze"`` or ``"dpsgd"``.
        topology: the graph; None: the factor that held on every graph measured.
        faults: the run's :class:`~.faults.FaultPlan` (its ``drop_prob``), or None; with loss the
            `topology` is needed (its out-degrees).
    Returns:
        ``gamma`` in (0, 1].
    """
    check_choice("algorithm", algorithm, ALGORITHMS)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology or None, got {type(topology).__name__}")
    if faults is not None and not isinstance(faults, FaultPlan):
        raise TypeError(f"faults must be a FaultPlan or None, got {type(faults).__name__}")
    if algorithm == "dpsgd":
        return 1.0
    quality = compression_quality(compressor)
    if isinstance(compressor, RandomK):
        factor = RANDOM_K_CONSENSUS_LR_PER_QUALITY[algorithm]
    elif isinstance(compressor, QSGD):
        factor = QSGD_CONSENSUS_LR_PER_QUALITY[algorithm]
    else:
        factor = CONSENSUS_LR_PER_QUALITY[algorithm]
    if topology is not None and isinstance(compressor, TopK):
        factor = next((c for (alg, name, n), c in CONSENSUS_LR_PER_QUALITY_ON.items()
                       if alg == algorithm and _is_standard_graph(topology, name, n)), factor)
    gamma = min(1.0, factor * quality)
    drop_prob = faults.drop_prob if faults is not None else 0.0
    if algorithm == "choco" and quality < 1.0 and drop_prob > 0:
        if topology is None:
            raise ValueError("the default Choco step under message loss needs the topology (its out-degrees): pass "
                             "topology=..., or set gamma")
        out_degree = max(len(topology.out_neighbors(i, t)) for t in range(topology.period)
                         for i in range(topology.num_nodes))
        gamma *= (1.0 - drop_prob) ** out_degree
    return gamma


def _is_standard_graph(topology: Topology, name: str, num_nodes: int) -> bool:
    """Whether `topology` is ``make_topology(name, num_nodes)``: its matrices, whatever its name (the
    same graph from a file takes the same step)."""
    return topology.num_nodes == num_nodes and topology.fingerprint() == make_topology(name, num_nodes).fingerprint()
