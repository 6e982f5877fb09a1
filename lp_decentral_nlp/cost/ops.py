"""Arithmetic cost of one forward call of an ATen operator or a layer (SPEC section 7).

Conventions (every count is per forward call, on the real shapes of the call):

* A multiply-accumulate (MAC) is one addition plus one multiplication, as in SPEC 7's
  ``b*Cout*Cin*K^2*Hout*Wout`` "each of adds and mults"; accumulating ``m`` values costs ``m``
  additions (the accumulator starts at zero), for GEMMs and reductions alike.
* Comparisons (max/min, ReLU, clamp, rounding) are priced as additions.
* Transcendental functions (exp, log, sqrt, rsqrt, erf, tanh, sigmoid, reciprocal, pow) are
  priced as one multiplication per element; composite activations are the sum of their parts
  (GELU ``0.5*x*(1+erf(x/sqrt2))`` = 1 add + 4 mults).
* Data movement, layout and selection (views, copies, concatenation, embedding lookups, gather,
  ``where``/``masked_fill``, tensor creation, logical ops on masks) and random number generation
  (dropout masks, stochastic rounding noise) cost nothing.
* Per-tensor scalars (scales, zero points, running-average updates) are O(1) and not counted.

An operator this module does not know returns ``None``; the walk reports it in
``CostReport.uncounted_ops`` instead of guessing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ops:
    """Additions and multiplications of one call; ``macs`` is the GEMM part of both."""

    adds: int = 0
    mults: int = 0
    macs: int = 0

    def __add__(self, other: "Ops") -> "Ops":
        return Ops(self.adds + other.adds, self.mults + other.mults, self.macs + other.macs)

    def scaled(self, k: int) -> "Ops":
        """The counts of ``k`` such calls."""
        return Ops(k * self.adds, k * self.mults, k * self.macs)


def gemm(macs: int, bias_adds: int = 0) -> Ops:
    """A GEMM/convolution of ``macs`` multiply-accumulates plus ``bias_adds`` bias additions."""
    return Ops(adds=macs + bias_adds, mults=macs, macs=macs)


def normalization(n: int, stat_units: int, affine_weight: bool, affine_bias: bool) -> Ops:
    """Standardise ``n`` elements with ``stat_units`` independent mean/variance statistics.

    mean (n adds, 1 mult per unit), centre (n adds), square (n mults), sum (n adds),
    divide (1 mult per unit), +eps (1 add per unit), rsqrt (1 mult per unit), scale (n mults),
    then the optional affine weight (n mults) and bias (n adds).
    """
    adds = 3 * n + stat_units + (n if affine_bias else 0)
    mults = 2 * n + 3 * stat_units + (n if affine_weight else 0)
    return Ops(adds, mults)


def quantize(n: int, range_search: bool, clamp: bool, stochastic: bool) -> Ops:
    """Uniform 8-bit quantization of ``n`` elements (SPEC 4), run in float.

    ``range_search``: per-tensor/per-sample min and max (2 comparisons per element);
    shift by the zero point (1 add) and scale (1 mult); round (1 add, +1 add for the uniform noise
    of stochastic rounding); ``clamp`` to [0, 255] (2 comparisons). Random number generation is
    not counted.
    """
    adds = (2 * n if range_search else 0) + n + n + (n if stochastic else 0) + (2 * n if clamp else 0)
    return Ops(adds, n)


def dequantize(n: int) -> Ops:
    """Rescale ``n`` integer GEMM outputs to float: one mult (scale) and one add (offset) each."""
    return Ops(n, n)


# ---------------------------------------------------------------------------------------------
# ATen operator table
# ---------------------------------------------------------------------------------------------

_FREE = frozenset(
    """
    view _unsafe_view reshape _reshape_alias t transpose permute expand expand_as squeeze unsqueeze
    slice select narrow unbind split split_with_sizes chunk unsafe_split unsafe_split_with_sizes unsafe_chunk
    as_strided alias detach clone contiguous
    _to_copy to copy copy_ cat stack flatten unflatten repeat roll flip constant_pad_nd
    embedding index index_select gather scatter index_put masked_fill where
    arange zeros ones full empty empty_like empty_strided zeros_like ones_like full_like new_empty
    new_empty_strided new_zeros new_ones new_full fill zero scalar_tensor lift_fresh lift_fresh_copy
    tril triu bitwise_not bitwise_and bitwise_or logical_not logical_and logical_or
    _local_scalar_dense sym_size sym_stride sym_numel resize set
    bernoulli uniform normal rand rand_like randn randn_like randint randperm exponential
    """.split()
)

# (adds, mults) per output element.
_ELEMENTWISE = {
    **dict.fromkeys("add sub rsub neg abs".split(), (1, 0)),
    **dict.fromkeys("mul div".split(), (0, 1)),
    **dict.fromkeys(
        "relu threshold clamp_min clamp_max maximum minimum eq ne gt ge lt le sign round floor ceil trunc".split(),
        (1, 0),
    ),
    **dict.fromkeys("clamp clip hardtanh".split(), (2, 0)),
    **dict.fromkeys(
        "exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal tanh sigmoid erf erfc sin cos pow".split(),
        (0, 1),
    ),
    "gelu": (1, 4),  # 0.5 * x * (1 + erf(x / sqrt(2)))
    "silu": (0, 2),  # x * sigmoid(x)
    "hardsigmoid": (3, 1),  # clamp((x + 3) / 6, 0, 1)
    "hardswish": (3, 2),  # x * hardsigmoid(x)
    "leaky_relu": (1, 1),
    "elu": (1, 2),
    "softplus": (1, 2),  # log(1 + exp(x))
    "mish": (1, 4),  # x * tanh(softplus(x))
    "native_dropout": (0, 1),  # x * (mask / (1 - p))
    "_softmax": (3, 2),  # max, subtract, exp, sum, divide
    "_safe_softmax": (3, 2),
    "_log_softmax": (4, 1),  # max, subtract, exp, sum, subtract log-sum
}

# (adds per input element, mults per input element, mults per output element).
_REDUCTION = {
    **dict.fromkeys("sum amax amin max min argmax argmin any all cumsum unique_consecutive".split(), (1, 0, 0)),
    "aminmax": (2, 0, 0),  # a comparison for each end
    "mean": (1, 0, 1),
    "var": (3, 1, 2),
    "var_mean": (3, 1, 2),
    "std": (3, 1, 3),
    "std_mean": (3, 1, 3),
    "linalg_vector_norm": (1, 1, 1),
    "prod": (0, 1, 0),
}


def _bind(func, args, kwargs) -> dict:
    """Name every argument of an ATen call after its schema, defaults filled in."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _numel(x) -> int:
    return x.numel() if isinstance(x, torch.Tensor) else 0


