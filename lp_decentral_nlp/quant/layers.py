"""8-bit layers with gradient bifurcation (SPEC section 4, Banner et al. 2018).

Each layer subclasses its float counterpart, so ``isinstance(layer, nn.Linear)`` holds and its
parameters keep their state-dict keys; the fp32 master weights are the float layer's own
``Parameter`` objects. Three buffers per GEMM layer hold the running activation range.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from transformers.pytorch_utils import Conv1D

from .config import QuantConfig
from .functional import fake_quantize, grad_range, mean_sample_range, tensor_range, update_running_range
from .gemm import Conv2dGemm, Gemm, LinearGemm, TransposedLinearGemm, conv_output_hw
from .kernels import AUTO, Kernel, resolve_kernel
from ..utils.layout import dense_like, is_channels_last
from ..utils.numba_threads import eager_under_compile


def outside_compiled_graphs(forward):
    """`forward` (an 8-bit layer's call) run eagerly under ``torch.compile``: one graph break per
    call, between the compiled pieces of the model around it (``torch.compiler.disable``).

    The layers' CPU kernels are numba functions Dynamo cannot trace. Traced around them, each call
    broke several times and Dynamo compiled the pieces between the breaks once per weight shape
    until its recompile limit, so a compiled 8-bit model ran slower than an uncompiled one
    (docs/design.md). The kernels' own mechanism (``utils.numba_threads.eager_under_compile``):
    eager calls skip the ``disable`` wrapper."""
    return eager_under_compile(forward)


class QuantGemmFunction(torch.autograd.Function):
    """One quantized GEMM forward, bifurcated backward (SPEC 4).

    Forward: ``y = gemm(Q(x; x_lo, x_hi), Q(W; min W, max W)) + b`` with nearest rounding; the
    GEMM runs once. Backward, with the straight-through estimator for every rounding:

    * layer gradient ``dL/dx = grad_input(Q_sr(g), Q(W))``: the output gradient ``g`` is quantized
      to ``grad_bits`` (stochastic rounding in training, range = min/max of ``g``);
    * weight gradient ``dL/dW = grad_weight(Q(x), g)`` from the *full-precision* ``g``, so the
      quantized layer gradient never leaks into it; ``dL/db = sum g``.

    Saved for backward (``ctx.save_for_backward``) is what these products use, the forward's
    quantized operands, not the float tensors: the input's 8-bit codes with their scale and offset
    when ``dL/dW`` is needed, the weight's 8-bit codes when ``dL/dx`` is (a quarter of the fp32
    bytes; the kernel's ``for_backward`` drops float copies). The backward is the same computation
    as recomputing the operands from the float tensors, bit for bit.

    The output may be modified in place, as ``nn.Linear``'s (Wav2Vec2's masking writes into a
    projection's output): a kernel's output is often a view of the GEMM's result (a reshape of the
    ``(rows, out)`` product, the int8 Conv2d's channels-last permute), and autograd refuses in-place
    writes to a view made inside a Function, so ``forward`` returns ``y.detach()``: the same memory,
    no copy, not a view for autograd.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, x_lo, x_hi, gemm: Gemm, kernel: Kernel, config: QuantConfig, training: bool):
        need_x, need_w = ctx.needs_input_grad[:2]
        x_q = kernel.quantize(x, x_lo, x_hi, config.bits, False)
        w_q = kernel.quantize(weight, *tensor_range(weight), config.bits, False)
        y = kernel.forward(gemm, x_q, w_q, bias)
        kept_x = kernel.for_backward(x_q) if need_w else (None,) * len(x_q)
        kept_w = kernel.for_backward(w_q) if need_x else (None,) * len(w_q)
        ctx.save_for_backward(*kept_x, *kept_w)
        ctx.operand_types, ctx.shapes = (type(x_q), type(w_q)), (x.shape, weight.shape)
        ctx.gemm, ctx.kernel, ctx.config = gemm, kernel, config
        ctx.stochastic = config.stochastic_grad_rounding and training
        return y.detach()  # not a view: the caller may write into it (see the class docstring)

    @staticmethod
    @once_differentiable  # its products run on 8-bit codes outside autograd: no second derivative
    def backward(ctx, g):
        # a strided g (attention's K projection gets a transposed one) would take the torch passes,
        # not the one-pass quantizer: one copy is cheaper (the same codes: the dither follows the
        # elements' row-major order either way); a channels-last g (a Conv2d's) stays as it is
        g = dense_like(g)
        gemm, kernel, config = ctx.gemm, ctx.kernel, ctx.config
        (x_type, w_type), (x_shape, w_shape) = ctx.operand_types, ctx.shapes
        saved = ctx.saved_tensors
        x_q, w_q = x_type(*saved[: len(x_type._fields)]), w_type(*saved[len(x_type._fields):])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x:
            g_q = kernel.quantize(g, *grad_range(g, config.grad_granularity), config.grad_bits, ctx.stochastic)
            grad_x = kernel.grad_input(gemm, g_q, w_q, x_shape)
        if need_w:
            grad_w = kernel.grad_weight(gemm, x_q, g, w_shape)
        if need_b:
            grad_b = gemm.grad_bias(g)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class QuantModule:
    """Contract of every module the surgery swaps in (see ``surgery.register_quant_layer``).

    ``from_float(module, config)`` builds the quantized module around `module`'s own parameters;
    ``to_float()`` gives back a plain module holding the current (trained) parameters.
    ``enabled_by`` names a ``QuantConfig`` bool that must be True for the surgery to swap this
    type (None: always swapped); ``unsupported(module)`` says why a module of the float type
    cannot be swapped (None: it can).
    """

    quant_config: QuantConfig
    enabled_by: str | None = None
    float_type: type[nn.Module]

    @staticmethod
    def _constructor_args(module: nn.Module) -> dict:
        """Keyword arguments that rebuild a float module of `module`'s shape."""
        raise NotImplementedError

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        """Why `module` (of ``float_type``) cannot be swapped, for the dry-run report; None: it can.

        A ``weight`` or ``bias`` that is no parameter of `module` itself is recomputed before each
        forward from parameters of other names (``torch.nn.utils.prune``, the old-style
        ``weight_norm``/``spectral_norm`` hooks): the 8-bit layer shares parameters, not the hook."""
        own = dict(module.named_parameters(recurse=False))
        computed = [name for name in ("weight", "bias") if getattr(module, name, None) is not None and name not in own]
        if computed:
            return (f"its {' and '.join(computed)} is recomputed from {', '.join(sorted(own))} before each forward (pruning, "
                    "weight_norm or spectral_norm), which the 8-bit layer would not do: make it permanent first "
                    "(torch.nn.utils.prune.remove, torch.nn.utils.remove_weight_norm)")
        return None

    @classmethod
    def from_float(cls, module: nn.Module, config: QuantConfig) -> nn.Module:
        """A quantized module sharing `module`'s parameter and buffer objects (no copy), same training flag."""
        if type(module) is not cls.float_type:
            raise TypeError(f"{cls.__name__}.from_float needs a {cls.float_type.__name__}, got {type(module).__name__}")
        _require_float32(module, cls.__name__, "call model.float() first")
        with torch.device("meta"):
            layer = cls(**cls._constructor_args(module), quant_config=config)
        _share_state(module, layer)
        return layer.train(module.training)

    def check_master_weights(self) -> None:
        """Raise TypeError unless the master weights are still float32 (SPEC 4), as ``from_float``
        asked: ``model.to(torch.bfloat16)`` / ``.half()`` (or float64) after the surgery would run
        the 8-bit grids in another dtype. Every forward calls it first (one dtype comparison)."""
        dtype = self.weight.dtype
        if dtype != torch.float32:
            undo = ("call model.to(torch.float32)" if dtype.itemsize > 4 else  # float64 holds every float32 value
                    f"the conversion rounded the float32 master weights and activation ranges to {dtype}: load the "
                    "model (or its checkpoint) again and quantize it")
            _require_float32(self, f"{type(self).__name__} with weight {tuple(self.weight.shape)}",
                             f"the model was converted after quantize_model (only float32 is allowed): {undo}; "
                             "torch.autocast gives bf16/fp16 compute elsewhere, the 8-bit GEMMs stay fp32")

    def to_float(self) -> nn.Module:
        """The plain float module holding this module's current parameters and buffers (same objects)."""
        with torch.device("meta"):
            layer = self.float_type(**self._constructor_args(self))
        _share_state(self, layer)
        return layer.train(self.training)


