"""Sample-statistics normalisation layers for vision (SPEC section 5).

BatchNorm's batch statistics break under non-IID shards, so the vision path uses layers whose
statistics come from one sample (EvoNorm-S0, Range EvoNorm) or, for comparison, the range-based
batch norm of Banner et al. 2018 that the 8-bit literature uses.

All layers take ``(N, C, H, W)`` input, hold parameters ``weight``, ``bias`` (and ``v`` for the
fused activation) of shape ``(C,)``, compute their statistics in (at least) float32 and return a
tensor of the input's dtype and shape. Each layer is a thin module over a functional form
(:func:`evonorm_s0`, :func:`range_evonorm2d`, :func:`range_batch_norm2d`) so that an 8-bit
variant can call the same maths on quantized inputs and parameters.

Normalising constant (SPEC section 5, Banner et al. 2018 eq. 3): ``C(n) = 1 / sqrt(2 ln n)``,
so that ``C(n) * range`` stands in for a standard deviation. It is undefined for ``n = 1``
(``ln 1 = 0``); :func:`range_scale_constant` raises for ``n < 2`` and the layers check their
``n`` when they are built (Range EvoNorm: ``n = C / groups``) or on the first forward pass
(Range BatchNorm: ``n = N * H * W``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..checks import POSITIVE_INT, Number, check_flag, check_number
from ..utils.layout import dense_like

__all__ = [
    "range_scale_constant",
    "evonorm_s0",
    "range_evonorm2d",
    "RangeEvoNormFunction",
    "range_batch_norm2d",
    "EvoNormS0",
    "RangeEvoNorm2d",
    "RangeBatchNorm2d",
]


def range_scale_constant(n: int) -> float:
    """``C(n) = 1 / sqrt(2 ln n)`` (SPEC section 5): scales a range over ``n`` values to a std.

    Raises ValueError for ``n < 2`` (``ln 1 = 0``: one value has no spread to measure).
    """
    if not Number(integer=True).admits(n):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if n < 2:
        raise ValueError(
            f"range normalisation needs at least 2 values per statistic, got n={n} "
            "(C(n) = 1/sqrt(2 ln n) is undefined for n = 1)"
        )
    return 1.0 / math.sqrt(2.0 * math.log(n))


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    # Statistics in float32, or float64 when the input already is (gradcheck, reference runs).
    return torch.promote_types(x.dtype, torch.float32)


def _checked_channels_groups(num_channels: int, groups: int) -> tuple[int, int]:
    """``(num_channels, groups)`` as ints; ValueError unless both are integers >= 1 and ``groups``
    divides ``num_channels``."""
    num_channels, groups = (check_number(name, value, POSITIVE_INT)
                            for name, value in (("num_channels", num_channels), ("groups", groups)))
    if num_channels % groups:
        raise ValueError(
            f"num_channels={num_channels} must be divisible by groups={groups}"
        )
    return num_channels, groups


#: a norm's eps (added to the variance) and running-statistics momentum (PyTorch's convention)
EPS, MOMENTUM = Number(low=0, low_open=True), Number(low=0, high=1, low_open=True, optional=True)


def _check_input(x: torch.Tensor, num_channels: int, layer: str) -> None:
    if x.dim() != 4 or x.shape[1] != num_channels:
        raise ValueError(
            f"{layer} expects input of shape (N, {num_channels}, H, W), got {tuple(x.shape)}"
        )
    if not x.is_floating_point():  # an integer image batch gave integer zeros (RangeBatchNorm2d)
        raise TypeError(f"{layer} expects a floating-point input, got {x.dtype}: convert images with .float()")


def empty_batch_output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A norm layer's output for a batch of 0 samples, as torch's norms give it: the (0, C, H, W)
    input through the affine map (joined to the parameters' graph, zero gradients); there is no
    statistic to compute and none is updated."""
    return _affine(x, weight, bias)


