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
bifurcation passes two, SPEC 4, ``gx`` as uint8 codes decoded on the fly like ``x``):

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
Arrays are ``(N, G, C/G, H*W)`` views of contiguous ``(N, C, H, W)`` tensors, or for
channels-last tensors (what oneDNN's int8 convolution returns) ``(N, H*W*C)`` views walked in
runs of whole positions by the ``_last`` kernels (the same per-element formulas; the backward's
sums in another order); samples are split over numba's threads (as many as torch's intra-op pool; one thread runs the serial build without
starting numba's pool: :mod:`lp_decentral_nlp.utils.numba_threads`).

numba compiles each kernel on its first use, once per dtype, and caches the machine code on disk
(``NUMBA_CACHE_DIR`` moves the cache); :mod:`.norms` imports this module on the first CPU call
that needs it, so importing the package does not import numba.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from ..quant.fused import per_row_array
from ..utils.layout import is_channels_last, memory_order
from ..utils.numba_threads import compile_serial_and_parallel, eager_under_compile, run_kernel

# autograd's hardsigmoid_backward multiplies by 1/6 as a float32 constant, also for float64
_ONE_SIXTH = np.float32(1.0 / 6.0)


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _max_nan(a, b):
    """The larger of `a` and `b`, NaN if either is: ``torch.amax``'s rule (a NaN stays the running
    extreme, so a NaN anywhere makes the group's range NaN, as in the torch formula)."""
    return a if a > b or a != a else b


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _min_nan(a, b):
    """The smaller of `a` and `b`, NaN if either is (``torch.amin``'s rule)."""
    return a if a < b or a != a else b


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _group_range(xs):
    """``(max, min)`` of a group ``xs`` ``(C/G, H*W)`` (values or codes): first an elementwise max
    and min over its channel rows (vectorised), then over the one row left. The same extremes as
    ``max``/``min`` element by element; both NaN where the group holds a NaN."""
    per_group, positions = xs.shape
    highs = xs[0].copy()
    lows = xs[0].copy()
    for j in range(1, per_group):
        row = xs[j]
        for k in range(positions):
            highs[k] = _max_nan(row[k], highs[k])
            lows[k] = _min_nan(row[k], lows[k])
    hi = highs[0]
    lo = lows[0]
    for k in range(1, positions):
        hi = _max_nan(highs[k], hi)
        lo = _min_nan(lows[k], lo)
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


def _backward_kernel(x, x_scale, x_lo, gx, gx_scale, gx_lo, gp, weight, v, apply_act, want_dx, want_params, eps,
                     scale, three, six, one_sixth, dx, part_b, part_w, part_v):
    samples, groups, per_group, positions = x.shape
    zero = three - three  # every per-element quantity in the values' dtype (selects, no bool products)
    for n in numba.prange(samples):
        g_step, g_lo = gx_scale[n], gx_lo[n]  # gx decoded as gx * g_step + g_lo (values: 1 and 0)
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
                        sum_x += (gx[n, grp, j, k] * g_step + g_lo) * num
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
                    a = (gx[n, grp, j, k] * g_step + g_lo) * w / denom
                    d = a
                    if apply_act:
                        t = vj * val
                        inside = (t > -three) & (t < three)
                        d = a * (min(max(t + three, zero), six) / six) + ((a * val * one_sixth * vj) if inside else zero)
                    # summed first: a constant group's +-dL/dR/n cancel exactly
                    through_range = (to_max if val == hi else zero) - (to_min if val == lo else zero)
                    dx[n, grp, j, k] = d + through_range


# Channels last: a sample is a (H*W, C) matrix, and a loop along one position's C channels (16
# in ResNet's first stage) is too short to vectorise well. The kernels walk a sample's memory in
# runs of SPAN_ELEMENTS (whole positions) with each per-channel quantity repeated along the run
# (:func:`_along_run`), so the inner loops are long; per-channel sums are folded at the end.
SPAN_ELEMENTS = 256


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _run_length(channels, size):
    """Elements per run of a channels-last sample of `size` elements: whole positions, about
    ``SPAN_ELEMENTS`` (at least one position, at most the sample)."""
    return min(channels * max(1, SPAN_ELEMENTS // channels), size)


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _along_run(per_channel, span):
    """A (C,) array repeated along a run of `span` elements (whole positions)."""
    channels = per_channel.shape[0]
    out = np.empty(span, per_channel.dtype)
    for first in range(0, span, channels):
        for c in range(channels):
            out[first + c] = per_channel[c]
    return out


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _fold_runs(along_run, channels):
    """The (C,) per-channel sums of a quantity accumulated along a run (whole positions, as
    :func:`_along_run` lays a run out): each channel's entries added position by position."""
    out = np.zeros(channels, along_run.dtype)
    for first in range(0, along_run.shape[0], channels):
        for c in range(channels):
            out[c] += along_run[first + c]
    return out


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _group_bounds_last(xs, channels, groups, span, x_scale, x_lo):
    """The decoded ``(max, min)`` of each group of a channels-last sample ``xs`` (flat ``H*W*C``),
    as two (C,) arrays holding each channel's group's values: elementwise max and min down the runs
    (vectorised), folded to channels, then to groups. The same extremes as element by element; both
    NaN where the group holds a NaN."""
    size = xs.shape[0]
    highs = xs[:span].copy()
    lows = xs[:span].copy()
    for start in range(span, size, span):
        run = xs[start:min(start + span, size)]
        for j in range(run.shape[0]):
            highs[j] = _max_nan(run[j], highs[j])
            lows[j] = _min_nan(run[j], lows[j])
    for first in range(channels, span, channels):  # fold the run's positions onto the first
        for c in range(channels):
            highs[c] = _max_nan(highs[first + c], highs[c])
            lows[c] = _min_nan(lows[first + c], lows[c])
    per_group = channels // groups
    out_hi = np.empty(channels, np.float64)
    out_lo = np.empty(channels, np.float64)
    for grp in range(groups):
        hi = highs[grp * per_group]
        lo = lows[grp * per_group]
        for c in range(grp * per_group + 1, (grp + 1) * per_group):
            hi = _max_nan(highs[c], hi)
            lo = _min_nan(lows[c], lo)
        for c in range(grp * per_group, (grp + 1) * per_group):
            out_hi[c] = hi * x_scale + x_lo
            out_lo[c] = lo * x_scale + x_lo
    return out_hi, out_lo


def _forward_kernel_last(x, weight, bias, v, groups, apply_act, eps, scale, three, six, y):
    # x, y: (N, H*W*C) channels last; weight, bias, v: (C,). The per-element formula of
    # _forward_kernel, with the group's divisor and the parameters repeated along each run
    samples, size = x.shape
    channels = weight.shape[0]
    span = _run_length(channels, size)
    zero = three - three
    one = three / three
    for n in numba.prange(samples):
        xs, ys = x[n], y[n]
        his, los = _group_bounds_last(xs, channels, groups, span, one, zero)
        denom = np.empty(channels, x.dtype)
        for c in range(channels):
            denom[c] = scale * ((x.dtype.type(his[c]) - x.dtype.type(los[c])) + eps)
        denom_run, w_run, b_run, v_run = (_along_run(denom, span), _along_run(weight, span),
                                          _along_run(bias, span), _along_run(v, span))
        for start in range(0, size, span):
            x_run, y_run = xs[start:min(start + span, size)], ys[start:min(start + span, size)]
            for j in range(x_run.shape[0]):
                val = x_run[j]
                if apply_act:
                    h = min(max(v_run[j] * val + three, zero), six) / six
                    val = val * h
                y_run[j] = val / denom_run[j] * w_run[j] + b_run[j]


def _backward_kernel_last(x, x_scale, x_lo, gx, gx_scale, gx_lo, gp, weight, v, groups, apply_act, want_dx,
                          want_params, eps, scale, three, six, one_sixth, dx, part_b, part_w, part_v):
    # _backward_kernel on channels-last (N, H*W*C) arrays, per-channel quantities repeated along
    # runs of whole positions: sums over the runs (vectorised), folded to channels, then groups;
    # parts (N, C)
    samples, size = x.shape
    channels = weight.shape[0]
    per_group = channels // groups
    span = _run_length(channels, size)
    zero = three - three
    real = dx.dtype.type
    for n in numba.prange(samples):
        xs = x[n]
        g_step, g_lo = gx_scale[n], gx_lo[n]  # gx decoded as gx * g_step + g_lo (values: 1 and 0)
        # decoding is monotone: the range of the codes, decoded
        his, los = _group_bounds_last(xs, channels, groups, span, x_scale, x_lo)
        hi_c = np.empty(channels, dx.dtype)
        lo_c = np.empty(channels, dx.dtype)
        denom = np.empty(channels, dx.dtype)
        for c in range(channels):
            hi_c[c] = real(his[c])
            lo_c[c] = real(los[c])
            denom[c] = scale * ((hi_c[c] - lo_c[c]) + eps)
        hi_run, lo_run, v_run = _along_run(hi_c, span), _along_run(lo_c, span), _along_run(v, span)
        # one array each: rows unpacked from a 2-D array are typed non-contiguous by numba, and the
        # loops over them stop vectorising (2-3x slower in an A/B)
        n_hi = np.zeros(span, np.int32)
        n_lo = np.zeros(span, np.int32)
        sum_b = np.zeros(span, dx.dtype)
        sum_w = np.zeros(span, dx.dtype)
        sum_v = np.zeros(span, dx.dtype)
        sum_x = np.zeros(span, dx.dtype)
        for start in range(0, size, span):
            stop = min(start + span, size)
            x_run = xs[start:stop]
            gp_run = gp[n, start:stop] if want_params else sum_b[:0]  # not read when not wanted
            gx_run = gx[n, start:stop] if want_dx else gx[n, :0]
            for j in range(x_run.shape[0]):
                val = x_run[j] * x_scale + x_lo
                n_hi[j] += val == hi_run[j]
                n_lo[j] += val == lo_run[j]
                num = val
                inside = False
                if apply_act:
                    t = v_run[j] * val
                    num = val * (min(max(t + three, zero), six) / six)
                    inside = (t > -three) & (t < three)
                if want_params:
                    g = gp_run[j]
                    sum_b[j] += g
                    sum_w[j] += g * num
                    sum_v[j] += (g * val * val) if inside else zero
                if want_dx:
                    sum_x[j] += (gx_run[j] * g_step + g_lo) * num
        ch_b, ch_w, ch_v = _fold_runs(sum_b, channels), _fold_runs(sum_w, channels), _fold_runs(sum_v, channels)
        ch_x, ch_hi, ch_lo = _fold_runs(sum_x, channels), _fold_runs(n_hi, channels), _fold_runs(n_lo, channels)
        if want_params:
            for c in range(channels):
                part_b[n, c] = ch_b[c]
                part_w[n, c] = ch_w[c] / denom[c]
                part_v[n, c] = ch_v[c] * weight[c] / denom[c] * one_sixth
        if not want_dx:
            continue
        to_max = np.empty(channels, dx.dtype)
        to_min = np.empty(channels, dx.dtype)
        for grp in range(groups):
            first = grp * per_group
            range_sum = 0.0  # sum_c w_c sum gx * num, float64 over the group's channels
            ties_hi = 0
            ties_lo = 0
            for c in range(first, first + per_group):
                range_sum += weight[c] * ch_x[c]
                ties_hi += ch_hi[c]
                ties_lo += ch_lo[c]
            grad_range = -scale * range_sum / (denom[first] * denom[first])
            for c in range(first, first + per_group):
                to_max[c] = grad_range / ties_hi
                to_min[c] = grad_range / ties_lo
        w_run, d_run = _along_run(weight, span), _along_run(denom, span)
        max_run, min_run = _along_run(to_max, span), _along_run(to_min, span)
        for start in range(0, size, span):
            stop = min(start + span, size)
            x_run, gx_run, dx_run = xs[start:stop], gx[n, start:stop], dx[n, start:stop]
            for j in range(x_run.shape[0]):
                val = x_run[j] * x_scale + x_lo
                a = (gx_run[j] * g_step + g_lo) * w_run[j] / d_run[j]
                d = a
                if apply_act:
                    t = v_run[j] * val
                    inside = (t > -three) & (t < three)
                    d = a * (min(max(t + three, zero), six) / six) + ((a * val * one_sixth * v_run[j]) if inside
                                                                      else zero)
                # summed first: a constant group's +-dL/dR/n cancel exactly
                through_range = (max_run[j] if val == hi_run[j] else zero) - (min_run[j] if val == lo_run[j] else zero)
                dx_run[j] = d + through_range


# IEEE division (numpy's error model, as torch divides): python's checks every divisor for zero,
# which stops a loop over per-element divisors from vectorising, and raises where a NaN range has
# no element equal to it (0 ties: the gradient is NaN, as autograd's)
_FORWARD = compile_serial_and_parallel(_forward_kernel, error_model="numpy")
_BACKWARD = compile_serial_and_parallel(_backward_kernel, fastmath={"reassoc"}, error_model="numpy")
_FORWARD_LAST = compile_serial_and_parallel(_forward_kernel_last, error_model="numpy")
_BACKWARD_LAST = compile_serial_and_parallel(_backward_kernel_last, fastmath={"reassoc"}, error_model="numpy")


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


def _channels_last(t: torch.Tensor) -> np.ndarray:
    """A channels-last (N, C, H, W) CPU tensor as its (N, H*W*C) numpy view (memory order)."""
    return memory_order(t.detach()).numpy().reshape(t.shape[0], -1)


@eager_under_compile
def range_evonorm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, v: torch.Tensor | None,
                          groups: int, eps: float, scale: float) -> torch.Tensor:
    """``y`` of Range EvoNorm (module docstring) for a float32/float64 CPU ``x`` (N, C, H, W),
    contiguous or channels last (``utils.layout.is_dense``); ``weight``, ``bias``, ``v`` (C,) (cast
    to ``x``'s dtype; ``v=None``: no ``hsig`` factor); ``scale = C(c/g)``. Returns ``y`` of ``x``'s
    shape, dtype and layout (the same values in either layout)."""
    y = torch.empty_like(x)
    w = _per_group(weight, groups, x.dtype)
    b = _per_group(bias, groups, x.dtype)
    v_array = w if v is None else _per_group(v, groups, x.dtype)
    constants = _constants(x.dtype, eps, scale)
    if is_channels_last(x):
        run_kernel(_FORWARD_LAST, x.numel(), _channels_last(x), w.reshape(-1), b.reshape(-1), v_array.reshape(-1),
                   groups, v is not None, *constants, _channels_last(y))
    else:
        run_kernel(_FORWARD, x.numel(), _grouped(x, groups), w, b, v_array, v is not None, *constants,
                   _grouped(y, groups))
    return y


@eager_under_compile
def range_evonorm_backward(x: torch.Tensor, grad_for_input: torch.Tensor | None,
                           grad_for_params: torch.Tensor | None, weight: torch.Tensor, v: torch.Tensor | None,
                           groups: int, eps: float, scale: float, x_scale: torch.Tensor | None = None,
                           x_lo: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
                           grad_lo: torch.Tensor | None = None):
    """Gradients of Range EvoNorm (module docstring) at a CPU ``x`` (N, C, H, W), contiguous or
    channels last.

    ``x``: float32/float64 values, or uint8 codes with ``x_scale``/``x_lo`` (0-d float32) standing
    for ``codes * x_scale + x_lo`` (SPEC 4's dequantization, the same float32 operations as
    ``quant.functional.dequantize_uint8``, decoded on the fly: the float tensor is never written).
    ``grad_for_input`` (``gx``) / ``grad_for_params`` (``gp``): output gradients of ``x``'s shape in
    the values' dtype, any layout, or None when that gradient is not wanted; ``gx`` may also be
    uint8 codes with ``grad_scale``/``grad_lo`` (float32, 0-d or one per sample, ``(N, 1, 1, 1)``)
    standing for ``codes * grad_scale + grad_lo``, decoded on the fly like ``x`` (the 8-bit layer's
    quantized output gradient: a byte per element where its values take four). The kernel runs in the
    layout of the first gradient given, channels last or row-major: the other operands are copied
    to it where they differ (codes are a quarter of a float gradient's bytes, so a channels-last
    gradient at row-major codes costs one small copy, not two large ones). Returns ``(dx, dweight,
    dbias, dv)``: ``dx`` (N, C, H, W) in that layout (None without ``gx``), the parameter gradients
    (C,) (None without ``gp``; ``dv`` None when ``v`` is None), all in the values' dtype. The two
    layouts sum the parameter gradients and the range's gradient in different orders: the same
    values up to rounding.
    """
    n, c = x.shape[:2]
    if x.dtype == torch.uint8:
        dtype, decode = torch.float32, (x_scale.detach().numpy().astype(np.float32)[()],
                                        x_lo.detach().numpy().astype(np.float32)[()])
    else:
        dtype, decode = x.dtype, (_real(x.dtype)(1.0), _real(x.dtype)(0.0))
    want_dx, want_params = grad_for_input is not None, grad_for_params is not None
    if want_dx and grad_for_input.dtype == torch.uint8:
        grad_decode = per_row_array(grad_scale, n), per_row_array(grad_lo, n)
    else:  # values: decoded as themselves
        grad_decode = (np.ones(n, _real(dtype)), np.zeros(n, _real(dtype)))
    first_grad = grad_for_input if want_dx else grad_for_params
    channels_last = first_grad is not None and is_channels_last(first_grad)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = x.contiguous(memory_format=layout)
    view = _channels_last if channels_last else (lambda t: _grouped(t, groups))
    dx = torch.empty_like(x, dtype=dtype) if want_dx else torch.empty((0,) * 4, dtype=dtype)
    part_shape = (3, n, c) if channels_last else (3, n, groups, c // groups)
    parts = torch.empty(part_shape if want_params else (3,) + (0,) * (len(part_shape) - 1), dtype=torch.float64)
    w = _per_group(weight, groups, dtype)
    v_array = w if v is None else _per_group(v, groups, dtype)
    empty = np.zeros((n, 0) if channels_last else (0,) * 4, dtype=_real(dtype))  # sliced per sample
    grads = [view(g.contiguous(memory_format=layout)) if g is not None else empty
             for g in (grad_for_input, grad_for_params)]
    flags = (v is not None, want_dx, want_params, *_constants(dtype, eps, scale), _real(dtype)(_ONE_SIXTH),
             view(dx) if want_dx else empty)
    if channels_last:
        run_kernel(_BACKWARD_LAST, x.numel(), view(x), *decode, grads[0], *grad_decode, grads[1], w.reshape(-1),
                   v_array.reshape(-1), groups, *flags, *parts.numpy())
    else:
        run_kernel(_BACKWARD, x.numel(), view(x), *decode, grads[0], *grad_decode, grads[1], w, v_array, *flags,
                   *parts.numpy())
    if not want_params:
        return (dx if want_dx else None), None, None, None
    d_bias, d_weight, d_v = parts.reshape(3, n, c).sum(1).to(dtype).unbind()
    return (dx if want_dx else None), d_weight, d_bias, (d_v if v is not None else None)
