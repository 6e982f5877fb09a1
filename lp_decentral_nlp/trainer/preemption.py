"""``enable_jit_checkpoint``: SIGTERM (a preempted job's notice) becomes a checkpoint at the end of
the current step, written by every process of the run at the same step, and the end of training."""
from __future__ import annotations

import contextlib
import signal

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


class SigtermWatch:
    """Records SIGTERM while :meth:`installed` (the signal no longer ends the process there).

    Attributes:
        received: whether this process got SIGTERM since :meth:`installed` was entered.
    """

    def __init__(self):
        self.received = False

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGTERM for the block, then restore the handler it replaced. ValueError outside
        the main thread (Python delivers signals to the main thread only)."""
        try:
            previous = signal.signal(signal.SIGTERM, self._handler)
        except ValueError:
            raise ValueError("enable_jit_checkpoint handles SIGTERM, which Python delivers to the main thread only: "
                             "call train() from the main thread, or leave enable_jit_checkpoint False") from None
        self.received = False
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _handler(self, signum, frame) -> None:
        if not self.received:
            logger.warning("SIGTERM received: a checkpoint is written at the end of this step, then training stops "
                           "(enable_jit_checkpoint)")
        self.received = True

    def agreed(self, node_group) -> bool:
        """Whether any process of the run received SIGTERM (a gather over the processes in the
        distributed backend: every rank calls it at the same step, so all stop at the same one)."""
        local = torch.full((len(node_group.node_ids),), int(self.received), dtype=torch.int64)
        return bool(node_group.gather(local).any())
