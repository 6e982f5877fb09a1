"""Gossip engine: graphs, push-sum, compressors, Choco-SGD / Deep-Squeeze, transports (SPEC 1-3).

Simulated (all nodes in one process)::

    topo = make_topology("directed_ring", num_nodes=8)
    gossip = ChocoSGD(topo, compressor=TopK(0.01))  # gamma: step_size.default_consensus_lr, 0.02 here
    stats = gossip.step(nodes)      # nodes[i]: node i's parameter tensors z_i, updated in place
    gossip.close()                  # (or ``with gossip: ...``) shuts down its segment thread pool

Distributed (one node per rank, after ``torch.distributed.init_process_group``)::

    gossip = ChocoSGD(topo, compressor=TopK(0.01), gamma=0.02,
                      transport=TorchDistributedTransport(timeout=300))
    stats = gossip.step([my_params])
"""
from .choco import ChocoSGD
from .deepsqueeze import DeepSqueeze
from .push_sum import GossipStats, PushSumGossip, average_model, consensus_distance, gossiped_parameters
from .sgp import SGP
from .compressors import QSGD, Compressor, Identity, Quantize, RandomK, TopK
from .momentum import QuasiGlobalAdam, QuasiGlobalMomentum
from .topology import TOPOLOGIES, Topology, make_topology
from .faults import FaultPlan
from .transport import (GossipMismatchError, GossipPeerError, GossipTimeoutError, SimulatedTransport,
                        TorchDistributedTransport)
from .wire import Message, MessageLayout, index_dtype
from .factory import COMPRESSORS, REFERENCES, GossipConfig, build_compressor, build_gossip, build_topology
from .step_size import ALGORITHMS, compression_quality, default_consensus_lr

__all__ = [
    "TOPOLOGIES", "Topology", "make_topology",
    "Compressor", "Identity", "TopK", "RandomK", "QSGD", "Quantize",
    "PushSumGossip", "SGP", "ChocoSGD", "DeepSqueeze", "GossipStats", "average_model", "consensus_distance",
    "gossiped_parameters",
    "QuasiGlobalMomentum", "QuasiGlobalAdam",
    "SimulatedTransport", "TorchDistributedTransport", "GossipPeerError", "GossipTimeoutError", "GossipMismatchError",
    "FaultPlan",
    "Message", "MessageLayout", "index_dtype",
    "ALGORITHMS", "COMPRESSORS", "REFERENCES", "GossipConfig", "build_gossip", "build_topology", "build_compressor",
    "compression_quality", "default_consensus_lr",
]
