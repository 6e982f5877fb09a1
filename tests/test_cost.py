"""Hardware cost model (SPEC 7): exact counts on hand-countable models, the walk on real models."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lp_decentral_nlp.cost import ENERGY_PJ, estimate_cost, format_comparison
from lp_decentral_nlp.quant import QuantConfig, saved_tensor_bytes

FP, I8 = ENERGY_PJ["fp32"], ENERGY_PJ["int8"]


def layer(report, name):
    return next(l for l in report.layers if l.name == name)


# -- a single linear layer ---------------------------------------------------------------------
# Sequential(Linear(3, 2)), batch 4: MACs = 4 samples * 2 outputs * 3 inputs = 24, bias adds = 8.


def linear_model():
    return nn.Sequential(nn.Linear(3, 2))


def test_single_linear_fp32_exact():
    r = estimate_cost(linear_model(), (3,), 4, "fp32", optimizer="momentum")
    assert r.walk_device == "meta" and r.uncounted_ops == {}
    assert r.weight_grad_gemm is None  # no quantized layer, no 8-bit weight-gradient GEMM
    # training: the forward, the weight-gradient GEMM and the bias gradient (2x its adds); the
    # input is data, so backward computes no input gradient (SPEC 7's third GEMM)
    assert r.adds == (32 + 24 + 16, 32) and r.mults == (2 * 24, 24)  # (train, inference)
    assert r.inference_energy_mj == pytest.approx((32 * FP["add"] + 24 * FP["mult"]) * 1e-9)
    assert r.train_energy_mj == pytest.approx((72 * FP["add"] + 48 * FP["mult"]) * 1e-9)
    fc = layer(r, "0")
    assert (fc.kind, fc.precision, fc.forward_macs) == ("Linear", "fp32", 24)
    # weights 8 floats = 32 B, gradients 32 B, momentum 32 B, saved input 4*3 floats = 48 B
    assert r.memory_breakdown_mb["train"] == pytest.approx(
        {"weights": 32e-6, "gradients": 32e-6, "optimizer": 32e-6, "activations": 48e-6})
    # inference: weights + peak live activations (input 48 B + output 4*2 floats 32 B)
    assert r.memory_breakdown_mb["inference"] == pytest.approx({"weights": 32e-6, "activations": 80e-6})
    assert r.train_memory_mb == pytest.approx(144e-6) and r.inference_memory_mb == pytest.approx(112e-6)


def test_single_linear_int8_exact():
    r = estimate_cost(linear_model(), (3,), 4, "int8", optimizer="adam", weight_grad_gemm="int8")
    fc = layer(r, "0")
    assert fc.precision == "int8" and r.quantized_mac_share == 1.0 and r.weight_grad_gemm == "int8"
    # inference: int8 GEMM; fp32: bias 8 adds, quantize 12 inputs with the running range
    # (shift, round, 2 clamps = 4 adds + 1 mult each), rescale 8 outputs (1 add + 1 mult each)
    assert (fc.inference.int8_adds, fc.inference.int8_mults) == (24, 24)
    assert (fc.inference.fp32_adds, fc.inference.fp32_mults) == (8 + 48 + 8, 12 + 8)
    # training: 2 int8 GEMMs (forward, weight gradient; the input is data: no input gradient);
    # fp32: 3x bias (24 adds), input 12 (range search 2, shift, round, clamp 2 = 6 adds + 1 mult),
    # weights 6 (4 adds + 1 mult), forward output rescale 8 (1+1), weight-gradient rescale 6
    assert (fc.train.int8_adds, fc.train.int8_mults) == (48, 48)
    assert fc.train.fp32_adds == 24 + 72 + 24 + 8 + 6
    assert fc.train.fp32_mults == 12 + 6 + 8 + 6
    assert r.train_energy_mj == pytest.approx(
        (134 * FP["add"] + 32 * FP["mult"] + 48 * I8["add"] + 48 * I8["mult"]) * 1e-9)
    # 8-bit weight (6 B) + fp32 bias (8 B); gradients alike; Adam: 2 states; input saved as 12
    # 8-bit codes + a fp32 scale and offset (8 B)
    assert r.memory_breakdown_mb["train"] == pytest.approx(
        {"weights": 14e-6, "gradients": 14e-6, "optimizer": 28e-6, "activations": 20e-6})
    assert (r.convention, r.memory_unit) == ("ours", "MB")
    assert r.memory_breakdown_mb["inference"] == pytest.approx({"weights": 14e-6, "activations": 80e-6})


def test_the_weight_gradient_gemm_is_priced_fp32_as_our_training_runs_it():
    """Convention "ours" prices int8 only what our training runs in 8 bits (SPEC 7), but priced the
    weight-gradient GEMM, an fp32 GEMM of the codes and the full-precision output gradient (SPEC
    4), int8 by default: ResNet-20's 8-bit training read 11.6x less energy than fp32 instead of 2.5x."""
    r = estimate_cost(linear_model(), (3,), 4, "int8")
    fc = layer(r, "0")
    assert r.weight_grad_gemm == "fp32" and "8-bit weight-gradient GEMM priced fp32" in str(r)
    assert (fc.train.int8_adds, fc.train.int8_mults) == (24, 24)
    # one GEMM moves to fp32, and its output needs no rescaling (6 weights)
    assert (fc.train.fp32_adds, fc.train.fp32_mults) == (134 - 6 + 24, 32 - 6 + 24)
    assert estimate_cost(linear_model(), (3,), 4, "int8", convention="paper").weight_grad_gemm == "int8"