def _per_channel(p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # A (C,) parameter as (1, C, 1, 1) in the input's dtype (fp32 master weights, bf16 input).
    return p.to(like.dtype).view(1, -1, 1, 1)


def _affine(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return y * _per_channel(weight, y) + _per_channel(bias, y)


def _divide_by_group_stat(x: torch.Tensor, stat: torch.Tensor, groups: int) -> torch.Tensor:
    """``x`` (N, C, H, W) divided by a per-(sample, group) statistic ``stat`` of shape (N, groups, 1)."""
    n = x.shape[0]
    return (x.reshape(n, groups, -1) / stat.to(x.dtype)).reshape(x.shape)


def evonorm_s0(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    v: torch.Tensor | None,
    groups: int,
    eps: float,
) -> torch.Tensor:
    """EvoNorm-S0 (SPEC section 5; Liu et al. 2020):
    ``y = x * sigmoid(v*x) / sqrt(groupvar(x) + eps) * weight + bias``.

    x: (N, C, H, W); weight, bias, v: (C,) (``v=None`` drops the ``sigmoid(v*x)`` factor, the
    form used where a BatchNorm had no ReLU after it). groupvar is the biased variance per sample
    over (channels of the group, H, W), computed in float32 or wider.
    """
    n, c = x.shape[:2]
    c, groups = _checked_channels_groups(c, groups)
    var = x.to(_stat_dtype(x)).reshape(n, groups, -1).var(dim=-1, unbiased=False, keepdim=True)
    numerator = x if v is None else x * torch.sigmoid(_per_channel(v, x) * x)
    return _affine(_divide_by_group_stat(numerator, (var + eps).sqrt(), groups), weight, bias)


def range_evonorm2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    v: torch.Tensor | None,
    groups: int,
    eps: float,
) -> torch.Tensor:
    """Range EvoNorm (SPEC section 5, the paper's eq. 5):
    ``y = x * hsig(v*x) / (C(c/g) * (range_group(x) + eps)) * weight + bias``.

    x: (N, C, H, W); weight, bias, v: (C,) (``v=None`` drops the ``hsig(v*x)`` factor).
    ``range_group(x) = max - min`` per sample over (channels of the group, H, W), in float32 or
    wider; ``eps`` (in units of x) keeps a constant group from dividing by zero.
    ``C(c/g) = 1/sqrt(2 ln(c/g))`` with ``c/g`` the channels per group, as the paper's equation
    states (not the number of elements the range spans); ``c/g`` must be at least 2.
    ``hsig(t) = max(0, min(1, (t + 3) / 6))``.

    A float32 or float64 CPU input runs :class:`RangeEvoNormFunction` (compiled forward, hand-written
    backward); other devices and dtypes the torch formula through autograd. Both give the
    gradient autograd gives the formula: the range's goes to the group's max and min elements,
    shared evenly among ties.
    """
    n, c = x.shape[:2]
    c, groups = _checked_channels_groups(c, groups)
    scale = range_scale_constant(c // groups)
    if RangeEvoNormFunction.supports(x):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, v)):
            return RangeEvoNormFunction.apply(x, weight, bias, v, groups, eps)
        return RangeEvoNormFunction.output(x, weight, bias, v, groups, eps)  # no graph to build
    grouped = x.to(_stat_dtype(x)).reshape(n, groups, -1)
    group_range = grouped.amax(dim=-1, keepdim=True) - grouped.amin(dim=-1, keepdim=True)
    numerator = x if v is None else x * F.hardsigmoid(_per_channel(v, x) * x)
    denominator = scale * (group_range + eps)
    return _affine(_divide_by_group_stat(numerator, denominator, groups), weight, bias)


