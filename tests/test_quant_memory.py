"""What 8-bit layers keep for backward (SPEC 4): the forward's 8-bit codes, not fp32 tensors.

The gradients stay bit for bit those of recomputing the quantized operands from the float input
(the layer before it kept its codes): the reference below is that computation, written with the
public functional API and the GEMMs of ``quant.gemm``. Byte counts are deterministic, so the
memory tests assert exact counts and ratios.
"""
import pytest
import torch
from torch import nn
from transformers import DistilBertConfig, DistilBertForSequenceClassification
from transformers.pytorch_utils import Conv1D

from lp_decentral_nlp.quant import QuantConfig, quantize_model, saved_tensor_bytes
from lp_decentral_nlp.quant.functional import fake_quantize, grad_range, mean_sample_range, tensor_range
from lp_decentral_nlp.quant.gemm import Conv2dGemm, LinearGemm, TransposedLinearGemm
from lp_decentral_nlp.vision import resnet20


def float_layer(kind):
    if kind == "linear":
        return nn.Linear(24, 16), LinearGemm(), torch.randn(3, 5, 24) * 2 + 0.3
    if kind == "conv1d":
        layer = Conv1D(16, 24)
        nn.init.normal_(layer.bias)
        return layer, TransposedLinearGemm(), torch.randn(3, 5, 24)
    return nn.Conv2d(3, 8, 3, stride=2, padding=1), Conv2dGemm((2, 2), (1, 1), (1, 1), 1), torch.randn(4, 3, 9, 9)


def reference_step(layer, gemm, x, upstream, config, seed):
    """SPEC 4 step recomputing the operands from the float input and weight (the layer before
    it saved 8-bit codes): output, dL/dx, dL/dW, dL/db."""
    w = layer.weight.detach()
    x_q = fake_quantize(x, *mean_sample_range(x, batched=True), config.bits)
    w_q = fake_quantize(w, *tensor_range(w), config.bits)
    y = gemm.forward(x_q, w_q, layer.bias.detach())
    torch.manual_seed(seed)
    g_q = fake_quantize(upstream, *grad_range(upstream, config.grad_granularity), config.grad_bits,
                        config.stochastic_grad_rounding)
    return y, gemm.grad_input(g_q, w_q, x.shape), gemm.grad_weight(x_q, upstream, w.shape), gemm.grad_bias(upstream)


@pytest.mark.parametrize("kind", ["linear", "conv1d", "conv2d"])
@pytest.mark.parametrize("granularity", ["tensor", "sample"])
def test_gradients_from_saved_codes_are_bit_identical_to_recomputing_them(kind, granularity):
    layer, gemm, x = float_layer(kind)
    config = QuantConfig(kernel="simulated", grad_granularity=granularity)
    expected = reference_step(layer, gemm, x, upstream := torch.randn_like(layer(x)), config, seed=7)
    model = quantize_model(nn.Sequential(layer), config)
    x_leaf = x.clone().requires_grad_(True)
    y = model(x_leaf)
    torch.manual_seed(7)  # the same stochastic-rounding draws as the reference
    y.backward(upstream)
    got = (y.detach(), x_leaf.grad, layer.weight.grad, layer.bias.grad)
    for name, a, b in zip(("output", "dL/dx", "dL/dW", "dL/db"), got, expected):
        assert torch.equal(a, b), f"{name} differs from the reference"


