"""8-bit layers (SPEC 4): quantized forward, gradient bifurcation, running ranges, determinism."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.pytorch_utils import Conv1D

from lp_decentral_nlp.quant import (
    KERNELS,
    QuantConfig,
    QuantConv1D,
    QuantConv2d,
    QuantEmbedding,
    QuantLinear,
    register_kernel,
)
from lp_decentral_nlp.quant.functional import fake_quantize, mean_sample_range, tensor_range
from lp_decentral_nlp.quant.kernels import SimulatedKernel

from helpers import check_running_range
from test_quant_functional import assert_on_grid


def make_layer(kind, config=None):
    """A float layer, its 8-bit version (sharing parameters) and an input batch."""
    config = config or QuantConfig()
    if kind == "linear":
        f, x = nn.Linear(12, 6), torch.randn(4, 5, 12)
    elif kind == "conv1d":
        f, x = Conv1D(6, 12), torch.randn(4, 5, 12)
        nn.init.normal_(f.bias)
    else:
        f, x = nn.Conv2d(3, 5, 3, stride=2, padding=1), torch.randn(4, 3, 9, 9)
    q = {"linear": QuantLinear, "conv1d": QuantConv1D, "conv2d": QuantConv2d}[kind].from_float(f, config)
    return f, q, x


def quantized_operands(q, x):
    """Input and weight on the 8-bit grids a training step uses (SPEC 4 ranges)."""
    x_q = fake_quantize(x, *mean_sample_range(x, batched=True), 8)
    w_q = fake_quantize(q.weight.detach(), *tensor_range(q.weight.detach()), 8)
    return x_q, w_q


class RecordingKernel(SimulatedKernel):
    """The simulated kernel, keeping the (dequantized) operands each product received."""

    name = "recording-test"
    calls: dict = {}

    def forward(self, gemm, x_q, w_q, bias):
        self.calls.update(fwd_x=x_q.dequantize(), fwd_w=w_q.dequantize(), n_forward=self.calls.get("n_forward", 0) + 1)
        return super().forward(gemm, x_q, w_q, bias)

    def grad_input(self, gemm, g_q, w_q, input_shape):
        self.calls.update(g_q=g_q.dequantize())
        return super().grad_input(gemm, g_q, w_q, input_shape)

    def grad_weight(self, gemm, x_q, g, weight_shape):
        self.calls.update(gw_x=x_q.dequantize(), gw_g=g)
        return super().grad_weight(gemm, x_q, g, weight_shape)


@pytest.fixture
def recording_kernel():
    kernel = register_kernel(RecordingKernel())
    kernel.calls.clear()
    yield kernel
    del KERNELS[kernel.name]


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_layer_is_its_float_type_and_shares_master_weights(kind):
    f, q, _ = make_layer(kind)
    assert isinstance(q, type(f))
    assert q.weight is f.weight and q.bias is f.bias and q.weight.dtype == torch.float32
    assert set(q.state_dict()) == set(f.state_dict()) | {"act_running_min", "act_running_max", "act_num_batches"}
    back = q.to_float()
    assert type(back) is type(f) and back.weight is f.weight and back.bias is f.bias


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_an_integer_input_is_refused_as_the_float_layer_refuses_it(kind):
    """It was cast to float32 and quantized as if it were activations."""
    f, q, x = make_layer(kind)
    with pytest.raises(RuntimeError):
        f(x.long())
    with pytest.raises(TypeError, match=r"with weight \(.*\): expected a floating-point input, got torch.int64"):
        q(x.long())
    assert q(x.double()).dtype == torch.float32  # another float dtype has the same 8-bit codes: cast


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_forward_uses_8bit_weights_and_activations(kind):
    f, q, x = make_layer(kind)
    x_q, w_q = quantized_operands(q, x)
    expected = {
        "linear": lambda: nn.functional.linear(x_q, w_q, f.bias),
        "conv1d": lambda: x_q @ w_q + f.bias,
        "conv2d": lambda: nn.functional.conv2d(x_q, w_q, f.bias, stride=2, padding=1),
    }[kind]
    with torch.no_grad():
        out = q(x)
        assert torch.allclose(out, expected(), atol=1e-5)
        assert not torch.allclose(out, f(x), atol=1e-4), "the output should differ from the float layer's"


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_gradient_bifurcation(kind, recording_kernel):
    """Layer gradient from the 8-bit output gradient; weight gradient from the fp32 one (SPEC 4)."""
    _, q, x = make_layer(kind, QuantConfig(kernel=recording_kernel.name))
    x.requires_grad_(True)
    out = q(x)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    calls = recording_kernel.calls
    assert calls["n_forward"] == 1, "the forward GEMM must run once"

    # Operands of the forward GEMM are on 8-bit grids.
    x_lo, x_hi = mean_sample_range(x.detach(), batched=True)
    assert_on_grid(calls["fwd_x"], x_lo, (x_hi - x_lo) / 255)
    w_lo, w_hi = tensor_range(q.weight.detach())
    assert_on_grid(calls["fwd_w"], w_lo, (w_hi - w_lo) / 255)
    # The output gradient entering the layer-gradient GEMM is on the 8-bit grid of its own min/max ...
    g_lo, g_hi = tensor_range(upstream)
    assert_on_grid(calls["g_q"], g_lo, (g_hi - g_lo) / 255)
    assert not torch.equal(calls["g_q"], upstream)
    # ... while the weight gradient gets the untouched fp32 gradient and the 8-bit input.
    assert torch.equal(calls["gw_g"], upstream)
    assert torch.equal(calls["gw_x"], calls["fwd_x"])

    # The resulting gradients equal autograd through the float op on the quantized operands
    # (straight-through estimator): dW from the fp32 upstream, dx from the quantized one.
    xq_leaf = calls["fwd_x"].clone().requires_grad_(True)
    wq_leaf = calls["fwd_w"].clone().requires_grad_(True)
    float_op = {
        "linear": lambda a, w: nn.functional.linear(a, w, q.bias),
        "conv1d": lambda a, w: a @ w + q.bias,
        "conv2d": lambda a, w: nn.functional.conv2d(a, w, q.bias, stride=2, padding=1),
    }[kind]
    dw, dx_fp = torch.autograd.grad((float_op(xq_leaf, wq_leaf) * upstream).sum(), (wq_leaf, xq_leaf))
    (dx_q,) = torch.autograd.grad((float_op(xq_leaf, wq_leaf) * calls["g_q"]).sum(), xq_leaf)
    assert torch.allclose(q.weight.grad, dw, atol=1e-5)
    assert torch.allclose(x.grad, dx_q, atol=1e-5)
    assert not torch.allclose(x.grad, dx_fp, atol=1e-6), "the layer gradient must come from the 8-bit gradient"
    bias_dims = (0, 2, 3) if kind == "conv2d" else (0, 1)
    assert torch.allclose(q.bias.grad, upstream.sum(bias_dims), atol=1e-5)


def test_layer_gradient_through_identity_weight_is_on_the_8bit_grid():
    """End to end with the real simulated kernel: with W = I, dL/dx is the quantized output gradient."""
    f = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        f.weight.copy_(torch.eye(16))
    q = QuantLinear.from_float(f, QuantConfig())
    x = torch.randn(8, 16, requires_grad=True)
    upstream = torch.randn(8, 16)
    (q(x) * upstream).sum().backward()
    lo, hi = tensor_range(upstream)
    assert_on_grid(x.grad, lo, (hi - lo) / 255)
    assert (x.grad - upstream).abs().max() <= (hi - lo) / 255 + 1e-6
    assert (x.grad != upstream).any()


def test_per_sample_gradient_granularity(recording_kernel):
    _, q, x = make_layer("linear", QuantConfig(kernel=recording_kernel.name, grad_granularity="sample"))
    x.requires_grad_(True)
    out = q(x)
    upstream = torch.randn_like(out) * torch.tensor([0.01, 1.0, 10.0, 100.0]).view(4, 1, 1)
    (out * upstream).sum().backward()
    for g_q, g in zip(recording_kernel.calls["g_q"], upstream):
        assert_on_grid(g_q, g.min(), (g.max() - g.min()) / 255)


def test_layer_gradient_is_stochastic_in_training_and_reproducible_under_a_seed():
    _, q, x = make_layer("linear")
    grads = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        x_leaf = x.clone().requires_grad_(True)
        q(x_leaf).pow(2).sum().backward()
        grads.append(x_leaf.grad)
    assert torch.equal(grads[0], grads[1])
    assert not torch.equal(grads[0], grads[2])


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_eval_mode_is_deterministic(kind):
    _, q, x = make_layer(kind)
    q(x)  # one training batch calibrates the running range
    q.eval()
    results = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        x_leaf = x.clone().requires_grad_(True)
        out = q(x_leaf)
        out.pow(2).sum().backward()
        results.append((out.detach(), x_leaf.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1]), "no stochastic rounding in eval mode, backward included"


def test_running_range_in_training_and_its_use_in_eval():
    f, q, _ = make_layer("linear")
    check_running_range(q, [torch.randn(4, 5, 12) * s for s in (1.0, 3.0)], rel=1e-6)

    q.eval()
    x = torch.randn(2, 5, 12) * 5
    before = q.act_running_min.clone()
    with torch.no_grad():
        out = q(x)
    assert torch.equal(q.act_running_min, before), "eval must not update the running range"
    x_q = fake_quantize(x, q.act_running_min, q.act_running_max, 8)
    w_q = fake_quantize(f.weight.detach(), *tensor_range(f.weight.detach()), 8)
    assert torch.allclose(out, nn.functional.linear(x_q, w_q, f.bias), atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_training_batch_leaves_the_running_range_alone(bad):
    """One such batch made the range NaN for good: every later evaluation gave NaN logits."""
    _, q, _ = make_layer("linear")
    q.train()
    q(torch.randn(4, 5, 12))
    before = (q.act_running_min.clone(), q.act_running_max.clone(), q.act_num_batches.clone())
    x = torch.randn(4, 5, 12)
    x[1, 2, 3] = bad
    q(x)
    assert (q.act_running_min, q.act_running_max, q.act_num_batches) == before
    q(torch.randn(4, 5, 12))  # a clean batch counts again
    assert int(q.act_num_batches) == 2 and bool(torch.isfinite(q.act_running_min + q.act_running_max))
    with torch.no_grad():
        assert bool(torch.isfinite(q.eval()(torch.randn(2, 5, 12))).all())


def test_uncalibrated_eval_uses_the_batch_range():
    f, q, x = make_layer("linear")
    q.eval()
    with torch.no_grad():
        out = q(x)
    x_q = fake_quantize(x, *mean_sample_range(x, batched=True), 8)  # the training estimator, on this batch
    w_q = fake_quantize(f.weight.detach(), *tensor_range(f.weight.detach()), 8)
    assert torch.allclose(out, nn.functional.linear(x_q, w_q, f.bias), atol=1e-5)
    assert q.act_num_batches.item() == 0


class SyncDetector(TorchDispatchMode):
    """Records the tensors whose value an op copies to the host (what .item(), float(t), bool(t)
    call): ``reads``, ``(device type, shape)`` each."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.reads.append((args[0].device.type, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