class RangeEvoNormFunction(torch.autograd.Function):
    """Range EvoNorm (:func:`range_evonorm2d`) with a hand-written backward, on the CPU.

    ``apply(x, weight, bias, v, groups, eps)``: ``x`` (N, C, H, W) float32 or float64 on the CPU
    (:meth:`supports`), ``weight``, ``bias``, ``v`` (C,) (``v`` may be None), returns ``y`` like
    ``x``. The forward and :meth:`gradients` run compiled kernels (``vision/norm_kernels.py``,
    where the backward is derived) that keep each (sample, group) in cache; the Function saves
    only ``x`` and the (C,) parameters. Gradients are autograd's of the torch formula up to
    rounding, including the ``amax``/``amin`` subgradient for ties (shared evenly).
    """

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether the compiled kernels take `x`: a float32/float64 CPU tensor of real storage (or
        a ``meta`` one: the cost model's walk then sees what the Function saves on the CPU)."""
        return (x.device.type in ("cpu", "meta") and x.dtype in (torch.float32, torch.float64)
                and type(x.detach()) is torch.Tensor and x.numel() > 0)

    @staticmethod
    def forward(ctx, x, weight, bias, v, groups: int, eps: float):
        x = dense_like(x)
        ctx.save_for_backward(x, weight, v)
        ctx.groups, ctx.eps = groups, eps
        return RangeEvoNormFunction.output(x, weight, bias, v, groups, eps)

    @staticmethod
    def output(x, weight, bias, v, groups: int, eps: float) -> torch.Tensor:
        """``y`` of the compiled forward (no autograd graph): what :meth:`forward` returns."""
        if x.is_meta:
            return torch.empty_like(x)
        from .norm_kernels import range_evonorm_forward

        return range_evonorm_forward(dense_like(x), weight, bias, v, groups, eps,
                                     range_scale_constant(x.shape[1] // groups))

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight, v = ctx.saved_tensors
        need_x, need_w, need_b, need_v = ctx.needs_input_grad[:4]
        dx, dw, db, dv = RangeEvoNormFunction.gradients(
            x, g if need_x else None, g if (need_w or need_b or need_v) else None,
            weight, v, ctx.groups, ctx.eps)
        return (dx, dw if need_w else None, db if need_b else None, dv if need_v else None, None, None)

    @staticmethod
    def gradients(x: torch.Tensor, grad_for_input: torch.Tensor | None, grad_for_params: torch.Tensor | None,
                  weight: torch.Tensor, v: torch.Tensor | None, groups: int, eps: float,
                  x_scale: torch.Tensor | None = None, x_lo: torch.Tensor | None = None,
                  grad_scale: torch.Tensor | None = None, grad_lo: torch.Tensor | None = None):
        """``(dL/dx, dL/dweight, dL/dbias, dL/dv)`` of :func:`range_evonorm2d` at ``x``, with the
        output gradient ``grad_for_input`` for ``dL/dx`` and ``grad_for_params`` for the parameters
        (the 8-bit layer passes its quantized and its full-precision gradient, SPEC 4; either None:
        those gradients are not computed and come back None).

        ``x`` (N, C, H, W): a tensor :meth:`supports` takes, or the uint8 codes of an 8-bit input
        with its 0-d float32 step ``x_scale`` and offset ``x_lo`` (``x = codes * x_scale + x_lo``,
        SPEC 4, decoded on the fly). The output gradients are like ``x``'s values; ``grad_for_input``
        may also be the uint8 codes of the quantized gradient with its float32 step ``grad_scale`` and
        offset ``grad_lo`` (0-d or one per sample, ``(N, 1, 1, 1)``), decoded on the fly the same
        way. Parameter gradients (C,) in the dtype of ``weight``.
        """
        from .norm_kernels import range_evonorm_backward

        if x.dtype == torch.uint8 and (x_scale is None or x_lo is None or x_scale.dim() or x_lo.dim()):
            raise ValueError("uint8 codes x need their 0-d x_scale and x_lo")
        if grad_for_input is not None and grad_for_input.dtype == torch.uint8:
            n = grad_for_input.shape[0]
            if any(t is None or t.numel() not in (1, n) or t.dim() not in (0, 4) for t in (grad_scale, grad_lo)):
                raise ValueError("uint8 codes grad_for_input need their grad_scale and grad_lo, 0-d or (N, 1, 1, 1)")
        dx, dw, db, dv = range_evonorm_backward(
            x, grad_for_input, grad_for_params, weight, v, groups, eps,
            range_scale_constant(x.shape[1] // groups), x_scale, x_lo, grad_scale, grad_lo)
        return (dx, *(None if d is None else d.to(weight.dtype) for d in (dw, db, dv)))


def range_batch_norm2d(
    x: torch.Tensor,
    running_mean: torch.Tensor,
    running_scale: torch.Tensor,
    num_batches_tracked: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    training: bool,
    momentum: float | None,
    eps: float,
) -> torch.Tensor:
    """Range BatchNorm (SPEC section 5; Banner et al. 2018 eq. 3):
    ``y = (x - mean) / (C(b) * range(x - mean) + eps) * weight + bias``.

    x: (N, C, H, W); all other tensors (C,) except ``num_batches_tracked`` (scalar, int64).
    Training: per-channel ``mean`` and ``range = max - min`` over the ``b = N*H*W`` values of the
    channel (float32 or wider); the buffers are updated in place with PyTorch's convention
    ``running = (1 - momentum) * running + momentum * batch`` (``momentum=None``: cumulative
    average over the batches seen). Eval: ``running_mean`` and ``running_scale``
    (= a running average of ``C(b) * range``) replace the batch statistics.
    """
    stat_dtype = _stat_dtype(x)
    xs = x.to(stat_dtype)  # the centring is done at this precision too: a bf16 mean is too coarse
    if training:
        n, c, h, w = x.shape
        b = n * h * w
        if b < 2:
            raise ValueError(
                f"RangeBatchNorm2d needs more than 1 value per channel when training, "
                f"got input of shape {tuple(x.shape)}"
            )
        mean = xs.mean(dim=(0, 2, 3))
        # range(x - mean) == range(x): a shift changes neither max - min nor its gradient.
        scale = range_scale_constant(b) * (xs.amax(dim=(0, 2, 3)) - xs.amin(dim=(0, 2, 3)))
        with torch.no_grad():
            num_batches_tracked.add_(1)
            factor = (
                (1.0 / num_batches_tracked).to(running_mean.dtype) if momentum is None else momentum
            )
            running_mean.lerp_(mean.to(running_mean.dtype), factor)
            running_scale.lerp_(scale.to(running_scale.dtype), factor)
    else:
        mean, scale = running_mean.to(stat_dtype), running_scale.to(stat_dtype)
    normalised = (xs - mean.view(1, -1, 1, 1)) / (scale + eps).view(1, -1, 1, 1)
    return _affine(normalised.to(x.dtype), weight, bias)


class _GroupNormAct(nn.Module):
    """Shared parameters/validation of the sample-statistics norm-activation layers."""

    def __init__(self, num_channels: int, groups: int, eps: float, apply_act: bool):
        super().__init__()
        num_channels, groups = _checked_channels_groups(num_channels, groups)
        eps = check_number("eps", eps, EPS)
        apply_act = check_flag("apply_act", apply_act)
        self.num_channels, self.groups, self.eps, self.apply_act = num_channels, groups, eps, apply_act
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))
        self.v = nn.Parameter(torch.ones(num_channels)) if apply_act else None

    def extra_repr(self) -> str:
        return f"{self.num_channels}, groups={self.groups}, eps={self.eps}, apply_act={self.apply_act}"


class EvoNormS0(_GroupNormAct):
    """EvoNorm-S0 normalisation-activation layer; see :func:`evonorm_s0`.

    Replaces a BatchNorm2d + ReLU pair (``apply_act=True``, parameter ``v``) or a BatchNorm2d
    with no activation after it (``apply_act=False``: ``x / sqrt(groupvar + eps) * w + b``).
    Input and output: (N, num_channels, H, W).
    """

    def __init__(self, num_channels: int, groups: int = 2, eps: float = 1e-5, apply_act: bool = True):
        super().__init__(num_channels, groups, eps, apply_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.num_channels, type(self).__name__)
        if x.shape[0] == 0:
            return empty_batch_output(x, self.weight, self.bias)
        return evonorm_s0(x, self.weight, self.bias, self.v, self.groups, self.eps)


class RangeEvoNorm2d(_GroupNormAct):
    """Range EvoNorm normalisation-activation layer (the paper's eq. 5); see :func:`range_evonorm2d`.

    Needs at least 2 channels per group (``C(c/g)`` is undefined for ``c/g = 1``): a ValueError
    at construction otherwise. ``apply_act=False`` drops the ``hsig(v*x)`` factor.
    Input and output: (N, num_channels, H, W).
    """

    def __init__(self, num_channels: int, groups: int = 2, eps: float = 1e-5, apply_act: bool = True):
        super().__init__(num_channels, groups, eps, apply_act)
        if num_channels // groups < 2:
            raise ValueError(
                f"RangeEvoNorm2d needs at least 2 channels per group, got num_channels="
                f"{num_channels}, groups={groups} (C(c/g) = 1/sqrt(2 ln(c/g)) is undefined for c/g = 1)"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.num_channels, type(self).__name__)
        if x.shape[0] == 0:
            return empty_batch_output(x, self.weight, self.bias)
        return range_evonorm2d(x, self.weight, self.bias, self.v, self.groups, self.eps)


class RangeBatchNorm2d(nn.Module):
    """Range BatchNorm (Banner et al. 2018); see :func:`range_batch_norm2d`.

    Buffers: ``running_mean`` (C,), ``running_scale`` (C,) — the running average of the range
    based std estimate ``C(b) * range``, initialised to 1 (it is *not* a variance, hence not named
    ``running_var``) — and ``num_batches_tracked``. ``momentum`` follows PyTorch's BatchNorm
    convention (weight of the newest batch; ``None`` = cumulative average).
    Input and output: (N, num_features, H, W).
    """

    def __init__(self, num_features: int, momentum: float | None = 0.1, eps: float = 1e-5):
        super().__init__()
        num_features = check_number("num_features", num_features, POSITIVE_INT)
        eps, momentum = check_number("eps", eps, EPS), check_number("momentum", momentum, MOMENTUM)
        self.num_features, self.momentum, self.eps = num_features, momentum, eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_scale", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.num_features, type(self).__name__)
        if x.shape[0] == 0:
            return empty_batch_output(x, self.weight, self.bias)
        return range_batch_norm2d(
            x, self.running_mean, self.running_scale, self.num_batches_tracked,
            self.weight, self.bias, self.training, self.momentum, self.eps,
        )

    def extra_repr(self) -> str:
        return f"{self.num_features}, momentum={self.momentum}, eps={self.eps}"
