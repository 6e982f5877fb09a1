"""8-bit versions of the vision norm layers (SPEC sections 4 and 5), registered with the surgery.

Importing this module (``lp_decentral_nlp.vision`` does) registers
:class:`QuantEvoNormS0`, :class:`QuantRangeEvoNorm2d` and :class:`QuantRangeBatchNorm2d` with
:func:`lp_decentral_nlp.quant.register_quant_layer`, so ``quantize_model(resnet, QuantConfig())``
swaps every conv, every linear but the ``classifier`` head (``DEFAULT_SKIP``) *and* every
EvoNorm-S0 / Range EvoNorm / Range BatchNorm, and ``dequantize_model`` swaps them back: the whole
network trains in 8 bits. ``nn.BatchNorm2d`` and ``nn.GroupNorm`` have no 8-bit version: they are
the fp32 baselines of the paper's norm comparison (SPEC 5 pairs Range EvoNorm with 8-bit training).

What an 8-bit norm layer computes (the GEMM layers' treatment of SPEC 4 carried over to an
elementwise layer; quantize-dequantize in float, as the ``simulated`` kernel):

* forward: the float formula of the layer (``norms.evonorm_s0`` / ``range_evonorm2d`` /
  ``range_batch_norm2d``) on the input quantized by the SPEC 4 activation quantizer (batch mean
  of per-sample min/max in training, running range in eval; the very buffers and rule of the
  8-bit GEMM layers) and on every parameter (``weight``, ``bias``, ``v``) quantized per tensor on
  its own min/max, nearest rounding;
* backward (gradient bifurcation): the layer gradient ``dL/dx`` is the VJP of the formula with
  the output gradient ``g`` quantized to ``grad_bits`` (stochastic rounding in training, range =
  min/max of ``g`` or per sample, as ``QuantConfig.grad_granularity``); the parameter gradients
  are the VJP with the full-precision ``g``. Straight-through estimator for every rounding.

As ``QuantGemmFunction`` does, the layer keeps for backward (``ctx.save_for_backward``) the
input's 8-bit codes with their scale and offset (a quarter of the fp32 input; the float layer's
autograd keeps several fp32 intermediates) and the (C,) 8-bit parameters; the backward works at the
dequantized input, bit for bit the forward's (``QuantNormLayer.normalize_backward``), and its
output gradient is quantized to uint8 codes, a step and an offset (no float copy written). Range
EvoNorm on the CPU runs its hand-written backward there (``RangeEvoNormFunction.gradients``: both
VJPs in one pass over each group, the input and the quantized gradient decoded from their codes on
the fly); the other layers, and Range EvoNorm elsewhere, dequantize the gradient and recompute the
formula under autograd, a Range BatchNorm in training with the same batch statistics and without
touching the running buffers.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..quant import register_quant_layer
from ..quant.functional import dequantize_uint8, fake_quantize, grad_range, quantize_fused, quantize_uint8
from ..quant.layers import ActivationQuantizer, in_backward, outside_compiled_graphs
from ..utils.layout import dense_like
from .norms import (
    EvoNormS0,
    RangeBatchNorm2d,
    RangeEvoNorm2d,
    RangeEvoNormFunction,
    _check_input,
    empty_batch_output,
    evonorm_s0,
    range_batch_norm2d,
    range_evonorm2d,
)

__all__ = ["QuantNormFunction", "QuantNormLayer", "QuantEvoNormS0", "QuantRangeEvoNorm2d", "QuantRangeBatchNorm2d"]


def _quantize_parameters(params: list[torch.Tensor], bits: int) -> list[torch.Tensor]:
    """Each (C,) parameter on the ``bits``-bit grid of its own min/max, nearest rounding (SPEC 4):
    stacked into one (P, C) tensor with one range per row, so one chain of small ops serves them
    all (each row's operations are those of quantizing it alone: the same values)."""
    stacked = torch.stack([p.detach() for p in params])
    return list(fake_quantize(stacked, *torch.aminmax(stacked, dim=1, keepdim=True), bits).unbind())


class QuantNormFunction(torch.autograd.Function):
    """One 8-bit norm-layer call with a bifurcated backward (module docstring; SPEC 4).

    ``apply(x, x_lo, x_hi, layer, training, *params)``: ``x`` (N, C, H, W) float32, ``x_lo`` /
    ``x_hi`` the 0-d input range, ``layer`` the :class:`QuantNormLayer` whose ``normalize`` is the
    float formula, ``params`` its (C,) parameters in ``layer.quant_parameters()`` order.
    """

    @staticmethod
    def forward(ctx, x, x_lo, x_hi, layer: "QuantNormLayer", training: bool, *params):
        bits = layer.quant_config.bits
        codes, scale, x_q = quantize_uint8(x, x_lo, x_hi, bits)
        params_q = _quantize_parameters(params, bits)
        ctx.save_for_backward(codes, scale, x_lo, *params_q)
        ctx.layer, ctx.training = layer, training
        ctx.stochastic = layer.quant_config.stochastic_grad_rounding and training
        # a forward inside a backward is checkpointing's recomputation: the running statistics
        # were updated by the step's forward already (as the activation range, ``_activation_range``)
        return layer.normalize(x_q, params_q, training, update_stats=not in_backward())

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        codes, scale, x_lo, *params_q = ctx.saved_tensors
        layer, config = ctx.layer, ctx.layer.quant_config
        need_x, need_params = ctx.needs_input_grad[0], list(ctx.needs_input_grad[5:])
        g_q = None
        if need_x:  # uint8 codes, step and offset; quantize_fused does not write the float values
            g_lo, g_hi = grad_range(g, config.grad_granularity)
            g_codes, _, _, g_scale = quantize_fused(dense_like(g), g_lo, g_hi, config.grad_bits, ctx.stochastic,
                                                    signed=False, values=False, last_dim_sums=False)
            g_q = (g_codes, g_scale, g_lo)
        grad_x, grad_params = layer.normalize_backward(codes, scale, x_lo, params_q, ctx.training, g_q, g, need_params)
        return (grad_x, None, None, None, None, *grad_params)


class QuantNormLayer(ActivationQuantizer):
    """Shared part of the 8-bit norm layers: activation quantizer, quantized call, swaps.

    A subclass also subclasses its float layer (``isinstance(QuantRangeEvoNorm2d(...),
    RangeEvoNorm2d)`` holds, the state-dict keys stay) and shares that layer's ``Parameter`` and
    buffer objects. Extra buffers (0-d), those of the 8-bit GEMM layers: ``act_running_min``,
    ``act_running_max``, ``act_num_batches``.
    """

    def normalize(self, x: torch.Tensor, params: list[torch.Tensor], training: bool,
                  update_stats: bool) -> torch.Tensor:
        """The float formula on (already quantized) ``x`` and ``params`` (``quant_parameters()``
        order) in the mode of the forward call (``training``); ``update_stats=False``: no side effect
        on running statistics (the backward recomputation)."""
        raise NotImplementedError

    def normalize_backward(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                           params: list[torch.Tensor], training: bool,
                           grad_for_input: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                           grad_for_params: torch.Tensor,
                           need_params: list[bool]) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """VJPs of :meth:`normalize` at the forward's 8-bit operands, the input ``codes * scale + lo``
        (uint8 codes (N, C, H, W), 0-d step and offset; ``dequantize_uint8``) and ``params``, no side
        effect on running statistics: ``(dL/dx from grad_for_input, [dL/dp from grad_for_params
        where need_params])``. ``grad_for_input``: the quantized output gradient as ``(codes, step,
        offset)`` (uint8 codes of ``x``'s shape; step and offset 0-d or one per sample), standing for
        ``dequantize_uint8(codes, step, offset)``; None: no ``dL/dx``, None. This one recomputes
        :meth:`normalize` under autograd; a layer with a hand-written backward overrides it."""
        need_x = grad_for_input is not None
        if need_x:
            grad_for_input = dequantize_uint8(*grad_for_input)
        with torch.enable_grad():
            x = dequantize_uint8(codes, scale, lo).requires_grad_(need_x)
            params = [p.detach().requires_grad_(n) for p, n in zip(params, need_params)]
            y = self.normalize(x, params, training, update_stats=False)
        wanted = [p for p, n in zip(params, need_params) if n]
        grad_x = None
        if need_x:
            (grad_x,) = torch.autograd.grad(y, x, grad_for_input, retain_graph=bool(wanted))
        grads = iter(torch.autograd.grad(y, wanted, grad_for_params) if wanted else ())
        return grad_x, [next(grads) if n else None for n in need_params]

    def quant_parameters(self) -> list[nn.Parameter]:
        """The parameters quantized in the forward pass: ``weight``, ``bias`` and ``v`` if present."""
        return [p for p in (self.weight, self.bias, getattr(self, "v", None)) if p is not None]

    @outside_compiled_graphs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, C, H, W) float32 (the master-weight dtype, as the 8-bit GEMM layers)."""
        _check_input(x, self.weight.numel(), type(self).__name__)
        self.check_master_weights()
        x = x.to(self.weight.dtype)
        if x.shape[0] == 0:  # no range to take: the running range stays as it is
            return empty_batch_output(x, self.weight, self.bias)
        lo, hi, batch_finite = self._activation_range(x)
        y = QuantNormFunction.apply(x, lo, hi, self, self.training, *self.quant_parameters())
        return self._keep_non_finite(y, batch_finite, lambda: self.non_finite_outputs(x))

    def non_finite_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """Bool mask broadcastable to the output of ``x (N, C, H, W)``: the outputs that depend on a
        NaN or infinite element of `x` in evaluation (``ActivationQuantizer._keep_non_finite``)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        c = self.quant_config
        return f"{super().extra_repr()}, bits={c.bits}, grad_bits={c.grad_bits}"


