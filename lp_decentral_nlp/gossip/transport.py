"""How gossip messages travel: all nodes in one process, or one node per torch.distributed rank.

Both transports expose the same three calls used by the push-sum core in :mod:`.push_sum`:

- ``node_ids(num_nodes)``: which graph nodes this process runs (all of them, or ``[rank]``);
- ``prepare(topology, layout, device, start_step, settings)``: once, before the first step, with
  what every rank must build alike (``{"gamma": "0.5", ...}``; the distributed transport's
  pre-flight check compares them);
- ``exchange(step, outgoing)``: hand every local node's message to its out-neighbours and return,
  for every local node, the ``(sender, message)`` pairs from its in-neighbours at ``step``,
  sorted by sender.
"""
from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..checks import NUMBER_FIELDS, check_number
from .topology import Topology
from .wire import Message, MessageLayout

Received = dict[int, list[tuple[int, Message]]]


class GossipPeerError(RuntimeError):
    """A gossip exchange with one peer failed: it timed out, or the peer's connection broke
    (e.g. its process died).

    Attributes:
        peer: the graph node (= rank) that failed, or None where the backend cannot tell which of
            a step's peers it was (NCCL completes a step's sends and receives as one batch: the
            message names them all).
    """

    def __init__(self, message: str, peer: int | None):
        super().__init__(message)
        self.peer = peer


class GossipTimeoutError(GossipPeerError, TimeoutError):
    """A peer did not complete a send/receive within the transport's timeout (also a
    ``TimeoutError``)."""


class GossipMismatchError(ValueError):
    """The distributed transport's pre-flight check found a neighbour that built the gossip
    otherwise (another graph, algorithm, compressor, message size, model or step): the ranks'
    settings differ. A ``ValueError``, as the settings' own checks raise.

    Attributes:
        peer: the graph node (= rank) that disagrees.
    """

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class SimulatedTransport:
    """All ``n`` nodes live in this process; a "send" is handing over the message buffer itself.

    Nothing is copied: receivers decode the sender's buffer directly, so a simulated round costs
    what ``n`` nodes' computation costs. The bytes reported are still those of the real buffer.
    """

    def node_ids(self, num_nodes: int) -> list[int]:
        """Every graph node, ``0 .. num_nodes - 1``: they all run in this process."""
        return list(range(num_nodes))

    def prepare(self, topology: Topology, layout: MessageLayout, device: torch.device,
                start_step: int, settings: dict[str, str]) -> None:
        """Keep `topology` (nothing to allocate or compare: one process built every node)."""
        self._topology = topology

    def exchange(self, step: int, outgoing: dict[int, Message]) -> Received:
        """Every node's in-neighbours' messages at `step`, the senders' own buffers (no copy)."""
        return {i: [(j, outgoing[j]) for j in self._topology.in_neighbors(i, step)] for i in outgoing}

    def memory_bytes(self, topology: Topology, layout: MessageLayout, node_ids: list[int]) -> int:
        """Bytes of receive buffers: none, receivers read the senders' buffers."""
        return 0

    def __repr__(self):
        return "SimulatedTransport()"


