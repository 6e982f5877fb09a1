"""Memory layouts the compiled CPU kernels take: row-major (``contiguous``) and, for 4-D
``(N, C, H, W)`` tensors, channels last (``torch.channels_last``: memory ordered ``(N, H, W, C)``).

oneDNN's int8 convolution reads and writes channels last, so the 8-bit vision layers pass
channels-last tensors from one to the next (``docs/design.md``); an elementwise or per-sample
kernel runs on either layout by walking the tensor in memory order (:func:`memory_order`).
"""
from __future__ import annotations

import torch


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether `t` is a 4-D tensor with dense channels-last strides and not also row-major (a
    tensor with one channel, or 1 x 1 images, is both: it counts as row-major)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def is_dense(t: torch.Tensor) -> bool:
    """Whether `t` is row-major contiguous or channels last (:func:`is_channels_last`)."""
    return t.is_contiguous() or is_channels_last(t)


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A view of a :func:`is_dense` `t` whose row-major order is `t`'s memory order: `t` itself,
    or ``(N, H, W, C)`` for a channels-last ``(N, C, H, W)``. Dim 0 (the samples) stays first, so
    a per-sample loop over ``memory_order(t).reshape(N, -1)`` sees the same elements of each
    sample as over ``t.reshape(N, -1)``, in another order."""
    return t.permute(0, 2, 3, 1) if is_channels_last(t) else t


def dense_like(t: torch.Tensor) -> torch.Tensor:
    """`t` if :func:`is_dense`, else a row-major copy."""
    return t if is_dense(t) else t.contiguous()
