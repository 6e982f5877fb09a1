"""8-bit vision norm layers (SPEC 4 + 5) and the whole-CNN surgery.

Tensors stay under 32k elements so that torch runs them on one thread (fast on shared cores).
"""
import copy

import pytest
import torch
from torch import nn

from lp_decentral_nlp.quant import (QuantConfig, QuantConv2d, QuantLinear, QuantModule, dequantize_model, kernel_report,
                                    quantize_model)
from lp_decentral_nlp.quant.kernels import onednn_conv_available
from lp_decentral_nlp.quant.functional import fake_quantize, mean_sample_range, sample_range, tensor_range
from lp_decentral_nlp.vision import (
    ARCHS,
    EvoNormS0,
    ImageClassifier,
    QuantEvoNormS0,
    QuantRangeBatchNorm2d,
    QuantRangeEvoNorm2d,
    RangeBatchNorm2d,
    RangeEvoNorm2d,
    build_vision_model,
    evonorm_s0,
    range_batch_norm2d,
    range_evonorm2d,
)

from helpers import check_running_range
from test_quant_functional import assert_on_grid

KINDS = ["evonorm", "range_evonorm", "range_batchnorm"]
C = 8


def make_norm(kind, config=None, apply_act=True):
    """A float norm with random parameters, its 8-bit version (sharing them) and an input batch."""
    torch.manual_seed(0)
    if kind == "evonorm":
        f, qtype = EvoNormS0(C, apply_act=apply_act), QuantEvoNormS0
    elif kind == "range_evonorm":
        f, qtype = RangeEvoNorm2d(C, apply_act=apply_act), QuantRangeEvoNorm2d
    else:
        f, qtype = RangeBatchNorm2d(C), QuantRangeBatchNorm2d
    with torch.no_grad():
        for p in f.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    x = torch.randn(4, C, 5, 5) * 2 + 0.3
    return f, qtype.from_float(f, config or QuantConfig()), x


def formula(kind, layer, x, params, training=True):
    """The float formula of `layer` (no side effects) on the given input and parameters."""
    weight, bias, *v = params
    v = v[0] if v else None
    if kind == "evonorm":
        return evonorm_s0(x, weight, bias, v, layer.groups, layer.eps)
    if kind == "range_evonorm":
        return range_evonorm2d(x, weight, bias, v, layer.groups, layer.eps)
    stats = (layer.running_mean.clone(), layer.running_scale.clone(), layer.num_batches_tracked.clone())
    return range_batch_norm2d(x, *stats, weight, bias, training, layer.momentum, layer.eps)


def q8(t):
    return fake_quantize(t.detach(), *tensor_range(t.detach()), 8)


def record_normalize(layer):
    """Wrap ``layer.normalize`` to keep the operands of every call."""
    calls, inner = [], layer.normalize

    def normalize(x, params, training, update_stats):
        calls.append({"x": x.detach().clone(), "params": [p.detach().clone() for p in params],
                      "update_stats": update_stats})
        return inner(x, params, training, update_stats)

    layer.normalize = normalize
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_is_its_float_type_and_shares_parameters_and_buffers(kind):
    f, q, _ = make_norm(kind)
    assert isinstance(q, type(f)) and isinstance(q, QuantModule)
    assert all(a is b for a, b in zip(q.parameters(), f.parameters()))
    assert all(q.get_buffer(n) is b for n, b in f.named_buffers())
    assert set(q.state_dict()) == set(f.state_dict()) | {"act_running_min", "act_running_max", "act_num_batches"}
    back = q.to_float()
    assert type(back) is type(f) and set(back.state_dict()) == set(f.state_dict())
    assert all(a is b for a, b in zip(back.parameters(), f.parameters()))
    assert all(back.get_buffer(n) is b for n, b in f.named_buffers())


