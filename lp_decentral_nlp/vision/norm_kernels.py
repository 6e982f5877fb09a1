"""Compiled CPU kernels (numba) of Range EvoNorm's forward and hand-written backward (SPEC section 5).

In torch ops Range EvoNorm is a chain of whole-tensor passes (group max, group min, ``v*x``,
``hsig``, ``x*hsig``, divide, scale, shift) and autograd's backward of that chain about twenty
more (``amax``/``amin`` backward alone builds equality masks and counts). These kernels work one
(sample, group) at a time, so the group, at most a few hundred KB for the paper's CNNs, stays in
cache between their passes:

* :func:`range_evonorm_forward`: one pass for the group's max and min, one writing ``y``;
* :func:`range_evonorm_backward`: one pass for the max and min, one for their counts (ties,
  below) and the per-channel sums of the parameter gradients and of ``dL/d range``, one writing
  ``dL/dx``.

Backward of ``y = x * hsig(v*x) / D * w + b`` with ``D = C(c/g) * (max - min + eps)`` over a
(sample, group), ``t = v*x``, ``h = hsig(t)``, ``num = x*h``, ``in = (-3 < t < 3)``, ``g`` the
output gradient (``gp`` for the parameters, ``gx`` for the input: the 8-bit layer's gradient
bifurcation passes two, SPEC 4):

* ``dL/db_c = sum gp``, ``dL/dw_c = sum gp * num / D``, ``dL/dv_c = w_c / D * sum gp * x^2 * in * 1/6``
  (sums over the samples and the channel's positions);
* ``dL/dx = gx * w / D * (h + t * in * 1/6) + dL/dR * ([x = max] / n_max - [x = min] / n_min)``
  with ``dL/dR = -C(c/g) / D^2 * sum_c w_c sum gx * num`` (sum over the group). The range's
  gradient goes to the elements equal to the max (min), shared evenly among the ``n_max``
  (``n_min``) ties: the subgradient autograd gives ``amax``/``amin``. A constant group
  (``max = min``) gets ``+dL/dR/n - dL/dR/n = 0``.

``hsig``'s derivative is taken as autograd's ``hardsigmoid_backward`` does: ``1/6`` rounded to
float32 (also for float64 tensors) strictly inside ``(-3, 3)``, 0 outside and on the kinks.
Arithmetic is in the tensor's dtype (float32 or float64), the forward's in the order of the torch
formula (the same bits); the backward's per-channel sums in whatever order vectorises
(``fastmath={"reassoc"}`` only: no fused multiply-add, IEEE NaN and inf), as torch's own sums.
Arrays are ``(N, G, C/G, H*W)`` views of contiguous ``(N, C, H, W)`` tensors; samples are split
over numba's threads (as many as torch's intra-op pool; one thread runs the serial build without
starting numba's pool: :mod:`lp_decentral_nlp.utils.numba_threads`).

numba compiles each kernel on its first use, once per dtype, and caches the machine code on disk
(``NUMBA_CACHE_DIR`` moves the cache); :mod:`.norms` imports this module on the first CPU call
that needs it, so importing the package does not import numba.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from ..utils.numba_threads import compile_serial_and_parallel, run_kernel

# autograd's hardsigmoid_backward multiplies by 1/6 as a float32 constant, also for float64
_ONE_SIXTH = np.float32(1.0 / 6.0)


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _group_range(xs):
    """``(max, min)`` of a group ``xs`` ``(C/G, H*W)`` (values or codes): first an elementwise max
    and min over its channel rows (vectorised), then over the one row left. The same extremes as
    ``max``/``min`` element by element, for any values but NaN."""
    per_group, positions = xs.shape
    highs = xs[0].copy()
    lows = xs[0].copy()
    for j in range(1, per_group):
        row = xs[j]
        for k in range(positions):
            a = row[k]
            highs[k] = a if a > highs[k] else highs[k]
            lows[k] = a if a < lows[k] else lows[k]
    hi = highs[0]
    lo = lows[0]
    for k in range(1, positions):
        hi = max(hi, highs[k])
        lo = min(lo, lows[k])
    return hi, lo


def _forward_kernel(x, weight, bias, v, apply_act, eps, scale, three, six, y):
    samples, groups, per_group, positions = x.shape
    zero = three - three
    for n in numba.prange(samples):
        for grp in range(groups):
            xs = x[n, grp]
            hi, lo = _group_range(xs)
            denom = scale * ((hi - lo) + eps)
            ys = y[n, grp]
            for j in range(per_group):
                w, b, vj = weight[grp, j], bias[grp, j], v[grp, j]
                for k in range(positions):
                    val = xs[j, k]
                    if apply_act:
                        h = min(max(vj * val + three, zero), six) / six
                        val = val * h
                    ys[j, k] = val / denom * w + b


def _backward_kernel(x, x_scale, x_lo, gx, gp, weight, v, apply_act, want_dx, want_params, eps, scale, three, six,
              one_sixth, dx, part_b, part_w, part_v):
    samples, groups, per_group, positions = x.shape
    zero = three - three  # every per-element quantity in the values' dtype (selects, no bool products)
    for n in numba.prange(samples):
        for grp in range(groups):
            xs = x[n, grp]
            hi, lo = _group_range(xs)  # decoding is monotone: the range of the codes, decoded
            hi = hi * x_scale + x_lo
            lo = lo * x_scale + x_lo
            denom = scale * ((hi - lo) + eps)
            n_hi = 0
            n_lo = 0
            range_sum = 0.0  # sum_c w_c sum gx * num, float64 over the channels
            for j in range(per_group):
                w, vj = weight[grp, j], v[grp, j]
                sum_b = zero
                sum_w = zero
                sum_v = zero
                sum_x = zero
                for k in range(positions):
                    val = xs[j, k] * x_scale + x_lo
                    n_hi += val == hi
                    n_lo += val == lo
                    num = val
                    inside = False
                    if apply_act:
                        t = vj * val
                        num = val * (min(max(t + three, zero), six) / six)
                        inside = (t > -three) & (t < three)
                    if want_params:
                        g = gp[n, grp, j, k]
                        sum_b += g
                        sum_w += g * num
                        sum_v += (g * val * val) if inside else zero
                    if want_dx:
                        sum_x += gx[n, grp, j, k] * num
                if want_params:
                    part_b[n, grp, j] = sum_b
                    part_w[n, grp, j] = sum_w / denom
                    part_v[n, grp, j] = sum_v * w / denom * one_sixth
                range_sum += w * sum_x
            if not want_dx:
                continue
            grad_range = -scale * range_sum / (denom * denom)
            to_max = dx.dtype.type(grad_range / n_hi)
            to_min = dx.dtype.type(grad_range / n_lo)
            for j in range(per_group):
                w, vj = weight[grp, j], v[grp, j]
                for k in range(positions):
                    val = xs[j, k] * x_scale + x_lo
                    a = gx[n, grp, j, k] * w / denom
                    d = a
                    if apply_act:
                        t = vj * val
                        inside = (t > -three) & (t < three)
                        d = a * (min(max(t + three, zero), six) / six) + ((a * val * one_sixth * vj) if inside else zero)
                    # summed first: a constant group's +-dL/dR/n cancel exactly
                    through_range = (to_max if val == hi else zero) - (to_min if val == lo else zero)
                    dx[n, grp, j, k] = d + through_range


_FORWARD = compile_serial_and_parallel(_forward_kernel)
_BACKWARD = compile_serial_and_parallel(_backward_kernel, fastmath={"reassoc"})


def _grouped(t: torch.Tensor, groups: int) -> np.ndarray:
    """A contiguous (N, C, H, W) CPU tensor as its (N, groups, C/groups, H*W) numpy view."""
    n, c = t.shape[:2]
    return t.detach().numpy().reshape(n, groups, c // groups, -1)


def _per_group(p: torch.Tensor, groups: int, dtype: torch.dtype) -> np.ndarray:
    """A (C,) parameter as a contiguous (groups, C/groups) array of `dtype`."""
    return p.detach().to(dtype).contiguous().numpy().reshape(groups, -1)


def _real(dtype: torch.dtype):
    """The numpy scalar type of a float32/float64 tensor dtype: constants of it keep the kernels'
    arithmetic in that dtype (a Python float would promote float32 to float64)."""
    return np.float32 if dtype == torch.float32 else np.float64


def _constants(dtype: torch.dtype, eps: float, scale: float):
    """``eps``, ``scale``, 3 and 6 as scalars of `dtype`."""
    real = _real(dtype)
    return real(eps), real(scale), real(3.0), real(6.0)


def range_evonorm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, v: torch.Tensor | None,
                          groups: int, eps: float, scale: float) -> torch.Tensor:
    """``y`` of Range EvoNorm (module docstring) for a contiguous float32/float64 CPU ``x`` (N, C, H, W);
    ``weight``, ``bias``, ``v`` (C,) (cast to ``x``'s dtype; ``v=None``: no ``hsig`` factor);
    ``scale = C(c/g)``. Returns ``y`` of ``x``'s shape and dtype."""
    y = torch.empty_like(x)
    w = _per_group(weight, groups, x.dtype)
    run_kernel(_FORWARD, x.numel(), _grouped(x, groups), w, _per_group(bias, groups, x.dtype),
             w if v is None else _per_group(v, groups, x.dtype), v is not None,
             *_constants(x.dtype, eps, scale), _grouped(y, groups))
    return y


def range_evonorm_backward(x: torch.Tensor, grad_for_input: torch.Tensor | None,
                           grad_for_params: torch.Tensor | None, weight: torch.Tensor, v: torch.Tensor | None,
                           groups: int, eps: float, scale: float, x_scale: torch.Tensor | None = None,
                           x_lo: torch.Tensor | None = None):
    """Gradients of Range EvoNorm (module docstring) at a contiguous CPU ``x`` (N, C, H, W).

    ``x``: float32/float64 values, or uint8 codes with ``x_scale``/``x_lo`` (0-d float32) standing
    for ``codes * x_scale + x_lo`` (SPEC 4's dequantization, the same float32 operations as
    ``quant.functional.dequantize_uint8``, decoded on the fly: the float tensor is never written).
    ``grad_for_input`` (``gx``) / ``grad_for_params`` (``gp``): output gradients of ``x``'s shape in
    the values' dtype, or None when that gradient is not wanted. Returns ``(dx, dweight, dbias,
    dv)``: ``dx`` (N, C, H, W) (None without ``gx``), the parameter gradients (C,) (None without
    ``gp``; ``dv`` None when ``v`` is None), all in the values' dtype.
    """
    n, c = x.shape[:2]
    if x.dtype == torch.uint8:
        dtype, decode = torch.float32, (x_scale.detach().numpy().astype(np.float32)[()],
                                        x_lo.detach().numpy().astype(np.float32)[()])
    else:
        dtype, decode = x.dtype, (_real(x.dtype)(1.0), _real(x.dtype)(0.0))
    want_dx, want_params = grad_for_input is not None, grad_for_params is not None
    dx = torch.empty(x.shape, dtype=dtype) if want_dx else torch.empty((0,) * 4, dtype=dtype)
    parts = torch.empty((3, n, groups, c // groups) if want_params else (3, 0, 0, 0), dtype=torch.float64)
    w = _per_group(weight, groups, dtype)
    empty = dx.numpy()[:0]
    run_kernel(_BACKWARD, x.numel(), _grouped(x, groups), *decode,
              _grouped(grad_for_input.contiguous(), groups) if want_dx else empty,
              _grouped(grad_for_params.contiguous(), groups) if want_params else empty,
              w, w if v is None else _per_group(v, groups, dtype), v is not None, want_dx, want_params,
              *_constants(dtype, eps, scale), _real(dtype)(_ONE_SIXTH),
              _grouped(dx, groups) if want_dx else dx.numpy(), *parts.numpy())
    if not want_params:
        return (dx if want_dx else None), None, None, None
    d_bias, d_weight, d_v = parts.reshape(3, n, c).sum(1).to(dtype).unbind()
    return (dx if want_dx else None), d_weight, d_bias, (d_v if v is not None else None)