def test_single_linear_paper_convention_exact():
    """The paper's convention (SPEC 7, Table 10): every op of the 8-bit model int8, counted by SPEC
    7's formula (three GEMMs per layer, the first layer's too), inference memory = the weights
    alone, memory in MiB."""
    ours = estimate_cost(linear_model(), (3,), 4, "int8", optimizer="adam", weight_grad_gemm="int8")
    r = estimate_cost(linear_model(), (3,), 4, "int8", optimizer="adam", convention="paper")
    fc = layer(r, "0")
    assert (fc.train.fp32_adds, fc.train.fp32_mults) == (0, 0)
    # ours' int8 + fp32 ops, with the input-gradient GEMM (24), its output gradient's quantization
    # (8 with stochastic rounding: 5 adds + 1 mult) and its output's rescaling (12: 1 + 1)
    assert (fc.train.int8_adds, fc.train.int8_mults) == (48 + 24 + 134 + 40 + 12, 48 + 24 + 32 + 8 + 12)
    assert (fc.inference.fp32_adds, fc.inference.int8_adds, fc.inference.int8_mults) == (0, 24 + 64, 24 + 20)
    assert r.adds.inference == ours.adds.inference and r.mults.inference == ours.mults.inference
    assert r.train_energy_mj == pytest.approx((258 * I8["add"] + 124 * I8["mult"]) * 1e-9)
    mib = 2**20
    # inference: the 8 parameters at 1 byte, no activations; training counted as in ours
    assert r.memory_breakdown_mb["inference"] == pytest.approx({"weights": 8 / mib})
    assert r.memory_breakdown_mb["train"] == pytest.approx(
        {k: v * 1e6 / mib for k, v in ours.memory_breakdown_mb["train"].items()})
    assert (r.convention, r.memory_unit) == ("paper", "MiB")
    assert r.to_dict()["convention"] == "paper" and r.to_dict()["memory_unit"] == "MiB"
    assert "convention paper" in str(r) and "inference memory (MiB)" in str(r) and "peak activations" not in str(r)
    assert "convention ours" in str(ours) and "inference memory (MB)" in str(ours)
    fp32 = estimate_cost(linear_model(), (3,), 4, "fp32", optimizer="adam", convention="paper")
    assert fp32.train_energy_mj == pytest.approx((96 * FP["add"] + 72 * FP["mult"]) * 1e-9)  # 3x the forward
    assert fp32.memory_breakdown_mb["inference"] == pytest.approx({"weights": 32 / mib})
    with pytest.raises(ValueError, match="share one convention"):
        format_comparison({"fp32": fp32, "int8": ours})


def test_paper_convention_reproduces_table_10():
    """ResNet-20 (CIFAR-10, batch 32): 19.9x less training energy (this gives 19.74x: the 8-bit
    norms' quantization arithmetic is priced too); inference memory 1.04 MB fp32 vs 0.26 MB 8-bit;
    VGG-11: 36.22 vs 9.01 MB (the paper's MB are MiB)."""
    vision = pytest.importorskip("lp_decentral_nlp.vision")

    def pair(arch, batch_size):
        return (estimate_cost(vision.build_vision_model(arch, 10, "evonorm"), (3, 32, 32), batch_size, "fp32",
                              convention="paper"),
                estimate_cost(vision.build_vision_model(arch, 10, "range_evonorm"), (3, 32, 32), batch_size,
                              "int8", convention="paper"))

    fp32, int8 = pair("resnet20", 32)
    assert fp32.train_energy_mj / int8.train_energy_mj == pytest.approx(19.9, rel=0.01)
    assert fp32.inference_memory_mb == pytest.approx(1.04, rel=0.05)
    assert int8.inference_memory_mb == pytest.approx(0.26, rel=0.05)
    fp32, int8 = pair("vgg11", 2)
    assert fp32.inference_memory_mb == pytest.approx(36.22, rel=0.05)
    assert int8.inference_memory_mb == pytest.approx(9.01, rel=0.05)


# -- a single convolution ----------------------------------------------------------------------


def test_single_conv_exact():
    # Conv2d(2 -> 3, 3x3, pad 1), batch 2, 5x5: 2*3*5*5 = 150 outputs, 2*9 MACs each
    r = estimate_cost(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False)), (2, 5, 5), 2)
    assert layer(r, "0").forward_macs == 2700
    # training: the forward and the weight-gradient GEMM (the input is data: no input gradient)
    assert r.adds == (5400, 2700) and r.mults == (5400, 2700)


def test_grouped_strided_conv_with_bias_exact():
    # Conv2d(4 -> 4, 3x3, stride 2, pad 1, groups 2) on 6x6: 4*3*3 = 36 outputs, (4/2)*9 MACs each
    r = estimate_cost(nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=2)), (4, 6, 6), 1)
    assert layer(r, "0").forward_macs == 648
    # training: forward, weight-gradient GEMM and the bias gradient (2x its adds); no input gradient
    assert r.adds == (2 * 648 + 3 * 36, 648 + 36) and r.mults == (2 * 648, 648)


# -- linear + residual addition ------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.fc(x) + x


