"""Run a model once and record, per module, the arithmetic and the memory of that forward pass.

The model runs through ``torch.func.functional_call`` with every parameter and buffer replaced
(the model itself is never modified):

1. on the ``meta`` device (no data, no allocation) -- the default;
2. if the forward needs real values (e.g. a ``.item()`` in the model's Python code), again on the
   model's own device with zero-valued inputs and detached copies of the parameters.

During the pass:

* module hooks keep the stack of running modules; a GEMM layer or a SPEC 5 norm layer
  (``layers``) is costed from its type and shapes, and nothing it runs inside is counted again;
* a ``TorchDispatchMode`` costs every other ATen op (``ops.aten_cost``) and books it on the
  innermost running module (so a residual ``add`` lands on its block, attention matmuls on the
  attention module);
* training pass: what backward will compute is recorded beside the forward, from what requires
  grad (the walk's parameters require grad as the model's do): a GEMM layer's input-gradient GEMM
  when its input requires grad, its weight-gradient GEMM when its weight does; every other op's
  backward, counted as twice its forward, when one of its inputs requires grad (a frozen
  embedding's output, the first layer's input and everything computed from frozen weights alone
  have none);
* training pass: ``saved_tensors_hooks`` record every tensor autograd saves for backward (the
  activation memory of training); a GEMM/norm layer is recorded as saving its input
  (``Saved.kind == "input"``: what a quantized layer keeps, as codes), and what autograd saves
  inside a norm layer is recorded too (``"inside"``: what the float norm keeps, e.g. EvoNorm-S0's
  intermediates, several times its input);
* inference pass: the live activation storages are tracked op by op; their peak is the
  activation memory of inference;
* activation checkpointing (the layers passed as ``checkpointed``, transformers'
  ``GradientCheckpointingLayer`` blocks): the pass runs without transformers' own, and each
  checkpointed layer's call is priced as checkpointing runs it: what its inside saves is not
  kept, the tensors it is called with are (the recompute's inputs), and its forward is recorded a
  second time, forward only (``Walk.recomputed``: backward recomputes it).

Attention runs with PyTorch's math SDPA backend so that its matmuls and softmax are visible ops.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .layers import (computes_its_type, embedding_layer_types, gemm_layer_types, gemm_macs, norm_layer_cost,
                     norm_layer_types)
from .ops import Ops, aten_cost, gemm

ROOT = "(model)"


@dataclass
class Row:
    """What one module did in one forward pass (summed over its calls).

    ``ops``: forward arithmetic, for a GEMM layer its MACs plus bias adds (no quantization).
    ``calls``, ``input_numel``/``output_numel``: calls of a GEMM, norm or embedding layer and the
    elements of its inputs and outputs over all calls; ``weight_numel``: a GEMM layer's weight
    elements, a norm layer's parameter elements, an embedding's table (what an 8-bit layer
    quantizes, or an 8-bit embedding searches for its range, each call). ``is_embedding``: the row
    of a table lookup (``nn.Embedding``), which no arithmetic prices.

    What backward computes (training pass; zero in inference): ``backward``: every op's backward
    but a GEMM layer's two GEMMs, 2x the forward of each op that autograd differentiates (a GEMM
    layer's bias gradient when its bias requires grad); ``input_grad_macs``/``weight_grad_macs``:
    the MACs of a GEMM layer's input- and weight-gradient GEMMs over the calls that compute them;
    ``weight_grad_calls``: those computing a weight gradient; ``grad_output_numel`` /
    ``grad_input_numel``: over the calls that pass a gradient back to their input, the elements
    of the output gradient (what an 8-bit layer quantizes) and of the input gradient.
    """

    name: str
    kind: str
    is_gemm: bool = False
    weight_numel: int = 0
    is_embedding: bool = False
    calls: int = 0
    ops: Ops = field(default_factory=Ops)
    input_numel: int = 0
    output_numel: int = 0
    backward: Ops = field(default_factory=Ops)
    input_grad_macs: int = 0
    weight_grad_macs: int = 0
    weight_grad_calls: int = 0
    grad_output_numel: int = 0
    grad_input_numel: int = 0

    def fully_trained(self) -> "Row":
        """This row as SPEC 7's formula counts it (the paper's convention): every call computes
        both backward GEMMs and every op its backward, whatever requires grad."""
        bias_adds = Ops(self.ops.adds - self.ops.macs, self.ops.mults - self.ops.macs)
        return replace(self, backward=(bias_adds if self.is_gemm else self.ops).scaled(2),
                       input_grad_macs=self.ops.macs if self.is_gemm else 0,
                       weight_grad_macs=self.ops.macs if self.is_gemm else 0,
                       weight_grad_calls=self.calls if self.is_gemm else 0,
                       grad_output_numel=self.output_numel, grad_input_numel=self.input_numel)


@dataclass
class Saved:
    """One storage autograd keeps for backward: its size, the row that saved it, and how it was
    recorded: ``"op"`` by an op outside the typed layers, ``"input"`` as the input of a GEMM or
    norm layer, ``"inside"`` by autograd inside a norm layer."""

    numel: int
    itemsize: int
    row: str
    kind: str


@dataclass
class Walk:
    rows: dict[str, Row]
    uncounted_ops: Counter
    saved: dict[StorageWeakRef, list[Saved]]
    peak_activation_bytes: int
    device: str
    norm_rows: set[str] = field(default_factory=set)  # the rows of norm layers
    # forward-only rows of the calls made inside checkpointed layers: what backward computes again
    recomputed: dict[str, Row] = field(default_factory=dict)


def checkpointable_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that transformers' activation checkpointing wraps
    (``GradientCheckpointingLayer``: a model's blocks), checkpointed or not; [] for other models."""
    hf_layers = sys.modules.get("transformers.modeling_layers")  # not loaded: no such layer exists
    if hf_layers is None:
        return []
    return [m for m in model.modules() if isinstance(m, hf_layers.GradientCheckpointingLayer)]


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    return next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)


class _Recorder(TorchDispatchMode):
    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor], training: bool,
                 checkpointed: frozenset[nn.Module]):
        super().__init__()
        self.checkpointed = checkpointed
        self.checkpoint_depth = 0  # > 0 inside a checkpointed layer's call (training pass)
        self.recomputed: dict[str, Row] = {}
        self.training = training
        self.names = {m: (name or ROOT) for name, m in model.named_modules()}
        self.gemm_types = gemm_layer_types()
        self.norm_types = norm_layer_types()
        self.embedding_types = embedding_layer_types()
        self.state_storages = {StorageWeakRef(t.untyped_storage()) for t in state.values()}
        self.stack: list[tuple[str, nn.Module]] = [(ROOT, model)]
        self.typed_depth = 0  # > 0 while inside a layer costed by type
        self.rows: dict[str, Row] = {}
        self.uncounted = Counter()
        self.saved: dict[StorageWeakRef, list[Saved]] = {}
        self.live: dict[StorageWeakRef, int] = {}
        self.peak = 0
        self._typed_input: list[torch.Tensor | None] = []
        self.norm_rows: set[str] = set()
        self._inside_norm: str | None = None  # the row of the outermost typed layer, when it is a norm

    # -- rows ---------------------------------------------------------------------------------
    def row(self, module_name: str, module: nn.Module, recomputed: bool = False) -> Row:
        """The row of `module` (`recomputed`: in ``self.recomputed``)."""
        rows = self.recomputed if recomputed else self.rows
        if module_name not in rows:
            typed = self.typed(module)
            is_gemm = typed and isinstance(module, self.gemm_types)
            is_embedding = typed and isinstance(module, self.embedding_types)
            if is_gemm or is_embedding:
                weight_numel = module.weight.numel()
            elif typed:  # a norm: its (C,) weight, bias and v
                weight_numel = sum(p.numel() for p in module.parameters(recurse=False))
            else:
                weight_numel = 0
            rows[module_name] = Row(module_name, type(module).__name__, is_gemm, weight_numel, is_embedding)
        return rows[module_name]

    def forward_rows(self, module_name: str, module: nn.Module) -> list[Row]:
        """The rows a forward computation of `module` is booked on: its row, and its recomputed
        row inside a checkpointed layer."""
        row = self.row(module_name, module)
        return [row, self.row(module_name, module, recomputed=True)] if self.checkpoint_depth else [row]

    def typed(self, module: nn.Module) -> bool:
        return isinstance(module, self.gemm_types + self.norm_types + self.embedding_types) and \
            computes_its_type(module)

    def checkpoints(self, module: nn.Module) -> bool:
        """Whether `module`'s call is an activation-checkpointed one (training pass, grad enabled)."""
        return module in self.checkpointed and self.training and torch.is_grad_enabled()

    def differentiated(self, *tensors) -> bool:
        """Whether backward computes a gradient through an op on `tensors` (training pass)."""
        return self.training and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)

    # -- module hooks ---------------------------------------------------------------------------
    def pre_hook(self, module, args, kwargs):
        self.stack.append((self.names.get(module, type(module).__name__), module))
        if self.checkpoints(module):
            if not self.checkpoint_depth:  # checkpointing keeps what the layer is called with
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor):
                        self._save(t, self.stack[-1][0], "op")
            self.checkpoint_depth += 1
        if self.typed(module):
            if self.typed_depth == 0:
                name = self.stack[-1][0]
                x = _first_tensor(args, kwargs)
                self._typed_input.append(x)
                # a GEMM layer keeps its input for the weight gradient, an embedding its ids for the
                # table's gradient; a norm layer keeps it for backward
                needing_it = [module.weight] if isinstance(module, self.gemm_types + self.embedding_types) else \
                    [x, *module.parameters()]
                if self.differentiated(*needing_it):
                    self._save(x, name, "input")
                if isinstance(module, self.norm_types):
                    self.norm_rows.add(name)
                    self._inside_norm = name
            self.typed_depth += 1

    def post_hook(self, module, args, kwargs, output):
        name, _ = self.stack.pop()
        if self.checkpoints(module):
            self.checkpoint_depth -= 1
        if not self.typed(module):
            return
        self.typed_depth -= 1
        if self.typed_depth:
            return
        self._inside_norm = None
        x = self._typed_input.pop()
        out = _first_tensor((output,), {})
        if out is None:  # the forward raised; the error propagates
            return
        rows = self.forward_rows(name, module)
        row = rows[0]
        if row.is_gemm:
            bias = getattr(module, "bias", None)
            bias_adds = out.numel() if bias is not None else 0
            macs = gemm_macs(module, out)
            cost = gemm(macs, bias_adds)
        elif row.is_embedding:  # a lookup; its gradient adds output rows into the table, unpriced as before
            cost = Ops()
        else:
            cost = norm_layer_cost(module, x, self.training)
        for r in rows:
            r.calls += 1
            r.input_numel += x.numel()
            r.output_numel += out.numel()
            r.ops += cost
        if row.is_gemm:
            if self.differentiated(x):
                row.input_grad_macs += macs
                row.grad_output_numel += out.numel()
                row.grad_input_numel += x.numel()
            if self.differentiated(module.weight):
                row.weight_grad_macs += macs
                row.weight_grad_calls += 1
            if self.differentiated(bias):
                row.backward += Ops(bias_adds, 0).scaled(2)
        elif not row.is_embedding and self.differentiated(x, *module.parameters()):
            row.backward += cost.scaled(2)
            row.grad_output_numel += out.numel()
            row.grad_input_numel += x.numel()
        self._track(out)

    # -- ATen ops -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.typed_depth:
            return out
        cost = aten_cost(func, args, kwargs, out)
        if cost is None:
            self.uncounted[str(func.overloadpacket.__name__)] += 1
        elif cost != Ops():
            rows = self.forward_rows(*self.stack[-1])
            row = rows[0]
            for r in rows:
                r.ops += cost
            if self.differentiated(*tree_flatten((args, kwargs))[0]):
                row.backward += cost.scaled(2)
        self._track(out)
        return out

    # -- memory ---------------------------------------------------------------------------------
    def _save(self, t: torch.Tensor | None, row: str, kind: str) -> None:
        if t is None or self.checkpoint_depth:  # a checkpointed layer keeps nothing: backward recomputes it
            return
        key = StorageWeakRef(t.untyped_storage())
        if key in self.state_storages:
            return  # parameters and buffers are counted as weights
        entry = Saved(t.untyped_storage().nbytes() // t.element_size(), t.element_size(), row, kind)
        self.saved.setdefault(key, []).append(entry)

    def pack(self, t: torch.Tensor):
        if not self.typed_depth:
            self._save(t, self.stack[-1][0], "op")
        elif self._inside_norm is not None:
            self._save(t, self._inside_norm, "inside")
        return t

    def _track(self, out) -> None:
        """Add the storages of ``out`` to the live set and update the activation peak."""
        if self.training:
            return
        for key in [k for k in self.live if k.expired()]:
            del self.live[key]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = StorageWeakRef(t.untyped_storage())
                if key not in self.state_storages:
                    self.live[key] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(self.live.values()))


def walk(model: nn.Module, make_inputs, training: bool, checkpointed=()) -> Walk:
    """Run one forward pass of ``model`` (train or eval mode) and record it.

    ``make_inputs(device)`` returns ``(args, kwargs)`` for ``model`` on ``device``.
    ``checkpointed``: the modules whose calls activation checkpointing wraps in a training pass
    (``report`` picks them from ``estimate_cost``'s ``activation_checkpointing``).
    """
    checkpointed = frozenset(checkpointed)
    try:
        return _walk(model, make_inputs, training, torch.device("meta"), checkpointed)
    except (RuntimeError, NotImplementedError):
        # The forward needs real values (data-dependent Python control flow): run it for real, on
        # a fork of the random streams, so its dropout does not move a seeded run's numbers
        device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            return _walk(model, make_inputs, training, device, checkpointed)


def _walk(model: nn.Module, make_inputs, training: bool, device: torch.device, checkpointed: frozenset) -> Walk:
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    if device.type == "meta":
        state = {k: torch.empty_like(v, device=device).requires_grad_(v.requires_grad) for k, v in named}
    else:
        state = {
            k: v.detach().requires_grad_(v.requires_grad) if isinstance(v, nn.Parameter) else v.clone()
            for k, v in named
        }
    recorder = _Recorder(model, state, training, checkpointed)
    handles = []
    for module in recorder.names:
        handles.append(module.register_forward_pre_hook(recorder.pre_hook, with_kwargs=True))
        handles.append(
            module.register_forward_hook(recorder.post_hook, with_kwargs=True, always_call=True)
        )
    was_training = {m: m.training for m in recorder.names}
    # the pass runs without transformers' checkpointing; the recorder prices it (module docstring)
    was_checkpointing = {m: m.gradient_checkpointing for m in checkpointable_layers(model)}
    # an nn.TransformerEncoder packs a padded batch into a nested tensor for its layers' fused kernel,
    # whose ops the recorder cannot price (an 8-bit model is held off it: quant.surgery); the hooks
    # above already keep each layer on its own forward, which computes the same products
    was_nesting = {m: m.use_nested_tensor for m in model.modules() if isinstance(m, nn.TransformerEncoder)}
    args, kwargs = make_inputs(device)
    saved_hooks = (
        torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
        if training
        else contextlib.nullcontext()
    )
    try:
        model.train(training)
        for module in was_checkpointing:
            module.gradient_checkpointing = False
        for module in was_nesting:
            module.use_nested_tensor = False
        with torch.set_grad_enabled(training), sdpa_kernel(SDPBackend.MATH), saved_hooks, recorder:
            recorder._track((args, kwargs))
            output = torch.func.functional_call(model, state, args, kwargs, tie_weights=True)
            del output
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in was_training.items():
            module.training = mode
        for module, flag in was_checkpointing.items():
            module.gradient_checkpointing = flag
        for module, flag in was_nesting.items():
            module.use_nested_tensor = flag
    return Walk(recorder.rows, recorder.uncounted, recorder.saved, recorder.peak, device.type, recorder.norm_rows,
                recorder.recomputed)
