"""The SPEC section 5 normalisation layers against their equations, computed here independently."""
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from lp_decentral_nlp.vision.norms import (
    EvoNormS0,
    RangeBatchNorm2d,
    RangeEvoNorm2d,
    RangeEvoNormFunction,
    evonorm_s0,
    range_batch_norm2d,
    range_evonorm2d,
    range_scale_constant,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _randomise(layer, gen_scale=1.0):
    """Non-trivial weight/bias/v so that the affine part and the activation are exercised."""
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * gen_scale)
    return layer


def _reference_group_norm_act(x, weight, bias, v, groups, eps, kind):
    """Loop-by-loop evaluation of EvoNorm-S0 ("evo") or Range EvoNorm ("range"), float64."""
    x = x.double()
    n, c = x.shape[:2]
    cg = c // groups
    y = torch.empty_like(x)
    for i in range(n):
        for g in range(groups):
            xs = x[i, g * cg:(g + 1) * cg]
            if kind == "evo":
                denom = math.sqrt(((xs - xs.mean()) ** 2).mean().item() + eps)
            else:
                denom = (1.0 / math.sqrt(2.0 * math.log(cg))) * ((xs.max() - xs.min()).item() + eps)
            for j in range(cg):
                ch = g * cg + j
                t = v[ch].double() * xs[j] if v is not None else None
                if v is None:
                    act = torch.ones_like(xs[j])
                elif kind == "evo":
                    act = 1.0 / (1.0 + torch.exp(-t))
                else:
                    act = torch.clamp((t + 3.0) / 6.0, min=0.0, max=1.0)
                y[i, ch] = xs[j] * act / denom * weight[ch].double() + bias[ch].double()
    return y


@pytest.mark.parametrize("apply_act", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_evonorm_s0_matches_equation(groups, apply_act):
    layer = _randomise(EvoNormS0(8, groups=groups, apply_act=apply_act))
    x = torch.randn(3, 8, 4, 5) * 2 + 0.5
    expected = _reference_group_norm_act(x, layer.weight, layer.bias, layer.v, groups, layer.eps, "evo")
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("apply_act", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_range_evonorm_matches_equation(groups, apply_act):
    layer = _randomise(RangeEvoNorm2d(8, groups=groups, apply_act=apply_act), gen_scale=1.5)
    x = torch.randn(3, 8, 4, 5) * 3
    if apply_act:  # both saturated ends of hsig are reached (v*x < -3 and v*x > 3)
        t = layer.v.view(1, -1, 1, 1) * x
        assert (t < -3).any() and (t > 3).any() and ((t > -3) & (t < 3)).any()
    expected = _reference_group_norm_act(x, layer.weight, layer.bias, layer.v, groups, layer.eps, "range")
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_nan_makes_its_groups_range_evonorm_output_and_gradient_nan(dtype, layout):
    """The compiled kernels' max/min skipped a NaN: Range EvoNorm on the CPU left the rest of the
    group finite, where the torch formula (``amax``/``amin``, any other device) and EvoNorm-S0 make
    it NaN, and a diverged activation disappeared. Now the group's range is NaN as torch's."""
    layer = _randomise(RangeEvoNorm2d(8, groups=2), gen_scale=1.5)
    x = (torch.randn(3, 8, 4, 5, dtype=dtype) * 3).contiguous(memory_format=layout)
    x[1, 5, 2, 3] = float("nan")
    x.requires_grad_()
    y = layer.to(dtype)(x)
    expected = torch.zeros_like(y, dtype=torch.bool)
    expected[1, 4:] = True  # the second group of the second sample
    assert RangeEvoNormFunction.supports(x) and torch.equal(y.isnan(), expected)
    reference = _reference_group_norm_act(x.detach(), layer.weight, layer.bias, layer.v, 2, layer.eps, "range")
    assert torch.equal(reference.isnan(), expected)
    torch.testing.assert_close(y[~expected].double(), reference[~expected], rtol=1e-5, atol=1e-5)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad.isnan(), expected)
    for p in (layer.weight, layer.v):  # the NaN group's channels; dL/db = sum g does not read x
        assert p.grad[4:].isnan().all() and p.grad[:4].isfinite().all()
    assert layer.bias.grad.isfinite().all()


def test_range_evonorm_constant_group_is_finite():
    layer = RangeEvoNorm2d(4, groups=2)
    x = torch.full((2, 4, 3, 3), 0.7)
    y = layer(x)
    assert torch.isfinite(y).all()
    # range = 0: denominator C(2) * eps.
    expected = 0.7 * torch.nn.functional.hardsigmoid(torch.tensor(0.7)) / (range_scale_constant(2) * layer.eps)
    torch.testing.assert_close(y, expected.expand_as(y))


def test_range_scale_constant_values_and_domain():
    assert range_scale_constant(2) == pytest.approx(1 / math.sqrt(2 * math.log(2)))
    assert range_scale_constant(1024) == pytest.approx(1 / math.sqrt(2 * math.log(1024)))
    with pytest.raises(ValueError, match="at least 2"):
        range_scale_constant(1)
    with pytest.raises(TypeError):
        range_scale_constant(2.0)


def _reference_range_bn(x, weight, bias, mean, scale, eps):
    return ((x - mean.view(1, -1, 1, 1)) / (scale.view(1, -1, 1, 1) + eps)
            * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1))