def test_linear_residual_add_exact():
    r = estimate_cost(Residual(), (4,), 2, "int8")
    fc, skip = layer(r, "fc"), layer(r, "(model)")
    assert fc.forward_macs == 32 and fc.precision == "int8"
    # the skip addition: 8 fp32 adds booked on the model that runs it, 3x in training
    assert skip.precision == "fp32" and skip.inference.adds == 8 and skip.train.fp32_adds == 24
    assert skip.train.mults == 0 and skip.saved_activation_bytes == 0
    f32 = estimate_cost(Residual(), (4,), 2, "fp32")
    # fc: forward and weight gradient (its input is data); the skip addition 3x
    assert f32.adds == (2 * 32 + 3 * 8, 40) and f32.mults == (2 * 32, 32)
    # fp32: fc saves its input (8 floats); inference peak = input, fc output and sum live together
    assert f32.memory_breakdown_mb["train"]["activations"] == pytest.approx(32e-6)
    assert f32.memory_breakdown_mb["inference"]["activations"] == pytest.approx(96e-6)
    # 8-bit: fc saves its input as 8 codes + a fp32 scale and offset
    assert r.memory_breakdown_mb["train"]["activations"] == pytest.approx(16e-6)


# -- op rules of norms, softmax, pooling -----------------------------------------------------------


class NormSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return F.softmax(self.ln(x), dim=-1)


def test_layer_norm_and_softmax_exact():
    r = estimate_cost(NormSoftmax(), (8,), 2)
    ln, top = layer(r, "ln"), layer(r, "(model)")
    # n = 16 elements in 2 rows: 3n + rows adds + n (bias); 2n + 3 rows mults + n (weight)
    assert (ln.inference.adds, ln.inference.mults) == (66, 54)
    # softmax per element: max, subtract, sum (3 adds); exp, divide (2 mults)
    assert (top.inference.adds, top.inference.mults) == (48, 32)
    assert r.adds.train == 3 * r.adds.inference


@pytest.mark.parametrize(
    "pool, shape, adds, mults",
    [
        (nn.AvgPool2d(2), (1, 4, 4), 4 * 4, 4),  # 4 windows of 4
        (nn.MaxPool2d(2), (1, 4, 4), 4 * 4, 0),  # comparisons priced as adds
        # 5 -> 2 adaptive windows [0, 3) and [2, 5): 3 + 3 per dimension, 36 per map
        (nn.AdaptiveAvgPool2d((2, 2)), (1, 5, 5), 36, 4),
        (nn.AdaptiveAvgPool2d(1), (2, 3, 3), 2 * 9, 2),  # global average: a mean over 9
    ],
)
def test_pooling_exact(pool, shape, adds, mults):
    r = estimate_cost(nn.Sequential(pool), shape, 1)
    assert (r.adds.inference, r.mults.inference) == (adds, mults)
    assert r.uncounted_ops == {}


def test_batch_norm_train_uses_batch_statistics_inference_the_running_ones():
    model = nn.Sequential(nn.BatchNorm2d(3))
    before = copy.deepcopy(model.state_dict())
    r = estimate_cost(model, (3, 2, 2), 2)
    n, c = 24, 3
    # train: n elements, c statistics, affine, 3x; + 1 add, once: num_batches_tracked += 1 (no gradient)
    assert r.adds.train == 3 * (3 * n + c + n) + 1 and r.mults.train == 3 * (2 * n + 3 * c + n)
    assert (r.adds.inference, r.mults.inference) == (n + 2 * c, n + 3 * c)
    # the model is untouched: running statistics and mode
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training


def test_vision_norm_layers_from_their_equations():
    norms = pytest.importorskip("lp_decentral_nlp.vision.norms")
    n, units = 2 * 4 * 3 * 3, 2 * 2  # batch 2, 4 channels 3x3; 2 groups per sample
    cases = [
        # Range EvoNorm with hsig: 6n + 2 per unit adds, 5n + 2 per unit mults
        (norms.RangeEvoNorm2d(4, groups=2), (6 * n + 2 * units, 5 * n + 2 * units), None),
        # EvoNorm-S0 without the sigmoid factor: 4n + unit adds, 3n + 3 per unit mults
        (norms.EvoNormS0(4, groups=2, apply_act=False), (4 * n + units, 3 * n + 3 * units), None),
        # Range BN: batch statistics in training, one scale and shift per channel at inference
        (norms.RangeBatchNorm2d(4), (5 * n + 8, 2 * n + 12), (n + 8, n + 12)),
    ]
    for module, train_forward, inference in cases:
        r = estimate_cost(nn.Sequential(module), (4, 3, 3), 2)
        assert r.adds.train == 3 * train_forward[0] and r.mults.train == 3 * train_forward[1]
        assert (r.adds.inference, r.mults.inference) == (inference or train_forward)
        assert layer(r, "0").kind == type(module).__name__