@pytest.mark.parametrize("kind", KINDS)
def test_forward_is_the_formula_on_8bit_input_and_parameters(kind):
    f, q, x = make_norm(kind)
    calls = record_normalize(q)
    expected = formula(kind, q, fake_quantize(x, *mean_sample_range(x, batched=True), 8),
                       [q8(p) for p in q.quant_parameters()])
    with torch.no_grad():
        out = q(x)
    assert torch.allclose(out, expected, atol=1e-5)
    assert not torch.allclose(out, f.train()(x), atol=1e-3), "the output should differ from the float layer's"
    # the operands really are on 8-bit grids: input from the SPEC 4 activation range, each
    # parameter from its own min/max
    (call,) = calls
    lo, hi = mean_sample_range(x, batched=True)
    assert_on_grid(call["x"], lo, (hi - lo) / 255)
    for p_q, p in zip(call["params"], q.quant_parameters()):
        p_lo, p_hi = tensor_range(p.detach())
        assert_on_grid(p_q, p_lo, (p_hi - p_lo) / 255)
        assert torch.equal(p_q, q8(p)) and not torch.equal(p_q, p.detach())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("granularity", ["tensor", "sample"])
def test_gradient_bifurcation(kind, granularity):
    """Layer gradient from the 8-bit stochastically rounded output gradient, parameter gradients
    from the fp32 one, both through the formula at the 8-bit operands (straight-through)."""
    _, q, x = make_norm(kind, QuantConfig(grad_granularity=granularity))
    x.requires_grad_(True)
    upstream = torch.randn(4, C, 5, 5) * torch.tensor([0.01, 1.0, 10.0, 100.0]).view(4, 1, 1, 1)
    out = q(x)
    torch.manual_seed(123)
    (out * upstream).sum().backward()

    torch.manual_seed(123)  # the backward's only random draw: the stochastic rounding of g
    if granularity == "sample":
        g_lo, g_hi = (r.view(-1, 1, 1, 1) for r in sample_range(upstream))
    else:
        g_lo, g_hi = tensor_range(upstream)
    g_q = fake_quantize(upstream, g_lo, g_hi, 8, stochastic=True)
    for g_qi, g_loi, g_hii in zip(g_q, g_lo.expand(4, 1, 1, 1), g_hi.expand(4, 1, 1, 1)):
        assert_on_grid(g_qi, g_loi, (g_hii - g_loi) / 255)
    assert not torch.equal(g_q, upstream)

    x_q = fake_quantize(x.detach(), *mean_sample_range(x.detach(), batched=True), 8).requires_grad_(True)
    params_q = [q8(p).requires_grad_(True) for p in q.quant_parameters()]
    y = formula(kind, q, x_q, params_q)
    (dx,) = torch.autograd.grad(y, x_q, g_q, retain_graph=True)
    dparams = torch.autograd.grad(y, params_q, upstream, retain_graph=True)
    dparams_from_gq = torch.autograd.grad(y, params_q, g_q)
    assert torch.allclose(x.grad, dx, atol=1e-4 * dx.abs().max())
    for p, dp, dp_q in zip(q.quant_parameters(), dparams, dparams_from_gq):
        assert torch.allclose(p.grad, dp, rtol=1e-5, atol=1e-5 * dp.abs().max())
        assert not torch.allclose(p.grad, dp_q, rtol=1e-6, atol=1e-7), "8-bit g leaked into a parameter gradient"


def test_layer_gradient_through_an_identity_norm_is_on_the_8bit_grid():
    """End to end: an eval Range BN that is the identity passes back exactly the quantized g."""
    f = RangeBatchNorm2d(C, eps=1e-5)
    with torch.no_grad():
        f.running_scale.fill_(1 - 1e-5)  # (x - 0) / (scale + eps) * 1 + 0 = x
    q = QuantRangeBatchNorm2d.from_float(f, QuantConfig()).eval()
    x = torch.randn(4, C, 3, 3, requires_grad=True)
    upstream = torch.randn(4, C, 3, 3)
    (q(x) * upstream).sum().backward()
    lo, hi = tensor_range(upstream)
    assert_on_grid(x.grad, lo, (hi - lo) / 255)
    assert (x.grad - upstream).abs().max() <= (hi - lo) / 255 / 2 + 1e-6  # eval: nearest rounding
    assert (x.grad != upstream).any()