def test_range_batchnorm_training_matches_equation_and_updates_buffers():
    layer = _randomise(RangeBatchNorm2d(3, momentum=0.25))
    x1 = torch.randn(4, 3, 5, 6) * torch.tensor([1.0, 3.0, 0.2]).view(1, 3, 1, 1) + 2.0
    x2 = torch.randn(4, 3, 5, 6) - 1.0
    b = 4 * 5 * 6  # the range of a channel is taken over batch * H * W values
    stats = []
    for x in (x1, x2):
        mean = x.mean(dim=(0, 2, 3))
        centred = x - mean.view(1, 3, 1, 1)
        rng = centred.amax(dim=(0, 2, 3)) - centred.amin(dim=(0, 2, 3))
        scale = rng / math.sqrt(2 * math.log(b))
        stats.append((mean, scale))
        torch.testing.assert_close(layer(x), _reference_range_bn(x, layer.weight, layer.bias, mean, scale, layer.eps))
    (m1, s1), (m2, s2) = stats
    # PyTorch convention: running = (1 - momentum) * running + momentum * batch, from (0, 1).
    exp_mean = 0.75 * (0.75 * torch.zeros(3) + 0.25 * m1) + 0.25 * m2
    exp_scale = 0.75 * (0.75 * torch.ones(3) + 0.25 * s1) + 0.25 * s2
    torch.testing.assert_close(layer.running_mean, exp_mean)
    torch.testing.assert_close(layer.running_scale, exp_scale)
    assert int(layer.num_batches_tracked) == 2


def test_range_batchnorm_eval_uses_running_stats_and_freezes_them():
    layer = _randomise(RangeBatchNorm2d(3))
    for _ in range(3):
        layer(torch.randn(8, 3, 4, 4) * 2 + 1)
    layer.eval()
    frozen = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 3, 4, 4) * 5
    y = layer(x)
    torch.testing.assert_close(
        y, _reference_range_bn(x, layer.weight, layer.bias, layer.running_mean, layer.running_scale, layer.eps)
    )
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(v, frozen[k])
    # Per-sample in eval: a sample's output does not depend on the rest of the batch.
    torch.testing.assert_close(layer(x[:1]), y[:1])
    # Training mode ignores the running statistics.
    layer.train()
    y_train = layer(x)
    layer.running_scale.fill_(123.0)
    layer.running_mean.fill_(-4.0)
    torch.testing.assert_close(layer(x), y_train)