def test_an_8bit_norm_prices_its_quantization_and_stores_its_parameters_at_8_bits():
    """An 8-bit norm layer's quantization (input, parameters, layer gradient) was priced nowhere:
    its row was labelled int8 but cost exactly the fp32 row, and only its weight counted 8 bits,
    though it quantizes its bias and v too."""
    norms = pytest.importorskip("lp_decentral_nlp.vision.norms")
    from lp_decentral_nlp.cost.ops import dequantize, quantize

    model = nn.Sequential(norms.RangeEvoNorm2d(4, groups=2))
    fp32, int8 = (estimate_cost(model, (4, 3, 3), 2, precision) for precision in ("fp32", "int8"))
    n, params = 2 * 4 * 3 * 3, 3 * 4  # input elements; weight, bias and v
    quant_train = (quantize(n, True, True, False) + dequantize(n) + quantize(params, True, False, False)
                   + dequantize(params) + quantize(n, True, False, True) + dequantize(n))
    quant_inference = quantize(n, False, True, False) + dequantize(n)
    assert layer(int8, "0").precision == "int8"
    for ops, quant in (("train", quant_train), ("inference", quant_inference)):
        got, float_row = getattr(layer(int8, "0"), ops), getattr(layer(fp32, "0"), ops)
        assert (got.fp32_adds, got.fp32_mults) == (float_row.fp32_adds + quant.adds, float_row.fp32_mults + quant.mults)
        assert got.int8_adds == got.int8_mults == 0
    assert int8.memory_breakdown_mb["train"]["weights"] * 1e6 == pytest.approx(params)  # one byte each


# -- real models --------------------------------------------------------------------------------


def tiny_bert(num_labels=3):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                     vocab_size=100, num_labels=num_labels)
    return BertForSequenceClassification(cfg)


def test_transformer_attention_matmuls_and_quantized_share():
    model = tiny_bert()
    b, seq, hidden = 2, 8, 32
    r = estimate_cost(model, (seq,), b, "int8")
    assert r.walk_device == "meta" and r.uncounted_ops == {}
    attention = [l for l in r.layers if l.kind == "BertSelfAttention"]
    # scores Q K^T and probabilities x V: 2 * b * seq^2 * hidden MACs per layer, kept fp32
    assert [l.forward_macs for l in attention] == [2 * b * seq * seq * hidden] * 2
    assert all(l.precision == "fp32" and l.train.int8_adds == 0 for l in attention)
    linears = {l.name: l for l in r.layers if l.kind == "Linear"}
    assert linears["classifier"].precision == "fp32"  # the head stays full precision (SPEC 4)
    assert {n for n, l in linears.items() if l.precision == "int8"} == set(linears) - {"classifier"}
    total = sum(l.forward_macs for l in r.layers)
    quantized = sum(l.forward_macs for l in linears.values() if l.precision == "int8")
    assert r.quantized_mac_share == pytest.approx(quantized / total)
    assert linears["bert.encoder.layer.0.intermediate.dense"].forward_macs == b * seq * hidden * 64


@pytest.mark.parametrize("config", [None, QuantConfig(embeddings=True)], ids=["default", "8-bit embeddings"])
def test_quantized_model_priced_like_its_float_plan(config):
    """8-bit embeddings had two prices: the plan priced nothing for their quantization and the
    quantized model its ops (7% apart in training energy), and both counted their saved int64 ids
    as 8-bit codes."""
    from lp_decentral_nlp.quant import quantize_model

    model = tiny_bert()
    planned = estimate_cost(model, (8,), 2, "int8", quant_config=config)
    quantized = quantize_model(copy.deepcopy(model), config)
    own = estimate_cost(quantized, (8,), 2, "int8")
    # the 8-bit layers' own simulated quantization ops are not counted on top of the model's
    strip_kind = lambda d: {**d, "layers": [{**l, "kind": None} for l in d["layers"]]}  # noqa: E731
    assert strip_kind(own.to_dict()) == strip_kind(planned.to_dict())
    assert layer(own, "bert.pooler.dense").kind == "QuantLinear"
    table = layer(own, "bert.embeddings.word_embeddings")
    assert table.saved_activation_bytes == 2 * 8 * 8, "its int64 ids, whatever its precision"
    if config is not None:  # the table's range (2 per entry), the rows' quantization (5 adds, 2 mults each)
        entries, rows = quantized.bert.embeddings.word_embeddings.weight.numel(), 2 * 8 * quantized.config.hidden_size
        assert table.precision == "int8" and table.inference.fp32_adds == 2 * entries + 5 * rows
        assert table.inference.fp32_mults == 2 * rows
    with pytest.raises(ValueError, match="already quantized"):
        estimate_cost(quantized, (8,), 2, "int8", quant_config=QuantConfig())
    # the default precision priced the 8-bit layers as float layers, with quantized_mac_share 0
    with pytest.raises(ValueError, match=r"^precision='fp32' prices every layer in fp32, and the model has \d+ 8-bit "
                                         r"layers \(quantize_model\): use precision='int8'"):
        estimate_cost(quantized, (8,), 2)
    skip_pooler = estimate_cost(model, (8,), 2, "int8", quant_config=QuantConfig(skip=("classifier", "pooler")))
    assert layer(skip_pooler, "bert.pooler.dense").precision == "fp32"


def test_the_traced_batch_holds_no_padding_token():
    """The traced rows were zeros ending in the end-of-sequence token: a DeBERTa's padding token 0,
    and a GPT-2's padding with its end-of-sequence token, so transformers warned that no attention
    mask hid the padding of rows that were not padded."""
    from transformers import (DebertaV2Config, DebertaV2ForSequenceClassification, GPT2Config,
                              GPT2ForSequenceClassification)

    for model in (DebertaV2ForSequenceClassification(DebertaV2Config(
                      vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      pad_token_id=0, eos_token_id=2)),
                  GPT2ForSequenceClassification(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2,
                                                           pad_token_id=5, eos_token_id=5))):
        traced = []
        model.register_forward_pre_hook(lambda module, args, kwargs: traced.append(kwargs["input_ids"]),
                                        with_kwargs=True)
        report = estimate_cost(model, (8,), 2)
        assert report.walk_device == "cpu"  # values were read: a real run, whose inputs can be checked
        real = [ids for ids in traced if ids.device.type == "cpu"]
        assert real and not any((ids == model.config.pad_token_id).any() for ids in real)


