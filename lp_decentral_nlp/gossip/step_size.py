"""The consensus step ``gamma`` of Choco-SGD and Deep-Squeeze (SPEC 2 step 5): the default is
proportional to the compressor's contraction quality, never one constant for all
(docs/consensus_step.md has the measurements). :class:`~.push_sum.PushSumGossip` takes it when no
``gamma`` is given, and :class:`~.factory.GossipConfig` when no ``consensus_lr`` is."""
from __future__ import annotations

import math

from ..checks import check_choice
from .compressors import QSGD, Compressor, Identity, Quantize, RandomK, TopK

ALGORITHMS = ("choco", "deepsqueeze", "dpsgd")

#: gamma / (compression quality delta), per algorithm (docs/consensus_step.md): Choco's is the best
#: measured in training, Deep-Squeeze's the fastest measured consensus
CONSENSUS_LR_PER_QUALITY = {"choco": 5.0, "deepsqueeze": 1.5}

#: tensor size at which a scaled QSGD's quality ``1 / (1 + omega)`` is taken (a 1024 x 1024 layer)
QSGD_REFERENCE_NUMEL = 1 << 20


def compression_quality(compressor: Compressor | None) -> float:
    """The contraction quality ``delta`` in (0, 1] of ``compressor`` (Koloskova et al. 2019,
    ``E||C(x) - x||^2 <= (1 - delta) ||x||^2``): 1 for exact and 8-bit-quantized messages (their
    error is negligible next to sparsification), ``keep`` for top-k and random-k (whatever their
    value bits), ``1 / (1 + omega)`` for scaled QSGD at a ``QSGD_REFERENCE_NUMEL``-entry tensor.
    Unscaled QSGD is no contraction (ValueError)."""
    if compressor is None or isinstance(compressor, (Identity, Quantize)):
        return 1.0
    if isinstance(compressor, (TopK, RandomK)):
        return compressor.keep
    if isinstance(compressor, QSGD):
        if not compressor.scaled:
            raise ValueError("compressor QSGD(scaled=False) is not a contraction, so it has no default consensus "
                             "step (and Choco-SGD and Deep-Squeeze diverge with it whatever the step): use "
                             "QSGD(scaled=True)")
        n, s = QSGD_REFERENCE_NUMEL, compressor.levels
        return 1.0 / (1.0 + min(n / s**2, math.sqrt(n) / s))
    raise TypeError(f"compressor must be None, Identity, Quantize, TopK, RandomK or QSGD, got "
                    f"{type(compressor).__name__}")


def default_consensus_lr(compressor: Compressor | None, algorithm: str) -> float:
    """The default consensus step ``gamma`` (SPEC 2 step 5): ``min(1, c * delta)`` with ``delta``
    the compressor's :func:`compression_quality` and ``c`` from :data:`CONSENSUS_LR_PER_QUALITY`
    (5 for ``"choco"``, 1.5 for ``"deepsqueeze"``); 1.0 for ``"dpsgd"`` (exact or 8-bit SGP).

    Derived from measurements of the per-step contraction of the consensus distance
    (docs/consensus_step.md): the fastest ``gamma`` scales with ``delta`` (top-k at 10% and 1%,
    8-bit or fp32 values) and did not move with the graph's spectral gap from 0.013 to 0.40
    (rings of 4 to 32 nodes, a 4x4 torus), so the graph is not an input. Deep-Squeeze, which
    compresses the models themselves, mixes fastest at about 1.5 delta (it diverges beyond ~7
    delta). Choco mixes fastest at about 2.5 delta and diverges beyond ~10-20 delta; in training,
    twice that step (5 delta) did better at 1% top-k (digits +3 to +17 points, AG News at skew
    0.9 +1.6 points over three seeds) and the same at 10%, so Choco's default is 5 delta.

    Args:
        compressor: the message codec (None: exact messages).
        algorithm: ``"choco"``, ``"deepsqueeze"`` or ``"dpsgd"``.
    Returns:
        ``gamma`` in (0, 1].
    """
    check_choice("algorithm", algorithm, ALGORITHMS)
    if algorithm == "dpsgd":
        return 1.0
    return min(1.0, CONSENSUS_LR_PER_QUALITY[algorithm] * compression_quality(compressor))
