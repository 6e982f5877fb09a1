"""int8 kernel (``QuantConfig(kernel="int8")``): exact affine int8 GEMMs, parity with the simulated
kernel, gradient bifurcation with int8 operands, per-layer fallback and ``kernel="auto"``.

Tolerance. The int8 kernel and the simulated kernel compute the same real number, the product of
the same dequantized operands ``A^ (M, K) @ B^ (K, N)``: the integer product is exact in int32, so
the two differ only by fp32 rounding. The float GEMM and each of the int8 kernel's four terms
(``s_a s_b C_a C_b``, the two zero-point sums, ``K o_a o_b``) are bounded in magnitude by
``K * (2 max|A^|) * (2 max|B^|)`` (a code times its scale is at most the range, at most twice the
largest magnitude), each rounded with relative error about ``K * eps`` at worst; so we allow
``32 * eps * K * max|A^| * max|B^|`` per element, far below one quantization step.
"""
import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from transformers import DistilBertConfig, DistilBertForSequenceClassification
from transformers.pytorch_utils import Conv1D

from lp_decentral_nlp.quant import QuantConfig, QuantConv2d, fused, kernel_report, quantize_model
from lp_decentral_nlp.quant.kernels import (
    AUTO_MIN_CONV_CHANNELS,
    AUTO_MIN_CONV_MACS,
    AUTO_MIN_FEATURES,
    KERNELS,
    Int8Kernel,
    Int8Operand,
    affine_int8_matmul,
    cpu_has_int8_dot,
    onednn_conv_available,
    resolve_kernel,
)
from lp_decentral_nlp.quant.functional import quantize_codes
from lp_decentral_nlp.quant.gemm import Conv2dGemm, LinearGemm, TransposedLinearGemm
from lp_decentral_nlp.quant.kernels import int8 as int8_module
from lp_decentral_nlp.quant.kernels.auto import CONV_REASON, NO_INT8_GEMM_REASON, NOT_CPU_REASON
from lp_decentral_nlp.utils.layout import is_channels_last

EPS = torch.finfo(torch.float32).eps


def gemm_tolerance(a_hat, b_hat):
    """Per-element bound on the fp32 rounding difference of two ways to compute ``A^ @ B^``."""
    return 32 * EPS * a_hat.shape[-1] * a_hat.abs().max() * b_hat.abs().max()


def random_operand(shape, scale_shape=()):
    codes = torch.randint(-128, 128, shape, dtype=torch.int8)
    return Int8Operand(codes, torch.rand(scale_shape) * 0.1 + 1e-3, torch.randn(scale_shape) * 3)


@pytest.mark.parametrize("row_ranges", [False, True])
def test_affine_int8_matmul_equals_float_product_of_dequantized_operands(row_ranges):
    a = random_operand((37, 53), (37, 1) if row_ranges else ())
    b = random_operand((53, 29))
    b = b._replace(codes=b.codes.T.contiguous().T)  # strided operand: the kernel makes it contiguous
    expected = a.dequantize().double() @ b.dequantize().double()
    out = affine_int8_matmul(a, b)
    assert out.dtype == torch.float32 and out.shape == (37, 29)
    assert (out.double() - expected).abs().max() <= gemm_tolerance(a.dequantize(), b.dequantize())
    # the zero points matter: dropping them would be far off
    assert (a.codes.double() * a.scale @ (b.codes.double() * b.scale) - expected).abs().max() > 1.0


def exact_values(operand):
    """An operand's values ``codes * scale + offset`` in float64 (exact for these operands: an
    8-bit code times an fp32 scale plus an fp32 offset of nearby magnitude)."""
    return operand.codes.double() * operand.scale.double() + operand.offset.double()


def cancelling_operands(rows_shape, cols_shape, row_ranges=False):
    """Operands whose affine terms are thousands of times their product, as in MiniLM's output
    layers: rows of a skewed activation (range middle about 4.6, MiniLM layer 3's after GELU) and
    columns of an asymmetric weight range (offset 1.3) whose values centre on 0."""
    per_row = (rows_shape[0],) + (1,) * (len(rows_shape) - 1) if row_ranges else ()
    rows = Int8Operand(torch.randint(-128, 128, rows_shape, dtype=torch.int8),
                       torch.rand(per_row) * 0.01 + 0.03, torch.rand(per_row) + 4.1)
    cols = Int8Operand(torch.randint(-100, -53, cols_shape, dtype=torch.int8), torch.tensor(0.017), torch.tensor(1.3))
    return rows, cols


def affine_terms_bound(a, b, k):
    """A bound on each of the four affine terms of a product over `k` of operands `a` and `b`:
    ``k * max(128 s_a + |o_a|) * max(128 s_b + |o_b|)``."""
    return k * (128 * a.scale + a.offset.abs()).max().double() * (128 * b.scale + b.offset.abs()).max().double()