def test_gpt2_needs_real_values_and_falls_back_to_a_real_run():
    from transformers import GPT2Config, GPT2ForSequenceClassification

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, num_labels=2, pad_token_id=0,
                     bos_token_id=1, eos_token_id=1)
    model = GPT2ForSequenceClassification(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(1)
    r = estimate_cost(model, (8,), 2, "int8")
    drawn_after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(drawn_after, torch.rand(3)), "the real run's dropout moved a seeded run's random stream"
    assert r.walk_device == "cpu" and r.uncounted_ops == {}
    # HF Conv1D (weight (nx, nf)): c_attn maps 32 -> 96 on 2*8 tokens
    assert layer(r, "transformer.h.0.attn.c_attn").forward_macs == 16 * 96 * 32
    assert layer(r, "transformer.h.0.attn.c_attn").precision == "int8"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_resnet20_macs_match_torch_flop_counter():
    vision = pytest.importorskip("lp_decentral_nlp.vision")
    from torch.utils.flop_counter import FlopCounterMode

    model = vision.build_vision_model("resnet20", 10, "range_evonorm")
    r = estimate_cost(model, (3, 32, 32), 2, "int8")
    assert r.uncounted_ops == {} and r.walk_device == "meta"
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.eval()(torch.zeros(2, 3, 32, 32))
    assert sum(l.forward_macs for l in r.layers) == counter.get_total_flops() // 2
    kinds = {l.kind for l in r.layers}
    assert {"Conv2d", "Linear", "RangeEvoNorm2d", "BasicBlock", "AdaptiveAvgPool2d"} <= kinds
    assert {l.precision for l in r.layers if l.kind == "Conv2d"} == {"int8"}
    totals = sum((l.train for l in r.layers[1:]), r.layers[0].train)
    assert r.train_energy_mj == pytest.approx(totals.energy_pj * 1e-9)


def test_to_dict_is_json():
    r = estimate_cost(Residual(), (4,), 2, "int8")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["adds"] == {"train": r.adds.train, "inference": r.adds.inference}
    assert d["precision"] == "int8" and d["input_shape"] == [4] and d["communication"] is None
    assert [row["name"] for row in d["layers"]] == [l.name for l in r.layers]
    assert "train energy (mJ)" in str(r)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "int4"}, "precision must be one of"),
        ({"optimizer": "adamw"}, "optimizer must be one of"),
        ({"weight_grad_gemm": "bf16"}, "weight_grad_gemm must be one of"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"input_shape": (4, 0)}, "input_shape must be"),
        ({"input_shape": 4}, r"^input_shape must be a non-empty tuple of positive ints, got 4"),
        ({"quant_config": QuantConfig()}, r"^quant_config selects the 8-bit layers of precision='int8'"),
        ({"samples_per_node": 100}, "needs gossip="),
        ({"convention": "table10"}, "convention must be one of"),
        ({"convention": "paper", "weight_grad_gemm": "fp32"}, "weight_grad_gemm='fp32' needs convention='ours'"),
        ({"precision": "fp32", "weight_grad_gemm": "int8"}, r"^weight_grad_gemm='int8' prices the weight-gradient GEMM "
                                                            r"of the 8-bit layers, and precision='fp32' has none"),
        # a torch optimizer's repr spans lines, so the message did too
        # priced fp32 with half the memory, and the report said fp32
        ({"model": Residual().to(torch.bfloat16)}, r"^the cost model prices fp32 training .*; parameter '[a-z0-9.]+' is "
                                                   r"torch.bfloat16: call model.float\(\) first$"),
        ({"optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)},
         r"^optimizer must be one of \('sgd', 'momentum', 'adam', 'sgd_qgm', 'adam_qgm'\), got SGD$"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"model": Residual(), "input_shape": (4,), "batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_cost(**args)


def test_only_8bit_layers_are_priced():
    """SPEC 7 has int8 energies only: a 4-bit config was priced as 8-bit, silently."""
    message = r"computes at bits=4, grad_bits=8; the cost model prices 8-bit layers only"
    with pytest.raises(ValueError, match="^quant_config " + message):
        estimate_cost(linear_model(), (3,), 4, "int8", quant_config=QuantConfig(bits=4, skip=()))
    from lp_decentral_nlp import quantize_model

    with pytest.raises(ValueError, match="^layer '0' " + message):
        estimate_cost(quantize_model(linear_model(), QuantConfig(bits=4, skip=())), (3,), 4, "int8")


@pytest.mark.parametrize("settings, optimizer_cls_and_kwargs, expected", [
    (dict(optim="sgd"), None, "sgd"),  # transformers' SGD has no momentum unless optim_args give one
    (dict(optim="sgd", optim_args="momentum=0.9,nesterov=True"), None, "momentum"),
    (dict(optim="sgd", qgm=True), None, "sgd_qgm"),
    (dict(optim="adamw_torch"), None, "adam"),
    (dict(optim="adamw_torch", qgm=True), None, "adam_qgm"),
    (dict(optim="adafactor"), None, "adam"),  # other optimizers: priced as Adam
    (dict(optim="adamw_torch"), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "momentum"),
])
def test_a_runs_optimizer_is_priced_by_the_state_it_keeps(tmp_path, settings, optimizer_cls_and_kwargs, expected):
    from lp_decentral_nlp.cost import OPTIMIZER_STATES
    from lp_decentral_nlp.trainer import DecentralizedTrainingArguments, cost_optimizer

    args = DecentralizedTrainingArguments(output_dir=str(tmp_path), report_to="none", **settings)
    assert cost_optimizer(args, linear_model(), optimizer_cls_and_kwargs) == expected
    assert expected in OPTIMIZER_STATES


def test_an_optimizer_priced_as_adam_says_so(tmp_path, caplog):
    """Adafactor's state was priced as Adam's (35x more) in every cost report, with no word."""
    from lp_decentral_nlp.trainer import DecentralizedTrainingArguments, cost_optimizer

    for optim, warned in (("adafactor", True), ("adamw_torch", False)):
        caplog.clear()
        args = DecentralizedTrainingArguments(output_dir=str(tmp_path), report_to="none", optim=optim)
        with caplog.at_level("WARNING"):
            assert cost_optimizer(args, linear_model(), warn=True) == "adam"
        assert ("cost report: Adafactor keeps its own state per parameter, which the cost model prices as Adam's"
                in caplog.text) is warned


def test_token_model_needs_a_sequence_length():
    with pytest.raises(ValueError, match=r"\(seq_len,\)"):
        estimate_cost(tiny_bert(), (3, 8), 2)


def test_an_encoder_decoder_is_priced_with_a_decoder_of_the_same_length():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                             decoder_start_token_id=0))
    layers = {layer.name for layer in estimate_cost(t5, (8,), 2, "int8").layers}
    assert any(name.startswith("encoder.") for name in layers) and any(name.startswith("decoder.") for name in layers)