@pytest.mark.parametrize("kind", KINDS)
def test_partial_gradients(kind):
    """First layer (input without grad) and frozen parameters both work."""
    _, q, x = make_norm(kind)
    q(x).pow(2).sum().backward()
    assert all(p.grad is not None for p in q.parameters())
    q.zero_grad(set_to_none=True)
    for p in q.parameters():
        p.requires_grad_(False)
    x.requires_grad_(True)
    q(x).pow(2).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in q.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_layer_gradient_stochastic_in_training_deterministic_in_eval(kind):
    _, q, x = make_norm(kind)

    def grads(seed):
        torch.manual_seed(seed)
        leaf = x.clone().requires_grad_(True)
        out = q(leaf)
        out.pow(2).sum().backward()
        return out.detach(), leaf.grad

    a, b, c = grads(0), grads(0), grads(1)
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])
    q.eval()
    (o0, g0), (o1, g1) = grads(0), grads(1)
    assert torch.equal(o0, o1) and torch.equal(g0, g1)


@pytest.mark.parametrize("kind", KINDS)
def test_running_activation_range_in_training_and_its_use_in_eval(kind):
    _, q, x = make_norm(kind)
    check_running_range(q, [x, x * 3 - 1], rel=1e-5)
    q.eval()
    probe = torch.randn(2, C, 5, 5) * 10
    expected = formula(kind, q, fake_quantize(probe, q.act_running_min, q.act_running_max, 8),
                       [q8(p) for p in q.quant_parameters()], training=False)
    with torch.no_grad():
        assert torch.allclose(q(probe), expected, atol=1e-5)


