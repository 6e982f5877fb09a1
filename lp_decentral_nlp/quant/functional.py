"""Uniform affine quantization primitives (SPEC section 4, GEMMLOWP style).

``q = clamp(round((x - lo) / s), 0, 2**bits - 1)``, ``s = (hi - lo) / (2**bits - 1)``,
``x^ = q * s + lo``. Ranges are tensors (0-d or broadcastable to ``x``) so nothing here reads a
device's value back to the host: every function is free of host-device synchronisation (CPU
tensors may be read, as ``update_running_range`` does: there is no device to wait for).
"""
from __future__ import annotations

import math

import torch

from ..utils.layout import memory_order


# Resolution of the stochastic-rounding dither: u takes the 2**16 values (j + 1/2) / 2**16.
DITHER_BITS = 16
_DITHER_OFFSET = 0.5 + 2.0 ** -(DITHER_BITS + 1)  # the dither's constant part
# The smallest step with a finite float32 reciprocal (the smallest normal float32); smaller steps count as zero.
MIN_STEP = float(torch.finfo(torch.float32).tiny)


@torch.no_grad()
def quantize_codes(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, stochastic: bool = False, signed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes of `x` on the `bits`-bit affine grid spanning ``[lo, hi]`` (SPEC 4).

    Args:
        x: tensor of any shape and dtype; computed in float32 at least (a float16/bfloat16 ``v``
            cannot tell the levels of an 8-bit grid apart, nor hold the dither).
        lo, hi: range, 0-d or broadcastable to `x`; values outside it are clamped.
        bits: grid has ``2**bits`` levels.
        stochastic: round ``v`` to ``floor(v + u)``, ``u`` uniform on the ``2**16`` midpoints
            ``(j + 1/2) / 2**16`` of [0, 1): ``v`` goes up with probability ``v - floor(v)`` up
            to ``2**-17`` (unbiased to that resolution inside the range). On the CPU the 16-bit
            words come from a counter-based hash keyed by one 64-bit draw of torch's generator
            per call (``fused.dither_words``: computed in parallel, reproducible from
            ``torch.manual_seed``); elsewhere four words from each 64-bit draw of the device's
            generator. Nearest rounding otherwise.
        signed: return ``q - 2**(bits - 1)``: the unsigned codes shifted after rounding, bit for bit
            (the int8 kernel's codes are the simulated kernel's, .5 ties included).

    Returns:
        ``(codes, scale)``: codes as floats (float32, or float64 for a float64 `x`) holding
        integers in ``[0, 2**bits - 1]`` (``signed``: ``[-2**(bits-1), 2**(bits-1) - 1]``; same
        shape as `x`), and the step ``s`` (shape of ``hi - lo``). A zero-width range gives
        ``s = 0`` and codes 0, so every element dequantizes to ``lo``. Not differentiable
        (rounding has zero gradient): callers apply the straight-through estimator.
    """
    scale, inv, levels, shift = _affine_parameters(lo, hi, bits, signed)
    v = torch.sub(x.to(torch.promote_types(x.dtype, torch.float32)), lo).mul_(inv)
    if stochastic:  # u = r / 2**16 + (1/2 + 2**-17), r a signed 16-bit integer
        v.add_(_DITHER_OFFSET).add_(_dither(v.numel(), v.device).view(v.shape), alpha=2.0**-DITHER_BITS).floor_()
    else:
        v.round_()
    v.clamp_(0, levels)
    return (v.sub_(shift) if shift else v), scale


def _affine_parameters(lo, hi, bits, signed):
    """``(scale, inv, levels, shift)`` of ``quantize_codes``: ``v = (x - lo) * inv``, then round
    and clamp to ``[0, levels]``, then subtract ``shift``.

    ``(x - lo) * inv``, not ``x * inv - lo * inv``: the two products of the second cancel when
    ``|lo|`` is large against the range (``[1000, 1000.01]`` gave 69% wrong codes). A step too
    small for a finite float32 reciprocal (below the smallest normal float32: a range under 3e-36)
    is taken as zero, as a zero-width range. The shift is subtracted after rounding: rounding
    ``v - shift`` instead of ``v`` can put a .5 tie on the other side."""
    levels = 2**bits - 1
    shift = 2 ** (bits - 1) if signed else 0
    scale = (hi - lo) / levels
    inv = torch.where(scale >= MIN_STEP, scale.reciprocal(), torch.zeros_like(scale))
    return scale, inv, levels, shift


def _dither(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int16 random words ``r`` (the dither is ``r / 2**16`` plus the offset's constant).

    CPU: ``fused.dither_words`` keyed by one draw of torch's generator (:func:`_dither_key`), the
    words the one-pass quantizer computes in place (the same hash in torch's integer ops while a
    tracer hands out tensors without data). Other devices: four words from each 64-bit draw of
    the device's generator."""
    if device.type != "cpu":
        words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
        return words.view(torch.int16)[:n]
    key = _dither_key()
    if type(key) is torch.Tensor:
        from . import fused

        return fused.dither_words(n, int(key.numpy()))
    return _hashed_words(n, key)


def _dither_key() -> torch.Tensor:
    """One 64-bit draw of torch's default CPU generator (0-d int64), the key of a call's CPU dither
    words. Read on the host with ``.numpy()``: a CPU tensor, so no device sync and no scalar op."""
    return torch.empty((), dtype=torch.int64).random_(-(2**63), None)


def _hashed_words(n: int, key: torch.Tensor) -> torch.Tensor:
    """``fused.dither_words(n, key)`` in torch's int64 ops (each product masked to 32 bits)."""
    mask = 0xFFFFFFFF
    h = (torch.arange(n, dtype=torch.int64) * 0x9E3779B9 + (key & mask)).bitwise_and_(mask)
    h.bitwise_xor_((key >> 32) & mask)
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h.bitwise_xor_(h >> shift).mul_(factor).bitwise_and_(mask)
    h.bitwise_xor_(h >> 16)
    return ((h >> 16) - 32768).to(torch.int16)


def fake_quantize(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, stochastic: bool = False
) -> torch.Tensor:
    """Quantize-dequantize: the value of `x` on its affine grid, ``q * s + lo`` (same shape as `x`,
    and dtype for a floating `x`: the grid computed in float32 at least, then cast; no autograd
    history). One compiled pass (8-bit codes) where ``fused.quantize_rows`` takes the operands:
    the same bits."""
    if bits <= 8 and _fusable(x, lo, hi):
        return quantize_fused(x, lo, hi, bits, stochastic, signed=False, values=True, last_dim_sums=False)[1]
    codes, scale = quantize_codes(x, lo, hi, bits, stochastic)
    with torch.no_grad():
        values = codes.mul_(scale).add_(lo)
        return values.to(x.dtype) if x.is_floating_point() else values


def quantize_uint8(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, stochastic: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` on its affine grid in two forms (SPEC 4): ``(codes, scale, x_hat)``.

    ``codes`` uint8 ``q`` in ``[0, 2**bits - 1]`` (one byte per element, what a layer keeps for
    backward), ``scale`` the step ``s`` (shape of ``hi - lo``), ``x_hat`` the fp32 value
    ``q * s + lo``, bit for bit ``fake_quantize(x, lo, hi, bits, stochastic)`` and
    ``dequantize_uint8(codes, scale, lo)``.
    """
    codes, values, _, scale = quantize_fused(x, lo, hi, bits, stochastic, signed=False, values=True,
                                             last_dim_sums=False)
    return codes, scale, values


def quantize_fused(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, stochastic: bool, signed: bool,
                   values: bool, last_dim_sums: bool):
    """``quantize_codes`` with 8-bit integer output, in one pass where it can (``fused.py``).

    Returns:
        ``(codes, values, sums, scale)``: codes uint8 (``signed``: int8, shifted by
        ``2**(bits-1)``) of `x`'s shape; ``values`` (if asked) the fp32 ``codes * scale + lo`` of
        the unsigned codes; ``sums`` (if asked) the codes summed over the last dim (fp32,
        keepdim); the step ``scale``. Bit for bit the torch passes' results: a float32 CPU tensor,
        contiguous or channels last (its codes and values come channels last), goes through
        ``fused.quantize_rows``, anything else through ``quantize_codes``.
        No autograd history.
    """
    if values and signed:
        raise ValueError("values are the unsigned codes' dequantized tensor; ask for signed=False")
    if _fusable(x, lo, hi):  # numpy arrays underneath: no autograd history to turn off
        from . import fused

        dither_key = int(_dither_key().numpy()) if stochastic else None
        return fused.quantize_rows(x, lo, hi, bits, signed, dither_key, 2.0**-DITHER_BITS, _DITHER_OFFSET, values,
                                   last_dim_sums)
    code_dtype = torch.int8 if signed else torch.uint8
    float_codes, scale = quantize_codes(x, lo, hi, bits, stochastic, signed)
    with torch.no_grad():
        sums = float_codes.sum(-1, keepdim=True) if last_dim_sums else None
        codes = float_codes.to(code_dtype)
        return codes, float_codes.mul_(scale).add_(lo) if values else None, sums, scale


def _fusable(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether ``fused.quantize_rows`` takes `x` with the float32 range ``[lo, hi]`` (one shape)."""
    if lo.shape != hi.shape or lo.dtype != torch.float32 or hi.dtype != torch.float32:
        return False
    from . import fused  # numba, imported on the first call that can use it

    return fused.fusable(x, lo, hi)


def dequantize_uint8(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``q * s + lo`` in fp32 from uint8 codes (shape of `codes`): the same operations on the same
    values as ``fake_quantize``, so the same bits."""
    return torch.mul(codes, scale).add_(lo)


def tensor_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of the whole tensor, two 0-d tensors. A channels-last `x` is read in memory
    order (``torch.aminmax`` would first copy it to row-major; the same extremes)."""
    return torch.aminmax(memory_order(x))


def sample_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(min, max)`` over all dims but dim 0, each of shape ``(x.shape[0],)``.

    ``amin`` and ``amax`` rather than ``aminmax(dim=1)``: the same values (NaN included), but on
    the CPU ``aminmax`` over a dim is ~16x slower (0.88 vs 0.05 ms for 8 x 98304 floats, 2 threads).
    A channels-last `x` is read in memory order (no copy; the same extremes).
    """
    rows = memory_order(x).reshape(x.shape[0], -1)
    return rows.amin(dim=1), rows.amax(dim=1)


def grad_range(g: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Range of the output-gradient quantizer (SPEC 4): min/max of all of ``g`` (``"tensor"``), or
    one per sample (``"sample"``, shape ``(batch, 1, ..., 1)`` broadcastable to ``g``)."""
    if granularity == "sample" and g.dim() > 1:
        return tuple(r.reshape((-1,) + (1,) * (g.dim() - 1)) for r in sample_range(g))
    return tensor_range(g)


def mean_sample_range(x: torch.Tensor, batched: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation range of SPEC 4: the batch mean of per-sample minima and maxima (two 0-d tensors).

    Args:
        x: a layer input; samples along dim 0 when `batched`, else one sample.
        batched: whether dim 0 indexes samples.
    """
    if not batched:
        return tensor_range(x)
    lo, hi = sample_range(x)
    return lo.mean(), hi.mean()


@torch.no_grad()
def update_running_range(
    running_min: torch.Tensor,
    running_max: torch.Tensor,
    num_batches: torch.Tensor,
    batch_min: torch.Tensor,
    batch_max: torch.Tensor,
    momentum: float,
) -> None:
    """Momentum update of a running range, in place, PyTorch's convention (SPEC 4).

    ``running = (1 - momentum) * running + momentum * batch``; the first batch (``num_batches == 0``)
    initialises the range. A batch whose range is not finite (a NaN or infinite input) leaves the
    range and the count as they were: one such batch would otherwise make every later evaluation
    NaN. All arguments are 0-d tensors except `momentum`. On the CPU the batch's range and count
    are read on the host (no device to sync with) and the update is three small ops, where the
    device path's selects take about fifteen on every 8-bit layer's training call; the same bits.
    """
    if batch_min.is_cpu and running_min.is_cpu:
        lo, hi = batch_min.item(), batch_max.item()
        if not math.isfinite(lo + hi):
            return
        if num_batches.item() == 0:
            running_min.fill_(lo)  # a float32 value read as a Python float and written back: exact
            running_max.fill_(hi)
        else:
            running_min.lerp_(batch_min, momentum)
            running_max.lerp_(batch_max, momentum)
        num_batches.add_(1)
        return
    first = num_batches == 0
    finite = torch.isfinite(batch_min + batch_max)  # inf - inf is NaN: one test for both ends
    torch.where(finite, torch.where(first, batch_min, torch.lerp(running_min, batch_min, momentum)), running_min,
                out=running_min)
    torch.where(finite, torch.where(first, batch_max, torch.lerp(running_max, batch_max, momentum)), running_max,
                out=running_max)
    num_batches.add_(finite)
