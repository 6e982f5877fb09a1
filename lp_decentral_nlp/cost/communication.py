"""Gossip traffic per node, measured with the gossip engine's own encoders (SPEC 3, SPEC 7).

The bytes of one message are not computed from a formula: the same algorithm class with the same
compressor runs one real step on a one-node graph over copies of the model's parameters, and
the engine reports the length of the wire buffer it encoded (values, indices, scales, zero
points and the push-sum weight). Every node of a run sends a message of that length to each of
its out-neighbours at every step, so the traffic follows from the run's topology.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from ..checks import POSITIVE_INT, check_number


@dataclass(frozen=True)
class CommunicationCost:
    """Bytes a node puts on the wire.

    ``message_bytes``: one encoded message (all parameters + push-sum weight).
    ``bytes_per_iteration``: ``message_bytes`` times the out-degree, averaged over the nodes and
    over one period of the (possibly time-varying) topology.
    ``iterations_per_epoch`` = ``floor(samples_per_node / batch_size)`` (the trainer's loaders drop
    the last partial batch) and ``bytes_per_epoch``
    (the sum over those steps, averaged over nodes): ``None`` when not requested.
    ``spectral_gap``: the topology's per-step gap ``1 - |lambda_2|`` over one period
    (:meth:`~lp_decentral_nlp.gossip.Topology.period_spectral_gap`; spec 1), in [0, 1]: how fast
    gossip mixes.
    """

    algorithm: str
    compressor: str
    topology: str
    num_nodes: int
    message_bytes: int
    bytes_per_iteration: float
    iterations_per_epoch: int | None
    bytes_per_epoch: float | None
    spectral_gap: float

    def to_dict(self) -> dict:
        """The fields as a JSON-serialisable dict."""
        return asdict(self)


def communication_cost(model: nn.Module, gossip, *, batch_size: int | None = None,
                       samples_per_node: int | None = None) -> CommunicationCost:
    """Gossip traffic per node for ``model`` under the algorithm object ``gossip``.

    Args:
        model: the model every node trains (its trainable parameters are gossiped,
            ``gossip.gossiped_parameters``; it is not modified).
        gossip: a ``lp_decentral_nlp.gossip`` algorithm (``SGP``, ``ChocoSGD``, ``DeepSqueeze``),
            which fixes the compressor and the topology.
        batch_size, samples_per_node: give both for the per-epoch traffic (``samples_per_node >=
            batch_size``: an epoch is its full batches).
    """
    from lp_decentral_nlp.gossip import SGP, PushSumGossip, gossiped_parameters, make_topology

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(gossip, PushSumGossip):
        raise TypeError(f"gossip must be an SGP, ChocoSGD or DeepSqueeze instance, got {type(gossip).__name__}")
    if (batch_size is None) != (samples_per_node is None):
        raise ValueError("give both batch_size and samples_per_node (for the per-epoch traffic) or neither")
    batch_size, samples_per_node = (check_number(name, value, POSITIVE_INT._replace(optional=True))
                                    for name, value in (("batch_size", batch_size), ("samples_per_node", samples_per_node)))
    if batch_size is not None and samples_per_node < batch_size:
        raise ValueError(f"samples_per_node={samples_per_node} holds no full batch of batch_size={batch_size}: an "
                         "epoch is the full batches (the loaders drop the last partial one)")

    # One real step of the same algorithm on a one-node graph: its encoded message length.
    alone = make_topology("directed_ring", 1)
    probe = SGP(alone) if isinstance(gossip, SGP) else type(gossip)(alone, compressor=gossip.compressor,
                                                                      gamma=gossip.gamma)
    params = [p.clone() for p in gossiped_parameters(model)]  # the trained ones: frozen ones are not sent
    if not params:
        raise ValueError("model has no trainable parameter (requires_grad=True): nothing is gossiped")
    message_bytes = probe.step([params]).message_bytes

    topology = gossip.topology
    n = topology.num_nodes

    def mean_fanout(step: int) -> float:
        return sum(len(topology.out_neighbors(i, step)) for i in range(n)) / n

    per_iteration = message_bytes * sum(mean_fanout(t) for t in range(topology.period)) / topology.period
    iterations = per_epoch = None
    if batch_size is not None:
        iterations = samples_per_node // batch_size
        per_epoch = message_bytes * sum(mean_fanout(t) for t in range(iterations))
    return CommunicationCost(
        algorithm=type(gossip).__name__, compressor=repr(gossip.compressor), topology=repr(topology),
        num_nodes=n, message_bytes=message_bytes, bytes_per_iteration=per_iteration,
        iterations_per_epoch=iterations, bytes_per_epoch=per_epoch, spectral_gap=topology.period_spectral_gap())
