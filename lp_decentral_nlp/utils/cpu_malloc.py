"""glibc malloc settings for training on the CPU: keep freed tensor memory for the next step.

PyTorch's CPU tensors come from ``malloc``. By default glibc hands large freed blocks back to the
system: a block above the *mmap threshold* is its own mapping and is unmapped when freed, and
free memory at the top of the heap beyond the *trim threshold* is released. A training step
allocates and frees hundreds of MB of activations and gradients, so every step page-faults that
memory in again, and the kernel zeroes each page (about 140K minor faults per DistilBERT-base
step at batch 8 x 128 on the CPU, a quarter of its time on 2 cores). glibc also moves the mmap
threshold up whenever a mapped block is freed, so how much of this happens depends on what the
process freed before: it changes from run to run, and between equal steps of one process (the
steps of a simulated round against plain steps, say).

:func:`keep_freed_memory` fixes the three settings with ``mallopt``: blocks up to 32 MiB (glibc's
largest mmap threshold on 64-bit systems) come from the heap, up to 1 GiB of free heap top is
kept, and the heap grows 256 MiB at a time. Freed memory is then reused by the next step, which
takes fewer page faults and the same time every step; the process keeps its peak memory
until it exits (blocks above 32 MiB, such as a large embedding's gradient, are still mapped and
unmapped each time). :class:`~lp_decentral_nlp.trainer.DecentralizedTrainer` applies it in one
place, :func:`tune_process_for_training` at the start of ``train()``, when it trains on the CPU
(``tune_cpu_malloc=True``, the default; ``--default-malloc`` in the recipes keeps glibc's policy).
``benchmarks/bench_simulator.py`` measures its effect (docs/benchmarks.md; why: docs/design.md). The settings last for
the life of the process and apply to every thread.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch
from transformers.utils import logging

from ..checks import Number, check_number

logger = logging.get_logger(__name__)

#: glibc's ``mallopt`` parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
#: glibc's largest mmap threshold on 64-bit systems (``HEAP_MAX_SIZE / 2``); mallopt refuses more
MAX_MMAP_THRESHOLD = 32 << 20


def glibc_available() -> bool:
    """Whether this process runs on glibc, where :func:`keep_freed_memory` can change the policy."""
    return _glibc() is not None


@functools.cache
def _glibc():
    """The C library if it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # musl and others lack it
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def keep_freed_memory(mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_threshold: int = 1 << 30,
                      top_pad: int = 256 << 20) -> bool:
    """Set glibc's malloc to keep freed memory in the process (see the module docstring).

    Args:
        mmap_threshold: bytes; larger blocks get their own mapping, unmapped when freed. In
            ``[128 KiB, 32 MiB]`` (glibc refuses more); fixing it also stops glibc from moving it.
        trim_threshold: bytes of free memory at the top of the heap kept rather than released,
            at least ``mmap_threshold`` and below 2 GiB.
        top_pad: extra bytes requested from the system each time the heap grows, below 2 GiB.
    Returns:
        True if the settings were applied, False where the C library is not glibc (macOS,
        Windows, musl): nothing is changed there.
    """
    def checked(name, value, low, high=(1 << 31) - 1):
        return check_number(name, value, Number(integer=True, low=low, high=high, what="an int of bytes"))

    mmap_threshold = checked("mmap_threshold", mmap_threshold, 128 << 10, MAX_MMAP_THRESHOLD)
    trim_threshold = checked("trim_threshold", trim_threshold, mmap_threshold)
    top_pad = checked("top_pad", top_pad, 0)
    libc = _glibc()
    if libc is None:
        return False
    for param, name, value in ((_M_MMAP_THRESHOLD, "mmap_threshold", mmap_threshold),
                               (_M_TRIM_THRESHOLD, "trim_threshold", trim_threshold),
                               (_M_TOP_PAD, "top_pad", top_pad)):
        if libc.mallopt(param, value) != 1:
            raise OSError(f"glibc's mallopt refused {name}={value}")
    return True


def tune_process_for_training(device, tune_cpu_malloc: bool) -> bool:
    """The process-wide settings of a training run: :func:`keep_freed_memory` when training on the
    CPU and ``tune_cpu_malloc`` is set (``DecentralizedTrainingArguments.tune_cpu_malloc``).

    Args:
        device: the ``torch.device`` the run trains on.
        tune_cpu_malloc: whether the run asks for the malloc policy.
    Returns:
        True if the policy was applied (CPU, asked for, glibc), else False.
    """
    if not tune_cpu_malloc or torch.device(device).type != "cpu" or not keep_freed_memory():
        return False
    logger.info("glibc malloc keeps freed memory for the next step (tune_cpu_malloc=True)")
    return True