@pytest.mark.parametrize("training", [True, False])
def test_only_the_cpu_running_range_is_read_on_the_host(kind, training):
    """A training call reads its batch's 0-d range and count to update the running range on the
    CPU (no device to wait for; off the CPU the update reads nothing, test_quant_functional), and
    nothing else; evaluation reads nothing."""
    _, q, x = make_layer(kind)
    q.train(training)
    x.requires_grad_(True)
    with SyncDetector() as detector:
        q(x).pow(2).sum().backward()
    assert detector.reads == ([("cpu", ())] * 3 if training else [])


def test_quantized_gemm_stays_fp32_under_autocast():
    _, q, x = make_layer("linear")
    q.eval()
    with torch.no_grad():
        expected = q(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = q(x.bfloat16())
    assert out.dtype == torch.float32
    # The bf16 input loses precision, but the GEMM itself runs on the fp32 8-bit grids.
    assert torch.allclose(out, expected, atol=0.05)
    w_q = fake_quantize(q.weight.detach(), *tensor_range(q.weight.detach()), 8)
    x_bf = x.bfloat16().float()
    x_q = fake_quantize(x_bf, *mean_sample_range(x_bf, batched=True), 8)
    assert torch.allclose(out, nn.functional.linear(x_q, w_q, q.bias), atol=1e-5)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(
    "kwargs, pad_first, conv_padding",
    [(dict(padding="same"), None, (1, 1)),
     # even kernel width: "same" pads 0 left, 1 right (F.pad order: left, right, top, bottom)
     (dict(kernel_size=(3, 2), padding="same"), ((0, 1, 1, 1), "constant"), 0),
     (dict(padding=1, padding_mode="reflect"), ((1, 1, 1, 1), "reflect"), 0),
     (dict(padding=(1, 2), padding_mode="circular"), ((2, 2, 1, 1), "circular"), 0)],
)
def test_conv2d_padding_modes_and_unbatched_input(kwargs, pad_first, conv_padding):
    kwargs = {"kernel_size": 3, **kwargs}
    f = nn.Conv2d(2, 3, **kwargs)
    q = QuantConv2d.from_float(f, QuantConfig())
    # positive inputs: zeros padded before quantizing would widen the input's range
    x = (torch.rand(2, 2, 7, 7) + 0.5).requires_grad_()
    out = q(x)
    # Reference: the float conv on the 8-bit input and weight. Symmetric zero padding stays outside
    # the quantizer (exact zeros, not in the input's range); other modes and asymmetric "same" pad
    # before quantizing.
    x_in = x.detach()
    if pad_first is not None:
        x_in = nn.functional.pad(x_in, pad_first[0], mode=pad_first[1])
    x_q, w_q = quantized_operands(q, x_in)
    ref = nn.functional.conv2d(x_q, w_q, f.bias, q.stride, conv_padding, q.dilation, q.groups)
    assert ref.shape == f(x).shape
    assert torch.allclose(out, ref, atol=1e-5)
    out.sum().backward()
    assert x.grad.shape == x.shape and q.weight.grad.shape == q.weight.shape
    assert q(x[0]).shape == f(x[0]).shape


def test_from_float_rejects_wrong_types_and_non_fp32_master_weights():
    with pytest.raises(TypeError, match="needs a Linear"):
        QuantLinear.from_float(nn.Conv2d(2, 2, 1), QuantConfig())
    with pytest.raises(TypeError, match="float32"):
        QuantLinear.from_float(nn.Linear(2, 2).half(), QuantConfig())


def test_directly_constructed_layer_works():
    q = QuantLinear(8, 4, quant_config=QuantConfig(bits=4))
    assert q.act_running_min.device == q.weight.device
    assert "bits=4" in repr(q)
    q(torch.randn(3, 8)).sum().backward()
    assert q.weight.grad is not None


def test_quant_embedding_looks_up_the_8bit_table_and_passes_the_float_gradient():
    torch.manual_seed(0)
    table = nn.Embedding(50, 16, padding_idx=0)
    layer = QuantEmbedding.from_float(table, QuantConfig())
    assert layer.weight is table.weight and isinstance(layer, nn.Embedding)
    ids = torch.randint(0, 50, (4, 7))
    out = layer(ids)
    master = table.weight.detach()
    lo, hi = tensor_range(master)
    # the rows of the whole table quantized per tensor (SPEC 4 weights), bit for bit
    assert torch.equal(out, fake_quantize(master, lo, hi, 8)[ids])
    assert_on_grid(out.detach(), lo, (hi - lo) / 255)
    assert not torch.equal(out, master[ids])  # it did round
    # straight-through: the master table gets exactly the float lookup's gradient
    g = torch.randn_like(out)
    out.backward(g)
    reference = master.clone().requires_grad_()
    torch.nn.functional.embedding(ids, reference, padding_idx=0).backward(g)
    assert torch.equal(layer.weight.grad, reference.grad)
    assert type(layer.to_float()) is nn.Embedding and layer.to_float().weight is table.weight


def test_quant_embedding_needs_a_float32_table():
    with pytest.raises(TypeError, match="master weights must be float32"):
        QuantEmbedding.from_float(nn.Embedding(5, 3).to(torch.bfloat16), QuantConfig())


@pytest.mark.filterwarnings("ignore:QuantConfig\\(kernel='int8_bf16'\\) cannot run every layer")
@pytest.mark.parametrize("kernel", ["simulated", "int8", "int8_bf16", "auto"])
@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d", "wide linear"])
def test_output_can_be_modified_in_place_like_the_float_layers(kind, kernel):
    """Writing into the output (Wav2Vec2's ``hidden_states[mask] = ...``) works with every kernel
    and gives the gradients of the out-of-place write."""
    config = QuantConfig(kernel=kernel)
    if kind == "wide linear":  # wide enough for auto to pick int8 where the CPU has an int8 GEMM
        q, x = QuantLinear.from_float(nn.Linear(256, 256), config), torch.randn(2, 3, 256)
    else:
        _, q, x = make_layer(kind, config)
    grads = []
    for inplace in (True, False):
        torch.manual_seed(1)
        x_leaf = x.clone().requires_grad_(True)
        out = q(x_leaf)
        mask = torch.zeros(out.shape[:2], dtype=torch.bool)
        mask[0, 1] = True
        if inplace:
            out[mask] = 0.5
            out.add_(1.0)
        else:
            out = torch.where(mask.view(mask.shape + (1,) * (out.dim() - 2)), 0.5, out) + 1.0
        q.weight.grad = None
        (out * out).sum().backward()
        grads.append((out.detach(), x_leaf.grad, q.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind, empty_shape", [("linear", (0, 12)), ("linear", (4, 0, 12)), ("conv1d", (0, 5, 12)),
                                               ("conv2d", (0, 3, 9, 9))])
def test_empty_batch_runs_like_the_float_layer_and_leaves_the_running_range(kind, empty_shape):
    f, q, x = make_layer(kind)
    q(x)  # calibrates the running range
    before = [b.clone() for b in q.buffers()]
    empty = torch.randn(empty_shape, requires_grad=True)
    out = q(empty)
    assert out.shape == f(empty).shape
    out.sum().backward()
    assert empty.grad.shape == empty.shape
    assert torch.equal(q.weight.grad, torch.zeros_like(q.weight)) and torch.equal(q.bias.grad, torch.zeros_like(q.bias))
    assert all(torch.equal(a, b) for a, b in zip(before, q.buffers())), "an empty batch must not move the range"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d", "embedding"])
def test_a_layer_converted_off_float32_after_the_surgery_refuses_to_run(kind, dtype):
    """``model.to(dtype)`` after ``quantize_model`` would compute off the 8-bit grid: the next forward
    says so (master weights stay float32, SPEC 4, as from_float requires); after float64 ``.float()``
    restores it, and after a 16-bit dtype, which rounded the weights, the message says to load the
    model again (it advised ``.float()``, which left the rounded weights)."""
    if kind == "embedding":
        q, x = QuantEmbedding.from_float(nn.Embedding(10, 6), QuantConfig()), torch.tensor([[1, 2]])
    else:
        _, q, x = make_layer(kind)
    name = type(q).__name__
    undo = (r"call model.to\(torch.float32\)" if dtype == torch.float64 else
            rf"the conversion rounded the float32 master weights and activation ranges to {dtype}: load the model")
    with pytest.raises(TypeError, match=rf"{name} with weight \(.*\): master weights must be float32 \(SPEC 4\), "
                                        rf"got weight of dtype {dtype}; the model was converted after quantize_model "
                                        rf"\(only float32 is allowed\): {undo}"):
        q.to(dtype)(x if kind == "embedding" else x.to(dtype))
    assert q.to(torch.float32)(x).dtype == torch.float32  # what a from_pretrained model allows (.float() it refuses)


NON_FINITE_LAYERS = {
    "linear": lambda: (nn.Linear(12, 6), torch.randn(4, 5, 12)),
    "conv1d": lambda: (Conv1D(6, 12), torch.randn(4, 5, 12)),
    "conv2d": lambda: (nn.Conv2d(3, 5, 3, stride=2, padding=1), torch.randn(4, 3, 9, 9)),
    "conv2d grouped dilated": lambda: (nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2), torch.randn(3, 4, 8, 8)),
    "conv2d reflect": lambda: (nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), torch.randn(2, 3, 7, 7)),
    "conv2d channels last": lambda: (nn.Conv2d(8, 8, 1), torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)),
}