def test_range_batchnorm_running_statistics_come_from_the_8bit_input_once_per_step():
    """The backward recomputation must not update the running buffers a second time."""
    _, q, x = make_norm("range_batchnorm")
    x.requires_grad_(True)
    q(x).pow(2).sum().backward()
    assert q.num_batches_tracked.item() == 1
    x_q = fake_quantize(x.detach(), *mean_sample_range(x.detach(), batched=True), 8)
    assert torch.allclose(q.running_mean, 0.1 * x_q.mean((0, 2, 3)), atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_range_batchnorm_updates_its_running_statistics_once(use_reentrant):
    """Under torch.utils.checkpoint the recomputed forward updated the running mean and scale a
    second time (num_batches_tracked 2): the evaluation statistics drifted from an uncheckpointed
    run's, although the activation range was updated once."""
    from torch.utils.checkpoint import checkpoint

    _, plain, x = make_norm("range_batchnorm")
    _, checkpointed, _ = make_norm("range_batchnorm")
    for run in (plain, lambda t: checkpoint(checkpointed, t, use_reentrant=use_reentrant)):
        torch.manual_seed(0)
        run(x.clone().requires_grad_(True)).pow(2).sum().backward()
    assert checkpointed.num_batches_tracked.item() == checkpointed.act_num_batches.item() == 1
    for name, buffer in plain.named_buffers():
        assert torch.equal(buffer, checkpointed.get_buffer(name)), name


@pytest.mark.parametrize("kind", ["evonorm", "range_evonorm"])
def test_norm_without_activation(kind):
    _, q, x = make_norm(kind, apply_act=False)
    assert q.v is None and len(q.quant_parameters()) == 2
    expected = formula(kind, q, fake_quantize(x, *mean_sample_range(x, batched=True), 8),
                       [q8(p) for p in q.quant_parameters()])
    assert torch.allclose(q(x), expected, atol=1e-5)
    assert type(q.to_float()).__name__ == type(q).__name__.removeprefix("Quant")


def test_from_float_errors():
    with pytest.raises(TypeError, match="needs a RangeEvoNorm2d"):
        QuantRangeEvoNorm2d.from_float(EvoNormS0(C), QuantConfig())
    with pytest.raises(TypeError, match="float32"):
        QuantEvoNormS0.from_float(EvoNormS0(C).double(), QuantConfig())
    _, q, _ = make_norm("evonorm")
    with pytest.raises(ValueError, match=r"expects input of shape \(N, 8, H, W\)"):
        q(torch.randn(2, 4, 3, 3))
    with pytest.raises(TypeError, match=r"QuantEvoNormS0 with weight \(8,\): master weights must be float32"):
        q.half()(torch.randn(2, C, 3, 3).half())


# -- whole networks -------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["evonorm", "range_evonorm", "range_batchnorm"])
@pytest.mark.parametrize("eight_bit", [False, True], ids=["fp32", "8bit"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_empty_batch_passes_through_without_changing_any_state(norm, eight_bit, training):
    """As torch's own layers do: (0, C, H, W) in, (0, classes) out, no statistic or range updated."""
    torch.manual_seed(0)
    model = build_vision_model("resnet20", 10, norm)
    if eight_bit:
        quantize_model(model, QuantConfig())
        model(torch.randn(4, 3, 8, 8))  # a calibrated running range, which the empty batch must leave alone
    model.train(training)
    before = copy.deepcopy(model.state_dict())
    logits = model(torch.randn(0, 3, 8, 8))
    logits.sum().backward()
    assert logits.shape == (0, 10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_whole_resnet_trains_in_8_bits_and_dequantizes_back():
    torch.manual_seed(0)
    model = build_vision_model("resnet20", 10, "range_evonorm")
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    quantize_model(model, QuantConfig())
    kinds = {type(m) for m in model.modules()}
    assert not kinds & {nn.Conv2d, RangeEvoNorm2d}, "every conv and every norm is 8-bit"
    assert sum(isinstance(m, QuantConv2d) for m in model.modules()) == 21  # stem, 9 blocks x 2, 2 shortcuts
    assert sum(isinstance(m, QuantRangeEvoNorm2d) for m in model.modules()) == 21
    assert type(model.classifier) is nn.Linear, "the head stays full precision (DEFAULT_SKIP)"
    assert all(p is params[n] for n, p in model.named_parameters()), "fp32 master weights are the float ones"

    x, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    nn.functional.cross_entropy(model(x), labels).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    opt.step()
    with torch.no_grad():
        assert not torch.allclose(model.eval()(x), reference.eval()(x), atol=1e-3)

    dequantize_model(model)
    assert not any(isinstance(m, QuantModule) for m in model.modules())
    assert {type(m) for m in model.modules()} == {type(m) for m in reference.modules()}
    assert set(model.state_dict()) == set(reference.state_dict())
    assert all(p is params[n] for n, p in model.named_parameters())
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model.eval()(x), reference.eval()(x))


@pytest.mark.skipif(not onednn_conv_available("cpu"), reason="needs a CPU with oneDNN's int8 convolution")
@pytest.mark.parametrize("kernel, batch, size", [
    ("int8", 4, 16),
    ("auto", 32, 32),  # auto at the benchmark's shape: the stem and the strided convolutions stay simulated
])
def test_8bit_resnet_passes_channels_last_from_layer_to_layer(kernel, batch, size):
    """The 8-bit net takes its images channels last, so with int8 convolutions (oneDNN, channels
    last) every 8-bit layer gets its input channels last, and in the backward pass every layer's
    output gradient and the layer gradient it returns are channels last, simulated convolutions
    included: no layout copies of float tensors between layers (an 8-bit convolution gives a
    row-major input's output back row-major, as nn.Conv2d)."""
    from lp_decentral_nlp.utils.layout import is_channels_last

    torch.manual_seed(0)
    model = quantize_model(build_vision_model("resnet20", 10, "range_evonorm"), QuantConfig(kernel=kernel))
    inputs, output_grads, layer_grads = {}, {}, {}

    def keep_grads(module, grad_input, grad_output, name):
        output_grads[name], layer_grads[name] = grad_output[0], grad_input[0]

    for name, module in model.named_modules():
        if isinstance(module, (QuantConv2d, QuantRangeEvoNorm2d)):
            module.register_forward_hook(lambda m, args, out, name=name: inputs.__setitem__(name, args[0]))
            if name != "stem.conv":  # its input (the image) needs no gradient
                module.register_full_backward_hook(lambda m, g_in, g_out, name=name: keep_grads(m, g_in, g_out, name))
    x = torch.randn(batch, 3, size, size)
    nn.functional.cross_entropy(model(x), torch.arange(batch) % 10).backward()
    assert "int8" in kernel_report(model).values()
    assert {name for name, t in inputs.items() if not is_channels_last(t)} == set()
    assert len(output_grads) == len(inputs) - 1
    for grads in (output_grads, layer_grads):
        assert {name for name, g in grads.items() if not is_channels_last(g)} == set()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_keeps_only_its_head_full_precision(arch):
    """Only the output layer: VGG-11's hidden Linear(512, 512) sat in its ``classifier`` too and
    stayed fp32."""
    model = build_vision_model(arch, 10, "range_evonorm")
    report = quantize_model(model, dry_run=True)
    assert len(report.skipped) == 1 and report.skipped[0].split(".")[0] == "classifier"
    assert model.get_submodule(report.skipped[0]).out_features == 10
    gemm_and_norms = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear, RangeEvoNorm2d))]
    assert sorted(report.quantized + report.skipped) == sorted(gemm_and_norms)


