"""Per-node random streams (SPEC 1: node ``i`` draws the same numbers in either backend), the
epoch sampler that makes a node's data order a pure function of ``(seed, epoch)``, and the seeds
each batch is read and collated under."""
from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import Sampler
from transformers.utils import logging

logger = logging.get_logger(__name__)


class NodeRNG:
    """One torch RNG stream per node, swapped in around that node's work.

    Dropout and stochastic rounding draw from torch's global generator; giving each node its own
    stream makes node ``i`` draw the same numbers whether it runs alone in a process or beside
    other nodes in a simulation.
    """

    def __init__(self, seed: int, node_ids):
        self.states = {}
        saved = self._get()
        for i in node_ids:
            torch.manual_seed(node_seed(seed, i))
            self.states[i] = self._get()
        self._set(saved)

    @staticmethod
    def _get():
        return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    @staticmethod
    def _set(state):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])

    @contextmanager
    def activate(self, node: int):
        """Run the block in `node`'s random stream (torch's CPU and CUDA generators), then keep
        where the block left that stream and restore the stream that was active before."""
        saved = self._get()
        self._set(self.states[node])
        try:
            yield
        finally:
            self.states[node] = self._get()
            self._set(saved)

    def state_dict(self, node: int) -> dict:
        """Node ``node``'s stream: ``{"cpu": uint8 tensor, "cuda": [uint8 tensor per device] or None}``."""
        cpu, cuda = self.states[node]
        return {"cpu": cpu, "cuda": cuda}

    def load_state_dict(self, node: int, state: dict) -> None:
        """Restore :meth:`state_dict`; CUDA streams only when this machine has as many devices."""
        cpu, cuda = self.states[node]
        saved_cpu = state.get("cpu") if isinstance(state, dict) else None
        if not torch.is_tensor(saved_cpu) or saved_cpu.dtype != cpu.dtype or saved_cpu.shape != cpu.shape:
            raise ValueError(f"node {node}: the saved CPU RNG stream is not a {cpu.dtype} tensor of shape "
                             f"{tuple(cpu.shape)}")
        saved_cuda = state.get("cuda")
        if cuda is not None and saved_cuda is not None and len(saved_cuda) == len(cuda):
            cuda = list(saved_cuda)
        elif cuda is not None or saved_cuda is not None:
            logger.warning(f"node {node}: the checkpoint's CUDA RNG streams do not fit this machine; dropout and "
                           "stochastic rounding on CUDA will not repeat the interrupted run's draws")
        self.states[node] = (saved_cpu, cuda)


def node_seed(seed: int, node: int) -> int:
    """Seed of node ``node``'s private RNG streams (data order, dropout, stochastic rounding)."""
    return (seed * 1_000_003 + 7919 * (node + 1)) % (2**63 - 1)


class EpochSampler(Sampler[int]):
    """A node's shuffled shard order: a pure function of ``(seed, epoch)``, so a resumed run can
    start mid-epoch exactly where the interrupted one stopped (:meth:`set_epoch`).

    Args:
        size: samples in the shard.
        seed: the node's seed (:func:`node_seed`).
    """

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch ``epoch``'s order from its ``start``-th sample on."""
        self.epoch, self.start = epoch, start

    def epoch_seed(self) -> int:
        """The seed of this epoch's order: a pure function of ``(seed, epoch)``."""
        return (self.seed * 6364136223846793005 + 1442695040888963407 * (self.epoch + 1)) % (2**63 - 1)

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch_seed()))
        return iter(order[self.start:].tolist())

    def __len__(self) -> int:
        return self.size - self.start


class EpochBatchSampler(Sampler[list]):
    """A node's batches of ``batch_size`` in its :class:`EpochSampler` order, each a list of
    ``(index, batch seed)``; the last incomplete batch is dropped. The seed is a pure function of
    the node's seed, the epoch and the batch's position in it (:func:`batch_seed`): the batch is read
    and collated under it (``node_data.SeededBatches``), so random transforms and collators draw the
    same numbers whether they run in the main process or in any number of dataloader workers,
    persistent or not, and after a resume mid-epoch."""

    def __init__(self, sampler: EpochSampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def __iter__(self):
        order = list(self.sampler)
        first = self.sampler.start // self.batch_size  # the position of the first batch in the epoch
        for b in range(len(order) // self.batch_size):
            seed = batch_seed(self.sampler.epoch_seed(), first + b)
            yield [(i, seed) for i in order[b * self.batch_size:(b + 1) * self.batch_size]]

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size


def batch_seed(epoch_seed: int, batch: int) -> int:
    """The seed of batch ``batch`` (0-based position in its epoch) of an epoch seeded ``epoch_seed``."""
    return int(np.random.SeedSequence([epoch_seed, batch]).generate_state(1, np.uint64)[0] >> 1)


@contextmanager
def seeded_host_rngs(seed: int):
    """Run the block with torch's CPU generator, Python's ``random`` and NumPy's global generator
    seeded from ``seed``, and restore all three after it (the CUDA generators are left alone)."""
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])

