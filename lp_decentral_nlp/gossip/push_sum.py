"""The push-sum core shared by SGP, Choco-SGD and Deep-Squeeze (SPEC 1-2).

The algorithms live in :mod:`.sgp`, :mod:`.choco` and :mod:`.deepsqueeze`; this module holds
what they share: :class:`PushSumGossip`, :class:`GossipStats`, :func:`average_model` and
:func:`consensus_distance`.

Every node ``i`` holds a de-biased model ``z_i`` (the trainer's parameters) and a push-sum weight
``w_i`` (starts at 1); the push-sum numerator is ``x_i = w_i * z_i``. One call to
:meth:`PushSumGossip.step` runs SPEC 2 steps 2-5 for every node this process holds, after the
trainer's local optimiser step has turned ``z_i`` (what the engine wrote back at its previous
step) into ``z~_i``:

1. SPEC 2 step 1, the update goes into the numerator unscaled: ``x~_i = x_i + delta_i`` with
   ``delta_i = z~_i - z_i``. The engine writes ``x~_i / w_i = z_i + delta_i / w_i`` back into the
   parameters first (one pass, only where ``w_i != 1``), so that from here on ``x~_i = w_i * z~_i``
   holds for what the parameters contain. For that it keeps ``z_i``, the models it wrote back, in
   the state ``"written"`` (one parameter-sized row per local node, in the parameters' dtype), but
   only once some local ``w_i`` has left 1: while every ``w_i == 1`` exactly (regular graphs
   without faults) ``x_i = z_i`` and ``x~_i = z~_i`` need no extra memory. Scaling the update by
   ``w_i`` instead would minimise a ``w``-weighted objective (SPEC 2 step 1);
   ``w_i`` is appended as one extra coordinate, so the weight is mixed by exactly the same
   arithmetic as the parameters (it is always sent uncompressed);
2. ``v_i = g(x~_i)`` (algorithm), ``q_i = C(v_i)`` encoded into a real wire buffer;
3. the transport delivers ``q_j`` from every in-neighbour ``j``;
4. ``x_i <- keep * x~_i + gamma * d_i`` with an algorithm-specific consensus direction ``d_i``;
5. ``z_i <- x_i / w_i`` is written back into the trainer's tensors in place.

=================  =====================  ================================  ==========================
algorithm          message ``v_i``        direction ``d_i``                 state per node
=================  =====================  ================================  ==========================
SGP (keep=0)       ``x~_i``               ``sum_j W_ij q_j``                none
Choco-SGD          ``x~_i - x^_i``        ``sum_j W_ij x^_j - x^_i``, after public copies ``x^_j``
                                          ``x^_j += q_j`` for all j
Deep-Squeeze       ``x~_i + e_i``         ``sum_j W_ij q_j - q_i``          ``e_i <- v_i - q_i``
=================  =====================  ================================  ==========================

(sums over ``j`` include ``i`` itself.) Choco recomputes ``sum_j W_ij x^_j`` from the public copies
every step rather than keeping a running sum ``s_i`` (Koloskova et al.'s memory-efficient form):
a running sum drifts away from the copies by float rounding, and that offset is re-injected at
every step, so the consensus value would drift linearly forever. In simulation one copy per node
is shared by all its holders (they agree exactly anyway): one model-sized buffer per node. Both
Choco and Deep-Squeeze conserve the push-sum mass ``sum_i x_i`` in exact arithmetic for any
compressor, because ``W`` is column stochastic.

Backends. With the default :class:`~.transport.SimulatedTransport` one object runs all ``n``
nodes of the topology in one process: ``step(nodes)`` takes ``n`` parameter lists. With
:class:`~.transport.TorchDistributedTransport` every rank runs the same class for its own node
only: ``step([my_params])``. Everything indexed per local node (``weights``, ``bytes_sent``,
state rows) follows :attr:`PushSumGossip.node_ids`: ``[0, ..., n-1]`` in simulation, ``[rank]``
distributed. Stochastic compressors draw from a generator seeded by ``(seed, node, step)``, so the
two backends compute the same numbers (up to float reduction order).

Reference. With ``reference=r`` (a model-shaped list of tensors every node holds alike: the
nodes' common initial model) the engine runs SPEC 2 on the offsets ``z_i - r``: it subtracts
``r`` from the parameters before a step and adds it back after, so the numerators it mixes are
``x_i - w_i r``. In exact arithmetic that is the same algorithm, since ``r`` moves exactly with
the weights; with compression it is not: the messages then carry what each node changed since
the start, not the whole model. Without it, a push-sum weight that leaves 1 (a lost message, an
absent node) makes ``x_i`` differ by ``(w_i - 1)`` times the whole model, which compressed
messages deliver a fraction per step, and a fine-tuned model's nodes drift apart
(docs/design.md, Faults, measures it). The parameters come back from ``z - r + r`` up to float
rounding (a part in ~1e7 of ``r`` in float32), that of a node away or unchanged too: with a
reference such a node keeps its model to rounding, not bit for bit.

Faults. An optional :class:`~.faults.FaultPlan` loses messages, delays stragglers and takes nodes
away for a while; :mod:`.faults` states the rules (a lost share returns to its sender; a Choco
message is committed to the public copies only when it reached every out-neighbour; an absent
node does nothing), under which the push-sum mass stays exactly conserved. Without a plan the
step does no extra work.

Threads. On a multi-threaded CPU, layer-wise codecs encode and decode the model's tensors
concurrently on a pool of ``torch.get_num_threads()`` threads (largest first), each running torch
single-threaded (see :func:`_single_threaded_pool`): CPU top-k selection is sequential per tensor,
and each tensor owns disjoint slices of the buffers, so the results are the same as one tensor
after another. Stochastic codecs encode in order (one generator per node and step). The pool
belongs to the gossip object: it is started on the first step that needs it and shut down by
:meth:`PushSumGossip.close`, on leaving a ``with`` block, or when the object is garbage
collected; nothing process-wide is left behind (the caller's torch thread count is never changed).

Memory traffic. Choco's update of all local nodes runs in cache-sized column chunks, so each public
copy is streamed once per step rather than once per node that mixes it (:meth:`.choco.ChocoSGD._update`).
Its message ``C(x~_i - x^_i)`` is encoded from the two operands where the codec can (CPU top-k:
:meth:`~.compressors.Compressor.encode_difference`), so the difference is never written.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import NUMBER_FIELDS, check_field, check_number
from .compressors import Compressor, Identity
from .faults import FaultPlan
from .step_size import contraction_fix, default_consensus_lr
from .topology import Topology
from .transport import SimulatedTransport
from .wire import Message, MessageLayout

ParamList = list[torch.Tensor]

#: state key of the models the engine wrote back at the previous step (SPEC 2 step 1)
_WRITTEN = "written"

#: what the engine calls on a transport (transport.py's two classes have them)
_TRANSPORT_METHODS = ("node_ids", "prepare", "exchange", "memory_bytes")


@dataclass
class GossipStats:
    """What one :meth:`PushSumGossip.step` did.

    Attributes:
        step: index of the gossip step that ran (0-based; the topology used ``W(step)``).
        node_ids: the graph nodes this process ran (aligned with ``bytes_sent``).
        bytes_sent: per local node, bytes put on the wire: the encoded message length (values,
            indices, scales, push-sum weight) times the number of out-neighbours it went to.
        message_bytes: length in bytes of one node's encoded message.
        lost_edges: the directed edges ``(sender j, receiver i)`` whose message this step's
            :class:`~.faults.FaultPlan` dropped (lost messages and every edge into or out of an
            absent node); empty without a fault plan.
    """

    step: int
    node_ids: list[int]
    bytes_sent: list[int]
    message_bytes: int
    lost_edges: frozenset[tuple[int, int]] = frozenset()


class PushSumGossip:
    """The shared push-sum core; use :class:`SGP`, :class:`ChocoSGD` or :class:`DeepSqueeze`.

    Args:
        topology: the graph (its ``num_nodes`` nodes are all simulated here, or one per rank).
        compressor: the layer-wise codec ``C`` for parameter tensors.
        gamma: consensus step size in (0, 1] (SPEC 2 step 5); None:
            :func:`~.step_size.default_consensus_lr` of the compressor, :attr:`algorithm`, graph and faults
            (``ChocoSGD(topo, TopK(0.01))``: 0.05 on the 4-node directed ring, 0.02 on other graphs).
        transport: :class:`~.transport.SimulatedTransport` (default) or
            :class:`~.transport.TorchDistributedTransport`.
        seed: base seed of the per-(node, step) generators of stochastic compressors.
        faults: a :class:`~.faults.FaultPlan` to inject lost messages, stragglers and absent nodes
            (default None: none). Every process must use the same plan (checked by the
            distributed pre-flight).
        reference: None (SPEC 2 as written: messages compress the numerators ``x_i``), or one
            node's list of tensors ``r`` shaped as its parameters, the same on every node and
            rank (the nodes' common initial model): the messages compress ``x_i - w_i r`` (see
            the module docstring). Copied; checkpoints and the distributed pre-flight compare
            its fingerprint.

    Parameter lists. ``nodes[k]`` is the list of local node ``node_ids[k]``'s parameter tensors
    (``[p.data for p in model.parameters()]`` or the parameters themselves), all nodes with the
    same shapes, one floating dtype and one device. The state (and "full precision" wire values)
    uses that dtype promoted to at least float32; ``"written"`` (SPEC 2 step 1, kept only once a
    push-sum weight leaves 1) uses the parameters' own dtype.

    Resources: on a multi-threaded CPU the object owns a thread pool for the layer-wise codecs;
    :meth:`close` (or ``with PushSumGossip(...) as gossip:``, or garbage collection) shuts it down.
    """

    #: coefficient of ``x~_i`` in the update (SPEC 2 step 5 keeps the local model; SGP replaces it)
    _keep = 1.0
    #: the algorithm's name in :data:`~.step_size.ALGORITHMS`, for its default ``gamma``
    algorithm: str
    #: names of the state buffers, each ``(rows, P + 1)`` with one row per node in ``_state_nodes[name]``
    _state_names: tuple[str, ...] = ()

    def __init__(self, topology: Topology, compressor: Compressor, gamma: float | None,
                 transport=None, seed: int = 0, faults: FaultPlan | None = None, reference: ParamList | None = None):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology (see make_topology), got {type(topology).__name__}")
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a Compressor (Identity, TopK, RandomK, QSGD, Quantize), "
                            f"got {type(compressor).__name__}")
        fix = contraction_fix(compressor)
        if fix is not None:
            raise ValueError(f"{type(self).__name__} needs a contraction, and {compressor!r} is none: its compression "
                             f"error grows with the models and they diverge whatever gamma; use {fix}")
        if faults is not None and not isinstance(faults, FaultPlan):
            raise TypeError(f"faults must be a FaultPlan or None, got {type(faults).__name__}")
        if faults is not None:
            faults.check_nodes(topology.num_nodes)
        if gamma is None:
            gamma = default_consensus_lr(compressor, self.algorithm, topology, faults)
        gamma = check_number("gamma", gamma, NUMBER_FIELDS["consensus_lr"]._replace(optional=False))
        seed = check_field("seed", seed)
        missing = [m for m in _TRANSPORT_METHODS if not callable(getattr(transport, m, None))]
        if transport is not None and missing:
            raise TypeError(f"transport must be a SimulatedTransport or TorchDistributedTransport (or None; one of "
                            f"your own needs {', '.join(_TRANSPORT_METHODS)}), got {type(transport).__name__}")
        if reference is not None and (not isinstance(reference, (list, tuple)) or not reference or not all(
                isinstance(r, torch.Tensor) and r.is_floating_point() for r in reference)):
            raise TypeError(f"reference must be None or one node's non-empty list of floating-point tensors (e.g. "
                            f"[p.detach().clone() for p in model.parameters()]), got {type(reference).__name__}")
        self._reference = None if reference is None else [r.detach().clone() for r in reference]
        self._reference_digest: str | None = None  # its _fingerprint, once needed (a meta one sizes memory only)
        self.faults = faults if faults is not None and faults.active else None
        self._lost: frozenset[tuple[int, int]] = frozenset()
        self.topology = topology
        self.compressor = compressor
        self.gamma = float(gamma)
        self.seed = seed
        self.transport = transport if transport is not None else SimulatedTransport()
        self._node_ids = self.transport.node_ids(topology.num_nodes)
        self._step = 0
        self._w = torch.ones(len(self._node_ids), dtype=torch.float64)
        self._state: dict[str, torch.Tensor] = {}
        self._state_nodes = {name: list(self._node_ids) for name in self._state_names}
        self._pending: dict[str, torch.Tensor] = {}
        # z_i as written back at the previous step, (len(node_ids), P) in the parameters' dtype, or
        # None while every local w_i == 1 (SPEC 2 step 1; see the module docstring)
        self._written: torch.Tensor | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # see _segment_pool
        self._pool_threads = 0
        self._pool_finalizer: weakref.finalize | None = None
        self._ready = False
        # Mixing coefficients per phase and local node: W_ii and {j: W_ij} over in-neighbours j.
        self._mix = [[(topology.weight(i, i, t), {j: topology.weight(i, j, t) for j in topology.in_neighbors(i, t)})
                      for i in self._node_ids] for t in range(topology.period)]
        self._fanout = [[len(topology.out_neighbors(i, t)) for i in self._node_ids] for t in range(topology.period)]

    # -- public API --------------------------------------------------------------------------------
    @property
    def node_ids(self) -> list[int]:
        """Graph nodes run by this process: ``[0..n-1]`` (simulated) or ``[rank]`` (distributed)."""
        return list(self._node_ids)

    @property
    def weights(self) -> torch.Tensor:
        """Push-sum weights ``w`` of the local nodes, shape ``(len(node_ids),)`` (a copy):
        ``(n,)`` in simulation; in the distributed backend ``(1,)`` holding this rank's own
        ``w_rank``. Float64 on CPU before the first step, then the state dtype and device."""
        return self._w.clone()

    @property
    def reference_fingerprint(self) -> str | None:
        """16 hex digits identifying the ``reference`` (SHA-256 of its shapes, dtypes and bytes, as
        given), the same on every rank for equal tensors; None without one."""
        return self._reference_id()

    @property
    def num_steps(self) -> int:
        """Gossip steps done so far (the next step uses ``W(num_steps)``)."""
        return self._step

    def memory_bytes(self, params: ParamList) -> int:
        """Bytes this object holds for its local nodes once it has stepped models whose parameters
        are shaped like ``params`` (one node's parameter list; ``meta`` tensors will do).

        That is the algorithm's state (one ``(P + 1,)`` row per held node and state name, see
        ``state_dict``), two ``(P + 1,)`` work vectors, one outgoing message per local node and the
        transport's receive buffers, all in the state dtype (the parameters' promoted to at least
        float32) or as encoded. ``"written"`` (``(len(node_ids), P)`` in the parameters' dtype, kept
        once a push-sum weight leaves 1) is counted wherever a weight may leave 1: under a fault plan
        that loses messages or has absences (:mod:`.faults`), or on a graph whose mixing rows do not
        sum to 1 (the built-in graphs' do, and without faults their weights stay 1), and the
        ``reference`` (``P`` values in the parameters' dtype) where one is given. Encoding scratch
        space, freed within a step, is not counted.
        """
        if (not isinstance(params, (list, tuple)) or not params
                or not all(isinstance(p, torch.Tensor) and p.is_floating_point() for p in params)):
            got = type(params).__name__ if not isinstance(params, (list, tuple)) else (
                "an empty list" if not params else "a list holding " + ", ".join(
                    sorted({type(p).__name__ if not isinstance(p, torch.Tensor) else str(p.dtype) for p in params})))
            raise TypeError(f"params must be one node's non-empty list of floating-point tensors (meta tensors will "
                            f"do), got {got}")
        sizes = [p.numel() for p in params]
        P = sum(sizes)
        dtype = torch.promote_types(params[0].dtype, torch.float32)
        layout = self._layout_of(self._segments_of(sizes), dtype)
        vector = (P + 1) * dtype.itemsize
        state_rows = sum(len(self._state_nodes[name]) for name in self._state_names)
        total = (state_rows + 2) * vector + len(self._node_ids) * layout.nbytes
        total += self.transport.memory_bytes(self.topology, layout, self._node_ids)
        rows_sum_to_one = all(np.allclose(self.topology.mixing_matrix(t).sum(dim=1).numpy(), 1.0)
                              for t in range(self.topology.period))
        moves_weights = self.faults is not None and (self.faults.drop_prob > 0 or bool(self.faults.absences))
        if moves_weights or not rows_sum_to_one:  # stragglers only delay: the weights stay 1
            total += len(self._node_ids) * P * params[0].element_size()
        if self._reference is not None:  # one copy, in the parameters' dtype
            total += P * params[0].element_size()
        return total

    def step(self, nodes: list[ParamList]) -> GossipStats:
        """One gossip round for every local node; updates ``nodes`` in place (SPEC 2 steps 2-5).

        Args:
            nodes: one parameter list per local node (``len(nodes) == len(node_ids)``): the
                de-biased models ``z~_i`` right after the local optimiser step (or left as the
                previous step wrote them, for a node that took no local step).
        Returns:
            :class:`GossipStats` with the bytes each local node sent.
        """
        with torch.no_grad():
            self._check_nodes(nodes)
            if self._reference is None:
                return self._step_nodes(nodes)
            for params in nodes:  # the offsets z - r (module docstring, "Reference")
                torch._foreach_sub_(list(params), self._reference)
            try:
                return self._step_nodes(nodes)
            finally:
                for params in nodes:
                    torch._foreach_add_(list(params), self._reference)

    def _step_nodes(self, nodes: list[ParamList]) -> GossipStats:
        """:meth:`step` on checked `nodes` (their offsets from the reference, if there is one)."""
        self._add_updates_unscaled(nodes)
        t = self._step
        phase = t % self.topology.period
        absent = self.faults.absent(t) if self.faults else frozenset()
        self._lost = self.faults.lost_edges(t, self.topology) if self.faults else frozenset()
        outgoing: dict[int, Message] = {}
        for k, i in enumerate(self._node_ids):
            outgoing[i] = self._outgoing[k]  # an absent node's (stale) buffer still travels, unread
            if i in absent:
                continue
            self._encode_message(k, nodes[k], self._outgoing[k], self._generator(i, t))
        if self.faults:
            self.faults.straggle([i for i in self._node_ids if i not in absent])
        received = self.transport.exchange(t, outgoing)
        if self._lost:
            received = {i: [(j, msg) for j, msg in pairs if (j, i) not in self._lost]
                        for i, pairs in received.items()}
        self._on_receive(received)
        returned = self._returned_edges(absent)
        updates = []
        for k, i in enumerate(self._node_ids):
            if i in absent:
                continue  # W'[i, i] = 1 and nothing received: x_i and w_i stay as they are
            self_weight, in_weights = self._mix[phase][k]
            if self._lost:
                contributions = self._contributions_under_faults(i, t, self_weight, in_weights, outgoing[i],
                                                                 received[i], returned)
            else:
                contributions = [(self_weight, i, outgoing[i])] + [(in_weights[j], j, msg) for j, msg in received[i]]
            updates.append((k, contributions))
        self._update(updates, nodes)
        self._record_written(nodes)
        self._step += 1
        nbytes = self._layout.nbytes
        return GossipStats(step=t, node_ids=self.node_ids, message_bytes=nbytes,
                           bytes_sent=[0 if i in absent else nbytes * f
                                       for i, f in zip(self._node_ids, self._fanout[phase])],
                           lost_edges=self._lost)

    def close(self) -> None:
        """Shut down this object's segment thread pool, if one was started (waits for its
        workers to exit). Idempotent; a later :meth:`step` starts a new pool when it needs one.
        Also runs on leaving a ``with gossip:`` block and when the object is garbage collected."""
        pool, self._pool = self._pool, None
        if pool is not None:
            self._pool_finalizer.detach()
            self._pool_finalizer = None
            pool.shutdown(wait=True)

    def __enter__(self) -> PushSumGossip:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def state_dict(self) -> dict:
        """The algorithm state as tensors (shared with the live state: save or clone them).

        Keys: ``"step"`` (0-dim int64), ``"node_ids"`` (int64 ``(m,)``), ``"weights"`` (``(m,)``,
        row ``r`` for node ``node_ids[r]``), ``"config"`` (str), ``"topology"`` (str: the graph and
        its matrices' fingerprint, which :meth:`load_state_dict` compares), and after the first step, per
        state name, the buffer (``(rows, P + 1)``, column ``P`` the push-sum coordinate) and
        ``"<name>_nodes"`` (int64 ``(rows,)``: the node each row belongs to). Once some push-sum
        weight has left 1 also ``"written"`` (``(m, P)``, the parameters' dtype: the models ``z_i``
        the engine wrote back, which the next step subtracts from ``z~_i``, SPEC 2 step 1) and
        ``"written_nodes"``.
        """
        sd = {"step": torch.tensor(self._step), "node_ids": torch.tensor(self._node_ids),
              "weights": self._w, "config": self._config(), "topology": self._graph()}
        for name, buf in (self._state if self._ready else self._pending).items():
            sd[name] = buf
            sd[f"{name}_nodes"] = torch.tensor(self._state_nodes[name])
        if self._written is not None:
            sd[_WRITTEN] = self._written
            sd[f"{_WRITTEN}_nodes"] = torch.tensor(self._node_ids)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` output, before or after the first step.

        Rows are matched by node id, so a simulated checkpoint (all nodes) can resume any rank of
        the distributed backend and vice versa. The state must come from the same algorithm,
        compressor, ``gamma`` and seed, and the same graph (where it records it: not in checkpoints
        saved before it did).
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict from state_dict(), got {type(state_dict).__name__}")
        absent = [key for key in ("step", "node_ids", "weights", "config") if key not in state_dict]
        if absent:
            raise ValueError(f"state_dict lacks {absent}: it is not a state_dict() of a gossip algorithm")
        if state_dict.get("config") != self._config():
            raise ValueError(f"state_dict is for {state_dict.get('config')!r}, this object is {self._config()!r}")
        saved_graph = state_dict.get("topology", self._graph())
        if saved_graph.rpartition("#")[2] != self._graph().rpartition("#")[2]:  # its matrices, whatever its name
            raise ValueError(f"state_dict is for the graph {saved_graph!r}, this object has {self._graph()!r}")
        rows = _rows_for(state_dict["node_ids"], self._node_ids, "weights")
        buffers = {name: state_dict[name][_rows_for(state_dict[f"{name}_nodes"], self._state_nodes[name], name)]
                   for name in self._state_names if name in state_dict}
        step = int(state_dict["step"])
        if step > 0 and len(buffers) != len(self._state_names):
            raise ValueError(f"state_dict at step {step} lacks buffers {set(self._state_names) - set(buffers)}")
        weights = state_dict["weights"][rows]
        written = self._written_rows(state_dict, weights)
        if self._ready:
            if written is not None and written.shape[1] != self._P:
                raise ValueError(f"state_dict[{_WRITTEN!r}] has {written.shape[1]} columns, the model has {self._P} "
                                 "parameters")
            self._written = None if written is None else written.to(device=self._device, dtype=self._param_dtype)
            for name, buf in buffers.items():
                if buf.shape != self._state[name].shape:
                    raise ValueError(f"state_dict[{name!r}] has shape {tuple(buf.shape)}, the model needs "
                                     f"{tuple(self._state[name].shape)}")
                self._state[name].copy_(buf)
            if not buffers:
                for buf in self._state.values():
                    buf.zero_()
            self._w.copy_(weights)
        else:
            self._pending = {name: buf.clone() for name, buf in buffers.items()}
            self._w = weights.clone()
            self._written = written
        self._step = step

    def _written_rows(self, state_dict: dict, weights: torch.Tensor) -> torch.Tensor | None:
        """The ``"written"`` rows of the local nodes from ``state_dict`` (a new tensor), or None
        when it has none; a node without a row must have ``w == 1`` (its row is then never read
        before the next step rewrites it, and is filled with zeros)."""
        unit = [bool(w == 1) for w in weights]
        if _WRITTEN not in state_dict:
            if not all(unit):
                raise ValueError(f"state_dict has push-sum weights != 1 but no {_WRITTEN!r} rows (the models the "
                                 "engine wrote back), so the next step could not form x~ = x + delta exactly")
            return None
        buf = state_dict[_WRITTEN]
        saved = [int(i) for i in state_dict[f"{_WRITTEN}_nodes"].tolist()]
        missing = [i for i, u in zip(self._node_ids, unit) if i not in saved and not u]
        if missing:
            raise ValueError(f"state_dict[{_WRITTEN!r}] holds nodes {saved}, it lacks nodes {missing} "
                             "whose push-sum weight is not 1")
        out = buf.new_zeros(len(self._node_ids), buf.shape[1])
        for k, i in enumerate(self._node_ids):
            if i in saved:
                out[k] = buf[saved.index(i)]
        return out

    def node_state_dict(self, node: int) -> dict:
        """The part of :meth:`state_dict` that graph node ``node`` keeps itself (one checkpoint
        file per node): its push-sum weight and, per state buffer, the rows it holds (Choco: its
        own public copy and those of its in-neighbours; Deep-Squeeze: its error memory), labelled
        by node id like :meth:`state_dict`. ``node`` must be a local node. Tensors are shared
        with the live state."""
        if node not in self._node_ids:
            raise ValueError(f"node {node} is not run by this process (local nodes: {self._node_ids})")
        sd = self.state_dict()
        row = self._node_ids.index(node)
        part = {"step": sd["step"], "config": sd["config"], "topology": sd["topology"],
                "node_ids": torch.tensor([node]), "weights": sd["weights"][row:row + 1]}
        for name in (*self._state_names, _WRITTEN):
            if name not in sd:
                continue
            held = self._held_nodes(name, node)
            saved = sd[f"{name}_nodes"].tolist()
            part[name] = sd[name][[saved.index(j) for j in held]]
            part[f"{name}_nodes"] = torch.tensor(held)
        return part

    def load_node_state_dicts(self, parts: list[dict]) -> None:
        """Restore from :meth:`node_state_dict` outputs (any set of nodes covering the local ones
        and the rows they hold). A row present in several parts must be identical in all."""
        if not parts:
            raise ValueError("load_node_state_dicts needs at least one node state dict")
        steps = {int(p["step"]) for p in parts}
        if len(steps) != 1:
            raise ValueError(f"node state dicts are from different steps: {sorted(steps)}")
        merged = {"step": parts[0]["step"], "config": parts[0]["config"],
                  **({"topology": parts[0]["topology"]} if "topology" in parts[0] else {}),
                  "node_ids": torch.cat([p["node_ids"] for p in parts]),
                  "weights": torch.cat([p["weights"] for p in parts])}
        for name in (*self._state_names, _WRITTEN):
            rows: dict[int, torch.Tensor] = {}
            for p in parts:
                if name not in p:
                    continue
                for j, r in zip(p[f"{name}_nodes"].tolist(), p[name]):
                    if j in rows and not torch.equal(rows[j], r):
                        raise ValueError(f"node state dicts disagree on the {name!r} row of node {j}")
                    rows.setdefault(j, r)
            if rows:
                ids = sorted(rows)
                merged[name] = torch.stack([rows[j] for j in ids])
                merged[f"{name}_nodes"] = torch.tensor(ids)
        self.load_state_dict(merged)

    def __repr__(self):
        reference = "" if self._reference is None else f", reference=#{self._reference_id()}"
        return f"{type(self).__name__}({self.topology!r}, compressor={self.compressor!r}, gamma={self.gamma:g}, " \
               f"transport={self.transport!r}{reference})"

    # -- algorithm hooks ---------------------------------------------------------------------------
    def _encode_message(self, k: int, params: ParamList, msg: Message, generator) -> None:
        """SPEC 2 step 2 for local node ``k``: ``q_k = C(v_k)`` into ``msg`` (and the own commit)."""
        self._encode(self._by_segment(self._message(k, params)), msg, generator, self._own_commit(k))

    def _message(self, k: int, params: ParamList) -> torch.Tensor:
        """``v_k = g(x~_k)`` (SPEC 2 step 2), ``(P + 1,)``, from local node ``k``'s parameters
        ``z~_k`` (``x~_k`` is :meth:`_scaled_copy`); may use ``self._flat``'s storage."""
        raise NotImplementedError

    def _own_commit(self, k: int) -> tuple[torch.Tensor, float] | None:
        """``(target, alpha)``: local node ``k``'s own ``q_k`` is decoded into ``target += alpha * q_k``
        (a ``(P + 1,)`` state row), each segment right after it is encoded; None: no such update."""
        return None

    def _on_receive(self, received: dict[int, list[tuple[int, Message]]]) -> None:
        """State update from all messages received this step (before any direction)."""

    def _direction(self, k: int, contributions: list[tuple[float, int, Message]]) -> None:
        """Write ``d_k`` into ``self._flat`` from ``[(W_kk, k's node, own message), (W_kj, j, j's message)...]``."""
        raise NotImplementedError

    def _update(self, updates: list[tuple[int, list[tuple[float, int, Message]]]], nodes: list[ParamList]) -> None:
        """SPEC 2 step 5 for every ``(k, contributions)`` in ``updates`` (the local nodes present
        this step): each node's direction ``d_k``, then its ``x_k`` and ``z_k`` into ``nodes[k]``."""
        for k, contributions in updates:
            self._direction(k, contributions)
            self._apply(k, nodes[k])

    def _returned_edges(self, absent) -> frozenset[tuple[int, int]]:
        """Edges ``(sender, receiver)`` whose mixing weight returns to the sender this step: the
        lost ones (faults.py; ``absent``: the nodes away this step, whose edges are among them)."""
        return self._lost

    def _contributions_under_faults(self, i, t, self_weight, in_weights, own_msg, received, returned):
        """SPEC 2 step 5's ``[(W'_ii, i, q_i), (W'_ij, j, q_j)...]`` for the step's ``W'``: each
        returned share is added to its sender's self-weight and leaves the receiver's row. An
        in-neighbour whose message was lost but not returned (Choco) comes with ``None``."""
        self_weight += sum(self.topology.weight(o, i, t) for o in self.topology.out_neighbors(i, t)
                           if (i, o) in returned)
        delivered = dict(received)
        return [(self_weight, i, own_msg)] + [(w, j, delivered.get(j)) for j, w in in_weights.items()
                                              if (j, i) not in returned]

    def _held_nodes(self, name: str, node: int) -> list[int]:
        """Nodes whose row of state buffer ``name`` graph node ``node`` keeps (sorted)."""
        return [node]

    # -- shared machinery --------------------------------------------------------------------------
    def _add_updates_unscaled(self, nodes: list[ParamList]) -> None:
        """SPEC 2 step 1: ``nodes[k] <- z_k + (z~_k - z_k) / w_k`` for every local node with
        ``w_k != 1`` (``z_k`` = the row of ``"written"``), so that ``w_k * nodes[k]`` is
        ``x~_k = x_k + delta_k``. A node whose parameters were not changed since the previous
        step keeps them bit for bit (here: with a ``reference``, the parameters are ``z - r``,
        which a step leaves exact, and ``z - r + r`` rounds, see the module docstring)."""
        if self._written is None:
            return
        for k, params in enumerate(nodes):
            w = float(self._w[k])
            if w != 1.0:
                torch._foreach_lerp_(list(params), self._param_views(self._written[k]), 1.0 - 1.0 / w)

    def _record_written(self, nodes: list[ParamList]) -> None:
        """Keep the models just written back as ``"written"`` (``z_k`` of the next step's
        ``delta_k``); allocated the first time some local ``w_k`` is not 1, kept from then on."""
        if self._written is None:
            if bool((self._w == 1).all()):
                return
            self._written = torch.empty(len(self._node_ids), self._P, dtype=self._param_dtype, device=self._device)
        for row, params in zip(self._written, nodes):
            torch._foreach_copy_(self._param_views(row), list(params))

    def _param_views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """The parameter-shaped views of a flat ``(P,)`` or ``(P + 1,)`` row."""
        return [row[o:o + n].view(s) for o, n, s in self._param_slices]

    def _graph(self) -> str:
        """The graph and its matrices' fingerprint, as :meth:`state_dict` records it; a state loads
        into a graph of the same matrices whatever its name (a renamed graph file). (Not the fault
        plan: a run may resume under other faults, the mass stays conserved.)"""
        return f"{self.topology!r} #{self.topology.fingerprint():x}"

    def _reference_id(self) -> str | None:
        """The reference's fingerprint (None without one), computed once."""
        if self._reference is not None and self._reference_digest is None:
            self._reference_digest = _fingerprint(self._reference)
        return self._reference_digest

    def _config(self) -> str:
        reference = "" if self._reference is None else f", reference=#{self._reference_id()}"
        return (f"{type(self).__name__}(compressor={self.compressor!r}, gamma={self.gamma!r}, "
                f"seed={self.seed}{reference})")

    def _rank_settings(self) -> dict[str, str]:
        """What every rank must build alike, by name (the distributed pre-flight check compares
        them and names the one that differs)."""
        return {"algorithm": type(self).__name__, "compressor": repr(self.compressor), "gamma": repr(self.gamma),
                "seed": repr(self.seed), "fault plan": repr(self.faults), "reference": repr(self._reference_id()),
                "parameter dtype": str(self._param_dtype),
                "parameter shapes": repr([tuple(s) for s in self._shapes])}

    def _mixed_sum(self, contributions, self_shift: float) -> None:
        """``self._flat = sum_j W_kj q_j - self_shift * q_k`` (the own message comes first)."""
        self._flat.zero_()
        for n, (wkj, _, msg) in enumerate(contributions):
            self._decode_add(msg, self._flat, wkj - self_shift if n == 0 else wkj)

    def _encode(self, v: list[torch.Tensor], msg: Message, generator, commit: tuple[torch.Tensor, float] | None,
                minus: list[torch.Tensor] | None = None) -> None:
        """Encode ``v`` into ``msg``, or ``v - minus`` when ``minus`` is given; ``v`` and ``minus``
        hold one 1-D tensor per segment (:meth:`_by_segment`). A codec with a difference path
        (:meth:`~.compressors.Compressor.encode_difference`) reads both; for the others the
        difference is first written into ``self._flat``. With ``commit = (target, alpha)`` also
        ``target += alpha * q``, segment by segment, while the segment's fields are fresh in cache
        (``target`` may be under ``v`` or ``minus``: a segment is read whole before it is updated)."""
        def encode(s):
            off, numel, codec = self._segments[s]
            work, fields = self._work[off:off + numel], msg.fields[s]
            if minus is None:
                codec.encode(v[s], fields, work, generator)
            elif not codec.encode_difference(v[s], minus[s], fields, work, generator):
                codec.encode(torch.sub(v[s], minus[s], out=self._flat[off:off + numel]), fields, work, generator)
            if commit is not None:
                target, alpha = commit
                codec.decode_add(fields, target[off:off + numel], alpha, work)

        self._each_segment(encode, in_order=generator is not None)

    def _by_segment(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The segments of a ``(P + 1,)`` tensor, as views."""
        return [x[off:off + numel] for off, numel, _ in self._segments]

    def _decode_add(self, msg: Message, target: torch.Tensor, alpha: float) -> None:
        def decode_add(s):
            off, numel, codec = self._segments[s]
            codec.decode_add(msg.fields[s], target[off:off + numel], alpha, self._work[off:off + numel])

        self._each_segment(decode_add)

    def _each_segment(self, fn, in_order: bool = False) -> None:
        """``fn(s)`` for every segment index ``s``: on the segment thread pool (largest segments
        first) when the CPU runs several torch threads and there are several segments, else in order."""
        threads = torch.get_num_threads()
        if in_order or threads < 2 or len(self._segments) < 3 or self._device.type != "cpu":
            for s in range(len(self._segments)):
                fn(s)
        else:
            list(self._segment_pool(threads).map(fn, self._largest_first))

    def _segment_pool(self, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        """This object's pool of ``threads`` single-threaded workers, started on first use (and
        again if the caller's thread count changed); :meth:`close` or garbage collection shuts it down."""
        if self._pool is None or self._pool_threads != threads:
            self.close()
            self._pool, self._pool_threads = _single_threaded_pool(threads), threads
            self._pool_finalizer = weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def _scaled_copy(self, k: int, params: ParamList) -> torch.Tensor:
        """``self._flat = x~_k = w_k * [z~_k, 1]``, shape ``(P + 1,)`` (SPEC 2 step 2's numerator)."""
        x, w = self._flat, self._w[k]
        if self._exact_scaling:  # one pass per tensor
            for view, p in zip(self._flat_views, params):
                torch.mul(p, w, out=view)
        else:  # widen first, so a low-precision z~ is scaled in the state dtype
            torch._foreach_copy_(self._flat_views, params)
            x[:self._P].mul_(w)
        x[self._P:].copy_(w)
        return x

    def _apply(self, k: int, params: ParamList) -> None:
        """``x_k <- keep * x~_k + gamma * d_k`` and ``z_k <- x_k / w_k`` into ``params``, with
        ``d_k`` in ``self._flat`` (SPEC 2 step 5)."""
        d = self._flat
        w_old = self._w[k]
        w_new = self._keep * w_old + self.gamma * d[self._P]
        scale = self.gamma / w_new
        if self._keep:
            # z_new = (w_old / w_new) * z~ + (gamma / w_new) * d: two passes over the parameters
            torch._foreach_mul_(params, w_old / w_new)
            torch._foreach_addcmul_(params, self._flat_views, [scale] * len(params))
        else:
            d.mul_(scale)
            torch._foreach_copy_(params, self._flat_views)
        self._w[k] = w_new

    def _generator(self, node: int, step: int):
        if not self.compressor.stochastic:
            return None
        seed = int(np.random.SeedSequence([self.seed, node, step]).generate_state(1, np.uint64)[0] >> 1)
        gen = torch.Generator(device=self._device)
        gen.manual_seed(seed)
        return gen

    def _segments_of(self, sizes: list[int]) -> list[tuple[int, int, Compressor]]:
        """``(offset, numel, codec)`` of every message segment for parameters of ``sizes`` elements:
        one per nonempty tensor (layer-wise codecs) or one for the whole model, then the weight's."""
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        P = int(offsets[-1])
        segs = [(int(o), n) for o, n in zip(offsets, sizes) if n > 0] if self.compressor.layerwise else [(0, P)]
        return [(o, n, self.compressor) for o, n in segs] + [(P, 1, Identity())]

    @staticmethod
    def _layout_of(segments, dtype: torch.dtype) -> MessageLayout:
        return MessageLayout([codec.fields(n, dtype) for _, n, codec in segments])

    def _check_nodes(self, nodes) -> None:
        m = len(self._node_ids)
        if not isinstance(nodes, (list, tuple)) or len(nodes) != m:
            where = "one per simulated node" if m > 1 else "[my_params] for this rank"
            launched = m > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1
            raise ValueError(f"nodes must be a list of {m} parameter lists ({where}), "
                             f"got {type(nodes).__name__} of length {len(nodes) if hasattr(nodes, '__len__') else '?'}"
                             + ("; under a launcher, one node per process: build the gossip with "
                                "transport=TorchDistributedTransport()" if launched else ""))
        # every node is checked, in one pass over its tensors, before anything is set up or written
        # (a refused call changes nothing); after the first step a step compares one list per node
        layouts = [_tensor_layout(k, params) for k, params in enumerate(nodes)]
        reference = self._node_layout if self._ready else layouts[0]
        for k, layout in enumerate(layouts):
            if layout != reference:
                raise self._layout_error(k, layout, reference, layouts)
        if not self._ready:
            for k, params in enumerate(nodes):
                _check_writable(k, params)
            shapes = [s for s, _, _ in reference]
            if self._reference is not None and [tuple(r.shape) for r in self._reference] != shapes:
                raise ValueError(f"reference holds tensors of shapes {[tuple(r.shape) for r in self._reference]}, the "
                                 f"nodes of {shapes}: it must be shaped as one node's parameters")
            dtypes, devices = {d for _, d, _ in reference}, {v for _, _, v in reference}
            if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
                raise ValueError(f"all parameters must share one floating dtype, got {sorted(map(str, dtypes))}")
            if len(devices) != 1:
                raise ValueError(f"all parameters must live on one device, got {sorted(map(str, devices))}")
            self._setup(nodes, reference)

    def _layout_error(self, k: int, layout, reference, layouts) -> ValueError:
        """Why node `k`'s ``(shape, dtype, device)`` list `layout` differs from `reference`."""
        shapes, expected = [s for s, _, _ in layout], [s for s, _, _ in reference]
        if shapes != expected and self._ready:
            return ValueError(f"nodes[{k}] must be a list of tensors with shapes {expected} "
                              "(the same model on every node, same order as at the first step)")
        if shapes != expected:
            return ValueError(f"nodes[{k}] holds tensors of shapes {shapes}, nodes[0] of {expected}: every node must "
                              "hold the same model, in the same order")
        dtypes = {d for node in layouts for _, d, _ in node}
        devices = {v for node in layouts for _, _, v in node}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            return ValueError(f"all parameters must share one floating dtype, got {sorted(map(str, dtypes))}")
        if len(devices) != 1:
            return ValueError(f"all parameters must live on one device, got {sorted(map(str, devices))}")
        return ValueError(f"the parameters must keep the first step's dtype {self._param_dtype} and device "
                          f"{self._device}, got {next(iter(dtypes))} on {next(iter(devices))}")

    def _setup(self, nodes, layout) -> None:
        """First step, after :meth:`_check_nodes` (`layout`: every node's ``(shape, dtype, device)``
        list): lay out the wire format, allocate buffers, run the transport's pre-flight."""
        first = nodes[0]
        self._node_layout = layout  # what every later step's nodes must match
        self._shapes = [s for s, _, _ in layout]
        _, self._param_dtype, self._device = layout[0]
        if self._reference is not None:  # subtracted from the parameters: their dtype and device
            problem = reference_dtype_problem(self._param_dtype)
            if problem:
                raise ValueError(f"reference needs float32 (or wider) parameters: {problem}")
            self._reference_id()  # of the reference as given, before the conversion
            self._reference = [r.to(device=self._device, dtype=self._param_dtype) for r in self._reference]
        self._dtype = torch.promote_types(self._param_dtype, torch.float32)
        sizes = [p.numel() for p in first]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self._P = P = int(offsets[-1])
        self._param_slices = [(int(o), n, s) for o, n, s in zip(offsets, sizes, self._shapes)]
        self._segments = self._segments_of(sizes)
        self._largest_first = sorted(range(len(self._segments)), key=lambda s: -self._segments[s][1])
        self._layout = self._layout_of(self._segments, self._dtype)
        dev, dt = self._device, self._dtype
        self._flat = torch.zeros(P + 1, dtype=dt, device=dev)
        self._work = torch.zeros(P + 1, dtype=dt, device=dev)
        self._flat_views = [self._flat[o:o + n].view(s) for o, n, s in self._param_slices]
        self._exact_scaling = self._param_dtype == dt
        self._outgoing = [Message(self._layout, dev) for _ in self._node_ids]
        self._state = {name: torch.zeros(len(self._state_nodes[name]), P + 1, dtype=dt, device=dev)
                       for name in self._state_names}
        for name, buf in self._pending.items():
            if buf.shape != self._state[name].shape:
                raise ValueError(f"loaded state {name!r} has shape {tuple(buf.shape)}, this model needs "
                                 f"{tuple(self._state[name].shape)}")
            self._state[name].copy_(buf)
        self._pending = {}
        if self._written is not None:
            if self._written.shape != (len(self._node_ids), P):
                raise ValueError(f"loaded state {_WRITTEN!r} has shape {tuple(self._written.shape)}, this model "
                                 f"needs {(len(self._node_ids), P)}")
            self._written = self._written.to(device=dev, dtype=self._param_dtype)
        # per state buffer and row, views shaped like the parameters (``load_state_dict`` copies in place)
        self._state_views = {name: [[buf[r, o:o + n].view(s) for o, n, s in self._param_slices]
                                    for r in range(buf.shape[0])] for name, buf in self._state.items()}
        self._w = self._w.to(device=dev, dtype=dt)
        self.transport.prepare(self.topology, self._layout, dev, self._step, self._rank_settings())
        self._ready = True


def _single_threaded_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """A new pool that encodes/decodes segments with ``threads`` workers, each running torch
    single-threaded (owned by one :class:`PushSumGossip`, which shuts it down).

    The workers are the parallelism. A worker that opened OpenMP parallel regions of its own
    would own a second OpenMP team, and with more OpenMP threads than cores libgomp stops
    spin-waiting: every short parallel op of the whole process then pays a thread wake-up, for
    the rest of the process (measured on 2 cores: 200 ``_foreach_mul_`` calls on 8 x 256K floats,
    17 -> 100 ms; Choco's chunked update 130 -> 350 ms). Under OpenMP a thread's count is its own,
    taken from the process default on its first use, so each worker first takes it, then sets 1,
    and the caller's default is put back once every worker has done so.
    """
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="gossip-segments")
    if torch.backends.openmp.is_available():
        caller = torch.get_num_threads()
        ready = threading.Barrier(threads, timeout=60)  # every worker takes exactly one of the tasks

        def single_threaded(_):
            torch.get_num_threads()
            torch.set_num_threads(1)
            ready.wait()

        list(pool.map(single_threaded, range(threads)))
        torch.set_num_threads(caller)
    return pool


def reference_dtype_problem(dtype: torch.dtype) -> str | None:
    """Why parameters of `dtype` cannot gossip relative to a reference (``PushSumGossip``'s
    ``reference``), or None: each step computes ``z - r`` and ``z - r + r`` in the parameters'
    dtype, which in 16 bits rounds every weight by a part in a few hundred."""
    if dtype.itemsize >= 4:
        return None
    return (f"the parameters are {dtype}, and each step computes z - r and z - r + r in their dtype, which would round "
            "every weight by a part in a few hundred")


def _fingerprint(tensors: ParamList) -> str:
    """16 hex digits of the SHA-256 of `tensors`' shapes, dtypes and bytes (the same on every rank
    and process for equal tensors)."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:16]


def _rows_for(saved_ids: torch.Tensor, wanted: list[int], what: str) -> torch.Tensor:
    """Row of each node id in ``wanted`` within a checkpoint whose rows belong to ``saved_ids``."""
    saved = [int(i) for i in saved_ids.tolist()]
    missing = [i for i in wanted if i not in saved]
    if missing:
        raise ValueError(f"state_dict[{what!r}] holds nodes {saved}, it lacks nodes {missing} needed here")
    return torch.tensor([saved.index(i) for i in wanted])


def _tensor_layout(k: int, params) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
    """``(shape, dtype, device)`` of each tensor of ``nodes[k]``; TypeError unless it is a non-empty
    list of tensors."""
    if not isinstance(params, (list, tuple)) or not params:
        got = "an empty list" if isinstance(params, (list, tuple)) else type(params).__name__
        raise TypeError(f"nodes[{k}] must be a non-empty list of tensors, got {got}")
    bad = next(((j, p) for j, p in enumerate(params) if not isinstance(p, torch.Tensor)), None)
    if bad is not None:  # a NumPy array has a shape, a dtype and a device too
        raise TypeError(f"nodes[{k}] must be a non-empty list of tensors, got {type(bad[1]).__name__} at [{bad[0]}]")
    return [(tuple(p.shape), p.dtype, p.device) for p in params]


def _check_writable(k: int, params) -> None:
    """ValueError unless every tensor of ``nodes[k]`` can be updated in place on its own: not an
    inference tensor, no entry seen twice (a stride-0 view, e.g. ``expand``), and no memory shared
    with another tensor of the node (a tied weight listed twice would take every update twice).
    Checked at the first step, before anything is written."""
    spans = []
    for j, p in enumerate(params):
        if p.is_inference():
            raise ValueError(f"nodes[{k}][{j}] is an inference tensor (made under torch.inference_mode), which "
                             "cannot be updated in place: give the parameters themselves")
        if p.numel() == 0:
            continue
        if any(stride == 0 and size > 1 for size, stride in zip(p.shape, p.stride())):
            raise ValueError(f"nodes[{k}][{j}] is a view that holds one entry at several places (stride 0, e.g. "
                             "expand()), which cannot be updated in place: give the parameters themselves")
        start = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
        reach = 1 + sum((size - 1) * abs(stride) for size, stride in zip(p.shape, p.stride()))  # entries spanned
        end = start + reach * p.element_size()
        spans.append((start, end, j))
    spans.sort()
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"nodes[{k}][{min(i, j)}] and nodes[{k}][{max(i, j)}] share memory (a tied weight listed "
                             "twice?): each would take every update, so give each tensor once "
                             "(model.parameters() lists a tied one once)")


def gossiped_parameters(model: torch.nn.Module) -> ParamList:
    """The parameters decentralized training gossips for ``model``: those that train
    (``requires_grad``), detached, in ``model.parameters()`` order. A frozen parameter (a LoRA
    model's base, a frozen embedding) starts equal on every node (SPEC 1) and never changes, so it
    needs no messages; gossiping it with compressed messages would move it."""
    return [p.detach() for p in model.parameters() if p.requires_grad]


def check_node_params(nodes) -> None:
    """That ``nodes`` holds one model per node: a non-empty list (or tuple) of non-empty lists of
    floating-point tensors (TypeError for a wrong type, ValueError for an empty list), every node's
    of node 0's shapes, in the same order (ValueError)."""
    if not isinstance(nodes, (list, tuple)):
        raise TypeError(f"nodes must be a list of parameter lists (one per node), got {type(nodes).__name__}")
    if not nodes:
        raise ValueError("nodes must hold at least one node's parameter list, got none")
    for k, params in enumerate(nodes):
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"nodes[{k}] must be a list of tensors, got {type(params).__name__}")
        if not params:
            raise ValueError(f"nodes[{k}] must be a non-empty list of tensors")
        for j, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                got = f"a {p.dtype} tensor" if isinstance(p, torch.Tensor) else type(p).__name__
                raise TypeError(f"nodes[{k}][{j}] must be a floating-point tensor, got {got}")
        shapes, expected = [tuple(p.shape) for p in params], [tuple(p.shape) for p in nodes[0]]
        if shapes != expected:
            raise ValueError(f"nodes[{k}] holds tensors of shapes {shapes}, nodes[0] of {expected}: every node must "
                             "hold the same model, in the same order")


def average_model(nodes: list[ParamList]) -> ParamList:
    """``mean_i z_i`` per tensor (SPEC 1's evaluation model), as new tensors. ``nodes``: one
    non-empty list of floating-point tensors per node, the same shapes on every node
    (:func:`check_node_params`)."""
    check_node_params(nodes)
    avg = [p.detach().clone() for p in nodes[0]]
    for params in nodes[1:]:
        torch._foreach_add_(avg, [p.detach() for p in params])
    torch._foreach_div_(avg, len(nodes))
    return avg


def consensus_distance(nodes: list[ParamList]) -> torch.Tensor:
    """``1/n * sum_i ||z_i - mean z||^2`` over all tensors (SPEC 1), a 0-dim tensor."""
    avg = average_model(nodes)
    total = torch.zeros((), dtype=torch.float64, device=avg[0].device)
    for params in nodes:
        diffs = torch._foreach_sub([p.detach() for p in params], avg)
        total += torch.stack(torch._foreach_norm(diffs)).double().square().sum()
    return total / len(nodes)