@pytest.mark.parametrize("kernel", ["simulated", "int8"])
def test_linear_keeps_one_byte_per_input_and_weight_element(kernel):
    layer = nn.Linear(64, 32)
    x = torch.randn(6, 10, 64, requires_grad=True)
    _, fp32 = saved_tensor_bytes(layer, x)
    assert fp32 == 4 * (x.numel() + layer.weight.numel()), "a float Linear keeps its fp32 input and weight"
    # the weight is a reference to the parameter: without the parameters only the input is counted
    assert saved_tensor_bytes(layer, x, exclude=layer.parameters())[1] == 4 * x.numel()
    # what the forward creates can be excluded too: exclude is read after the forward
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), layer)
    assert saved_tensor_bytes(model, x, exclude=model.parameters())[1] == 3 * 4 * x.numel(), "x, GELU's input, output"
    excluded = list(model.parameters())  # and the GELU input, appended during the forward
    model[1].register_forward_pre_hook(lambda module, args: excluded.append(args[0]))
    assert saved_tensor_bytes(model, x, exclude=excluded)[1] == 2 * 4 * x.numel()
    q = quantize_model(nn.Sequential(layer), QuantConfig(kernel=kernel))
    y, nbytes = saved_tensor_bytes(q, x)
    scalars = 4 * 4  # scale and offset of the input and of the weight (0-d fp32)
    # the int8 kernel also keeps each row's code sum (fp32): 60 input rows, 32 weight rows
    row_sums = 4 * (60 + 32) if kernel == "int8" else 0
    assert nbytes == x.numel() + layer.weight.numel() + scalars + row_sums
    assert saved_tensor_bytes(q, x, exclude=q.parameters())[1] == nbytes, "the 8-bit layer saves no parameter"
    y.sum().backward()  # the saved codes are enough for backward
    assert x.grad is not None and layer.weight.grad is not None


def test_layer_keeps_only_the_codes_its_gradients_need():
    """First layer (input without gradient): only the input codes for dL/dW; frozen weight: only
    the weight codes for dL/dx."""
    layer = nn.Linear(64, 32, bias=False)
    q = quantize_model(nn.Sequential(layer), QuantConfig(kernel="simulated"))
    x = torch.randn(60, 64)
    assert saved_tensor_bytes(q, x)[1] == x.numel() + 2 * 4
    layer.weight.requires_grad_(False)
    assert saved_tensor_bytes(q, x.requires_grad_(True))[1] == layer.weight.numel() + 2 * 4


@pytest.mark.parametrize("kernel", ["simulated", "int8"])
def test_tiny_distilbert_keeps_codes_for_every_quantized_linear(kernel):
    """fp32 minus 8-bit bytes is exactly what the 8-bit Linears save: 3 of every 4 bytes of each
    fp32 weight (the classifier head stays fp32) and of each input, counted the way storages are
    (q, k and v share one fp32 input but keep one set of codes each)."""
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=16)
    model = DistilBertForSequenceClassification(config).train()
    ids = torch.randint(0, 100, (2, 16))
    torch.manual_seed(1)
    _, fp32 = saved_tensor_bytes(lambda: model(input_ids=ids).logits)
    quantize_model(model, QuantConfig(kernel=kernel))
    torch.manual_seed(1)  # same dropout masks
    _, int8 = saved_tensor_bytes(lambda: model(input_ids=ids).logits)
    tokens, dim, hidden = 32, 32, 64
    per_block_inputs_fp32 = 4 * tokens * (dim + dim + dim + hidden)  # qkv input, out_lin, lin1, lin2
    per_block_inputs_int8 = tokens * (3 * dim + dim + dim + hidden)
    per_block_weights = 4 * dim * dim + 2 * dim * hidden
    scalars = 6 * 4 * 4  # six Linears, four 0-d tensors each
    row_sums = 4 * (tokens * 6 + 4 * dim + hidden + dim) if kernel == "int8" else 0
    blocks = 2
    expected_saving = blocks * (per_block_inputs_fp32 - per_block_inputs_int8 + 3 * per_block_weights
                                - scalars - row_sums)
    assert fp32 - int8 == expected_saving


def test_resnet20_range_evonorm_8bit_keeps_under_035_of_fp32_evonorm():
    """The vision goal: ResNet-20, 8-bit with Range EvoNorm vs fp32 with EvoNorm-S0 (SPEC 5)."""
    x = torch.randn(2, 3, 16, 16)
    _, fp32 = saved_tensor_bytes(resnet20(num_classes=10, norm="evonorm").train(), x)
    model = quantize_model(resnet20(num_classes=10, norm="range_evonorm").train(), QuantConfig())
    out, int8 = saved_tensor_bytes(model, x)
    assert int8 <= 0.35 * fp32, f"8-bit keeps {int8} bytes, fp32 {fp32}"
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