def test_range_batchnorm_cumulative_momentum_none():
    layer = RangeBatchNorm2d(2, momentum=None)
    batches = [torch.randn(3, 2, 4, 4) + k for k in range(3)]
    scales, means = [], []
    c = 1 / math.sqrt(2 * math.log(3 * 4 * 4))
    for x in batches:
        layer(x)
        means.append(x.mean(dim=(0, 2, 3)))
        scales.append(c * (x.amax(dim=(0, 2, 3)) - x.amin(dim=(0, 2, 3))))
    torch.testing.assert_close(layer.running_mean, torch.stack(means).mean(0))
    torch.testing.assert_close(layer.running_scale, torch.stack(scales).mean(0))


def test_range_batchnorm_buffers_are_named_honestly():
    keys = set(RangeBatchNorm2d(4).state_dict())
    assert keys == {"weight", "bias", "running_mean", "running_scale", "num_batches_tracked"}


def test_parameter_shapes():
    for layer in (EvoNormS0(6), RangeEvoNorm2d(6)):
        assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == {
            "weight": (6,), "bias": (6,), "v": (6,)}
    assert {n for n, _ in EvoNormS0(6, apply_act=False).named_parameters()} == {"weight", "bias"}


def test_gradcheck_float64():
    torch.manual_seed(1)
    x = torch.randn(2, 4, 2, 3, dtype=torch.float64, requires_grad=True)
    w, b, v = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for fn in (evonorm_s0, range_evonorm2d):
        assert torch.autograd.gradcheck(lambda x, w, b, v: fn(x, w, b, v, 2, 1e-5), (x, w, b, v))
        assert torch.autograd.gradcheck(lambda x, w, b: fn(x, w, b, None, 2, 1e-5), (x, w, b))

    def rbn(x, w, b):
        rm, rs = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
        return range_batch_norm2d(x, rm, rs, torch.tensor(0), w, b, True, 0.1, 1e-5)

    assert torch.autograd.gradcheck(rbn, (x, w, b))