def test_encoder_decoder_classifiers_get_an_end_of_sequence_token():
    """BART's and T5's classification heads read the state at the end-of-sequence token and refused
    the all-zero ids ("Each example must contain at least one <eos> token"), an error that then
    blamed input_shape."""
    from transformers import BartConfig, BartForSequenceClassification, T5Config, T5ForSequenceClassification

    bart = BartForSequenceClassification(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, num_labels=3))
    t5 = T5ForSequenceClassification(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                              num_decoder_layers=1, num_heads=2, num_labels=3))
    for model in (bart, t5):
        report = estimate_cost(model, (16,), 2, "int8")
        assert report.uncounted_ops == {} and report.train_energy_mj > 0
        assert any(layer.name.endswith("out_proj") for layer in report.layers)  # the head was walked


def test_an_input_shape_the_model_cannot_take_is_named():
    with pytest.raises(ValueError, match=r"^input_shape=\(4096,\) exceeds the model's 512 positions"):
        estimate_cost(tiny_bert(), (4096,), 2)
    with pytest.raises(ValueError, match=r"^the model's forward fails on a batch of shape \(2, 5\) \(RuntimeError: .*\): "
                                         r"is input_shape=\(5,\) one sample's shape for this model\?"):
        estimate_cost(linear_model(), (5,), 2)  # Linear(3, 2)
    with pytest.raises(ValueError, match="^reports must hold at least one CostReport, got none"):
        format_comparison({})


def test_a_token_model_without_get_input_embeddings_is_told_what_the_walk_needs():
    """It was fed floats and its Embedding's error was blamed on input_shape."""

    class TokenBag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(100, 8), nn.Linear(8, 4)

        def forward(self, input_ids, labels=None):
            return {"logits": self.head(self.embed(input_ids).mean(1))}

    with pytest.raises(ValueError, match=r": it holds an nn\.Embedding, and the walk gives token ids only to a model "
                                         r"whose get_input_embeddings\(\) returns its input embedding"):
        estimate_cost(TokenBag(), (16,), 2)
    TokenBag.get_input_embeddings = lambda self: self.embed
    assert estimate_cost(TokenBag(), (16,), 2).train_energy_mj > 0


def test_format_comparison_refuses_reports_of_different_settings():
    """It printed the first report's batch and optimizer above ratios of reports of another batch
    size or optimizer, and a list of reports gave an AttributeError."""
    small = estimate_cost(linear_model(), (3,), 2)
    with pytest.raises(ValueError, match=r"^reports must share one batch size to be compared, got \['2', '64'\]$"):
        format_comparison({"a": small, "b": estimate_cost(linear_model(), (3,), 64)})
    with pytest.raises(ValueError, match=r"^reports must share one optimizer to be compared, got \['adam', 'momentum'\]$"):
        format_comparison({"a": small, "b": estimate_cost(linear_model(), (3,), 2, optimizer="adam")})
    with pytest.raises(TypeError, match=r"^reports must be a dict of CostReports by label .*, got list$"):
        format_comparison([small])
    assert "batch=2" in format_comparison({"a": small, "b": estimate_cost(linear_model(), (3,), 2, "int8")})


def test_int8_with_nothing_to_quantize_is_an_error():
    with pytest.raises(ValueError, match="no layer to quantize"):
        estimate_cost(nn.Sequential(nn.ReLU()), (4,), 2, "int8")


