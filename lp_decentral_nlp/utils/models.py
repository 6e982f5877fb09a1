"""What a model exposes through transformers' conventions, read the same way by every package."""
from __future__ import annotations

from torch import nn


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_input_embeddings()`` (the module that reads token ids: NEFTune adds its noise
    there, the cost model feeds it token ids), or None where the model has none (not a
    transformers model, or one without input embeddings)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return embeddings if isinstance(embeddings, nn.Module) else None