class ActivationQuantizer(QuantModule):
    """The SPEC 4 input quantizer shared by every 8-bit layer (GEMM layers and vision norms).

    Buffers (0-d): ``act_running_min``/``act_running_max`` (running input range, same units as
    the input) and ``act_num_batches`` (training batches seen; 0 means uncalibrated).
    """

    _RANGE_BUFFERS = ("act_running_min", "act_running_max", "act_num_batches")

    def __init__(self, *args, quant_config: QuantConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.quant_config = QuantConfig() if quant_config is None else quant_config
        for name in self._RANGE_BUFFERS:
            self.register_buffer(name, None)
        self.reset_activation_range()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """``load_state_dict`` of a float checkpoint (none of the range buffers): the layer starts
        uncalibrated, as after ``quantize_model``, and the buffers are not reported missing. They
        would otherwise keep what they held, e.g. uninitialised memory after ``to_empty()`` of a
        model quantized on the ``meta`` device. (``from_pretrained`` loads otherwise; its quantizer
        does the same, :mod:`.hf_quantizer`.)"""
        absent = [prefix + name for name in self._RANGE_BUFFERS if prefix + name not in state_dict]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if len(absent) == len(self._RANGE_BUFFERS):
            self.reset_activation_range()
            missing_keys[:] = [key for key in missing_keys if key not in absent]

    @classmethod
    def from_float(cls, module: nn.Module, config: QuantConfig) -> nn.Module:
        """An 8-bit layer sharing `module`'s parameters and buffers, its activation range reset."""
        layer = super().from_float(module, config)
        layer.reset_activation_range()
        return layer

    def reset_activation_range(self) -> None:
        """Forget the running activation range (zeros on the weight's device, 0 batches seen)."""
        device = self.weight.device
        self.act_running_min = torch.zeros((), device=device)
        self.act_running_max = torch.zeros((), device=device)
        self.act_num_batches = torch.zeros((), dtype=torch.long, device=device)

    def _activation_range(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Input range (SPEC 4): batch mean of per-sample min/max in training, which also updates
        the running range; the running range in eval (the batch's own before any training batch).
        Returns ``(lo, hi, batch_finite)``, 0-d tensors; ``batch_finite`` (eval only, None in
        training): whether `x` holds no NaN and no infinity (its per-sample extremes are finite),
        for :meth:`_keep_non_finite`.

        A forward that runs inside a backward pass is gradient checkpointing's recomputation
        (``torch.utils.checkpoint``, reentrant or not): it takes the same batch range but leaves the
        running range alone, so a checkpointed step updates it once, as an uncheckpointed one."""
        with torch.no_grad():
            lo, hi = mean_sample_range(x.detach(), batched=x.dim() > 1)
            if self.training:
                if not in_backward():
                    update_running_range(
                        self.act_running_min, self.act_running_max, self.act_num_batches, lo, hi,
                        self.quant_config.act_momentum,
                    )
                return lo, hi, None
            batch_finite = torch.isfinite(lo + hi)  # inf - inf is NaN: one test for both ends
            calibrated = self.act_num_batches > 0
            return (torch.where(calibrated, self.act_running_min, lo), torch.where(calibrated, self.act_running_max, hi),
                    batch_finite)

    def _keep_non_finite(self, y: torch.Tensor, batch_finite: torch.Tensor | None,
                         non_finite_outputs: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`y` with NaN where, in evaluation, the output depends on a NaN or infinite input element
        (``non_finite_outputs()``, a bool mask broadcastable to `y`), the others untouched: for a
        GEMM layer exactly the outputs the float layer leaves non-finite, for a norm those of the
        statistic's group (the float layer's NaNs; an infinity may leave it finite values there, as
        ``x / inf``). The running range's codes cannot hold such a value (a NaN rounds to the
        lowest code, an infinity to an end of the grid), so a NaN from a diverged earlier layer
        would otherwise come out as finite numbers. In training the batch's own range is not
        finite, so every output is NaN already.

        On the CPU the 0-d `batch_finite` is read on the host (no device sync) and a finite batch
        costs nothing more; elsewhere (CUDA) the mask is computed every call, so no value leaves the
        device."""
        if self.training or (batch_finite.is_cpu and bool(batch_finite.numpy())):
            return y
        return y.masked_fill(non_finite_outputs(), float("nan"))


class QuantGemmLayer(ActivationQuantizer):
    """Shared part of the 8-bit GEMM layers: the quantized call and the swaps (the activation-range
    buffers come from :class:`ActivationQuantizer`)."""

    gemm_type: type  # the gemm.py class of this layer type (kernels decide support from it)
    _warned_fallback: str | None = None  # the reason this layer last warned it cannot run its configured kernel

    def fallback_told(self) -> None:
        """``quantize_model`` has warned why this layer cannot run its configured kernel (on its
        weight's device and shape): its forward warns only of another reason (a call shape, or a
        move to another device)."""
        self._warned_fallback = self._resolve_kernel(None, None)[1]

    @outside_compiled_graphs
    def _quant_gemm(self, x: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        """Run `gemm` through ``QuantGemmFunction`` in the master-weight dtype (autocast off), with
        the kernel ``resolve_kernel`` picks for this layer (the simulated one where it must fall back:
        a kernel named in the config, not ``"auto"``, that cannot run the layer warns why).

        An empty input (no elements, e.g. a batch of 0 samples) has nothing to quantize: it runs
        the float GEMM (``gemm.forward``: the float layer's empty output, zero weight and bias
        gradients) and leaves the running activation range alone. A floating-point input of
        another dtype (autocast's bf16/fp16) is cast, since its 8-bit codes are the same; an integer
        or bool one is refused, as the float layer refuses it."""
        self.check_master_weights()
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} with weight {tuple(self.weight.shape)}: expected a floating-point "
                            f"input, got {x.dtype} (as the float layer refuses it: token ids go through an embedding "
                            "first)")
        with _autocast_disabled(x.device.type):
            x = x.to(self.weight.dtype)
            if x.numel() == 0:
                return gemm.forward(x, self.weight, self.bias)
            kernel, fallback = self._resolve_kernel(x, gemm)
            if not x.is_meta:  # what kernel_report reports; a meta pass (the cost model's walk) runs nothing
                self.last_kernel = kernel.name
                if fallback is not None and self.quant_config.kernel != AUTO and fallback != self._warned_fallback:
                    # said once per layer (not every step); warnings shows a message once: one line per reason
                    self._warned_fallback = fallback
                    warnings.warn(f"QuantConfig(kernel={self.quant_config.kernel!r}) cannot run every layer: "
                                  f"{fallback}; those layers run the simulated kernel (kernel_report(model) names "
                                  f"them)", stacklevel=2)
            lo, hi, batch_finite = self._activation_range(x)
            y = QuantGemmFunction.apply(x, self.weight, self.bias, lo, hi, gemm, kernel, self.quant_config, self.training)
            return self._keep_non_finite(y, batch_finite, lambda: gemm.non_finite_outputs(x, self.weight))

    def kernel(self, x: torch.Tensor | None = None, gemm: Gemm | None = None) -> Kernel:
        """The kernel this layer's forward runs now (``resolve_kernel`` for its config, weight
        device and shape, and the call's input `x` and `gemm` where given; the simulated one where
        the configured kernel cannot run it)."""
        return self._resolve_kernel(x, gemm)[0]

    def _resolve_kernel(self, x: torch.Tensor | None, gemm: Gemm | None) -> tuple[Kernel, str | None]:
        """``resolve_kernel`` of this layer: the kernel, and why it is not the configured one (or None)."""
        return resolve_kernel(self.quant_config.kernel, self.gemm_type, self.weight,
                              **self._kernel_constraints(x, gemm))

    def _kernel_constraints(self, x: torch.Tensor | None, gemm: Gemm | None) -> dict:
        """Layer settings and call sizes beyond the weight's shape and device that decide the kernel
        (keyword arguments of ``resolve_kernel``)."""
        return {}

    def extra_repr(self) -> str:
        c = self.quant_config
        return f"{super().extra_repr()}, bits={c.bits}, grad_bits={c.grad_bits}, kernel={c.kernel}"


def check_module(model, what: str = "model") -> None:
    """TypeError ``"<what> must be a torch.nn.Module, got <type>"`` unless `model` is one: the
    functions that walk a model's layers say so instead of failing on ``.modules()``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} must be a torch.nn.Module, got {type(model).__name__}")


def kernel_report(model: nn.Module) -> dict[str, str]:
    """``{module name: kernel name}`` for every 8-bit GEMM layer of `model`: the kernel its last
    forward ran, or for a layer not called yet the one ``resolve_kernel`` picks from the layer's
    ``QuantConfig.kernel``, device and shape alone. That is a prediction: ``"auto"`` also weighs
    a convolution call's size, so a convolution's calls may run another kernel (and an evaluation
    at another batch size another than training's: ``trainer.TrainingKernelsCallback`` keeps the
    training steps'). Empty when nothing is quantized."""
    check_module(model)
    return {name: getattr(module, "last_kernel", None) or module.kernel().name
            for name, module in model.named_modules() if isinstance(module, QuantGemmLayer)}


class QuantLinear(QuantGemmLayer, nn.Linear):
    """8-bit ``nn.Linear``: input ``(..., in_features)`` -> output ``(..., out_features)``."""

    float_type = nn.Linear
    gemm_type = LinearGemm
    _gemm = LinearGemm()

    @staticmethod
    def _constructor_args(module):
        return dict(in_features=module.in_features, out_features=module.out_features, bias=module.bias is not None)

    def forward(self, x):
        return self._quant_gemm(x, self._gemm)


class QuantConv1D(QuantGemmLayer, Conv1D):
    """8-bit transformers ``Conv1D`` (GPT-2 family; weight ``(nx, nf)``): ``(..., nx)`` -> ``(..., nf)``."""

    float_type = Conv1D
    gemm_type = TransposedLinearGemm
    _gemm = TransposedLinearGemm()

    @staticmethod
    def _constructor_args(module):
        return dict(nf=module.nf, nx=module.nx)

    def __repr__(self):  # Conv1D overrides __repr__ without extra_repr
        return f"QuantConv1D(nf={self.nf}, nx={self.nx}, {QuantGemmLayer.extra_repr(self).lstrip(', ')})"

    def forward(self, x):
        return self._quant_gemm(x, self._gemm)


class QuantConv2d(QuantGemmLayer, nn.Conv2d):
    """8-bit ``nn.Conv2d``: ``(N, Cin, H, W)`` (or unbatched ``(Cin, H, W)``) -> ``(N, Cout, Ho, Wo)``.

    Non-zero padding modes (and asymmetric ``padding="same"``) are applied with ``F.pad`` before
    quantization; zero padding stays inside the convolution.

    The output has the memory format ``nn.Conv2d`` gives: channels last (``torch.channels_last``)
    for a channels-last input, else contiguous. oneDNN's int8 convolution (the int8 kernel on the
    CPU) computes channels last whatever its input, so a contiguous input costs one copy of the
    output; a network fed channels-last images passes channels-last tensors from layer to layer
    without converting them (``docs/design.md``). (Its channels-last output of a contiguous input
    broke a user's ``x.view(n, -1)`` at the batch sizes where ``kernel="auto"`` chose int8.)
    """

    float_type = nn.Conv2d
    gemm_type = Conv2dGemm

    @staticmethod
    def _constructor_args(module):
        return dict(
            in_channels=module.in_channels, out_channels=module.out_channels, kernel_size=module.kernel_size,
            stride=module.stride, padding=module.padding, dilation=module.dilation, groups=module.groups,
            bias=module.bias is not None, padding_mode=module.padding_mode,
        )

    def _kernel_constraints(self, x, gemm):
        if x is None:
            return {"groups": self.groups}
        out_h, out_w = conv_output_hw(x.shape[-2:], self.kernel_size, gemm.stride, gemm.padding, gemm.dilation)
        return {"groups": self.groups, "output_pixels": x.shape[0] * out_h * out_w}

    def _numeric_padding(self) -> tuple[int, int] | None:
        """Zero padding ``(h, w)`` the GEMM can take, or None when ``F.pad`` must apply it."""
        if self.padding_mode != "zeros":
            return None
        if not isinstance(self.padding, str):
            return self.padding
        left, right = self._reversed_padding_repeated_twice[::2], self._reversed_padding_repeated_twice[1::2]
        return tuple(reversed(left)) if left == right else None

    def forward(self, x):
        if x.dim() == 3:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        padding = self._numeric_padding()
        if padding is None:
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=mode)
            padding = (0, 0)
        out = self._quant_gemm(x, Conv2dGemm(self.stride, padding, self.dilation, self.groups))
        return out if is_channels_last(x) or not is_channels_last(out) else out.contiguous()


class _StraightThrough(torch.autograd.Function):
    """``apply(x, x_q)`` is ``x_q`` forward; the gradient goes to ``x`` unchanged (SPEC 4's STE)."""

    @staticmethod
    def forward(ctx, x, x_q):
        return x_q

    @staticmethod
    def backward(ctx, g):
        return g, None


class QuantEmbedding(QuantModule, nn.Embedding):
    """8-bit ``nn.Embedding`` (``QuantConfig(embeddings=True)``): ids ``(*)`` -> ``(*, embedding_dim)``.

    The looked-up rows are put on the table's ``bits``-bit grid (SPEC 4 weight quantization:
    per-tensor min/max of the whole table, nearest rounding), which is what looking them up in the
    quantized table gives, without quantizing the whole table every step. Straight-through
    estimator: the fp32 master table gets the float lookup's gradient. Ids carry no gradient, so
    there is no layer gradient to quantize and no activation range. ``max_norm`` (renormalizing
    the table in place) is not supported.
    """

    float_type = nn.Embedding
    enabled_by = "embeddings"

    def __init__(self, *args, quant_config: QuantConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.quant_config = QuantConfig() if quant_config is None else quant_config

    @classmethod
    def unsupported(cls, module):
        computed = super().unsupported(module)
        if computed:
            return computed
        if module.max_norm is not None:
            return f"max_norm={module.max_norm} renormalizes the table in place, which 8-bit lookups do not support"
        return None

    @staticmethod
    def _constructor_args(module):
        return dict(num_embeddings=module.num_embeddings, embedding_dim=module.embedding_dim,
                    padding_idx=module.padding_idx, scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse)

    @outside_compiled_graphs
    def forward(self, ids):
        self.check_master_weights()
        rows = F.embedding(ids, self.weight, self.padding_idx, None, 2.0, self.scale_grad_by_freq, self.sparse)
        with torch.no_grad():
            rows_q = fake_quantize(rows, *tensor_range(self.weight), self.quant_config.bits)
        return _StraightThrough.apply(rows, rows_q)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.quant_config.bits}"


def _require_float32(module: nn.Module, layer: str, hint: str) -> None:
    """Raise TypeError, naming `layer` and ending with `hint`, unless every parameter of `module`
    (not of its children) is float32: the master weights of the 8-bit layers (SPEC 4)."""
    for name, p in module.named_parameters(recurse=False):
        if p.dtype != torch.float32:
            raise TypeError(f"{layer}: master weights must be float32 (SPEC 4), got {name} of dtype {p.dtype}; {hint}")


def _share_state(src: nn.Module, dst: nn.Module) -> None:
    """Give `dst` the very parameter objects of `src`, and those of its buffers that `dst` also has."""
    src_buffers = dict(src.named_buffers(recurse=False))
    for name, p in src.named_parameters(recurse=False):
        setattr(dst, name, p)
    for name in dict(dst.named_buffers(recurse=False)):
        if name in src_buffers:
            setattr(dst, name, src_buffers[name])


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass now (the test torch's own FSDP and
    ``torch.utils.module_tracker.ModuleTracker.is_bw`` use; one C call, no device sync)."""
    return torch._C._current_graph_task_id() != -1


def _autocast_disabled(device_type: str):
    """Keep the quantized GEMM in fp32 under autocast: bf16/fp16 cannot hold the 8-bit grid exactly."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