def _adaptive_window_total(size_in: int, size_out: int) -> int:
    """Sum of the window lengths of adaptive pooling along one dimension (PyTorch's windows)."""
    return sum(
        math.ceil((i + 1) * size_in / size_out) - (i * size_in) // size_out for i in range(size_out)
    )


def aten_cost(func, args, kwargs, out) -> Ops | None:
    """Cost of one ATen call with its real arguments and output; ``None`` for an unknown op."""
    name = func.overloadpacket.__name__
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]  # in-place variant: same arithmetic
    first_out = out[0] if isinstance(out, (tuple, list)) else out
    n_out = _numel(first_out)
    if name in _FREE:
        return Ops()
    if name in _ELEMENTWISE:
        adds, mults = _ELEMENTWISE[name]
        return Ops(adds * n_out, mults * n_out)
    a = _bind(func, args, kwargs)
    if name in _REDUCTION:
        per_in_adds, per_in_mults, per_out_mults = _REDUCTION[name]
        n_in = _numel(args[0])
        if name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return Ops(n_out, 0)  # elementwise max/min of two tensors
        return Ops(per_in_adds * n_in, per_in_mults * n_in + per_out_mults * n_out)
    if name == "mm":
        m, k = args[0].shape
        return gemm(m * k * args[1].shape[1])
    if name == "addmm":
        m, k = a["mat1"].shape
        return gemm(m * k * a["mat2"].shape[1], bias_adds=n_out) + _alpha_beta(a, n_out)
    if name == "bmm":
        b, m, k = args[0].shape
        return gemm(b * m * k * args[1].shape[2])
    if name == "baddbmm":
        b, m, k = a["batch1"].shape
        return gemm(b * m * k * a["batch2"].shape[2], bias_adds=n_out) + _alpha_beta(a, n_out)
    if name == "mv":
        return gemm(args[0].numel())
    if name == "dot":
        return gemm(args[0].numel())
    if name in ("convolution", "_convolution"):
        weight = a["weight"]
        per_out = weight.shape[1] * math.prod(weight.shape[2:])
        macs = (_numel(a["input"]) if a["transposed"] else n_out) * per_out
        return gemm(macs, bias_adds=n_out if a.get("bias") is not None else 0)
    if name == "native_layer_norm":
        n = _numel(a["input"])
        units = n // math.prod(a["normalized_shape"])
        return normalization(n, units, a["weight"] is not None, a["bias"] is not None)
    if name == "native_group_norm":
        return normalization(
            _numel(a["input"]), a["N"] * a["group"], a["weight"] is not None, a["bias"] is not None
        )
    if name in ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"):
        if a["training"]:
            n, c = _numel(a["input"]), a["input"].shape[1]
            return normalization(n, c, a["weight"] is not None, a["bias"] is not None)
        return _batch_norm_eval(a)
    if name == "_native_batch_norm_legit_no_training":
        return _batch_norm_eval(a)
    if name in ("avg_pool2d", "avg_pool3d"):
        return Ops(n_out * math.prod(_expand(a["kernel_size"], first_out.dim() - 2)), n_out)
    if name in ("max_pool2d_with_indices", "max_pool3d_with_indices", "max_pool2d", "max_pool3d"):
        return Ops(n_out * math.prod(_expand(a["kernel_size"], first_out.dim() - 2)), 0)
    if name in ("_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d"):
        x = args[0]
        spatial = 2 if "2d" in name else 3
        lead = x.numel() // math.prod(x.shape[-spatial:])
        window = math.prod(
            _adaptive_window_total(s_in, s_out)
            for s_in, s_out in zip(x.shape[-spatial:], first_out.shape[-spatial:])
        )
        return Ops(lead * window, n_out if "avg" in name else 0)
    return None


def _expand(size, dims: int) -> list[int]:
    size = list(size)
    return size * dims if len(size) == 1 else size


def _alpha_beta(a: dict, n_out: int) -> Ops:
    """Extra scaling mults of addmm/baddbmm when alpha or beta is not 1."""
    return Ops(0, n_out * ((a.get("alpha", 1) != 1) + (a.get("beta", 1) != 1)))


def _batch_norm_eval(a: dict) -> Ops:
    """Inference batch norm from running statistics: a per-channel scale and shift.

    inv = rsqrt(var + eps) (1 add, 1 mult per channel), scale = weight*inv and
    shift = bias - mean*scale (2 mults, 1 add per channel), y = x*scale + shift (1 mult, 1 add).
    """
    n, c = _numel(a["input"]), a["input"].shape[1]
    return Ops(n + 2 * c, n + 3 * c)
