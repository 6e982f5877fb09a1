"""Stochastic Gradient Push (Assran et al. 2019) on the push-sum core (SPEC 1-2): uncompressed
push-sum averaging, on static or time-varying graphs."""
from __future__ import annotations

from .compressors import Identity
from .faults import FaultPlan
from .push_sum import PushSumGossip
from .topology import Topology


class SGP(PushSumGossip):
    """Stochastic Gradient Push (Assran et al. 2019): uncompressed push-sum averaging,
    ``x_i <- sum_j W_ij x~_j``, ``w_i <- sum_j W_ij w_j``. Works on time-varying graphs.

    Args:
        topology, transport, seed, faults, reference: as in :class:`PushSumGossip` (no compressor: the
            others are keyword-only, so ``SGP(topology, TopK(...))`` is refused).
    """

    _keep = 0.0
    algorithm = "dpsgd"

    def __init__(self, topology: Topology, *, transport=None, seed: int = 0, faults: FaultPlan | None = None,
                 reference=None):
        super().__init__(topology, Identity(), 1.0, transport, seed, faults, reference)

    def _message(self, k, params):
        return self._scaled_copy(k, params)

    def _direction(self, k, contributions):
        self._mixed_sum(contributions, self_shift=0.0)