def test_an_lstm_is_priced_without_a_false_uncounted_op():
    """The LSTM's unsafe_split (a view) was listed as an op without a cost rule, so the command line
    printed "ops without a cost rule, counted as zero" for nothing."""
    r = estimate_cost(_LSTMHead(), (5, 8), 2)
    assert r.uncounted_ops == {}


class _LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


@pytest.mark.parametrize("norm", ["evonorm", "batchnorm", "range_evonorm", "range_batchnorm"])
def test_fp32_saved_activations_are_what_autograd_saves(norm):
    """A norm layer was counted as saving its input only, but fp32 EvoNorm-S0 keeps four times
    its input (Range BatchNorm three): ResNet-20's fp32 training memory was half the real figure,
    and the command line's headline ratio 2.20x instead of 4.34x. Range EvoNorm's hand-written
    backward keeps its input alone, on the meta walk as on the CPU."""
    from torch.multiprocessing.reductions import StorageWeakRef

    vision = pytest.importorskip("lp_decentral_nlp.vision")
    torch.manual_seed(0)
    model = vision.build_vision_model("resnet20", 10, norm)
    state = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in state:
            saved[key] = (t.untyped_storage().nbytes(), t)  # the tensor keeps its storage alive
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(4, 3, 16, 16))
    report = estimate_cost(model, (3, 16, 16), 4, "fp32")
    assert report.walk_device == "meta"
    assert report.memory_breakdown_mb["train"]["activations"] * 1e6 == pytest.approx(
        sum(nbytes for nbytes, _ in saved.values()), rel=1e-9)


def test_per_layer_saved_activations_add_up_to_the_total():
    """An embedding keeps its token ids for backward but runs no priced op, so it had no row: the
    layer table and the JSON summed to less than the reported total."""
    report = estimate_cost(tiny_bert(), (8,), 2, "int8")
    rows = {layer.name: layer for layer in report.layers}
    assert rows["bert.embeddings.word_embeddings"].saved_activation_bytes == 2 * 8 * 8  # int64 ids
    assert rows["bert.embeddings.word_embeddings"].kind == "Embedding"
    assert sum(layer.saved_activation_bytes for layer in report.layers) == pytest.approx(
        report.memory_breakdown_mb["train"]["activations"] * 1e6)


class _LoraLinear(nn.Linear):
    """A Linear whose forward does more than its type's GEMM."""

    def __init__(self, features, rank=4):
        super().__init__(features, features)
        self.A, self.B = nn.Linear(features, rank, bias=False), nn.Linear(rank, features, bias=False)

    def forward(self, x):
        return super().forward(x) + self.B(self.A(x))


def test_a_layer_subclass_with_its_own_forward_is_costed_op_by_op():
    """It was priced by its type's formula alone: the low-rank branch's work, and its Linear
    layers, were not counted, and nothing was flagged."""
    model = nn.Sequential(_LoraLinear(64))
    rows = {layer.name: layer for layer in estimate_cost(model, (64,), 8).layers}
    assert rows["0"].forward_macs == 8 * 64 * 64  # its own GEMM, counted from the ATen ops it runs
    assert rows["0.A"].forward_macs == rows["0.B"].forward_macs == 8 * 64 * 4
    assert rows["0"].precision == "fp32"
    assert {n: r.precision for n, r in ((layer.name, layer) for layer in
                                         estimate_cost(model, (64,), 8, "int8").layers)} == {
        "0": "fp32", "0.A": "int8", "0.B": "int8"}  # the layers quantize_model swaps


class _Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(4, 4, 2)

    def forward(self, x):
        return self.bilinear(x, x)


def test_the_text_report_names_the_ops_it_counted_as_zero():
    """Only the command line printed them; print(report) and format_comparison showed a clean table."""
    report = estimate_cost(_Bilinear(), (4,), 2)
    assert report.uncounted_ops  # _trilinear has no cost rule
    assert str(report).endswith(f"note (fp32): ops without a cost rule, counted as zero: {report.uncounted_ops}")
    assert "note" not in str(estimate_cost(linear_model(), (3,), 2))


class _PartlyFrozen(nn.Module):
    """frozen Linear -> ReLU -> trained Linear -> ReLU -> frozen Linear, as in a model whose
    embeddings and head are frozen: backward runs from the head down to the trained layer only."""

    def __init__(self):
        super().__init__()
        self.frozen_in, self.trained, self.frozen_out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        for p in [*self.frozen_in.parameters(), *self.frozen_out.parameters()]:
            p.requires_grad_(False)

    def forward(self, x):
        return self.frozen_out(torch.relu(self.trained(torch.relu(self.frozen_in(x)))))


