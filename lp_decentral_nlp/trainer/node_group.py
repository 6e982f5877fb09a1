"""NodeGroup: the ``num_nodes`` graph nodes of a run as one system, whichever backend holds them.

* ``backend="simulated"``: every node lives in this process.
* ``backend="distributed"``: one node per process of an initialised ``torch.distributed`` group
  (``torchrun`` / ``accelerate launch``); the rank is the node index.

Everything that differs between the two backends is here: which node ids are local, the
collectives over all nodes (gather, sum, barrier, object gather), the broadcast of the initial
model (SPEC 1: every node starts from the same weights) and the gossip transport. The trainer
never branches on the backend itself.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from .. import gossip as gossip_lib
from ..gossip.transport import GossipPeerError


class CollectiveError(GossipPeerError):
    """A collective over every process (logging's gather, the averaged model's sum, a barrier)
    failed: another rank exited or stopped answering. A collective does not say which rank, so
    ``peer`` is None; the gossip step's :class:`~lp_decentral_nlp.gossip.GossipPeerError` names it
    when a neighbour is lost there. Like it, the trainer adds the checkpoint to resume from."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message, peer)


@contextlib.contextmanager
def _collective(what: str):
    """Run a ``torch.distributed`` collective, turning the process group's error (gloo's
    "Connection closed by peer", a timeout after ``ddp_timeout``) into a :class:`CollectiveError`."""
    try:
        yield
    except RuntimeError as err:  # gloo and NCCL raise RuntimeError (DistBackendError is one)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CollectiveError(f"rank {dist.get_rank()}: {what} with every rank failed (has another rank exited or "
                              f"stopped answering?): {first}") from err