class _QuantGroupNormAct(QuantNormLayer):
    """The two EvoNorm-style layers: a per-sample group statistic and no state (``norm_fn``)."""

    norm_fn = None  # evonorm_s0 or range_evonorm2d (set by the subclass)

    @staticmethod
    def _constructor_args(module):
        return dict(num_channels=module.num_channels, groups=module.groups, eps=module.eps, apply_act=module.apply_act)

    def normalize(self, x, params, training, update_stats):
        weight, bias, *v = params
        return self.norm_fn(x, weight, bias, v[0] if v else None, self.groups, self.eps)

    def non_finite_outputs(self, x):
        """``(N, C, 1, 1)``: every channel of a group whose statistic (over its channels, H and W of
        one sample) a non-finite element enters."""
        n, c = x.shape[:2]
        bad_groups = ~torch.isfinite(x).reshape(n, self.groups, -1).all(-1)
        return bad_groups.repeat_interleave(c // self.groups, dim=1).reshape(n, c, 1, 1)


class QuantEvoNormS0(_QuantGroupNormAct, EvoNormS0):
    """8-bit EvoNorm-S0 (``norms.evonorm_s0`` on 8-bit input and parameters)."""

    float_type = EvoNormS0
    norm_fn = staticmethod(evonorm_s0)


class QuantRangeEvoNorm2d(_QuantGroupNormAct, RangeEvoNorm2d):
    """8-bit Range EvoNorm (``norms.range_evonorm2d`` on 8-bit input and parameters): the norm of
    the paper's 8-bit training (SPEC 5)."""

    float_type = RangeEvoNorm2d
    norm_fn = staticmethod(range_evonorm2d)

    def normalize_backward(self, codes, scale, lo, params, training, grad_for_input, grad_for_params, need_params):
        """The hand-written backward (:meth:`RangeEvoNormFunction.gradients`) on the CPU: the layer
        gradient from ``grad_for_input``, the parameter gradients from ``grad_for_params``, the
        input and the quantized gradient decoded from their codes on the fly; no recomputation
        under autograd."""
        if codes.device.type != "cpu":
            return super().normalize_backward(codes, scale, lo, params, training, grad_for_input, grad_for_params,
                                              need_params)
        weight, bias, *v = params
        g_codes, g_scale, g_lo = grad_for_input if grad_for_input is not None else (None, None, None)
        dx, dw, db, dv = RangeEvoNormFunction.gradients(
            codes, g_codes, grad_for_params if any(need_params) else None, weight, v[0] if v else None,
            self.groups, self.eps, scale, lo, g_scale, g_lo)
        return dx, [d if n else None for d, n in zip((dw, db, dv), need_params)]


class QuantRangeBatchNorm2d(QuantNormLayer, RangeBatchNorm2d):
    """8-bit Range BatchNorm (``norms.range_batch_norm2d`` on 8-bit input and parameters; its
    running statistics are those of the 8-bit input)."""

    float_type = RangeBatchNorm2d

    @staticmethod
    def _constructor_args(module):
        return dict(num_features=module.num_features, momentum=module.momentum, eps=module.eps)

    def normalize(self, x, params, training, update_stats):
        weight, bias = params
        stats = (self.running_mean, self.running_scale, self.num_batches_tracked)
        if training and not update_stats:  # same batch statistics, scratch copies of the running buffers
            stats = tuple(t.clone() for t in stats)
        return range_batch_norm2d(x, *stats, weight, bias, training, self.momentum, self.eps)

    def non_finite_outputs(self, x):
        """``x``'s shape: in evaluation each output depends on its own input element only."""
        return ~torch.isfinite(x)


register_quant_layer(EvoNormS0, QuantEvoNormS0)
register_quant_layer(RangeEvoNorm2d, QuantRangeEvoNorm2d)
register_quant_layer(RangeBatchNorm2d, QuantRangeBatchNorm2d)
