"""Deep-Squeeze with push-sum (Tang et al. 2019; directed form of Sparse-Push, Aketi et al. 2021),
SPEC 2 and 2a: error-compensated compressed models, on static or time-varying graphs."""
from __future__ import annotations

from .compressors import Compressor, Identity
from .faults import FaultPlan
from .push_sum import PushSumGossip
from .topology import Topology


class DeepSqueeze(PushSumGossip):
    """Deep-Squeeze with push-sum (Tang et al. 2019; directed form of Sparse-Push, Aketi et al. 2021), SPEC 2.

    Error-compensated: ``v_i = x~_i + e_i``, ``q_i = C(v_i)``, ``e_i = v_i - q_i``;
    ``x_i <- x~_i + gamma * (sum_j W_ij q_j - q_i)``. Without compression and with ``gamma=1``
    this is SGP. Works on time-varying graphs.

    Args: as :class:`ChocoSGD` (any topology), but the default ``gamma`` is
    ``default_consensus_lr(compressor, "deepsqueeze")``, 1.5 times the compressor's quality (0.015
    for ``TopK(0.01)``; 0.5 times with ``RandomK``). State: ``"error"`` (``e_i``).
    """

    _state_names = ("error",)
    algorithm = "deepsqueeze"

    def __init__(self, topology: Topology, compressor: Compressor | None = None, gamma: float | None = None,
                 transport=None, seed: int = 0, faults: FaultPlan | None = None, reference=None):
        super().__init__(topology, compressor if compressor is not None else Identity(), gamma, transport, seed,
                         faults, reference)

    def _message(self, k, params):
        return self._state["error"][k].add_(self._scaled_copy(k, params))

    def _own_commit(self, k):
        return self._state["error"][k], -1.0  # e_k = v_k - q_k

    def _direction(self, k, contributions):
        self._mixed_sum(contributions, self_shift=1.0)