def assert_rounded_once(out, exact, terms_bound):
    """`out` is `exact` (float64) rounded to fp32, to within half an fp32 step, up to float64's
    rounding of terms of magnitude `terms_bound` (summed in fp32 they were hundreds of steps off)."""
    assert out.dtype == torch.float32 and out.shape == exact.shape
    float64_slack = 64 * torch.finfo(torch.float64).eps * terms_bound
    assert ((out.double() - exact).abs() <= EPS / 2 * exact.abs() + float64_slack).all()


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # from mkldnn.flags, harmless
@pytest.mark.parametrize("row_ranges", [False, True])
@pytest.mark.parametrize("path", ["compiled epilogue", "torch ops", "fp32 GEMM of the codes"])
def test_affine_int8_matmul_rounds_the_exact_product_once(row_ranges, path, monkeypatch):
    """The four affine terms are added in float64 and rounded once: the result is the exact
    product of the operands' values rounded to fp32, in the compiled CPU epilogue (of the int32
    product, or of the fp32 one of CPUs without an int8 GEMM: exact up to K = 1,024) and in the
    torch ops other devices run, where the terms (about 1e4) cancel to outputs of a few units."""
    if path == "torch ops":
        monkeypatch.setattr(fused, "epilogue_fusable", lambda *tensors: False)
    torch.manual_seed(0)
    k = int8_module.FLOAT_EXACT_MAX_K
    a, b = cancelling_operands((64, k), (k, 48), row_ranges)
    exact, terms_bound = exact_values(a) @ exact_values(b), affine_terms_bound(a, b, k)
    assert exact.abs().median() < 1e-2 * terms_bound, "the terms cancel"
    with torch.backends.mkldnn.flags(enabled=path != "fp32 GEMM of the codes"):
        assert (int8_module.int8_gemm_path(torch.device("cpu")) == int8_module.FLOAT_PATH) == (
            path == "fp32 GEMM of the codes" or not cpu_has_int8_dot())
        assert_rounded_once(affine_int8_matmul(a, b), exact, terms_bound)
        wide = affine_int8_matmul(a, b, out_dtype=torch.float64)
    assert wide.dtype == torch.float64 and ((wide - exact).abs() <= 64 * torch.finfo(torch.float64).eps * terms_bound).all()


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_linear_layer_gradient_rounds_the_exact_product_once(kind):
    """The int8 layer gradient of a Linear (``g^ @ W^``) and a transformers Conv1D (``g^ @ W^.T``)
    is the exact product of the operands' values rounded once, per-sample gradient ranges
    included."""
    torch.manual_seed(0)
    g, w = cancelling_operands((64, 768), (768, 512), row_ranges=True)  # w: (out, in) for a Linear
    gemm = LinearGemm()
    if kind == "conv1d":  # the weight (in, out), its code sums over the last dim: the GEMM's column sums
        w = Int8Operand(w.codes.T.contiguous(), w.scale, w.offset, w.codes.T.sum(1, keepdim=True, dtype=torch.float32))
        gemm = TransposedLinearGemm()
    w_out_in = exact_values(w) if kind == "linear" else exact_values(w).T
    exact = exact_values(g) @ w_out_in
    terms_bound = affine_terms_bound(g, w, 768)
    assert exact.abs().median() < 1e-2 * terms_bound, "the terms cancel"
    assert_rounded_once(Int8Kernel().grad_input(gemm, g, w, (64, 512)), exact, terms_bound)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # from mkldnn.flags, harmless
@pytest.mark.parametrize("onednn", [True, False])
def test_int8_gemm_is_the_exact_integer_product(onednn):
    """``int8_gemm`` on either CPU path (``torch._int_mm`` where ``cpu_has_int8_dot``, fp32 GEMMs
    of the codes elsewhere, e.g. with oneDNN disabled): the exact integer product up to ``K = 1024``,
    extreme codes included (``1024 * 128 * 128 = 2**24``); beyond, within fp32 GEMM rounding."""
    torch.manual_seed(0)
    with torch.backends.mkldnn.flags(enabled=onednn):
        if not onednn:
            assert not cpu_has_int8_dot(), "torch._int_mm needs oneDNN for a real int8 GEMM"
            assert int8_module.int8_gemm_path(torch.device("cpu")) == int8_module.FLOAT_PATH
        k = int8_module.FLOAT_EXACT_MAX_K
        a = torch.randint(-128, 128, (33, k), dtype=torch.int8)
        a[0], a[1] = -128, 127
        b = torch.randint(-128, 128, (40, k), dtype=torch.int8)
        b[0], b[1] = -128, 127
        # a Linear's W.T, a contiguous operand, and a strided one (copied)
        for b_kn in (b.T, b.T.contiguous(), torch.cat([b, b]).T[:, ::2]):
            exact = a.long() @ b_kn.long()
            out = int8_module.int8_gemm(a, b_kn)
            assert out.shape == (33, 40) and torch.equal(out.double(), exact.double())
        assert exact[0, 0] == 2**24, "the largest product that must stay exact"
        long_a = torch.randint(-128, 128, (17, 3 * k + 5), dtype=torch.int8)
        long_b = torch.randint(-128, 128, (3 * k + 5, 9), dtype=torch.int8)
        exact = (long_a.double() @ long_b.double())
        bound = long_a.shape[1] * EPS * (long_a.double().abs() @ long_b.double().abs())
        assert ((int8_module.int8_gemm(long_a, long_b).double() - exact).abs() <= bound).all()