class NodeGroup:
    """The nodes of a run and the collectives over them.

    Args:
        num_nodes: n, the number of graph nodes.
        backend: ``"simulated"`` or ``"distributed"``.
    Raises:
        RuntimeError: ``backend="distributed"`` without an initialised process group, or with one
            that has no backend for point-to-point messages.
        ValueError: the process group's world size is not ``num_nodes``, or a launcher started
            several processes for ``backend="simulated"`` (each would run every node and write the
            same files).
    """

    def __init__(self, num_nodes: int, backend: str):
        self.num_nodes, self.backend = num_nodes, backend
        self.distributed = backend == "distributed"
        initialized = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            world = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "1"))
            if world > 1:
                raise ValueError(f"backend='simulated' runs every node in one process, but the launcher started "
                                 f"{world} processes: set backend='distributed' and num_nodes={world}, or run "
                                 f"the script without a launcher")
            self.node_ids = list(range(num_nodes))
        else:
            if not initialized:
                how = ("accelerate launch on a machine without GPUs, or with --cpu, starts one process unless "
                       "--multi_gpu is given: add --multi_gpu and drop --cpu if given (accelerate refuses the two "
                       "together; without a GPU the nodes run on the CPU over gloo), or "
                       if "ACCELERATE_USE_CPU" in os.environ else "")
                raise RuntimeError(f"backend='distributed' needs an initialised torch.distributed process group: "
                                   f"{how}launch with torchrun --nproc_per_node {num_nodes}, one process per node")
            if dist.get_backend() == "undefined":
                raise RuntimeError("backend='distributed': the torch.distributed process group has no backend for "
                                   "point-to-point messages (transformers made it without one): on a machine "
                                   "without GPUs pass use_cpu=True (gloo)")
            if dist.get_world_size() != num_nodes:
                raise ValueError(f"num_nodes={num_nodes} but the torch.distributed world size is "
                                 f"{dist.get_world_size()}: launch exactly one process per node")
            here, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
            if str(dist.get_backend()) == "nccl" and here > gpus:  # NCCL refuses two ranks on one GPU, late
                raise RuntimeError(f"backend='distributed' over NCCL needs a GPU per process, and this machine runs "
                                   f"{here} processes (LOCAL_WORLD_SIZE) on {gpus} GPU(s): launch at most {gpus} "
                                   "per machine, pass use_cpu=True (gloo), or use backend='simulated', which runs "
                                   "every node in one process")
            self.node_ids = [dist.get_rank()]

    @property
    def is_main(self) -> bool:
        """Whether this process prints progress and writes shared files (rank 0, or the only process)."""
        return not self.distributed or dist.get_rank() == 0

    def transport(self, timeout: float):
        """The gossip transport of this backend (None: the in-process simulation)."""
        return gossip_lib.TorchDistributedTransport(timeout=timeout) if self.distributed else None

    @torch.no_grad()
    def broadcast_(self, tensors) -> None:
        """Overwrite ``tensors`` in place with process 0's values (no-op when simulated)."""
        if self.distributed:
            with _collective("broadcasting the initial model"):
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=0)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-node values of all nodes, shape ``(num_nodes, ...)``, from ``local`` of shape
        ``(len(node_ids), ...)`` in every process."""
        if not self.distributed:
            return local
        return torch.cat(self._gathered_parts(local)).to(local.device)

    def _gathered_parts(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every process's ``local``, in rank order, on the process group's device (distributed)."""
        sent = _on_group_device(local).contiguous()
        parts = [torch.empty_like(sent) for _ in range(dist.get_world_size())]
        with _collective("gathering the nodes' values"):
            dist.all_gather(parts, sent)
        return parts

    @torch.no_grad()
    def sum(self, tensors_per_node) -> list[torch.Tensor]:
        """Sum over all nodes of each float tensor: ``tensors_per_node[k][j]`` is tensor ``j`` of
        local node ``k``; returns one tensor per ``j``, all nodes' tensors ``j`` added one after
        another in node order in both backends, so the same bits (the averaged model of a
        distributed run is the simulation's). A 16-bit tensor's sum is float32 (no overflow or
        rounding before the caller divides it), another's in its dtype. Simulated it holds one sum
        at a time beyond the nodes; distributed each tensor is gathered (``num_nodes`` copies of
        one tensor at a time): an all-reduce's order of addition depends on its algorithm and
        moved the last bits."""
        sums = []
        for ts in zip(*tensors_per_node):
            dtype = torch.float32 if ts[0].dtype in (torch.float16, torch.bfloat16) else ts[0].dtype
            rows = ([row for part in self._gathered_parts(torch.stack(ts)) for row in part] if self.distributed
                    else ts)
            total = rows[0].to(ts[0].device, dtype, copy=True)
            for row in rows[1:]:
                total.add_(row.to(ts[0].device))
            sums.append(total)
        return sums

    def barrier(self) -> None:
        """Wait for every process (no-op when simulated)."""
        if self.distributed:
            with _collective("waiting at a barrier"):
                dist.barrier()

    def disagreement(self, settings: dict) -> tuple[str, int, object, object] | None:
        """The first of ``settings`` (name -> value, compared with ``==``) on which a process was
        given another value than process 0: ``(name, rank, its value, process 0's value)``; for a
        list value, the name says the first entry that differs (``"name[i]"``, a missing entry is
        ``None``). None when every process agrees, and always when simulated.

        One gather of every process's settings, so every process gets the same answer and all of
        them can stop together, before a collective whose calls would not match (the initial
        model's broadcast over tensors of other shapes or count waited for ``ddp_timeout``)."""
        if not self.distributed:
            return None
        every = self.gather_objects(settings)
        ours = every[0]
        for rank, theirs in enumerate(every[1:], start=1):
            for name in [*ours, *(name for name in theirs if name not in ours)]:
                mine, other = ours.get(name), theirs.get(name)
                if mine == other or repr(mine) == repr(other):  # (NaN, in a dict too, is not equal to itself)
                    continue
                if isinstance(mine, list) and isinstance(other, list):
                    i = next(i for i in range(max(len(mine), len(other)))
                             if i >= min(len(mine), len(other)) or mine[i] != other[i])
                    return (f"{name}[{i}]", rank, other[i] if i < len(other) else None,
                            mine[i] if i < len(mine) else None)
                return name, rank, other, mine
        return None

    def gather_objects(self, obj) -> list:
        """``[obj of process 0, obj of process 1, ...]`` (``[obj]`` when simulated)."""
        if not self.distributed:
            return [obj]
        out = [None] * dist.get_world_size()
        with _collective("gathering the processes' results"):
            dist.all_gather_object(out, obj)
        return out


def _on_group_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy on this process's GPU when the process group cannot reduce it where it
    is: NCCL (accelerate's backend on GPUs) takes CUDA tensors only, and the trainer's counters
    (bytes sent, skipped steps) live on the CPU."""
    backend = str(dist.get_backend())
    if tensor.device.type == "cpu" and "nccl" in backend and "gloo" not in backend:
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor
