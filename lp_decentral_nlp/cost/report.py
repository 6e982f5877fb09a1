"""Hardware cost of one training / inference iteration of one node (SPEC section 7).

``estimate_cost`` walks the real model (see ``walk``), counts additions and multiplications per
layer, prices them at 45 nm energies, and sums the memory a node needs.

What is counted, per forward pass on the real shapes (conventions in ``ops``):

* GEMM layers (Linear, Conv1d/2d/3d, HF Conv1D): ``MACs = b*Cout*(Cin/groups)*K^2*Hout*Wout``
  (Linear: ``out.numel() * in_features``), each MAC one add and one mult, plus one add per output
  for a bias. Functional matmuls (attention scores and values) the same way.
* SPEC 5 norm layers (EvoNorm-S0, Range EvoNorm, Range BN) from their equations (``layers``);
  LayerNorm, BatchNorm, GroupNorm, activations, softmax, residual additions, pooling, scaling
  and every other op from the ATen ops the model runs.
* Training = forward + backward, counted on a forward pass in train mode (batch statistics,
  dropout), backward as autograd runs it: a GEMM layer's input-gradient GEMM when its input
  requires grad, its weight-gradient GEMM when its weight does (SPEC 7's 3x for a trained layer
  inside the network; the first layer computes no input gradient, a frozen layer no weight
  gradient), every other op's backward at 2x its forward when one of its inputs requires grad.
  Nothing below the lowest trainable parameter has a backward: a PEFT model with frozen base
  weights costs what its step computes. Inference: 1x, eval mode.
* Activation checkpointing (``activation_checkpointing``): backward runs each checkpointed
  layer's forward again, priced a second time, and the layer keeps only the tensors it was
  called with for backward (``walk``).
* 8-bit (``precision="int8"``) adds the quantization of every quantized GEMM layer, run in
  float (``ops.quantize``/``ops.dequantize``). Training: its input activation (per-sample range
  search, clamp), its weights (range search), its output gradient (range search, stochastic
  rounding), and the rescaling of each integer GEMM's output. Inference: the input activation
  with the running range (no search) and the output rescaling; weights are stored 8-bit.

Energy (Horowitz, ISSCC 2014, 45 nm): fp32 add 0.9 pJ, fp32 mult 3.7 pJ, int8 add 0.03 pJ,
int8 mult 0.2 pJ. With ``precision="int8"`` only the GEMMs of the quantized layers are priced at
int8: the forward and the input-gradient GEMMs; the weight-gradient GEMM at fp32, as our training
runs it (SPEC 4 computes it from the full-precision output gradient), unless
``weight_grad_gemm="int8"`` prices it int8 as the paper's accelerator does. Everything else --
quantization arithmetic, bias, norms, activations, softmax, attention matmuls, residual additions,
pooling, the layers kept full precision (heads) -- is priced at fp32.

Memory (bytes, 1 MB = 10^6 bytes): training holds weights + gradients + optimizer state
(``optimizer``: 0 to 3 tensors per parameter) + the activations autograd saves for backward;
inference holds the weights + the peak of the live activation tensors during the forward pass.
With ``precision="int8"`` what the quantized layers quantize (a GEMM layer's weight, not its
bias; a norm's every parameter), its gradients and optimizer state count 8 bits, as SPEC 7's
8-bit accelerator holds them (``lp_decentral_nlp.quant`` keeps fp32 master weights and weight
gradients). The input a quantized layer saves for backward
counts what the 8-bit layers store: its 8-bit codes (1 byte per element) plus a per-tensor scale
and offset (two fp32 values, ``SAVED_RANGE_BYTES``). Every other tensor counts its dtype's size.

Conventions (SPEC 7, ``convention=``):

* ``"ours"`` (default): as above -- only what our 8-bit training runs in 8 bits is priced int8.
* ``"paper"`` (the paper's Table 10): training counted by SPEC 7's formula (every layer 3x its
  forward, the first layer and frozen ones too); every add and multiply of the 8-bit model --
  quantization arithmetic, norms, heads and all -- is an int8 op, so the fp32 / 8-bit energy ratio is about
  (0.9 + 3.7) / (0.03 + 0.2) = 20 by construction (19.7x for ResNet-20, the paper's 19.9x within
  1%); inference memory is the model weights alone (every parameter at 8 bits in the 8-bit
  model); training memory is counted as in ``"ours"``; memory is in MiB (2^20 bytes), the unit of
  the paper's "MB" (the paper's ResNet-20: 1.04 vs 0.26, which this reproduces; VGG-11: 36.22 vs
  9.01, this gives 9.05). Its weight-gradient GEMM is int8 too; ``weight_grad_gemm="fp32"`` has no
  meaning there and is refused.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..checks import POSITIVE_INT, check_number
from ..utils.models import input_embeddings
from .communication import CommunicationCost, communication_cost
from .conventions import (CONVENTION_TEXT, CONVENTIONS, ENERGY_PJ, MB, MEMORY_UNITS, OPTIMIZER_STATES, PRECISIONS,
                          SAVED_RANGE_BYTES)
from .ops import Ops, dequantize, quantize
from .layers import norm_layer_types
from .walk import ROOT, Row, Walk, checkpointable_layers, walk



@dataclass(frozen=True)
class PricedOps:
    """Operation counts split by the precision they run at."""

    fp32_adds: int = 0
    fp32_mults: int = 0
    int8_adds: int = 0
    int8_mults: int = 0

    @property
    def adds(self) -> int:
        """Additions at either precision."""
        return self.fp32_adds + self.int8_adds

    @property
    def mults(self) -> int:
        """Multiplications at either precision."""
        return self.fp32_mults + self.int8_mults

    @property
    def energy_pj(self) -> float:
        """Energy in picojoules at the 45 nm prices of SPEC 7 (:data:`ENERGY_PJ`)."""
        fp, i8 = ENERGY_PJ["fp32"], ENERGY_PJ["int8"]
        return (self.fp32_adds * fp["add"] + self.fp32_mults * fp["mult"]
                + self.int8_adds * i8["add"] + self.int8_mults * i8["mult"])

    def __add__(self, other: "PricedOps") -> "PricedOps":
        return PricedOps(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    @staticmethod
    def of(fp32: Ops = Ops(), int8: Ops = Ops()) -> "PricedOps":
        """The counts of `fp32` and `int8` operations, each at its precision."""
        return PricedOps(fp32.adds, fp32.mults, int8.adds, int8.mults)


class TrainInference(NamedTuple):
    """One figure for a training iteration and for an inference pass (the report's units)."""

    train: float
    inference: float


@dataclass(frozen=True)
class LayerCost:
    """One module's share of the cost (ops run directly in it, not in its children).

    ``precision``: ``"int8"`` for an 8-bit layer (its operands quantized: a GEMM layer, or a norm
    whose float formula runs on fake-quantized input and parameters), else ``"fp32"``; how each op
    is priced is in ``train`` and ``inference`` (the paper's convention prices every op of the
    8-bit model int8, an fp32 row's too). ``forward_macs``: GEMM multiply-accumulates of one
    forward pass. ``saved_activation_bytes``: what it keeps for backward in training.
    """

    name: str
    kind: str
    precision: str
    forward_macs: int
    train: PricedOps
    inference: PricedOps
    saved_activation_bytes: int


@dataclass
class CostReport:
    """Cost of one iteration of one node: ``batch_size`` samples of shape ``input_shape``.

    ``convention``: ``"ours"`` or ``"paper"`` (module docstring). ``weight_grad_gemm``: the
    precision its quantized layers' weight-gradient GEMMs are priced at, None in an fp32 report
    (no quantized layer). ``adds``/``mults``: operation
    counts (training, inference). Energies in millijoules, memory in ``memory_unit`` (``"MB"``,
    10^6 bytes, in the ours convention; ``"MiB"``, 2^20 bytes, in the paper's, despite the ``_mb``
    names); ``memory_breakdown_mb`` splits them into weights, gradients, optimizer state and
    activations (inference in the paper convention: weights only). ``quantized_mac_share``:
    fraction of the forward MACs that run in quantized layers. ``uncounted_ops``: ATen ops the model ran that the cost model has no rule for (name ->
    calls; they are costed as zero). ``walk_device``: ``"meta"``, or the real device when the
    model needed real values. ``communication``: gossip traffic, when a compressor was given.
    See the module docstring for exactly what is counted.
    """

    precision: str
    batch_size: int
    input_shape: tuple[int, ...]
    optimizer: str
    weight_grad_gemm: str | None
    convention: str
    memory_unit: str
    adds: TrainInference
    mults: TrainInference
    train_energy_mj: float
    inference_energy_mj: float
    train_memory_mb: float
    inference_memory_mb: float
    memory_breakdown_mb: dict[str, dict[str, float]]
    quantized_mac_share: float
    layers: list[LayerCost]
    uncounted_ops: dict[str, int]
    walk_device: str
    communication: CommunicationCost | None = None

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (for ``results.json``)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("layers", "communication")}
        d["adds"], d["mults"] = self.adds._asdict(), self.mults._asdict()
        d["input_shape"] = list(self.input_shape)
        d["layers"] = [
            {**asdict(layer), "train_energy_uj": layer.train.energy_pj * 1e-6,
             "inference_energy_uj": layer.inference.energy_pj * 1e-6}
            for layer in self.layers
        ]
        d["communication"] = None if self.communication is None else self.communication.to_dict()
        return d

    def layer_table(self) -> str:
        """The per-layer breakdown as a text table."""
        unit = MEMORY_UNITS[self.convention][1]
        header = ("layer", "kind", "prec", "fwd MACs", "train adds", "train mults",
                  "train uJ", "infer uJ", f"saved {self.memory_unit}")
        rows = [(layer.name, layer.kind, layer.precision, f"{layer.forward_macs:,}",
                 f"{layer.train.adds:,}", f"{layer.train.mults:,}",
                 f"{layer.train.energy_pj * 1e-6:.2f}", f"{layer.inference.energy_pj * 1e-6:.2f}",
                 f"{layer.saved_activation_bytes / unit:.3f}") for layer in self.layers]
        return _format_table(header, rows)

    def __str__(self) -> str:
        return format_comparison({self.precision: self})


def estimate_cost(
    model: nn.Module,
    input_shape,
    batch_size: int,
    precision: str = "fp32",
    *,
    quant_config=None,
    optimizer: str = "momentum",
    weight_grad_gemm: str | None = None,
    gossip=None,
    samples_per_node: int | None = None,
    convention: str = "ours",
    activation_checkpointing: bool | None = None,
) -> CostReport:
    """Compute, energy and memory of one iteration of one node (SPEC 7); see the module docstring.

    Args:
        model: any ``nn.Module``: a vision model (input ``(B, *input_shape)`` floats) or a model
            with an ``nn.Embedding`` as ``get_input_embeddings()`` (HF token models: int64
            ``input_ids`` of shape ``(B, seq_len)`` and no attention mask, i.e. no padding; an
            encoder-decoder's decoder reads ``seq_len`` tokens too). It is
            not modified. Its forward runs on the ``meta`` device (no compute), or for real with
            zero inputs when its Python code needs tensor values (``CostReport.walk_device``).
        input_shape: one sample's shape without the batch dimension: ``(C, H, W)`` for images,
            ``(seq_len,)`` for token models.
        batch_size: samples per iteration on this node.
        precision: ``"fp32"`` or ``"int8"`` (8-bit training of SPEC 4).
        quant_config: ``lp_decentral_nlp.quant.QuantConfig`` selecting the quantized layers for
            ``"int8"`` (default ``QuantConfig()``: what ``quantize_model`` would swap, every
            Linear/Conv1D/Conv2d but the heads, and with ``lp_decentral_nlp.vision`` imported its
            EvoNorm-S0 / Range norms; ``embeddings=True`` adds the embeddings). A model already
            passed through ``quantize_model`` uses its own 8-bit layers instead (and is refused
            with ``"fp32"``, which would price them as float layers).
        optimizer: ``"sgd"`` (no state), ``"momentum"`` (1 buffer, SGD/Nesterov), ``"adam"`` (2),
            ``"sgd_qgm"`` (2) or ``"adam_qgm"`` (3): quasi-global momentum's model snapshot on top
            (``OPTIMIZER_STATES``; ``lp_decentral_nlp.trainer.cost_optimizer`` names a run's).
        weight_grad_gemm: precision at which the weight-gradient GEMM of a quantized layer is
            priced, ``"fp32"`` (what our training runs: SPEC 4's full-precision ``g``) or
            ``"int8"`` (the paper's accelerator); None: the convention's, ``"fp32"`` in ours,
            ``"int8"`` in the paper's.
        gossip: a ``lp_decentral_nlp.gossip`` algorithm (``SGP``/``ChocoSGD``/``DeepSqueeze``,
            which fixes compressor and topology): adds the gossip traffic (``communication_cost``).
        samples_per_node: training samples per node, for the traffic per epoch.
        convention: ``"ours"`` or ``"paper"`` (SPEC 7, module docstring); the report says which.
        activation_checkpointing: None: as the model is set (the layers that
            ``activation_checkpointing_enable()`` switched on); True: as if it had been called
            (every layer transformers can checkpoint; ValueError for a model without such layers);
            False: as without. A checkpointed layer keeps only the tensors it is called with for
            backward, and backward runs its forward a second time.
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, tuple(OPTIMIZER_STATES))
    _check_choice("convention", convention, CONVENTIONS)
    gemm_given = weight_grad_gemm is not None
    if weight_grad_gemm is None:
        weight_grad_gemm = "int8" if convention == "paper" else "fp32"
    _check_choice("weight_grad_gemm", weight_grad_gemm, PRECISIONS)
    if convention == "paper" and weight_grad_gemm != "int8":
        raise ValueError(f"weight_grad_gemm={weight_grad_gemm!r} needs convention='ours': the paper's convention "
                         "prices every op of the 8-bit model int8")
    if gemm_given and precision == "fp32":
        raise ValueError(f"weight_grad_gemm={weight_grad_gemm!r} prices the weight-gradient GEMM of the 8-bit layers, "
                         "and precision='fp32' has none: drop it or use precision='int8'")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    other = next(((n, p.dtype) for n, p in model.named_parameters()
                  if p.is_floating_point() and p.dtype != torch.float32), None)
    if other is not None:  # its memory would be counted at its dtype, its arithmetic priced fp32
        raise ValueError(f"the cost model prices fp32 training and SPEC 4's 8-bit training of an fp32 model; "
                         f"parameter {other[0]!r} is {other[1]}: call model.float() first")
    batch_size = check_number("batch_size", batch_size, POSITIVE_INT)
    if precision == "fp32" and quant_config is not None:
        raise ValueError("quant_config selects the 8-bit layers of precision='int8'; precision='fp32' prices every "
                         "layer in fp32: drop quant_config or use precision='int8'")
    if precision == "fp32":
        from lp_decentral_nlp.quant import QuantModule

        own = sum(isinstance(m, QuantModule) for m in model.modules())
        if own:
            raise ValueError(f"precision='fp32' prices every layer in fp32, and the model has {own} 8-bit layers "
                             "(quantize_model): use precision='int8' to price them, or estimate the float model")
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list, torch.Size)) else ()
    if not shape or not all(POSITIVE_INT.admits(s) for s in shape):
        raise ValueError(f"input_shape must be a non-empty tuple of positive ints, got {input_shape!r}")
    input_shape = tuple(int(s) for s in shape)
    if gossip is None and samples_per_node is not None:
        raise ValueError("samples_per_node is for the gossip traffic: it needs gossip=")

    checkpointed = _checkpointed_layers(model, activation_checkpointing)
    make_inputs = _input_factory(model, input_shape, batch_size)
    try:
        train_walk = walk(model, make_inputs, training=True, checkpointed=checkpointed)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        floats_to_embedding = not isinstance(input_embeddings(model), nn.Embedding) and any(
            isinstance(m, nn.Embedding) for m in model.modules())
        raise ValueError(f"the model's forward fails on a batch of shape {(batch_size, *input_shape)} "
                         f"({type(err).__name__}: {first}): "
                         + ("it holds an nn.Embedding, and the walk gives token ids only to a model whose "
                            "get_input_embeddings() returns its input embedding (zero floats otherwise): define it"
                            if floats_to_embedding else
                            f"is input_shape={input_shape!r} one sample's shape for this model?")) from err
    eval_walk = walk(model, make_inputs, training=False)
    quantized = _quantized_layers(model, quant_config) if precision == "int8" else set()
    int8_weight_grad = weight_grad_gemm == "int8"
    all_int8 = convention == "paper" and precision == "int8"

    saved_by_row = _saved_activation_bytes(train_walk, quantized)
    layers = []
    kinds = {name or ROOT: type(module).__name__ for name, module in model.named_modules()}
    # a module that only saves (an embedding keeps its token ids) has a row too: the rows add up
    for name in dict.fromkeys([*train_walk.rows, *eval_walk.rows, *saved_by_row]):
        tr = train_walk.rows.get(name, Row(name, kinds.get(name, "")))
        ev = eval_walk.rows.get(name, Row(name, kinds.get(name, "")))
        q = name in quantized
        train = _train_ops(tr.fully_trained() if convention == "paper" else tr, q, int8_weight_grad, all_int8)
        if name in train_walk.recomputed:  # activation checkpointing: backward runs this forward again
            train += _train_ops(train_walk.recomputed[name], q, int8_weight_grad, all_int8)
        layers.append(LayerCost(
            name=name, kind=tr.kind or ev.kind, precision="int8" if q else "fp32", forward_macs=tr.ops.macs,
            train=train, inference=_inference_ops(ev, q, all_int8), saved_activation_bytes=saved_by_row.get(name, 0)))

    train_total = sum((layer.train for layer in layers), PricedOps())
    infer_total = sum((layer.inference for layer in layers), PricedOps())
    weights, trainable = _parameter_bytes(model, _eight_bit_weights(model, quantized))
    states = OPTIMIZER_STATES[optimizer]
    train_mem = {"weights": weights, "gradients": trainable, "optimizer": states * trainable,
                 "activations": sum(saved_by_row.values())}
    if convention == "paper":  # the weights alone, every one at 8 bits in the 8-bit model
        everything = {id(p) for p in model.parameters()} if precision == "int8" else set()
        infer_mem = {"weights": _parameter_bytes(model, everything)[0]}
    else:
        infer_mem = {"weights": weights, "activations": eval_walk.peak_activation_bytes}
    unit_name, unit = MEMORY_UNITS[convention]
    total_macs = sum(layer.forward_macs for layer in layers)
    report = CostReport(
        precision=precision, batch_size=batch_size, input_shape=input_shape, optimizer=optimizer,
        weight_grad_gemm=weight_grad_gemm if precision == "int8" else None, convention=convention, memory_unit=unit_name,
        adds=TrainInference(train_total.adds, infer_total.adds),
        mults=TrainInference(train_total.mults, infer_total.mults),
        train_energy_mj=train_total.energy_pj * 1e-9,
        inference_energy_mj=infer_total.energy_pj * 1e-9,
        train_memory_mb=sum(train_mem.values()) / unit,
        inference_memory_mb=sum(infer_mem.values()) / unit,
        memory_breakdown_mb={"train": {k: v / unit for k, v in train_mem.items()},
                             "inference": {k: v / unit for k, v in infer_mem.items()}},
        quantized_mac_share=sum(l.forward_macs for l in layers if l.precision == "int8") / max(total_macs, 1),
        layers=layers,
        uncounted_ops=dict(train_walk.uncounted_ops + eval_walk.uncounted_ops),
        walk_device=train_walk.device,
    )
    if gossip is not None:
        report.communication = communication_cost(
            model, gossip, batch_size=None if samples_per_node is None else batch_size,
            samples_per_node=samples_per_node)
    return report


# -- pricing ------------------------------------------------------------------------------------


def _as_int8(ops: PricedOps) -> PricedOps:
    """`ops` with every add and mult priced int8 (the paper's convention for the 8-bit model)."""
    return PricedOps(int8_adds=ops.adds, int8_mults=ops.mults)


def _train_ops(row: Row, quantized: bool, int8_weight_grad: bool, all_int8: bool) -> PricedOps:
    """Training ops of one row: its train-mode forward plus what backward computes (``Row``);
    quantized GEMMs priced as documented (`all_int8`: every op priced int8)."""
    if all_int8:
        return _as_int8(_train_ops(row, quantized, int8_weight_grad, False))
    grad_gemms = Ops(row.input_grad_macs + row.weight_grad_macs, row.input_grad_macs + row.weight_grad_macs)
    if not quantized:
        return PricedOps.of(fp32=row.ops + row.backward + grad_gemms)
    if row.is_embedding:
        return PricedOps.of(fp32=row.ops + row.backward + _lookup_quantization(row))
    layer_gradient = (quantize(row.grad_output_numel, range_search=True, clamp=False, stochastic=True)
                      + dequantize(row.grad_input_numel))  # and the input gradient's rescaling
    if not row.is_gemm:  # an 8-bit norm: its float formula on fake-quantized input and parameters
        params = row.weight_numel * row.calls
        quant = (quantize(row.input_numel, range_search=True, clamp=True, stochastic=False)
                 + dequantize(row.input_numel)
                 + quantize(params, range_search=True, clamp=False, stochastic=False) + dequantize(params)
                 + layer_gradient)
        return PricedOps.of(fp32=row.ops + row.backward + quant)
    macs = row.ops.macs
    bias_adds = Ops(row.ops.adds - macs, row.ops.mults - macs)
    quant = (
        quantize(row.input_numel, range_search=True, clamp=True, stochastic=False)  # activations
        + quantize(row.weight_numel * row.calls, range_search=True, clamp=False, stochastic=False)  # weights
        + dequantize(row.output_numel)  # forward GEMM output
        + layer_gradient
    )
    fp32 = bias_adds + row.backward + quant
    int8_gemms = Ops(macs + row.input_grad_macs, macs + row.input_grad_macs)
    weight_grad = Ops(row.weight_grad_macs, row.weight_grad_macs)
    if int8_weight_grad:  # its int32 output rescaled to float
        weight_grad_output = dequantize(row.weight_numel * row.weight_grad_calls)
        return PricedOps.of(fp32=fp32 + weight_grad_output, int8=int8_gemms + weight_grad)
    return PricedOps.of(fp32=fp32 + weight_grad, int8=int8_gemms)


def _lookup_quantization(row: Row) -> Ops:
    """What an 8-bit embedding (``quant.QuantEmbedding``) computes on each call, in training and in
    evaluation alike: the table's min and max (2 comparisons per entry), then the looked-up rows
    put on its grid (nearest rounding, clamped) and back to float."""
    rows = row.output_numel
    return (Ops(2 * row.weight_numel * row.calls, 0)
            + quantize(rows, range_search=False, clamp=True, stochastic=False) + dequantize(rows))


def _inference_ops(row: Row, quantized: bool, all_int8: bool) -> PricedOps:
    """Inference ops of one row: its eval-mode forward; a quantized GEMM runs in int8, its input
    is quantized with the running range and its output rescaled (weights are stored 8-bit).
    `all_int8`: every op priced int8."""
    if all_int8:
        return _as_int8(_inference_ops(row, quantized, False))
    if not quantized:
        return PricedOps.of(fp32=row.ops)
    if row.is_embedding:
        return PricedOps.of(fp32=row.ops + _lookup_quantization(row))
    if not row.is_gemm:  # an 8-bit norm: the input fake-quantized with the running range
        quant = quantize(row.input_numel, range_search=False, clamp=True, stochastic=False) + dequantize(
            row.input_numel)
        return PricedOps.of(fp32=row.ops + quant)
    macs = row.ops.macs
    quant = quantize(row.input_numel, range_search=False, clamp=True, stochastic=False) + dequantize(
        row.output_numel)
    return PricedOps.of(fp32=Ops(row.ops.adds - macs, row.ops.mults - macs) + quant, int8=Ops(macs, macs))


# -- memory -------------------------------------------------------------------------------------


def _eight_bit_weights(model: nn.Module, quantized: set[str]) -> set[int]:
    """Ids of the parameters the quantized layers quantize (stored 8-bit): a GEMM layer's weight
    (its bias stays fp32), every parameter of a norm (weight, bias and ``v``)."""
    norms = norm_layer_types()
    ids = set()
    for name in quantized:
        layer = model.get_submodule(name)
        if isinstance(layer, norms):
            ids.update(id(p) for p in layer.parameters(recurse=False))
        else:
            ids.add(id(layer.weight))
    return ids


def _parameter_bytes(model: nn.Module, eight_bit: set[int]) -> tuple[int, int]:
    """Bytes of all parameters and of the trainable ones; the parameters whose id is in `eight_bit` at 8 bits."""
    total = trainable = 0
    for p in model.parameters():
        nbytes = p.numel() if id(p) in eight_bit else p.numel() * p.element_size()
        total += nbytes
        trainable += nbytes if p.requires_grad else 0
    return total, trainable


def _saved_activation_bytes(train_walk: Walk, quantized: set[str]) -> dict[str, int]:
    """Bytes saved for backward, per row. A storage saved by several ops counts once per precision
    it is kept at (8-bit codes plus a per-tensor scale and offset when saved by a quantized layer,
    its dtype's size otherwise; an embedding's ids at theirs). A float norm layer counts what
    autograd saves inside it; a quantized one, a GEMM layer and an embedding, their input."""
    by_row: dict[str, int] = {}
    for entries in train_walk.saved.values():
        seen_bits = set()
        for e in entries:
            float_norm = e.row in train_walk.norm_rows and e.row not in quantized
            if e.kind == ("input" if float_norm else "inside"):
                continue
            coded = e.row in quantized and not train_walk.rows[e.row].is_embedding
            bits = 8 if coded else 8 * e.itemsize
            if bits not in seen_bits:
                seen_bits.add(bits)
                nbytes = e.numel * bits // 8 + (SAVED_RANGE_BYTES if coded else 0)
                by_row[e.row] = by_row.get(e.row, 0) + nbytes
    return by_row


def _quantized_layers(model: nn.Module, quant_config) -> set[str]:
    """Names of the layers 8-bit training quantizes: the model's own 8-bit layers if it has been
    through ``quantize_model``, else those ``quantize_model(model, quant_config)`` would swap."""
    from lp_decentral_nlp.quant import QuantConfig, QuantModule, quantize_model

    own = {name: m for name, m in model.named_modules() if isinstance(m, QuantModule)}
    if own:
        if quant_config is not None:
            raise ValueError("quant_config must be None for a model that is already quantized "
                             f"({len(own)} 8-bit layers): its own layers are priced")
        for name, layer in own.items():
            _check_priced_bits(getattr(layer, "quant_config", None), f"layer {name!r}")
        return set(own)
    if quant_config is not None and not isinstance(quant_config, QuantConfig):
        raise TypeError(f"quant_config must be a QuantConfig or None, got {type(quant_config).__name__}")
    _check_priced_bits(quant_config, "quant_config")
    plan = quantize_model(model, quant_config, dry_run=True)
    if plan.problems:
        raise ValueError("precision='int8': " + "; ".join(plan.problems))
    return set(plan.quantized)


def _checkpointed_layers(model: nn.Module, activation_checkpointing: bool | None) -> list[nn.Module]:
    """The layers whose calls activation checkpointing wraps, per ``estimate_cost``'s argument."""
    if activation_checkpointing not in (None, True, False):
        raise TypeError(f"activation_checkpointing must be None, True or False, got {activation_checkpointing!r}")
    layers = checkpointable_layers(model)
    if activation_checkpointing is None:
        return [m for m in layers if m.gradient_checkpointing]
    if activation_checkpointing and not layers:
        raise ValueError(f"activation_checkpointing=True: {type(model).__name__} has no layer transformers' "
                         "activation checkpointing wraps (GradientCheckpointingLayer)")
    return layers if activation_checkpointing else []


def _check_priced_bits(quant_config, what: str) -> None:
    """ValueError unless `quant_config` (None: the default) computes at 8 bits, the only integer
    width SPEC 7 has energies for."""
    if quant_config is not None and (quant_config.bits, quant_config.grad_bits) != (8, 8):
        raise ValueError(f"{what} computes at bits={quant_config.bits}, grad_bits={quant_config.grad_bits}; the cost "
                         "model prices 8-bit layers only (SPEC 7 lists int8 energies): use bits=8 and grad_bits=8")


# -- inputs and formatting ----------------------------------------------------------------------


def _input_factory(model: nn.Module, input_shape: tuple[int, ...], batch_size: int):
    """``make_inputs(device)`` for the walk: ``input_ids`` of shape ``(batch_size, seq_len)`` for a
    token model (an encoder-decoder's decoder reads as many tokens), token 0 (1 where 0 is the
    config's ``pad_token_id``) ending in the config's ``eos_token_id`` where it has one (BART's
    and T5's classification heads read the end-of-sequence token's state and refuse a row without
    one) other than its ``pad_token_id`` (a row holding the padding token reads as padded, and
    transformers warns that no attention mask hides it); zero floats of shape
    ``(batch_size, *input_shape)`` otherwise. ValueError naming ``input_shape`` when a token model
    cannot take it."""
    embeddings = input_embeddings(model)
    if isinstance(embeddings, nn.Embedding):
        if len(input_shape) != 1:
            raise ValueError(f"input_shape of a token model must be (seq_len,), got {input_shape!r}")
        config = getattr(model, "config", None)
        positions = getattr(config, "max_position_embeddings", None)
        if isinstance(positions, int) and input_shape[0] > positions:
            raise ValueError(f"input_shape={input_shape!r} exceeds the model's {positions} positions "
                             "(config.max_position_embeddings)")
        decoder = bool(getattr(config, "is_encoder_decoder", False))
        pad = getattr(config, "pad_token_id", None)
        eos = getattr(config, "eos_token_id", None)
        eos = next(iter(eos), None) if isinstance(eos, (list, tuple)) else eos
        eos = eos if isinstance(eos, int) and 0 <= eos < embeddings.num_embeddings and eos != pad else None

        def token_inputs(device):
            ids = torch.full((batch_size, *input_shape), 1 if pad == 0 else 0, dtype=torch.long, device=device)
            if eos is not None:
                ids[:, -1] = eos
            return (), ({"input_ids": ids, "decoder_input_ids": ids} if decoder else {"input_ids": ids})
        return token_inputs
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return lambda device: ((torch.zeros((batch_size, *input_shape), dtype=dtype, device=device),), {})


def _check_choice(name: str, value, allowed: tuple) -> None:
    if not isinstance(value, str) or value not in allowed:  # an object's repr may span lines: its type then
        got = repr(value) if isinstance(value, (str, int, float, type(None))) else type(value).__name__
        raise ValueError(f"{name} must be one of {allowed}, got {got}")


def _format_table(header, rows) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def format_comparison(reports: dict[str, CostReport]) -> str:
    """Side-by-side table of reports (e.g. ``{"fp32": r32, "int8": r8}``) of one convention and one
    setting (batch, input shape, optimizer), which the text names; with two reports a last column
    gives the ratio first / second."""
    if not isinstance(reports, dict) or not all(isinstance(r, CostReport) for r in reports.values()):
        raise TypeError(f"reports must be a dict of CostReports by label (e.g. {{'fp32': r32, 'int8': r8}}), got "
                        f"{type(reports).__name__}")
    if not reports:
        raise ValueError("reports must hold at least one CostReport, got none")
    labels = list(reports)
    rs = list(reports.values())
    for what, get in (("convention", lambda r: r.convention), ("batch size", lambda r: r.batch_size),
                      ("input shape", lambda r: tuple(r.input_shape)), ("optimizer", lambda r: r.optimizer)):
        values = {get(r) for r in rs}
        if len(values) != 1:
            raise ValueError(f"reports must share one {what} to be compared, got {sorted(map(str, values))}")
    convention = rs[0].convention
    unit = rs[0].memory_unit
    items = [
        ("train adds", lambda r: r.adds.train, "{:,.0f}"),
        ("train mults", lambda r: r.mults.train, "{:,.0f}"),
        ("inference adds", lambda r: r.adds.inference, "{:,.0f}"),
        ("inference mults", lambda r: r.mults.inference, "{:,.0f}"),
        ("train energy (mJ)", lambda r: r.train_energy_mj, "{:.4g}"),
        ("inference energy (mJ)", lambda r: r.inference_energy_mj, "{:.4g}"),
        (f"train memory ({unit})", lambda r: r.train_memory_mb, "{:.3f}"),
        ("  weights", lambda r: r.memory_breakdown_mb["train"]["weights"], "{:.3f}"),
        ("  gradients", lambda r: r.memory_breakdown_mb["train"]["gradients"], "{:.3f}"),
        ("  optimizer state", lambda r: r.memory_breakdown_mb["train"]["optimizer"], "{:.3f}"),
        ("  saved activations", lambda r: r.memory_breakdown_mb["train"]["activations"], "{:.3f}"),
        (f"inference memory ({unit})", lambda r: r.inference_memory_mb, "{:.3f}"),
        ("  weights", lambda r: r.memory_breakdown_mb["inference"]["weights"], "{:.3f}"),
    ]
    if convention == "ours":  # the paper's inference memory is the weights alone
        items.append(("  peak activations", lambda r: r.memory_breakdown_mb["inference"]["activations"], "{:.3f}"))
    items.append(("forward MACs in int8", lambda r: 100 * r.quantized_mac_share, "{:.1f}%"))
    if all(r.communication is not None for r in rs):
        items += [
            ("gossip bytes/iteration", lambda r: r.communication.bytes_per_iteration, "{:,.0f}"),
        ]
        if all(r.communication.bytes_per_epoch is not None for r in rs):
            items.append(("gossip MB/epoch", lambda r: r.communication.bytes_per_epoch / MB, "{:.3f}"))
    header = ("per node, per iteration", *labels) + (("ratio",) if len(rs) == 2 else ())
    rows = []
    for label, get, fmt in items:
        values = [get(r) for r in rs]
        ratio = (_ratio(*values),) if len(rs) == 2 and not label.startswith("forward MACs") else (
            ("",) if len(rs) == 2 else ())
        rows.append((label, *(fmt.format(v) for v in values), *ratio))
    weight_grads = {label: r.weight_grad_gemm for label, r in reports.items() if r.weight_grad_gemm}
    setup = ", ".join(f"{k}={v}" for k, v in (("batch", rs[0].batch_size), ("input", rs[0].input_shape),
                                                ("optimizer", rs[0].optimizer)))
    if len(set(weight_grads.values())) == 1:
        setup += f", 8-bit weight-gradient GEMM priced {next(iter(weight_grads.values()))}"
    elif weight_grads:
        setup += ", 8-bit weight-gradient GEMM priced " + ", ".join(f"{v} ({k})" for k, v in weight_grads.items())
    notes = "".join(f"\nnote ({label}): ops without a cost rule, counted as zero: {r.uncounted_ops}"
                    for label, r in reports.items() if r.uncounted_ops)
    return f"{setup}\n{CONVENTION_TEXT[convention]}\n" + _format_table(header, rows) + notes