@pytest.mark.parametrize("norm, quant_norm", [("batchnorm", None), ("groupnorm", None),
                                              ("evonorm", QuantEvoNormS0), ("range_batchnorm", QuantRangeBatchNorm2d)])
def test_norm_choice_under_surgery(norm, quant_norm):
    """Sample-statistics norms get their 8-bit versions; BatchNorm/GroupNorm are fp32 baselines."""
    model = quantize_model(build_vision_model("resnet20", 10, norm))
    norms = [m for n, m in model.named_modules() if n.endswith(".norm") or ".norm." in n + "."]
    if quant_norm is None:
        assert not any(isinstance(m, QuantModule) for m in norms)
        assert any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())
    else:
        assert sum(isinstance(m, quant_norm) for m in model.modules()) == 21


def test_image_classifier_output_and_8bit_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = ImageClassifier("resnet20", 10, "range_evonorm")
    quantize_model(model)
    x, labels = torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4])
    out = model(pixel_values=x, labels=labels)
    assert out.logits.shape == (4, 10)
    assert torch.allclose(out.loss, nn.functional.cross_entropy(out.logits, labels))
    assert model(x).loss is None
    model.save_pretrained(tmp_path)
    back = ImageClassifier.from_pretrained(tmp_path)
    assert back.applied_quant_config() == model.applied_quant_config() == QuantConfig()
    assert isinstance(back.net.stem.norm, QuantRangeEvoNorm2d) and isinstance(back.net.classifier, nn.Linear)
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, back.eval()(x).logits)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty must hold vision_config.json and model.safetensors"):
        ImageClassifier.from_pretrained(tmp_path / "empty")


def test_an_image_classifier_quantized_in_part_reloads_as_it_was_saved(tmp_path):
    """Its stem stayed float: the reload quantized every layer (the saved QuantConfig's), and the
    stem's float state loaded into an 8-bit layer as uncalibrated, silently."""
    import json

    torch.manual_seed(0)
    model = ImageClassifier("resnet20", 10, "range_evonorm")
    quantize_model(model.net.stages)
    model.train()(torch.randn(4, 3, 8, 8))
    model.save_pretrained(tmp_path / "part")
    back = ImageClassifier.from_pretrained(tmp_path / "part")
    assert type(back.net.stem.conv) is nn.Conv2d and isinstance(back.net.stages[0][0].conv1.conv, QuantModule)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, back(x).logits)
    # a folder written before the 8-bit layers were named: refused, not loaded wrong
    config = json.loads((tmp_path / "part" / "vision_config.json").read_text())
    del config["quantized_layers"]
    (tmp_path / "part" / "vision_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers \['net.stem.conv', .*\] were saved float but its quant_config "
                                         "makes them 8-bit"):
        ImageClassifier.from_pretrained(tmp_path / "part")
    # layers of two QuantConfigs: one is recorded, so saving is refused
    mixed = ImageClassifier("resnet20", 10, "range_evonorm")
    quantize_model(mixed.net.stages, QuantConfig(kernel="simulated"))
    quantize_model(mixed.net.stem, QuantConfig())
    with pytest.raises(ValueError, match="made with different QuantConfigs"):
        mixed.save_pretrained(tmp_path / "mixed")


