"""Hardware cost accounting (SPEC section 7): compute, energy, memory and communication per node.

``estimate_cost(model, input_shape, batch_size, precision)`` walks the real model once on the
``meta`` device and returns a :class:`CostReport`; ``communication_cost`` measures the gossip
traffic with the gossip engine's real encoders. ``python -m lp_decentral_nlp.cost`` prints
fp32 vs 8-bit side by side. ``convention="ours"`` (default) or ``"paper"`` (Table 10) chooses how
the 8-bit model is priced (SPEC 7).
"""
from .communication import CommunicationCost, communication_cost
from .report import (
    CONVENTIONS,
    ENERGY_PJ,
    OPTIMIZER_STATES,
    PRECISIONS,
    CostReport,
    LayerCost,
    PricedOps,
    TrainInference,
    estimate_cost,
    format_comparison,
)

__all__ = [
    "CommunicationCost",
    "communication_cost",
    "CONVENTIONS",
    "ENERGY_PJ",
    "OPTIMIZER_STATES",
    "PRECISIONS",
    "CostReport",
    "LayerCost",
    "PricedOps",
    "TrainInference",
    "estimate_cost",
    "format_comparison",
]