@pytest.mark.filterwarnings("ignore:QuantConfig\\(kernel='int8'\\) cannot run every layer")
@pytest.mark.parametrize("kernel", ["simulated", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("kind", sorted(NON_FINITE_LAYERS))
def test_evaluation_keeps_a_non_finite_input_where_the_float_layer_does(kind, bad, kernel):
    """The running range's codes cannot hold a NaN or an infinity (a NaN became the lowest code):
    a calibrated 8-bit layer in evaluation turned a NaN input, e.g. from a diverged earlier layer,
    into finite outputs. The outputs that depend on such an input are NaN now, exactly those the
    float layer leaves non-finite; the others are untouched."""
    torch.manual_seed(0)
    f, x = NON_FINITE_LAYERS[kind]()
    q = {nn.Linear: QuantLinear, Conv1D: QuantConv1D, nn.Conv2d: QuantConv2d}[type(f)].from_float(
        f, QuantConfig(kernel=kernel))
    q.train()
    q(x)  # calibrated
    q.eval()
    with torch.no_grad():
        clean = q(x)
        x[(0, 1, 2, 3)[: x.dim()]] = bad
        if x.dim() == 4:
            x[-1, -1, 0, 0] = bad  # a corner: reached through the padding's border windows
        out = q(x)
        expected = ~torch.isfinite(f(x))
    assert expected.any() and not expected.all()
    assert torch.equal(out.isnan(), expected)
    assert torch.equal(out[~expected], clean[~expected])


@pytest.mark.parametrize("kind", ["linear", "conv2d"])
def test_a_non_finite_training_batch_gives_nan_outputs(kind):
    _, q, x = make_layer(kind)
    q.train()
    x[0, 1, 2] = float("nan")
    assert q(x).isnan().all()


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
def test_a_second_derivative_through_a_gemm_layer_is_refused(kind):
    """The backward's products run on 8-bit codes outside autograd, so under create_graph=True
    the layer gradient carried no graph: a gradient penalty silently added nothing to the
    weights' gradients (the float layer's 499 for this penalty)."""
    _, q, x = make_layer(kind)
    x.requires_grad_(True)
    grad_x, = torch.autograd.grad(q(x).pow(2).sum() + x.pow(3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_x.pow(2).sum().backward()