def test_an_image_classifier_folder_or_preprocessing_it_cannot_use_is_one_value_error(tmp_path):
    """They were a JSONDecodeError naming no file, an __init__ TypeError, torch's size-mismatch dump,
    and a preprocessing that failed only when saved, after its folder was made."""
    import json

    ImageClassifier("resnet20", 10, "evonorm").save_pretrained(tmp_path / "m")
    config = tmp_path / "m" / "vision_config.json"
    saved = json.loads(config.read_text())
    for content, message in (("{not json", r"vision_config.json is not JSON"),
                             (json.dumps({**saved, "colour": "red"}), r"is not an ImageClassifier's config: expected"),
                             (json.dumps({**saved, "num_classes": 3}), r"model.safetensors does not fit its "
                                                                       r"vision_config.json \(Error\(s\) in loading")):
        config.write_text(content)
        with pytest.raises(ValueError, match=message):
            ImageClassifier.from_pretrained(tmp_path / "m")
    good = {"labels": ["a", "b"], "image_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3}
    ImageClassifier("resnet20", 2, "evonorm", preprocessing=good)
    for bad in ({**good, "image_size": "big"}, {**good, "mean": torch.zeros(3)}, {**good, "std": [0.2, 0.2, 0.0]},
                {"labels": ["a"]}):
        with pytest.raises(ValueError, match=r"^preprocessing must be None or \{'labels'"):
            ImageClassifier("resnet20", 2, "evonorm", preprocessing=bad)


def test_float_image_classifier_saves_no_quant_config(tmp_path):
    model = ImageClassifier("resnet20", 10, "evonorm")
    model.save_pretrained(tmp_path)
    back = ImageClassifier.from_pretrained(tmp_path)
    assert back.applied_quant_config() is None and back.vision_config == model.vision_config
    assert isinstance(back.net.classifier, nn.Linear) and not isinstance(back.net.classifier, QuantLinear)


def test_a_reloaded_image_classifier_predicts_pil_images_with_its_own_preprocessing(tmp_path):
    """The saved preprocessing had no use but by hand (VisionTransform wanted a label per image)."""
    from PIL import Image

    from lp_decentral_nlp.vision import VisionTransform

    torch.manual_seed(0)
    spec = {"labels": ["cat", "dog", "owl"], "image_size": 8, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]}
    model = ImageClassifier("resnet20", 3, "range_evonorm", preprocessing=spec)
    quantize_model(model)
    model.train()(torch.randn(4, 3, 8, 8))
    images = [Image.new("RGB", (12, 9), (40 * i, 200 - 30 * i, 90)) for i in range(5)]
    expected = VisionTransform(8, spec["mean"], spec["std"], train=False)(
        {"image": images, "label": [0] * 5})["pixel_values"]
    assert torch.equal(model.preprocess(images), expected)
    with torch.no_grad():
        names = [spec["labels"][i] for i in model.eval()(expected).logits.argmax(-1).tolist()]
    model.train()
    assert model.predict(images) == names and model.training  # its mode is restored
    model.save_pretrained(tmp_path)
    assert ImageClassifier.from_pretrained(tmp_path).predict(images) == names
    with pytest.raises(ValueError, match="records no preprocessing"):
        ImageClassifier("resnet20", 3, "evonorm").predict(images)


def test_load_quantized_of_an_image_classifier_folder_names_the_loader_to_use(tmp_path):
    """A vision recipe's model folder given to load_quantized (the README's loader of the NLP
    models) was transformers' 'Unrecognized model ... should have a model_type key'."""
    from lp_decentral_nlp import load_quantized

    quantize_model(ImageClassifier("resnet20", 2, "range_evonorm")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^{tmp_path} has no config.json: it is not a transformers model's "
                                         r"save_pretrained folder \(a vision recipe's model folder loads with "
                                         r"lp_decentral_nlp.vision.ImageClassifier.from_pretrained\)$"):
        load_quantized(tmp_path)


