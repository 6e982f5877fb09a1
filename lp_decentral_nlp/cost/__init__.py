"""Hardware cost accounting (SPEC section 7): compute, energy, memory and communication per node.

``estimate_cost(model, input_shape, batch_size, precision)`` walks the real model once on the
``meta`` device and returns a :class:`CostReport`; ``communication_cost`` measures the gossip
traffic with the gossip engine's real encoders. ``python -m lp_decentral_nlp.cost`` prints
fp32 vs 8-bit side by side. ``convention="ours"`` (default) or ``"paper"`` (Table 10) chooses how
the 8-bit model is priced (SPEC 7).

Lazy (:mod:`lp_decentral_nlp.utils.lazy`): a name imports its submodule on first use, so the
command line checks its flags before torch is imported.
"""
from ..utils.lazy import lazy_namespace

# public name -> the submodule that defines it
_EXPORTS = {
    "CommunicationCost": ".communication",
    "communication_cost": ".communication",
    "CONVENTIONS": ".conventions",
    "ENERGY_PJ": ".conventions",
    "OPTIMIZER_STATES": ".conventions",
    "PRECISIONS": ".conventions",
    "CostReport": ".report",
    "LayerCost": ".report",
    "PricedOps": ".report",
    "TrainInference": ".report",
    "estimate_cost": ".report",
    "format_comparison": ".report",
    "checkpointable_layers": ".walk",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_namespace(__name__, _EXPORTS, subpackages=("communication", "conventions", "layers", "ops",
                                                                            "report", "walk"))