class TorchDistributedTransport:
    """One graph node per rank of an initialised ``torch.distributed`` process group.

    Node ``i`` is the group's rank ``i``; the group size must equal the topology's ``num_nodes``.
    Every step posts nonblocking point-to-point sends to the out-neighbours and receives from the
    in-neighbours (``batch_isend_irecv``: gloo for CPU tensors, NCCL for CUDA tensors); there is
    no collective over all ranks. Receive buffers are allocated once (sizes follow from the
    layout, identical on every rank) and reused.

    Before the first step, :meth:`prepare` runs a pre-flight handshake over every edge of one
    period of the graph: each rank sends its out-neighbours (rank, destination, step, number of
    nodes, message size, topology fingerprint, one hash per setting of the algorithm) and
    checks what its in-neighbours sent, so different graphs, models, compressors or step counters
    on different ranks raise a ``ValueError`` naming the peer and what differs instead of
    deadlocking or silently mixing garbage. The algorithm's settings (algorithm, compressor,
    gamma, seed, fault plan, parameter dtype and shapes) travel as one hash each, so the error
    names the setting and shows this rank's value.

    Every wait is bounded by ``timeout`` seconds; a peer that never answers raises
    :class:`GossipTimeoutError` naming it (on NCCL, which completes a step's sends and receives as
    one batch, naming the step's peers). On NCCL, waiting with a timeout blocks the host thread
    until the messages have arrived (once per gossip step); that is what lets the error name the
    silent peers instead of leaving them to the NCCL watchdog.

    Args:
        timeout: seconds to wait for any one step's messages (> 0). Count the slowest peer's
            compute between two gossip steps (evaluation on one rank included).
        group: the process group (default: the world group).
    """

    _MAGIC = 0x6C70646E  # "lpdn"
    _HANDSHAKE = ("magic", "sender rank", "receiver rank", "step", "number of nodes", "message bytes",
                  "topology")

    def __init__(self, timeout: float = 300.0, group=None):
        self.timeout = float(check_number("timeout", timeout, NUMBER_FIELDS["gossip_timeout"]))
        self.group = group

    def node_ids(self, num_nodes: int) -> list[int]:
        """``[rank]``: this process runs the graph node of its rank. RuntimeError without an
        initialised process group; ValueError unless it has ``num_nodes`` ranks."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedTransport needs an initialised process group: call "
                               "torch.distributed.init_process_group(...) first (e.g. under torchrun)")
        size = dist.get_world_size(self.group)
        if size != num_nodes:
            raise ValueError(f"the process group has {size} ranks but the topology has {num_nodes} nodes; "
                             "run one rank per node")
        self._rank = dist.get_rank(self.group)
        return [self._rank]

    def prepare(self, topology: Topology, layout: MessageLayout, device: torch.device,
                start_step: int, settings: dict[str, str]) -> None:
        """Check the backend suits `device` (gloo on the CPU, NCCL on CUDA), allocate one receive
        buffer per in-neighbour, and run the pre-flight check: every neighbour built the same
        `settings`, message size and `start_step` (:class:`GossipMismatchError` otherwise)."""
        backend = str(dist.get_backend(self.group))
        needed = "nccl" if device.type == "cuda" else "gloo"
        if needed not in backend:
            raise ValueError(f"parameters on {device.type} need the {needed!r} backend for point-to-point "
                             f"messages, but the process group uses {backend!r}")
        self._topology = topology
        self._device = device
        self._slots = [Message(layout, device) for _ in range(_most_in_neighbors(topology, self._rank))]
        self._preflight(topology, layout.nbytes, start_step, settings)

    def memory_bytes(self, topology: Topology, layout: MessageLayout, node_ids: list[int]) -> int:
        """Bytes of receive buffers: one message per in-neighbour of this rank (``node_ids[0]``),
        the most it has in any phase of the graph."""
        return _most_in_neighbors(topology, node_ids[0]) * layout.nbytes

    def exchange(self, step: int, outgoing: dict[int, Message]) -> Received:
        """Send this rank's message to its out-neighbours at `step` and receive its in-neighbours'
        into the buffers ``prepare`` allocated (point to point, within the timeout:
        :class:`GossipTimeoutError` / :class:`GossipPeerError` name the peer)."""
        me = self._rank
        ins = self._topology.in_neighbors(me, step)
        outs = self._topology.out_neighbors(me, step)
        slots = self._slots[: len(ins)]
        self._transfer([outgoing[me].buffer] * len(outs), outs, [m.buffer for m in slots], ins,
                       f"gossip step {step}")
        return {me: list(zip(ins, slots))}

    # -- internals -------------------------------------------------------------------------------
    def _peer(self, node: int) -> int:
        return node if self.group is None else dist.get_global_rank(self.group, node)

    def _transfer(self, sends, send_to, recvs, recv_from, what: str) -> None:
        """Post all sends and receives at once, then wait for each with the deadline.

        Any failure names its peer (every peer of the step where the backend returns one handle for
        the batch: NCCL): a broken connection is a ``GossipPeerError``, a missed deadline a
        ``GossipTimeoutError``.
        """
        ops = [(dist.isend, buf, j, "sending to") for buf, j in zip(sends, send_to)]
        ops += [(dist.irecv, buf, j, "receiving from") for buf, j in zip(recvs, recv_from)]
        if not ops:
            return
        works = self._post(ops, what)
        if len(works) == len(ops):  # one handle per op (gloo): a failure names its peer
            pending = [(w, doing, j, f"rank {j}") for w, (_, _, j, doing) in zip(works, ops)]
            pending = pending[len(sends):] + pending[: len(sends)]  # receives first: they name a silent peer
        else:  # one handle for the whole batch (NCCL coalesces): a failure names every peer of the step
            peers = sorted({j for *_, j, _ in ops})
            pending = [(w, "exchanging with", None, f"one of ranks {peers}") for w in works]
        deadline = time.monotonic() + self.timeout
        for work, doing, peer, who in pending:
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                done = work.wait(timedelta(seconds=remaining))
            except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses with backend text
                if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                    raise GossipPeerError(f"rank {self._rank}: {what}: {doing} {who.removeprefix('one of ')} failed "
                                          f"(has {who} exited?): {exc}", peer) from exc
                done = False
            if done is False:
                raise GossipTimeoutError(
                    f"rank {self._rank}: {what}: timed out after {self.timeout:g} s {doing} "
                    f"{who.removeprefix('one of ')}; {who} never answered (is it running, alive, and calling "
                    "gossip.step() with the same topology and step count?)", peer)

    def _post(self, ops, what: str) -> list:
        """Post the point-to-point ops, returning their work handles in order.

        Backends that coalesce (NCCL) get one batch, so ranks posting sends before receives
        cannot deadlock; the others (gloo) get one op at a time, exactly as ``batch_isend_irecv``
        would post them, so that a connection already closed names its peer.
        """
        if "nccl" in str(dist.get_backend(self.group)):
            try:
                return dist.batch_isend_irecv([dist.P2POp(op, buf, self._peer(j), self.group)
                                               for op, buf, j, _ in ops])
            except RuntimeError as exc:
                peers = sorted({j for *_, j, _ in ops})
                raise RuntimeError(f"rank {self._rank}: {what}: posting messages to/from ranks {peers} failed "
                                   f"(has one of them exited?): {exc}") from exc
        works = []
        for op, buf, j, doing in ops:
            try:
                works.append(op(buf, self._peer(j), self.group))
            except RuntimeError as exc:  # e.g. the peer's connection is already closed
                raise GossipPeerError(f"rank {self._rank}: {what}: {doing} rank {j} failed (has rank {j} "
                                      f"exited?): {exc}", j) from exc
        return works

    def _preflight(self, topology: Topology, nbytes: int, start_step: int, settings: dict[str, str]) -> None:
        me = self._rank
        fields = self._HANDSHAKE + tuple(settings)
        hashes = [int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "little") >> 1
                  for value in settings.values()]
        for step in range(start_step, start_step + topology.period):
            outs = topology.out_neighbors(me, step)
            ins = topology.in_neighbors(me, step)

            def card(sender, receiver):
                return [self._MAGIC, sender, receiver, step, topology.num_nodes, nbytes, topology.fingerprint(), *hashes]

            sends = [torch.tensor(card(me, j), dtype=torch.int64, device=self._device) for j in outs]
            recvs = [torch.zeros(len(fields), dtype=torch.int64, device=self._device) for _ in ins]
            self._transfer(sends, outs, recvs, ins, f"pre-flight check before step {step}")
            for j, buf in zip(ins, recvs):
                got, expected = buf.tolist(), card(j, me)
                for field, g, e in zip(fields, got, expected):
                    if g != e:
                        if field in settings:
                            value = settings[field]
                            shown = f"this rank's {field}: {value if len(value) <= 120 else value[:117] + '...'}"
                        elif field == "topology":
                            shown = f"this rank's is {topology!r}; the peer's edges or mixing weights differ"
                        else:
                            shown = f"it sent {g}, this rank expects {e}"
                        raise GossipMismatchError(
                            f"rank {me}: pre-flight check before step {step} failed: rank {j} disagrees on the "
                            f"{field} ({shown}); every rank must build the same topology, algorithm, compressor "
                            "and model, and resume from the same step", j)

    def __repr__(self):
        return f"TorchDistributedTransport(timeout={self.timeout:g})"


def _most_in_neighbors(topology: Topology, node: int) -> int:
    return max(len(topology.in_neighbors(node, t)) for t in range(topology.period))