def test_quantize_gives_signed_codes_with_the_shift_folded_into_the_offset():
    x = torch.randn(5, 7)
    lo, hi = x.min(), x.max()
    q = Int8Kernel().quantize(x, lo, hi, 8, False)
    assert q.codes.dtype == torch.int8 and q.codes.min() == -128 and q.codes.max() == 127
    simulated = KERNELS["simulated"].quantize(x, lo, hi, 8, False).dequantize()
    assert torch.allclose(q.dequantize(), simulated, atol=4 * EPS * x.abs().max())
    const = Int8Kernel().quantize(torch.full((3, 4), 2.5), torch.tensor(2.5), torch.tensor(2.5), 8, False)
    assert torch.equal(const.dequantize(), torch.full((3, 4), 2.5)), "zero-width range dequantizes to lo"


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("contiguous", [True, False], ids=["fused", "torch"])
def test_int8_codes_are_the_simulated_codes_shifted_ties_included(stochastic, contiguous):
    """The signed codes are the unsigned codes minus 128 bit for bit. Rounding ``v - 128`` instead of
    ``v`` put a value on a .5 tie of its grid on the other side: one code of this weight differed,
    so the int8 kernel's forward and the int8 export (and the simulated kernel) used different
    weights."""
    torch.manual_seed(3)
    weight = nn.Linear(256, 512).weight.detach()  # holds a value on a .5 tie of its 8-bit grid
    x = weight if contiguous else weight.t()  # a transposed tensor goes through the torch passes
    lo, hi = x.min(), x.max()
    torch.manual_seed(0)
    signed = Int8Kernel().quantize(x, lo, hi, 8, stochastic).codes
    torch.manual_seed(0)
    unsigned = quantize_codes(x, lo, hi, 8, stochastic)[0]
    assert torch.equal(signed.int() + 128, unsigned.int())


class SpyIntMM:
    """Wraps the int8 kernel's integer GEMM (``int8_gemm``) and records its operands."""

    def __init__(self, monkeypatch):
        self.calls, self.real = [], int8_module.int8_gemm
        monkeypatch.setattr(int8_module, "int8_gemm", self)

    def __call__(self, a, b):
        self.calls.append((a, b))
        return self.real(a, b)


def run_step(model, x, grad_out, seed=1):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)  # same stochastic-rounding draws in both kernels
    y = model(x)
    y.backward(grad_out)
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("granularity", ["tensor", "sample"])
def test_int8_matches_simulated_outputs_and_gradients(kind, granularity, monkeypatch):
    base = nn.Linear(48, 40) if kind == "linear" else Conv1D(40, 48)
    nn.init.normal_(base.bias)
    x, grad_out = torch.randn(4, 9, 48) * 2 + 0.5, torch.randn(4, 9, 40).exp()  # skewed: big zero points
    results = {}
    for kernel in ("simulated", "int8"):
        model = quantize_model(nn.Sequential(copy.deepcopy(base)), QuantConfig(kernel=kernel, grad_granularity=granularity))
        results[kernel] = run_step(model, x, grad_out)
    spy = SpyIntMM(monkeypatch)
    run_step(quantize_model(nn.Sequential(copy.deepcopy(base)), QuantConfig(kernel="int8")), x, grad_out)

    (y_s, gx_s, gp_s), (y_i, gx_i, gp_i) = results["simulated"], results["int8"]
    w_hat = KERNELS["simulated"].quantize(base.weight.detach(), *base.weight.detach().aminmax(), 8, False).dequantize()
    x_hat = x.abs().max()  # the quantized input stays within the input range
    assert (y_i - y_s).abs().max() <= 32 * EPS * 48 * x_hat * w_hat.abs().max()
    assert (gx_i - gx_s).abs().max() <= 32 * EPS * 40 * grad_out.abs().max() * w_hat.abs().max()
    # weight gradient: the same fp32 GEMM, of the input dequantized as c*s + o instead of q*s + lo
    # (a few eps apart per element), and the same bias gradient
    assert (gp_i[0] - gp_s[0]).abs().max() <= 32 * EPS * x.shape[0] * x.shape[1] * grad_out.abs().max() * x_hat
    assert torch.equal(gp_i[1], gp_s[1])
    assert not torch.allclose(y_s, base(x), atol=1e-3), "outputs are really quantized"
    # forward and layer gradient really ran as int8 GEMMs: two per step, `a` contiguous
    assert len(spy.calls) == 2
    for a, b in spy.calls:
        assert a.dtype == b.dtype == torch.int8 and a.is_contiguous() and (b.is_contiguous() or b.T.is_contiguous())


def test_weight_gradient_gets_float_output_gradient(monkeypatch):
    """Bifurcation with int8 operands: dL/dW is from the full-precision output gradient."""
    seen = {}
    real = Int8Kernel.grad_weight

    def spy(self, gemm, x_q, g, weight_shape):
        seen["g"] = g
        return real(self, gemm, x_q, g, weight_shape)

    monkeypatch.setattr(Int8Kernel, "grad_weight", spy)
    model = quantize_model(nn.Sequential(nn.Linear(16, 8)), QuantConfig(kernel="int8"))
    grad_out = torch.randn(5, 8)
    run_step(model, torch.randn(5, 16), grad_out)
    assert seen["g"].dtype == torch.float32 and torch.equal(seen["g"], grad_out)


