"""What autograd keeps for backward: the memory 8-bit training saves (SPEC section 4)."""
from __future__ import annotations

from typing import Any, Callable

import torch


def saved_tensor_bytes(fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and count the bytes autograd holds for its backward.

    Every tensor an autograd node saves (``ctx.save_for_backward`` and the built-in ops' saved
    tensors, as seen by ``torch.autograd.graph.saved_tensors_hooks``) is counted by its whole
    storage, each storage once, parameters included (a float GEMM keeps its fp32 weight; an 8-bit
    layer keeps the weight's 8-bit codes instead). Tensors kept in other ways (e.g. plain ``ctx``
    attributes) are not seen.

    Returns:
        ``(output, nbytes)``: what `fn` returned (its graph intact, ready for ``backward``) and the
        byte count.
    """
    storages: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = fn(*args, **kwargs)
    return output, sum(storages.values())