def test_backward_is_priced_as_autograd_runs_it():
    """Training was priced 3x the forward for every layer and op: a frozen layer's weight-gradient
    GEMM, and the backward of everything below the lowest trained parameter (a frozen embedding's,
    a first layer's input gradient), were priced though no step computes them, and a frozen
    layer's input counted as saved. A PEFT/LoRA model's training cost was overstated."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _PartlyFrozen()
    fp32 = estimate_cost(model, (8,), 4)
    counter = FlopCounterMode(display=False)
    with counter:
        model(torch.randn(4, 8)).sum().backward()
    assert fp32.mults.train == counter.get_total_flops() // 2  # every GEMM MAC autograd runs, none more
    rows = {layer.name: layer for layer in fp32.layers}
    assert rows["frozen_in"].train.mults == 4 * 16 * 8  # the forward alone
    assert rows["trained"].train.mults == 2 * 4 * 16 * 16  # forward + weight gradient
    assert rows["frozen_out"].train.mults == 2 * 4 * 4 * 16  # forward + input gradient
    # saved: the trained layer's input and the second ReLU's output, 4 x 16 floats each; the frozen
    # layers keep nothing but their weights
    _, real = saved_tensor_bytes(model, torch.randn(4, 8), exclude=list(model.parameters()))
    assert fp32.memory_breakdown_mb["train"]["activations"] * 1e6 == real == 2 * 4 * 16 * 4

    int8 = {layer.name: layer for layer in estimate_cost(model, (8,), 4, "int8", weight_grad_gemm="int8").layers}
    assert [int8[n].train.int8_mults for n in ("frozen_in", "trained", "frozen_out")] == [
        4 * 16 * 8, 2 * 4 * 16 * 16, 2 * 4 * 4 * 16]
    # fp32 mults (one per element quantized or rescaled): every layer quantizes its input and
    # weights and rescales its output; the trained layer rescales its weight gradient (256); the
    # frozen head quantizes the gradient it passes back (16) and rescales the input gradient (64)
    assert int8["frozen_in"].train.fp32_mults == 32 + 128 + 64
    assert int8["trained"].train.fp32_mults == 64 + 256 + 64 + 256
    assert int8["frozen_out"].train.fp32_mults == 64 + 64 + 16 + 16 + 64
    assert estimate_cost(model, (8,), 4, "int8", convention="paper").mults.train > sum(
        layer.train.mults for layer in int8.values())  # SPEC 7's formula: three GEMMs everywhere


def test_activation_checkpointing_is_priced_as_it_runs():
    """A model with activation checkpointing on (the trainer's activation_checkpointing) was
    priced as without: every checkpointed layer's saved activations counted (3.2x the real
    figure for this BERT), its recomputed forward not. The recipes' memory check refused runs
    that checkpointing makes fit."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))  # train-mode forward = eval-mode forward
    ids = torch.zeros(4, 16, dtype=torch.long)
    plain = estimate_cost(model, (16,), 4)
    assert estimate_cost(model, (16,), 4, activation_checkpointing=False).to_dict() == plain.to_dict()

    def real_step():
        """GEMM MACs of a real forward + backward, and the bytes kept for backward: what autograd
        saves, and what the checkpointed layers are called with (their recompute's inputs)."""
        state = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
        kept = {}

        def keep(t):
            if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) not in state:
                kept[StorageWeakRef(t.untyped_storage())] = (t.untyped_storage().nbytes(), t)
            return t

        def keep_inputs(module, args, kwargs):
            for t in (*args, *kwargs.values()):
                keep(t)

        hooks = [layer.register_forward_pre_hook(keep_inputs, with_kwargs=True) for layer in model.bert.encoder.layer]
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):  # attention's matmuls as ops the counter sees
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss = model(input_ids=ids).logits.sum()
            loss.backward()
        for hook in hooks:
            hook.remove()
        return counter.get_total_flops() // 2, sum(nbytes for nbytes, _ in kept.values())

    model.train()
    model.activation_checkpointing_enable()
    macs, kept = real_step()
    report = estimate_cost(model, (16,), 4)
    assert report.to_dict() == estimate_cost(model, (16,), 4, activation_checkpointing=True).to_dict()
    assert report.memory_breakdown_mb["train"]["activations"] * 1e6 == kept
    assert kept < plain.memory_breakdown_mb["train"]["activations"] * 1e6 / 2
    # backward runs each checkpointed layer's forward again: its GEMMs, and every other op
    in_layers = [layer for layer in plain.layers if layer.name.startswith("bert.encoder.layer.")]
    model.activation_checkpointing_disable()
    assert macs - real_step()[0] == sum(layer.forward_macs for layer in in_layers)
    assert report.mults.train - plain.mults.train == sum(layer.inference.mults for layer in in_layers)
    assert report.adds.train - plain.adds.train == sum(layer.inference.adds for layer in in_layers)
    assert model.bert.encoder.layer[0].gradient_checkpointing is False  # the model is left as it was
    with pytest.raises(ValueError, match="has no layer transformers' activation checkpointing wraps"):
        estimate_cost(linear_model(), (3,), 2, activation_checkpointing=True)


def test_a_torch_transformer_encoder_is_priced_on_the_path_an_8bit_model_runs():
    """With a padding mask, nn.TransformerEncoder packed the batch into a nested tensor for its
    layers' fused kernel in the inference pass: the walk could not price those ops (only listed in
    uncounted_ops), and inference read about 11 times too cheap against the same model without it."""

    class Encoder(nn.Module):
        def __init__(self, nested: bool):
            super().__init__()
            torch.manual_seed(0)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested), nn.Linear(64, 4)

        def forward(self, x):
            mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
            return self.head(self.enc(x, src_key_padding_mask=mask).mean(1))

    for precision in ("fp32", "int8"):
        nested, plain = (estimate_cost(Encoder(n), (32, 64), 8, precision).to_dict() for n in (True, False))
        assert nested["uncounted_ops"] == {} and nested["inference_energy_mj"] == plain["inference_energy_mj"] > 0
    model = Encoder(True)
    estimate_cost(model, (32, 64), 8, "fp32")
    assert model.enc.use_nested_tensor  # the walk leaves the model as it was