def test_tiny_distilbert_int8_close_to_simulated():
    """Whole model: rounding differences may move a value across a code boundary in a later layer
    (one quantization step there), so the check is on the loss and the gradients' direction."""
    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=3)
    torch.manual_seed(0)
    base = DistilBertForSequenceClassification(config)
    batch = dict(input_ids=torch.randint(0, 100, (4, 12)), labels=torch.tensor([0, 1, 2, 1]))
    out = {}
    for kernel in ("simulated", "int8"):
        model = quantize_model(copy.deepcopy(base), QuantConfig(kernel=kernel))
        torch.manual_seed(3)
        loss = model(**batch).loss
        loss.backward()
        out[kernel] = loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    (loss_s, g_s), (loss_i, g_i) = out["simulated"], out["int8"]
    assert torch.allclose(loss_i, loss_s, rtol=1e-4)
    assert torch.nn.functional.cosine_similarity(g_i, g_s, dim=0) > 0.999


def test_fallback_per_layer_with_reason():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    report = quantize_model(model, QuantConfig(kernel="int8"), dry_run=True)
    reasons = {d.name: d.reason for d in report.layers}
    assert "kernel simulated (int8 falls back: grouped Conv2d (groups=2) has no int8 kernel)" in reasons["0"]
    assert reasons["2"].endswith("kernel int8")
    # the grouped Conv2d runs simulated, the Linear int8; the kernel asked for says why it is not run, where
    # it was asked for (it said so at the first forward, attributed to torch's code)
    with pytest.warns(UserWarning, match=r"^QuantConfig\(kernel='int8'\) cannot run 1 layer\(s\) \(e.g. '0'\): grouped "
                                         r"Conv2d \(groups=2\) has no int8 kernel; they run the simulated kernel") as told:
        quantize_model(model, QuantConfig(kernel="int8"))
    assert told[0].filename == __file__
    assert kernel_report(model) == {"0": "simulated", "2": "int8"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: not again at the forward
        model(torch.randn(2, 4, 8, 8)).sum().backward()
    assert model[0].weight.grad is not None and model[2].weight.grad is not None
    # a layer made by hand (no quantize_model) says it at its first forward
    layer = nn.Sequential(QuantConv2d.from_float(nn.Conv2d(4, 4, 3, groups=2), QuantConfig(kernel="int8")))
    with pytest.warns(UserWarning, match=r"QuantConfig\(kernel='int8'\) cannot run every layer: grouped Conv2d"):
        layer(torch.randn(2, 4, 8, 8))
    auto = quantize_model(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)), QuantConfig(kernel="auto"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under auto a fallback is the rule, not a setting left unused
        auto(torch.randn(2, 4, 8, 8))


@pytest.mark.parametrize("int8_dot, onednn", [(True, True), (True, False), (False, False)])
def test_a_layer_summing_more_products_than_int32_holds_falls_back_with_its_reason(int8_dot, onednn, monkeypatch):
    """torch._int_mm and oneDNN's convolution sum in int32: a head of 140,000 outputs gave a layer
    gradient of 1.7e5 for 0.03 (an audit's run), the sum of 2**17 products of -128 codes wrapped.
    Each output's sum (the forward's over the inputs, the layer gradient's over the outputs) must
    fit: ``INT32_MAX_K`` signed products, ``ONEDNN_CONV_MAX_K`` taps of unsigned activation codes
    in oneDNN's convolution (im2col's layer gradient sums over ``Cout`` only); the fp32 GEMM of
    CPUs without an int8 GEMM has no int32 sum to overflow."""
    monkeypatch.setattr(int8_module, "cpu_has_int8_dot", lambda: int8_dot)
    monkeypatch.setattr(int8_module, "onednn_conv_available", lambda device: onednn)
    gemm_max, conv_max = int8_module.INT32_MAX_K, int8_module.ONEDNN_CONV_MAX_K
    wide_taps = conv_max // 9 + 1  # 7,311 channels of 3 x 3: 65,799 taps
    cases = [(LinearGemm, (gemm_max, 8), None), (LinearGemm, (8, gemm_max + 1), (gemm_max + 1, gemm_max)),
             (TransposedLinearGemm, (gemm_max + 1, 8), (gemm_max + 1, gemm_max)),
             (Conv2dGemm, (8, conv_max // 9, 3, 3), None),
             (Conv2dGemm, (wide_taps, 8, 3, 3), (9 * wide_taps, conv_max) if onednn else None),  # im2col: K = Cout
             (Conv2dGemm, (8, gemm_max // 9 + 1, 3, 3), (9 * (gemm_max // 9 + 1), conv_max if onednn else gemm_max))]
    for gemm_type, shape, overflow in cases:
        reason = int8_module.Int8Kernel().unsupported_reason(gemm_type, torch.empty(shape))
        if overflow is None or not int8_dot:
            assert reason is None
        else:
            k, limit = overflow
            assert reason == (f"{gemm_type.__name__[:-4]} weight {shape} sums {k:,} int8 products per output, more "
                              f"than an int32 sum holds exactly ({limit:,})")
            kernel, fallback = resolve_kernel("auto", gemm_type, torch.empty(shape))
            assert kernel.name == "simulated" and fallback == reason


@pytest.mark.skipif(not cpu_has_int8_dot(), reason="needs torch._int_mm's int32 sums (AVX512-VNNI)")
def test_a_head_whose_layer_gradient_would_wrap_in_int32_runs_the_simulated_kernel():
    """Every weight and gradient code at the bottom of its range, so the int32 sum of the first
    input's products (2**31 + 16129) wrapped: -133131 for 131073."""
    head = nn.Linear(4, int8_module.INT32_MAX_K + 2)
    nn.init.constant_(head.weight, -1.0)
    with torch.no_grad():
        head.weight[0, 0] = 1.0
    grads = {}
    for name in ("simulated", "int8"):
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            model = quantize_model(nn.Sequential(copy.deepcopy(head)), QuantConfig(kernel=name, skip=()))
        assert [str(w.message).split(":")[0] for w in told] == (
            ["QuantConfig(kernel='int8') cannot run 1 layer(s) (e.g. '0')"] if name == "int8" else [])
        x = torch.randn(2, 4, requires_grad=True)
        grad_out = torch.full((2, head.out_features), -1.0)
        grad_out[:, 0] = 1.0
        model(x).backward(grad_out)
        grads[name] = x.grad
    assert kernel_report(model) == {"0": "simulated"}
    assert torch.equal(grads["int8"], grads["simulated"]) and (grads["int8"] > 1.3e5).all()


@pytest.mark.skipif(not getattr(torch.cpu, "get_capabilities", dict)().get("avx512_vnni", False),
                    reason="needs a CPU with AVX512-VNNI")
@pytest.mark.parametrize("platform", ["win32", "darwin"])
def test_the_int8_gemm_is_found_on_every_os(platform):
    """The CPU's AVX512-VNNI was read from Linux's /proc/cpuinfo only: on Windows and macOS the
    layers took the fp32 GEMM of the codes (auto: the simulated kernel) on the same CPU."""
    probe = ("from lp_decentral_nlp.quant.kernels import cpu_has_int8_dot\n"  # imported as on Linux, then asked
             f"import sys; sys.platform = {platform!r}\nprint(cpu_has_int8_dot())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == str(torch.backends.mkldnn.is_available()), out.stderr[-2000:]


def test_auto_picks_int8_only_for_wide_linear_layers_on_int8_hardware():
    wide, narrow = torch.zeros(AUTO_MIN_FEATURES, AUTO_MIN_FEATURES), torch.zeros(AUTO_MIN_FEATURES, 8)
    kernel, reason = resolve_kernel("auto", LinearGemm, narrow)
    assert kernel.name == "simulated" and "narrower" in reason
    wide_conv = wide.reshape(AUTO_MIN_FEATURES, AUTO_MIN_FEATURES, 1, 1)
    kernel, reason = resolve_kernel("auto", Conv2dGemm, wide_conv, groups=2)
    assert kernel.name == "simulated" and "grouped Conv2d" in reason
    kernel, reason = resolve_kernel("auto", Conv2dGemm, wide_conv)  # int8 where oneDNN's int8 convolution runs
    if onednn_conv_available("cpu"):
        assert (kernel.name, reason) == ("int8", None)
        narrow_conv = torch.zeros(AUTO_MIN_CONV_CHANNELS, AUTO_MIN_CONV_CHANNELS // 2, 3, 3)
        kernel, reason = resolve_kernel("auto", Conv2dGemm, narrow_conv)
        assert kernel.name == "simulated" and f"narrower than {AUTO_MIN_CONV_CHANNELS} channels" in reason
        pixels = AUTO_MIN_CONV_MACS // wide_conv.numel()  # a call of just enough multiply-adds, and one fewer pixel
        assert resolve_kernel("auto", Conv2dGemm, wide_conv, output_pixels=pixels) == (KERNELS["int8"], None)
        kernel, reason = resolve_kernel("auto", Conv2dGemm, wide_conv, output_pixels=pixels - 1)
        assert kernel.name == "simulated" and "multiply-adds" in reason
        plan = quantize_model(nn.Sequential(nn.Conv2d(AUTO_MIN_CONV_CHANNELS, AUTO_MIN_CONV_CHANNELS, 3)),
                              QuantConfig(), dry_run=True)
        assert plan.layers[0].reason.endswith(f"kernel int8 for calls of at least {AUTO_MIN_CONV_MACS:,} "
                                              "multiply-adds, simulated below"), "the dry run states the size rule"
    else:
        assert (kernel.name, reason) == ("simulated", CONV_REASON)
    assert resolve_kernel("int8", Conv2dGemm, wide_conv) == (KERNELS["int8"], None)
    kernel, reason = resolve_kernel("auto", LinearGemm, wide)
    assert (kernel.name, reason) == (("int8", None) if cpu_has_int8_dot() else ("simulated", NO_INT8_GEMM_REASON))
    assert resolve_kernel("int8", LinearGemm, narrow) == (KERNELS["int8"], None), "int8 asked for is honoured"
    assert QuantConfig(kernel="auto").kernel == "auto"
    with pytest.raises(ValueError, match=r"kernel must be one of .*'int8'.*'auto'"):
        QuantConfig(kernel="int4")


class CudaWeight:
    """What ``resolve_kernel`` reads of a ``(768, 768)`` weight on CUDA, its device and shape, where
    torch sees no GPU."""
    device, shape = torch.device("cuda"), (768, 768)

    def __getitem__(self, row):
        return torch.empty(768)


def test_auto_keeps_the_simulated_kernel_on_cuda_where_int8_measured_slower():
    assert resolve_kernel("auto", LinearGemm, CudaWeight()) == (KERNELS["simulated"], NOT_CPU_REASON)
    assert resolve_kernel("int8", LinearGemm, CudaWeight()) == (KERNELS["int8"], None), "int8 asked for is honoured"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_small_batch_is_padded_to_the_int_mm_shape_rule():
    a, b = random_operand((3, 32)), random_operand((32, 16))
    a, b = (Int8Operand(*(None if t is None else t.cuda() for t in op)) for op in (a, b))
    expected = a.dequantize().double() @ b.dequantize().double()
    assert (affine_int8_matmul(a, b).double() - expected).abs().max() <= gemm_tolerance(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_int8_bf16_differs_from_int8_only_in_a_bfloat16_rounded_weight_gradient(kind, monkeypatch):
    base = nn.Linear(48, 40) if kind == "linear" else Conv1D(40, 48)
    x, grad_out = torch.randn(4, 9, 48) * 2 + 0.5, torch.randn(4, 9, 40).exp()  # skewed: big zero points
    results = {}
    for kernel in ("int8", "int8_bf16"):
        model = quantize_model(nn.Sequential(copy.deepcopy(base)), QuantConfig(kernel=kernel))
        results[kernel] = run_step(model, x, grad_out)
    (y_i, gx_i, gp_i), (y_b, gx_b, gp_b) = results["int8"], results["int8_bf16"]
    assert torch.equal(y_i, y_b) and torch.equal(gx_i, gx_b) and torch.equal(gp_i[1], gp_b[1])
    # dW = sum over rows of g (x) x^: rounding g and the GEMM's result to bfloat16 (8 significant
    # bits, relative error <= 2**-8 each) moves an entry by at most ~2**-7 of sum |g| |x^|, and
    # |x^| <= max |x| (the quantization range lies within the input's)
    bound = grad_out.reshape(-1, 40).abs().sum(0)[:, None] * x.abs().max() * 2.0**-7
    w_i, w_b = (gp_i[0], gp_b[0]) if kind == "linear" else (gp_i[0].T, gp_b[0].T)
    assert ((w_b - w_i).abs() <= bound).all()
    assert not torch.equal(w_b, w_i), "the weight gradient really went through bfloat16"
    assert torch.nn.functional.cosine_similarity(w_b.flatten(), w_i.flatten(), dim=0) > 0.9999
    spy = SpyIntMM(monkeypatch)
    run_step(quantize_model(nn.Sequential(copy.deepcopy(base)), QuantConfig(kernel="int8_bf16")), x, grad_out)
    assert len(spy.calls) == 2  # forward and layer gradient still on int8 operands


def train_steps(model, input_shape, steps=3, lr=0.05):
    """A few SGD steps on a fixed regression batch (inputs of `input_shape`, 8 targets per sample);
    the losses and the final parameters."""
    torch.manual_seed(11)
    x, target = torch.randn(input_shape), torch.randn(input_shape[0], 8)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def auto_test_model(kind):
    """``(model, input shape, layers auto runs int8 here)``: an MLP of AUTO_MIN_FEATURES-wide Linear
    layers, or a CNN whose second convolution has at least AUTO_MIN_CONV_CHANNELS channels and
    enough multiply-adds per call; the 3-channel first convolution and the 8-output heads are too
    narrow for int8."""
    torch.manual_seed(0)
    if kind == "mlp":
        width = AUTO_MIN_FEATURES
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 8))
        return model, (64, width), {"0", "2"} if cpu_has_int8_dot() else set()
    channels = 32  # 32 x 16 x 16 outputs of 32 x 32 x 9 multiply-adds: above AUTO_MIN_CONV_MACS
    assert channels >= AUTO_MIN_CONV_CHANNELS
    model = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1),
                          nn.ReLU(), nn.AvgPool2d(4), nn.Flatten(), nn.Linear(channels * 4 * 4, 8))
    return model, (32, 3, 16, 16), {"2"} if onednn_conv_available("cpu") else set()


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_default_auto_trains_like_simulated_up_to_gemm_rounding(kind):
    """``kernel="auto"`` (the default) runs int8 only on wide layers and int8 hardware
    (``kernel_report`` says which). Where it does, the int8 GEMMs and convolutions compute the same
    products of the same 8-bit operands as the simulated kernel, so each differs by fp32 rounding
    only (module docstring); over a few steps such a difference can move a value across a rounding
    boundary of a later quantizer (one 8-bit step of one element, a tiny share of a batch
    gradient), so the losses and the parameter updates must agree to 1e-4 and 1e-3 relative.
    Where auto picks the simulated kernel everywhere (a CPU without AVX512-VNNI) the run is the
    simulated run, bit for bit."""
    base, input_shape, int8_layers = auto_test_model(kind)
    start = [p.detach().clone() for p in base.parameters()]
    assert QuantConfig().kernel == "auto"
    runs, reports = {}, {}
    for kernel in ("auto", "simulated"):
        model = quantize_model(copy.deepcopy(base), QuantConfig() if kernel == "auto" else QuantConfig(kernel=kernel))
        reports[kernel] = kernel_report(model)
        runs[kernel] = train_steps(model, input_shape)
    assert reports["auto"] == {name: "int8" if name in int8_layers else "simulated" for name in reports["auto"]}
    assert len(reports["auto"]) == 3 and set(reports["simulated"].values()) == {"simulated"}
    unrun = quantize_model(copy.deepcopy(base), QuantConfig())
    assert kernel_report(unrun) == reports["auto"], "before any forward kernel_report predicts the kernels run"
    (loss_a, params_a), (loss_s, params_s) = runs["auto"], runs["simulated"]
    assert not torch.equal(params_s[0], start[0]), "the run trains"
    if not int8_layers:
        assert torch.equal(loss_a, loss_s) and all(torch.equal(a, s) for a, s in zip(params_a, params_s))
    else:
        assert torch.allclose(loss_a, loss_s, rtol=1e-4)
        for a, s, p0 in zip(params_a, params_s, start):
            assert (a - s).abs().max() <= 1e-3 * (s - p0).abs().max()


CONV_CASES = {  # (in, out, kernel, stride, padding, dilation, padding_mode), input (N, C, H, W)
    "3x3 pad 1": ((6, 10, 3, 1, 1, 1, "zeros"), (3, 6, 9, 9)),
    "stride 2 odd size": ((6, 10, 3, 2, 1, 1, "zeros"), (3, 6, 10, 7)),
    "5x3 pad (2, 0) dilation 2": ((5, 8, (5, 3), 1, (2, 0), 2, "zeros"), (2, 5, 12, 11)),
    "1x1 stride 2": ((8, 16, 1, 2, 0, 1, "zeros"), (4, 8, 8, 8)),
    "reflect padding": ((4, 6, 3, 1, 1, 1, "reflect"), (2, 4, 7, 7)),
}


class SpyIntConv:
    """Wraps the int8 kernel's integer convolution (``int8_conv2d``, oneDNN) and records its operands."""

    def __init__(self, monkeypatch):
        self.calls, self.real = [], int8_module.int8_conv2d
        monkeypatch.setattr(int8_module, "int8_conv2d", self)

    def __call__(self, unsigned, weight_codes, *geometry):
        self.calls.append((unsigned, weight_codes))
        return self.real(unsigned, weight_codes, *geometry)


CONV_PATHS = ["im2col", pytest.param("onednn", marks=pytest.mark.skipif(
    not onednn_conv_available("cpu"), reason="needs a CPU with oneDNN's int8 convolution"))]


@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.parametrize("granularity", ["tensor", "sample"])
@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv2d_int8_matches_simulated(case, granularity, path, monkeypatch):
    """Conv2d on int8 codes, as oneDNN's int8 convolution or as im2col GEMMs: output, layer
    gradient (8-bit, stochastic rounding) and weight gradient (fp32, from the quantized input)
    equal the simulated kernel's up to fp32 rounding (module docstring's bound, ``K = C kh kw``
    for the forward and ``Cout kh kw`` terms per input element for the layer gradient); the bias
    gradient is the same computation. The strided, dilated and asymmetric cases take the layer
    gradient's zero insertion and extra rows/columns."""
    if path == "im2col":
        monkeypatch.setattr(int8_module, "onednn_conv_available", lambda device: False)
    (cin, cout, k, stride, padding, dilation, mode), shape = CONV_CASES[case]
    base = nn.Conv2d(cin, cout, k, stride=stride, padding=padding, dilation=dilation, padding_mode=mode)
    nn.init.normal_(base.bias)
    x = torch.randn(shape) * 2 + 0.7  # skewed: a large zero point, so padding must be exact 0
    grad_out = torch.randn_like(base(x)).exp()
    results = {}
    for kernel in ("simulated", "int8"):
        config = QuantConfig(kernel=kernel, grad_granularity=granularity)
        model = quantize_model(nn.Sequential(copy.deepcopy(base)), config)
        assert kernel_report(model) == {"0": kernel}
        results[kernel] = run_step(model, x, grad_out)
    spy = SpyIntMM(monkeypatch) if path == "im2col" else SpyIntConv(monkeypatch)
    run_step(quantize_model(nn.Sequential(copy.deepcopy(base)), QuantConfig(kernel="int8")), x, grad_out)
    (y_s, gx_s, gp_s), (y_i, gx_i, gp_i) = results["simulated"], results["int8"]
    w_max = base.weight.detach().abs().max()
    k_taps = base.weight[0].numel()
    assert y_i.shape == y_s.shape
    assert (y_i - y_s).abs().max() <= 32 * EPS * k_taps * x.abs().max() * w_max
    assert (gx_i - gx_s).abs().max() <= 32 * EPS * cout * base.weight[0, 0].numel() * grad_out.abs().max() * w_max
    assert (gp_i[0] - gp_s[0]).abs().max() <= 32 * EPS * grad_out[:, 0].numel() * grad_out.abs().max() * x.abs().max()
    assert torch.equal(gp_i[1], gp_s[1])
    assert not torch.allclose(y_s, base(x), atol=1e-3), "outputs are really quantized"
    assert len(spy.calls) == 2, "forward and layer gradient are integer products of the codes"
    for a, b in spy.calls:
        if path == "im2col":
            assert a.dtype == b.dtype == torch.int8 and a.is_contiguous() and (b.is_contiguous() or b.T.is_contiguous())
        else:  # oneDNN: u8 activations, s8 weights
            assert a.dtype == torch.uint8 and a.is_contiguous(memory_format=torch.channels_last)
            assert b.dtype == torch.int8 and b.dim() == 4


@pytest.mark.parametrize("path", CONV_PATHS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv2d_int8_rounds_the_exact_convolution_once(path, with_bias, monkeypatch):
    """Conv2d's int8 forward and layer gradient (strided: zeros inserted between the gradient's
    pixels, an extra row), by oneDNN's convolution or im2col (whose padded-tap correction is taken
    off, and whose columns are folded, before the rounding), are the exact convolutions of the
    operands' values, zero padding exact, rounded once to fp32; the gradient with per-sample
    ranges."""
    if path == "im2col":
        monkeypatch.setattr(int8_module, "onednn_conv_available", lambda device: False)
    torch.manual_seed(0)
    x, w = cancelling_operands((4, 64, 10, 8), (16, 64, 3, 3))
    x = x._replace(scale=x.scale.reshape(()), offset=x.offset.reshape(()))
    bias = torch.randn(16) if with_bias else None
    gemm = Conv2dGemm(stride=(2, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    exact = torch.nn.functional.conv2d(exact_values(x), exact_values(w), None if bias is None else bias.double(),
                                       (2, 1), (1, 1))
    terms_bound = affine_terms_bound(x, w, 64 * 9)
    assert exact.abs().median() < 1e-2 * terms_bound, "the terms cancel"
    assert_rounded_once(Int8Kernel().forward(gemm, x, w, bias), exact, terms_bound)

    g, _ = cancelling_operands((4, 16, 5, 8), (1,), row_ranges=True)  # the output gradient's codes
    exact_grad = torch.nn.grad.conv2d_input((4, 64, 10, 8), exact_values(w), exact_values(g), (2, 1), (1, 1))
    grad_bound = affine_terms_bound(g, w, 16 * 9)
    assert exact_grad.abs().median() < 1e-2 * grad_bound, "the terms cancel"
    assert_rounded_once(Int8Kernel().grad_input(gemm, g, w, (4, 64, 10, 8)), exact_grad, grad_bound)


@pytest.mark.skipif(not onednn_conv_available("cpu"), reason="needs a CPU with oneDNN's int8 convolution")
@pytest.mark.parametrize("granularity", ["tensor", "sample"])
@pytest.mark.parametrize("case", ["3x3 pad 1", "stride 2 odd size"])
def test_conv2d_int8_takes_and_gives_channels_last(case, granularity):
    """oneDNN's int8 convolution reads and writes channels last: a channels-last input is
    quantized in place of a copy, the output and the layer gradient come channels last, and they
    are the bits of a row-major input's, whose output is row-major as nn.Conv2d's (a channels-last
    one broke a user's ``x.view(n, -1)`` where kernel="auto" chose int8) (the same codes, the same integer convolution, the same
    stochastic-rounding words). The weight gradient (fp32, from the dequantized input) may sum in
    another order: equal up to rounding."""
    (cin, cout, k, stride, padding, dilation, mode), shape = CONV_CASES[case]
    base = nn.Conv2d(cin, cout, k, stride=stride, padding=padding, dilation=dilation, padding_mode=mode)
    model = quantize_model(nn.Sequential(base), QuantConfig(kernel="int8", grad_granularity=granularity))
    x = torch.randn(shape) * 2 + 0.7
    grad_out = torch.randn_like(base(x)).exp()
    y, gx, gp = run_step(model, x, grad_out)
    y_cl, gx_cl, gp_cl = run_step(model, x.contiguous(memory_format=torch.channels_last), grad_out)
    assert y.is_contiguous() and is_channels_last(y_cl) and is_channels_last(gx_cl)
    assert y.view(len(y), -1).shape == (len(y), y[0].numel())
    assert torch.equal(y_cl, y) and torch.equal(gx_cl, gx) and torch.equal(gp_cl[1], gp[1])
    assert (gp_cl[0] - gp[0]).abs().max() <= 32 * EPS * grad_out[:, 0].numel() * grad_out.abs().max() * x.abs().max()