@pytest.mark.parametrize("layer_cls", [EvoNormS0, RangeEvoNorm2d, RangeBatchNorm2d])
def test_backward_reaches_input_and_every_parameter(layer_cls):
    layer = _randomise(layer_cls(4))
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    layer(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_statistics_in_float32_for_bfloat16_input():
    # Around 1000 bfloat16 values are 4 apart: a mean rounded to bfloat16 can be 2 off, 0.25 std
    # here; the layers centre and scale in float32 and only the output is bfloat16.
    x32 = (1000.0 + 8.0 * torch.randn(4, 4, 8, 8)).bfloat16().float()
    x16 = x32.bfloat16()
    bn16, bn32 = RangeBatchNorm2d(4), RangeBatchNorm2d(4)
    y16 = bn16(x16)
    assert y16.dtype == torch.bfloat16 and bn16.running_mean.dtype == torch.float32
    torch.testing.assert_close(y16.float(), bn32(x32), rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(bn16.running_mean, bn32.running_mean)
    for norm in (EvoNormS0(4, apply_act=False), RangeEvoNorm2d(4, apply_act=False)):
        y16 = norm(x16)
        assert y16.dtype == torch.bfloat16
        torch.testing.assert_close(y16.float(), norm(x32), rtol=1e-2, atol=1e-2)


def test_argument_errors():
    with pytest.raises(ValueError, match="divisible by groups"):
        EvoNormS0(6, groups=4)
    with pytest.raises(ValueError, match="groups must be an integer >= 1"):
        RangeEvoNorm2d(6, groups=0)
    with pytest.raises(ValueError, match="at least 2 channels per group"):
        RangeEvoNorm2d(4, groups=4)
    with pytest.raises(ValueError, match="eps"):
        EvoNormS0(4, eps=0.0)
    with pytest.raises(ValueError, match="momentum"):
        RangeBatchNorm2d(4, momentum=1.5)
    # a string was "'<' not supported between instances of 'float' and 'str'"
    with pytest.raises(ValueError, match=r"^momentum must be a number in \(0, 1\], got '0.1'$"):
        RangeBatchNorm2d(4, momentum="0.1")
    with pytest.raises(ValueError, match=r"^eps must be a number > 0, got '1e-5'$"):
        EvoNormS0(4, eps="1e-5")
    with pytest.raises(ValueError, match="num_features"):
        RangeBatchNorm2d(0)
    with pytest.raises(ValueError, match=r"\(N, 4, H, W\)"):
        EvoNormS0(4)(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match=r"\(N, 4, H, W\)"):
        RangeEvoNorm2d(4)(torch.randn(4, 4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        RangeBatchNorm2d(4)(torch.randn(1, 4, 1, 1))
    with pytest.raises(ValueError, match="divisible by groups"):
        range_evonorm2d(torch.randn(1, 6, 2, 2), torch.ones(6), torch.zeros(6), None, 4, 1e-5)


# -- Range EvoNorm's hand-written backward (RangeEvoNormFunction) ---------------------------------


def _autograd_range_evonorm(x, weight, bias, v, groups, eps):
    """Range EvoNorm in torch ops, differentiated by autograd (the implementation the Function
    replaced on the CPU): amax/amin give the range's gradient to the max/min elements, shared
    evenly among ties."""
    n, c = x.shape[:2]
    grouped = x.reshape(n, groups, -1)
    group_range = grouped.amax(dim=-1, keepdim=True) - grouped.amin(dim=-1, keepdim=True)
    numerator = x if v is None else x * torch.nn.functional.hardsigmoid(v.view(1, -1, 1, 1) * x)
    denominator = range_scale_constant(c // groups) * (group_range + eps)
    y = (numerator.reshape(n, groups, -1) / denominator).reshape(x.shape)
    return y * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)


def _range_evonorm_case(dtype, apply_act, ties, seed=0):
    """An input (2 samples, 8 channels, 5 x 4) and parameters with both hsig kinks in play;
    ``ties``: the input on a coarse grid, so maxima, minima and hsig's kinks repeat, and sample 1
    constant over group 0 (range 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 5, 4, generator=gen, dtype=dtype) * 3
    if ties:
        x = (x * 2).round() / 2
        x[1, :4] = 1.5
    params = [torch.randn(8, generator=gen, dtype=dtype) * 1.5 for _ in range(3 if apply_act else 2)]
    if apply_act and ties:
        params[2][0] = 2.0  # v*x = +-3 at x = +-1.5: on hsig's kinks, where its gradient is 0
    return x, params


def _grads(fn, x, params, upstream, groups=2, eps=1e-5):
    leaves = [t.clone().requires_grad_(True) for t in (x, *params)]
    weight, bias, *v = leaves[1:]
    y = fn(leaves[0], weight, bias, v[0] if v else None, groups, eps)
    return y.detach(), torch.autograd.grad(y, leaves, upstream)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("apply_act", [True, False])
def test_range_evonorm_function_matches_autograd_float64(apply_act, ties):
    x, params = _range_evonorm_case(torch.float64, apply_act, ties)
    upstream = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y, grads = _grads(RangeEvoNormFunction.apply, x, params, upstream)
    y_ref, grads_ref = _grads(_autograd_range_evonorm, x, params, upstream)
    assert torch.equal(y, y_ref)
    for name, got, want in zip(["x", "weight", "bias", "v"], grads, grads_ref):
        # 1e-10 of the gradient's scale: a constant group divides by C * eps, gradients ~1e6
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * max(1.0, want.abs().max().item()), msg=name)
    if ties:  # the constant group gets no gradient through its range, only the elementwise part
        assert grads[0][1, :4].abs().max() > 0


@pytest.mark.parametrize("ties", [False, True])
def test_range_evonorm_function_close_to_autograd_float32(ties):
    x, params = _range_evonorm_case(torch.float32, True, ties, seed=3)
    x = torch.cat([x] * 4) * 0.7 + 0.2  # 8 samples; groups of 4 channels x 20 positions
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    y, grads = _grads(range_evonorm2d, x, params, upstream)
    y_ref, grads_ref = _grads(_autograd_range_evonorm, x, params, upstream)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_range_evonorm_ties_share_the_range_gradient_evenly():
    """Two maxima and three minima in a group: each gets 1/2 (1/3) of dL/drange, as amax/amin."""
    x = torch.tensor([[4.0, 4.0, 1.0, 2.0], [-1.0, -1.0, -1.0, 0.5]], dtype=torch.float64).view(1, 2, 2, 2)
    weight, bias = torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    # y = x / D, D = C(2) * (R + eps); L = sum(y * u) with u = 1 off the extremes -> only D matters there
    upstream = torch.ones_like(x)
    y = RangeEvoNormFunction.apply(leaf, weight, bias, None, 1, 1e-5)
    (dx,) = torch.autograd.grad(y, leaf, upstream)
    scale, r = range_scale_constant(2), 5.0
    d = scale * (r + 1e-5)
    grad_range = -scale * x.sum().item() / d**2
    expected = torch.full_like(x, 1.0 / d)
    expected.view(-1)[x.view(-1) == 4.0] += grad_range / 2
    expected.view(-1)[x.view(-1) == -1.0] -= grad_range / 3
    torch.testing.assert_close(dx, expected, rtol=0, atol=1e-12)


def test_range_evonorm_function_partial_gradients_and_layouts():
    x, params = _range_evonorm_case(torch.float64, True, False)
    upstream = torch.randn(x.shape, dtype=torch.float64)
    _, want = _grads(_autograd_range_evonorm, x, params, upstream)
    # only the input, only the parameters
    leaf = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(RangeEvoNormFunction.apply(leaf, *params, 2, 1e-5), leaf, upstream)
    torch.testing.assert_close(dx, want[0], rtol=0, atol=1e-10)
    leaves = [p.clone().requires_grad_(True) for p in params]
    dparams = torch.autograd.grad(RangeEvoNormFunction.apply(x, *leaves, 2, 1e-5), leaves, upstream)
    for got, expected in zip(dparams, want[1:]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    # a channels-last input and a non-contiguous output gradient
    leaf = x.clone().to(memory_format=torch.channels_last).requires_grad_(True)
    y = RangeEvoNormFunction.apply(leaf, *params, 2, 1e-5)
    (dx,) = torch.autograd.grad(y, leaf, upstream.transpose(2, 3).contiguous().transpose(2, 3))
    torch.testing.assert_close(dx, want[0], rtol=0, atol=1e-10)


def test_range_evonorm_layer_runs_the_function_on_cpu_and_keeps_fewer_bytes():
    from lp_decentral_nlp.quant import saved_tensor_bytes

    layer = _randomise(RangeEvoNorm2d(16))
    x = torch.randn(4, 16, 8, 8, requires_grad=True)
    y, nbytes = saved_tensor_bytes(layer, x)
    assert type(y.grad_fn).__name__ == "RangeEvoNormFunctionBackward"
    _, nbytes_autograd = saved_tensor_bytes(
        _autograd_range_evonorm, x, layer.weight, layer.bias, layer.v, layer.groups, layer.eps)
    assert nbytes <= x.numel() * 4 + 3 * 16 * 4 < nbytes_autograd
    assert RangeEvoNormFunction.supports(x) and not RangeEvoNormFunction.supports(x.bfloat16())


def test_range_evonorm_without_a_graph_gives_the_same_bits():
    """Under ``no_grad`` (the 8-bit norm's forward) the compiled forward runs without an autograd
    Function: no graph, and the very values of the Function's forward."""
    layer = _randomise(RangeEvoNorm2d(16, groups=4))
    x = torch.randn(4, 16, 8, 8, requires_grad=True)
    with_graph = layer(x)
    with torch.no_grad():
        without = layer(x)
    assert type(with_graph.grad_fn).__name__ == "RangeEvoNormFunctionBackward" and without.grad_fn is None
    assert torch.equal(with_graph.detach(), without)


def test_range_evonorm_gradcheck_through_the_function():
    x, params = _range_evonorm_case(torch.float64, True, False, seed=2)
    leaves = [t.clone().requires_grad_(True) for t in (x, *params)]
    assert torch.autograd.gradcheck(lambda *t: RangeEvoNormFunction.apply(*t, 2, 1e-5), leaves)


def test_range_evonorm_gradients_from_8bit_codes_equal_those_from_their_values():
    """The 8-bit layer's backward hands over the input's codes: decoded on the fly, the same bits
    as the gradients at the dequantized tensor."""
    from lp_decentral_nlp.quant.functional import dequantize_uint8, quantize_uint8

    x, params = _range_evonorm_case(torch.float32, True, False, seed=4)
    x = torch.cat([x] * 3)
    lo, hi = x.amin(), x.amax() * 0.8  # some values clamp: ties at the top code
    codes, scale, values = quantize_uint8(x, lo, hi, 8)
    g_x, g_p = torch.randn(x.shape), torch.randn(x.shape)
    weight, bias, v = params
    from_codes = RangeEvoNormFunction.gradients(codes, g_x, g_p, weight, v, 2, 1e-5, scale, lo)
    from_values = RangeEvoNormFunction.gradients(dequantize_uint8(codes, scale, lo), g_x, g_p, weight, v, 2, 1e-5)
    assert torch.equal(dequantize_uint8(codes, scale, lo), values)
    for a, b in zip(from_codes, from_values):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="x_scale and x_lo"):
        RangeEvoNormFunction.gradients(codes, g_x, g_p, weight, v, 2, 1e-5)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("per_sample", [False, True])
def test_range_evonorm_layer_gradient_from_8bit_gradient_codes_equals_that_from_their_values(layout, per_sample):
    """The 8-bit layer hands over its quantized output gradient as uint8 codes with a step and an
    offset (one per sample under ``grad_granularity="sample"``): decoded on the fly, the same
    bits as the gradients from the dequantized gradient, in either layout, with the input given
    as codes too; codes without their step and offset are refused."""
    from lp_decentral_nlp.quant.functional import dequantize_uint8, quantize_fused, quantize_uint8

    x, (weight, bias, v) = _range_evonorm_case(torch.float32, True, False, seed=5)
    x = torch.cat([x] * 3).contiguous(memory_format=layout)
    x_codes, x_scale, _ = quantize_uint8(x, x.amin(), x.amax(), 8)
    g = (torch.randn(x.shape) * torch.linspace(0.1, 10, x.shape[0]).view(-1, 1, 1, 1)).contiguous(memory_format=layout)
    if per_sample:
        g_lo, g_hi = (r.view(-1, 1, 1, 1) for r in (g.amin((1, 2, 3)), g.amax((1, 2, 3))))
    else:
        g_lo, g_hi = g.amin(), g.amax()
    g_codes, _, _, g_scale = quantize_fused(g, g_lo, g_hi, 8, True, signed=False, values=False, last_dim_sums=False)
    g_values = dequantize_uint8(g_codes, g_scale, g_lo)
    assert not torch.equal(g_values, g)
    from_codes = RangeEvoNormFunction.gradients(x_codes, g_codes, g, weight, v, 2, 1e-5, x_scale, x.amin(),
                                                g_scale, g_lo)
    from_values = RangeEvoNormFunction.gradients(x_codes, g_values, g, weight, v, 2, 1e-5, x_scale, x.amin())
    for a, b in zip(from_codes, from_values):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="grad_scale and grad_lo"):
        RangeEvoNormFunction.gradients(x_codes, g_codes, g, weight, v, 2, 1e-5, x_scale, x.amin())


@pytest.mark.parametrize("shape, groups", [((3, 16, 5, 7), 8), ((2, 24, 9, 9), 4), ((32, 16, 16, 16), 8),
                                           ((4, 64, 3, 2), 16)])
def test_range_evonorm_channels_last_kernels_match_the_row_major_ones(shape, groups):
    """Channels-last input (what oneDNN's int8 convolution hands the 8-bit norm) runs the
    channels-last kernels: ``y`` the same bits, channels last. Channels-last output gradients run
    the channels-last backward, at channels-last values or codes or at row-major ones (copied):
    the gradients, from float values or from 8-bit codes (ties at the clamped top code), equal the
    row-major kernels' up to the order of their sums, ``dL/dx`` channels last. Shapes: runs of
    whole positions with a tail (24 channels), a sample split over threads (32 x 16 x 16 x 16),
    more channels than a run."""
    from lp_decentral_nlp.quant.functional import quantize_uint8
    from lp_decentral_nlp.utils.layout import is_channels_last

    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    gen = torch.Generator().manual_seed(7)
    c = shape[1]
    x = torch.randn(shape, generator=gen) * 2 + 0.3
    weight, bias, v = (torch.randn(c, generator=gen) for _ in range(3))
    g_x, g_p = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    codes, scale, _ = quantize_uint8(x, x.amin(), x.amax() * 0.8, 8)
    last = dict(x=x.contiguous(memory_format=torch.channels_last),
                codes=codes.contiguous(memory_format=torch.channels_last))
    for act in (v, None):
        y = RangeEvoNormFunction.output(x, weight, bias, act, groups, 1e-5)
        y_last = RangeEvoNormFunction.output(last["x"], weight, bias, act, groups, 1e-5)
        assert is_channels_last(y_last) and torch.equal(y_last, y)
        for values, decode in ((x, ()), (codes, (scale, x.amin()))):
            for grads in ((g_x, g_p), (g_x, None), (None, g_p)):
                want = RangeEvoNormFunction.gradients(values, *grads, weight, act, groups, 1e-5, *decode)
                grads_last = [None if g is None else g.contiguous(memory_format=torch.channels_last) for g in grads]
                for at in (last["x" if values is x else "codes"], values):
                    got = RangeEvoNormFunction.gradients(at, *grads_last, weight, act, groups, 1e-5, *decode)
                    for a, b in zip(got, want):
                        assert (a is None) == (b is None)
                        if a is not None:
                            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
                    if grads[0] is not None:
                        assert is_channels_last(got[0])


def test_the_compiled_range_evonorm_leaves_torchs_thread_count_as_set():
    """Numba's OpenMP pool shares the runtime with torch and sets every core when it starts: a run on
    one thread must stay on one (results depend on torch's thread count), and on two stay on two.
    In a fresh process, where the pool has not started yet."""
    code = textwrap.dedent("""
        import torch
        from lp_decentral_nlp.vision import RangeEvoNormFunction
        x = torch.randn(32, 16, 32, 32, requires_grad=True)
        w = torch.ones(16, requires_grad=True)
        counts = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            RangeEvoNormFunction.apply(x, w, w, w, 8, 1e-5).sum().backward()
            counts.append(torch.get_num_threads())
        print(counts)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               NUMBA_NUM_THREADS="4")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[1, 2]"


@pytest.mark.parametrize("make", [lambda: EvoNormS0(8, groups=2), lambda: RangeEvoNorm2d(8, groups=2),
                                  lambda: RangeBatchNorm2d(8)])
def test_an_integer_input_is_refused(make):
    """RangeBatchNorm2d gave integer zeros for an int64 batch, RangeEvoNorm2d a NotImplementedError."""
    with pytest.raises(TypeError, match=r"expects a floating-point input, got torch.int64"):
        make()(torch.ones(2, 8, 4, 4, dtype=torch.int64))


@pytest.mark.parametrize("channels_last", [False, True])
def test_torch_compile_of_the_float_range_evonorm_equals_eager(channels_last):
    """The paper's norm in fp32 failed under torch.compile (numba's TypingError 'min(float32,
    array(float32, 0d, C))': the kernel constants, traced by Dynamo, reached numba as 0-d arrays),
    so did torch_compile=True with low_precision=False."""
    torch.manual_seed(0)
    norm = RangeEvoNorm2d(16)
    x = torch.randn(4, 16, 8, 8)
    x = (x.contiguous(memory_format=torch.channels_last) if channels_last else x).requires_grad_()
    eager = norm(x)
    eager.square().sum().backward()
    grad, x.grad = x.grad.clone(), None
    compiled = torch.compile(norm)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(x.grad, grad)
