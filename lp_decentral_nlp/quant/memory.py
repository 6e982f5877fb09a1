"""What autograd keeps for backward: the memory 8-bit training saves (SPEC section 4)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def saved_tensor_bytes(fn: Callable[..., Any], *args, exclude: Iterable[torch.Tensor] = (), **kwargs) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and count the bytes autograd holds for its backward.

    Every tensor an autograd node saves (``ctx.save_for_backward`` and the built-in ops' saved
    tensors, as seen by ``torch.autograd.graph.saved_tensors_hooks``) is counted by its whole
    storage, each storage once, parameters included (a float GEMM keeps its fp32 weight; an 8-bit
    layer keeps the weight's 8-bit codes instead). Tensors kept in other ways (e.g. plain ``ctx``
    attributes) are not seen.

    Args:
        fn, args, kwargs: the forward pass to measure, called as ``fn(*args, **kwargs)``.
        exclude: tensors whose storages are not counted, e.g. ``model.parameters()``: a
            float layer saves a reference to its weight, which costs no memory beyond the model,
            so the count without them is what the forward pass allocates for backward. Read
            after `fn` returns, so it may be a list the forward pass fills (e.g. from forward
            hooks collecting some layers' inputs).

    Returns:
        ``(output, nbytes)``: what `fn` returned (its graph intact, ready for ``backward``) and the
        byte count.
    """
    def key(tensor: torch.Tensor) -> tuple[int, int]:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    storages: set[tuple[int, int]] = set()  # (address, bytes) of each storage seen

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages.add(key(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = fn(*args, **kwargs)
    excluded = {key(tensor) for tensor in exclude}
    return output, sum(nbytes for _, nbytes in storages - excluded)