def test_predict_turns_a_phone_photo_upright_as_training_read_it(tmp_path):
    """A JPEG whose EXIF orientation tag says "rotate" (a phone photo) was trained upright (the
    datasets.Image decoder turns it) and predicted on its stored pixels, sideways."""
    import datasets
    import numpy as np
    from PIL import Image

    from lp_decentral_nlp.vision import VisionTransform

    stored = np.zeros((16, 32, 3), dtype=np.uint8)
    stored[:, :16] = (250, 30, 30)  # left half red, right half blue: the rotation shows in the crop
    stored[:, 16:] = (30, 30, 250)
    exif = Image.Image.getexif(Image.new("RGB", (1, 1)))
    exif[Image.ExifTags.Base.Orientation] = 6  # stored turned 90 degrees: show it rotated clockwise
    Image.fromarray(stored).save(tmp_path / "photo.jpg", exif=exif, quality=95)
    spec = {"labels": ["a", "b"], "image_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3}
    model = ImageClassifier("resnet20", 2, "evonorm", preprocessing=spec)
    trained = datasets.Dataset.from_dict({"image": [str(tmp_path / "photo.jpg")]}).cast_column("image", datasets.Image())
    expected = VisionTransform(8, spec["mean"], spec["std"], train=False)(
        {"image": [trained[0]["image"]], "label": [0]})["pixel_values"]
    photo = Image.open(tmp_path / "photo.jpg")
    assert torch.equal(model.preprocess([photo]), expected)
    assert photo.size == (32, 16)  # the image given is left as it was
    sideways = VisionTransform(8, spec["mean"], spec["std"], train=False)({"image": [photo], "label": [0]})
    assert not torch.equal(sideways["pixel_values"], expected)  # the tag matters for this image


def test_predict_refuses_what_it_cannot_convert_without_loss():
    """A 16-bit image became all white (dark and bright alike) and got a class; a path, an array or
    no image at all were AttributeErrors and torch's stack error; more classes than label names
    was an IndexError at the first prediction of the missing one."""
    import numpy as np
    from PIL import Image

    spec = {"labels": ["a", "b", "c"], "image_size": 8, "mean": [0.0] * 3, "std": [1.0] * 3}
    model = ImageClassifier("resnet20", 3, "evonorm", preprocessing=spec)
    dark = Image.fromarray(np.full((8, 8), 1000, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"^images\[1\]: a 16-bit image \(PIL mode I;16\): the transforms take 8-bit "
                                         r"images and would clip its values; convert it to 8 bits"):
        model.predict([Image.new("RGB", (8, 8)), dark])
    for bad, error, message in ((["img.png"], TypeError, r"^images\[0\] is a str: PIL images expected"),
                                ([np.zeros((8, 8, 3))], TypeError, r"^images\[0\] is a ndarray: PIL images expected"),
                                ([], ValueError, r"^images is empty")):
        with pytest.raises(error, match=message):
            model.predict(bad)
    assert len(model.predict(Image.new("L", (9, 12)))) == 1  # one image alone, any 8-bit mode
    with pytest.raises(ValueError, match=r"^preprocessing\['labels'\] names 2 classes and num_classes=3: give one "
                                         r"name per class$"):
        ImageClassifier("resnet20", 3, "evonorm", preprocessing={**spec, "labels": ["a", "b"]})


@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_keeps_a_nan_input_where_the_float_norm_does(kind):
    """A NaN became the lowest code of the running range: an 8-bit norm in evaluation gave finite
    outputs for it, hiding a NaN from the convolution before it. Now the outputs that depend on it
    are NaN, exactly those the float norm makes NaN (a group's, or the element's own)."""
    f, q, x = make_norm(kind)
    q(x)  # calibrated
    q.eval(), f.eval()
    with torch.no_grad():
        clean = q(x)
        x[1, 2, 3, 4] = float("nan")
        out = q(x)
        expected = f(x).isnan()
    assert expected.any() and not expected.all()
    assert torch.equal(out.isnan(), expected)
    assert torch.equal(out[~expected], clean[~expected])


def test_an_8bit_resnet_in_evaluation_gives_nan_logits_for_a_nan_image():
    torch.manual_seed(0)
    model = quantize_model(build_vision_model("resnet20", 10, "range_evonorm"), QuantConfig())
    x = torch.randn(4, 3, 8, 8)
    model(x)
    x[2, 0, 4, 4] = float("nan")
    with torch.no_grad():
        logits = model.eval()(x)
    assert logits[2].isnan().all() and torch.isfinite(logits[[0, 1, 3]]).all()
