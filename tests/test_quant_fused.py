"""The one-pass quantizer (``quant/fused.py``, via ``functional.quantize_fused``) gives bit for bit
the codes, values and row sums of the torch passes of ``functional.quantize_codes``."""
import pytest
import torch

from lp_decentral_nlp.quant.functional import grad_range, quantize_codes, quantize_fused, tensor_range
from lp_decentral_nlp.quant import fused
from lp_decentral_nlp.utils.layout import is_channels_last
from lp_decentral_nlp.utils.numba_threads import PARALLEL_MIN_ELEMENTS
from lp_decentral_nlp.quant.kernels.simulated import dequantize_codes

SHAPES = [(64, 50), (4, 9, 48), (3, 5, 7, 9), (1000,), (1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_fused_quantizer_equals_torch_passes(shape, per_sample, signed, stochastic, contiguous):
    x = torch.randn(shape) * 3 + 1
    x[..., 0] = 0.5  # a value exactly between two codes for some ranges: rounding half to even
    if not contiguous:  # strided input: the torch passes run instead, same results
        x = torch.randn(shape[::-1]).T * 3 + 1 if len(shape) == 2 else x.flip(0)
    lo, hi = grad_range(x, "sample") if per_sample and x.dim() > 1 else tensor_range(x)
    lo = lo - 0.3  # values outside the range are clamped
    torch.manual_seed(5)
    codes, values, sums, scale = quantize_fused(x, lo, hi, 8, stochastic, signed, values=not signed, last_dim_sums=True)
    torch.manual_seed(5)  # the same dither words
    expected, expected_scale = quantize_codes(x, lo, hi, 8, stochastic, signed)
    assert codes.dtype == (torch.int8 if signed else torch.uint8)
    assert torch.equal(codes, expected.to(codes.dtype)) and torch.equal(scale, expected_scale)
    assert torch.equal(sums, expected.sum(-1, keepdim=True))
    if not signed:
        assert torch.equal(values, expected * expected_scale + lo)

    torch.manual_seed(5)  # without the last-dim sums (rows of whole samples where x has 3+ dims): same codes
    codes_no_sums, values_no_sums, _, _ = quantize_fused(x, lo, hi, 8, stochastic, signed, values=not signed,
                                                         last_dim_sums=False)
    after_fused = torch.rand(())
    assert torch.equal(codes_no_sums, codes) and (signed or torch.equal(values_no_sums, values))
    torch.manual_seed(5)
    quantize_codes(x, lo, hi, 8, stochastic, signed)
    assert torch.equal(after_fused, torch.rand(())), "both draw the same random numbers: later draws stay in step"


def test_zero_width_range_and_out_of_range_values():
    x = torch.tensor([[-1e30, 2.5, 1e30, float("inf"), -float("inf")]])
    codes, values, _, scale = quantize_fused(x, torch.tensor(2.5), torch.tensor(2.5), 8, False, False, True, False)
    assert scale == 0 and torch.equal(codes, torch.zeros_like(codes)) and torch.equal(values, torch.full_like(x, 2.5))
    codes, _, _, _ = quantize_fused(x, torch.tensor(-1.0), torch.tensor(1.0), 8, False, True, False, False)
    assert codes.tolist() == [[-128, 127, 127, 127, -128]]


def test_signed_values_are_refused():
    with pytest.raises(ValueError, match="signed=False"):
        quantize_fused(torch.randn(3), torch.tensor(0.0), torch.tensor(1.0), 8, False, True,
                       values=True, last_dim_sums=False)


@pytest.mark.parametrize("stochastic", [False, True])
def test_parallel_rows_give_the_same_codes(stochastic):
    """A tensor of at least ``PARALLEL_MIN_ELEMENTS`` with two torch threads runs split by rows."""
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    x = torch.randn(3, 40, PARALLEL_MIN_ELEMENTS // 64)
    lo, hi = grad_range(x, "sample")
    torch.manual_seed(2)
    codes, values, sums, _ = quantize_fused(x, lo, hi, 8, stochastic, False, values=True, last_dim_sums=True)
    torch.manual_seed(2)
    expected, scale = quantize_codes(x, lo, hi, 8, stochastic)
    assert torch.equal(codes, expected.to(torch.uint8)) and torch.equal(values, expected * scale + lo)
    assert torch.equal(sums, expected.sum(-1, keepdim=True))


@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (4, 64, 16, 17)])  # serial, and split over samples
@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_channels_last_input_gets_the_codes_of_a_contiguous_one(shape, per_sample, stochastic):
    """A channels-last conv input is quantized in memory order, without a copy: codes, values and
    their dequantized values come channels last and equal a contiguous input's element for
    element, the stochastic dither words included (each element keeps its row-major word)."""
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    x = torch.randn(shape) * 3 + 1
    channels_last = x.contiguous(memory_format=torch.channels_last)
    assert is_channels_last(channels_last) and fused.fusable(channels_last)
    lo, hi = grad_range(x, "sample") if per_sample else tensor_range(x)
    assert all(torch.equal(a, b) for a, b in zip((lo, hi), grad_range(channels_last, "sample") if per_sample
                                                  else tensor_range(channels_last)))
    results = []
    for t in (x, channels_last):
        torch.manual_seed(3)
        results.append(quantize_fused(t, lo, hi, 8, stochastic, signed=False, values=True, last_dim_sums=False))
    (codes, values, _, scale), (cl_codes, cl_values, _, cl_scale) = results
    assert is_channels_last(cl_codes) and is_channels_last(cl_values)
    assert torch.equal(cl_codes, codes) and torch.equal(cl_values, values) and torch.equal(cl_scale, scale)
    dequantized = dequantize_codes(cl_codes, scale, lo)
    assert is_channels_last(dequantized) and torch.equal(dequantized, values)


@pytest.mark.parametrize("shape", SHAPES + [(3, 40, PARALLEL_MIN_ELEMENTS // 64)])
@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int8])
def test_one_pass_dequantize_equals_torch_multiply_add(shape, per_sample, code_dtype):
    """``kernels.simulated.dequantize_codes`` (one compiled pass where ``fused.dequantizable``,
    serial and split by rows) gives the bits of ``torch.mul(codes, scale).add_(lo)``."""
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    low, high = (0, 256) if code_dtype == torch.uint8 else (-128, 128)
    codes = torch.randint(low, high, shape, dtype=code_dtype)
    range_shape = (shape[0],) + (1,) * (len(shape) - 1) if per_sample else ()
    scale, lo = torch.rand(range_shape) * 0.1 + 1e-3, torch.randn(range_shape) * 3
    # a 1-D tensor with one range per element has no rows to split: torch's passes
    assert fused.dequantizable(codes, scale, lo) == (not per_sample or len(shape) > 1)
    expected = torch.mul(codes, scale).add_(lo)
    assert torch.equal(dequantize_codes(codes, scale, lo), expected)
    if len(shape) > 1 and shape[0] > 1:  # strided codes: not fusable, torch's passes, same values
        strided = codes.transpose(0, -1)
        assert not fused.dequantizable(strided, torch.tensor(0.5), torch.tensor(1.0))
        assert torch.equal(dequantize_codes(strided, torch.tensor(0.5), torch.tensor(1.0)),
                           torch.mul(strided, 0.5).add_(1.0))


def test_one_dim_tensor_with_a_range_per_element_takes_the_torch_passes():
    """A 1-D tensor is one row: one range per element cannot be split by rows (it used to read
    past the repeated ranges); the torch passes give the codes."""
    x = torch.randn(1000) * 3
    lo, hi = x - torch.rand(1000), x + torch.rand(1000)
    assert not fused.fusable(x, lo, hi)
    codes, values, _, scale = quantize_fused(x, lo, hi, 8, False, False, values=True, last_dim_sums=False)
    expected, expected_scale = quantize_codes(x, lo, hi, 8)
    assert torch.equal(codes, expected.to(torch.uint8)) and torch.equal(values, expected * expected_scale + lo)


def _chi_square_bound(dof: int, z: float = 4.75) -> float:
    """Upper ``~1e-6`` quantile of the chi-square distribution with `dof` degrees of freedom
    (Wilson-Hilferty): a uniform generator exceeds it about once in a million seeds."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * a**0.5) ** 3


def _chi_square(counts: torch.Tensor) -> float:
    expected = counts.sum() / counts.numel()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_dither_words_are_uniform_and_independent():
    """The counter-based CPU dither (``fused.dither_words``): the top 8 bits of 2**20 words are
    uniform over their 256 values, pairs of neighbouring words (same key) and words of two keys at
    one index (two calls) are uniform over the 256 pairs of their top 4 bits, and the low 8 bits
    too (chi-square, fixed keys)."""
    n = 2**20
    words = fused.dither_words(n, 12345).long() + 2**15  # in [0, 2**16)
    assert words.min() >= 0 and words.max() < 2**16
    bound = _chi_square_bound(255)
    assert _chi_square(torch.bincount(words >> 8, minlength=256)) < bound
    assert _chi_square(torch.bincount(words & 255, minlength=256)) < bound
    top = words >> 12
    assert _chi_square(torch.bincount(top[:-1] * 16 + top[1:], minlength=256)) < bound, "neighbours"
    other = (fused.dither_words(n, 12346).long() + 2**15) >> 12  # the next key: another call
    assert _chi_square(torch.bincount(top * 16 + other, minlength=256)) < bound, "two keys"
    # a generator stuck on part of its range fails the same check
    assert _chi_square(torch.bincount((words >> 8).clamp(max=250), minlength=256)) > bound


def _lowbias32_word(index: int, key: int) -> int:
    """The documented word: top 16 bits of lowbias32((index * 0x9E3779B9 + key_low) ^ key_high),
    minus 2**15, in plain Python integers."""
    m = 2**32 - 1
    key %= 2**64
    h = ((index * 0x9E3779B9 + (key & m)) & m) ^ (key >> 32)
    h ^= h >> 16
    h = (h * 0x7FEB352D) & m
    h ^= h >> 15
    h = (h * 0x846CA68B) & m
    h ^= h >> 16
    return (h >> 16) - 2**15


@pytest.mark.parametrize("key", [0, 12345, -(2**63), 2**63 - 1])
def test_dither_words_are_the_documented_hash(key):
    words = fused.dither_words(3000, key)
    assert [int(words[i]) for i in (0, 1, 2, 1023, 1024, 2999)] == [
        _lowbias32_word(i, key) for i in (0, 1, 2, 1023, 1024, 2999)]


def test_dither_words_split_over_threads_and_sized_calls_agree():
    """Word ``i`` depends on ``i`` and the key only: the same words serial and split over two
    threads, and a shorter call gives a prefix of a longer one."""
    serial = fused.dither_words(2 * PARALLEL_MIN_ELEMENTS, 7)
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    assert torch.equal(fused.dither_words(2 * PARALLEL_MIN_ELEMENTS, 7), serial)
    assert torch.equal(fused.dither_words(1000, 7), serial[:1000])
    assert not torch.equal(fused.dither_words(1000, 8), serial[:1000])
    with pytest.raises(ValueError, match="n must be"):
        fused.dither_words(-1, 7)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_pass_stochastic_rounding_is_unbiased(threads):
    """Stochastic rounding in the one-pass quantizer: the mean code of many roundings of a fixed
    value is the value (in steps) within 6 standard errors, over the elements of one call (one
    key, serial and split over threads) and over many calls of a small tensor (one key each)."""
    torch.set_num_threads(threads)  # the autouse fixture restores the thread count
    lo, hi = torch.tensor(0.0), torch.tensor(255.0)  # one step per unit: the code is the rounded value
    steps = torch.tensor([10.1, 40.3, 100.5, 200.7, 250.9])
    n = 2**15
    x = steps[:, None].expand(-1, n).contiguous()  # 5 * 2**15 >= PARALLEL_MIN_ELEMENTS elements
    assert fused.fusable(x, lo, hi)
    codes, _, _, _ = quantize_fused(x, lo, hi, 8, True, False, values=False, last_dim_sums=False)
    tol = 6 * 0.5 / n**0.5  # a rounding's standard deviation is at most half a step
    mean = codes.double().mean(1)
    assert (codes.double() - steps[:, None].double()).abs().max() < 1, "at most one step away"
    assert torch.allclose(mean, steps.double(), atol=tol)
    assert ((steps.double().round() - steps.double()).abs() > 2 * tol).all(), "nearest rounding would fail"
    calls = 4000
    small = torch.stack([quantize_fused(steps, lo, hi, 8, True, False, False, False)[0] for _ in range(calls)])
    assert torch.allclose(small.double().mean(0), steps.double(), atol=6 * 0.5 / calls**0.5)


def test_a_stochastic_call_advances_torch_generator_by_one_draw():
    """Whatever the size, a stochastic call on the CPU takes one 64-bit draw of torch's generator
    (its key): a resumed run's generator stays in step, and the draws are reproducible."""
    lo, hi = torch.tensor(-3.0), torch.tensor(3.0)
    after = []
    for x in (torch.randn(7), torch.randn(300, 500)):
        torch.manual_seed(3)
        first, _, _, _ = quantize_fused(x, lo, hi, 8, True, False, False, False)
        after.append(torch.rand(()))
        torch.manual_seed(3)
        assert torch.equal(quantize_fused(x, lo, hi, 8, True, False, False, False)[0], first)
    torch.manual_seed(3)
    torch.empty((), dtype=torch.int64).random_(-(2**63), None)  # one draw
    assert torch.equal(after[0], torch.rand(())) and torch.equal(after[1], after[0])


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_fake_quantize_one_pass_equals_torch_passes(stochastic, per_row):
    """``fake_quantize`` of a contiguous float32 tensor (one compiled pass) gives the bits of the
    torch passes it takes for a strided copy of the same values (the dither words follow the
    logical element order in both)."""
    from lp_decentral_nlp.quant.functional import fake_quantize

    strided = (torch.randn(40, 3) * 2).T  # (3, 40), not contiguous: the torch passes
    x = strided.contiguous()
    lo, hi = (x.amin(1, keepdim=True), x.amax(1, keepdim=True)) if per_row else tensor_range(x)
    assert fused.fusable(x, lo, hi) and not fused.fusable(strided, lo, hi)
    torch.manual_seed(4)
    one_pass = fake_quantize(x, lo, hi, 8, stochastic)
    torch.manual_seed(4)
    assert torch.equal(one_pass, fake_quantize(strided, lo, hi, 8, stochastic))


@pytest.mark.parametrize("shape", [(1, 1), (37, 29), (64, PARALLEL_MIN_ELEMENTS // 32)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("acc_dtype", [torch.int32, torch.float32])
def test_one_pass_epilogue_equals_torch_passes(shape, per_row, with_bias, acc_dtype):
    """``fused.affine_epilogue`` (serial and split by rows) gives the bits of torch's float64
    passes ``(row_offset * col_sums + bias) + acc * row_scale + row_term`` (unfused multiply-adds:
    the int8 kernel's ``addcmul`` elsewhere may fuse one), rounded once to fp32 (or kept in
    float64), for the int32 product of ``torch._int_mm`` and the integer-valued fp32 one of other
    CPUs; float32 coefficients (a layer's bias) are read in float64."""
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    m, n = shape
    acc = torch.randint(-2**22, 2**22, shape, dtype=torch.int32).to(acc_dtype)
    row_shape = (m, 1) if per_row else ()
    row_scale = torch.rand(row_shape, dtype=torch.float64) * 1e-3
    row_offset = torch.randn(row_shape, dtype=torch.float64)
    col_sums, row_term = torch.randn(1, n, dtype=torch.float64) * 100, torch.randn(m, 1, dtype=torch.float64)
    bias = torch.nn.Parameter(torch.randn(n)) if with_bias else None  # a layer's bias, float32
    assert fused.epilogue_fusable(acc, row_scale, row_offset, col_sums, row_term, *([bias] if with_bias else []))
    col_term = row_offset * col_sums + (0 if bias is None else bias.detach().double())
    expected = (col_term + acc.double() * row_scale) + row_term
    out = fused.affine_epilogue(acc, row_scale, row_offset, col_sums, bias, row_term)
    assert out.dtype == torch.float32 and torch.equal(out, expected.float())
    wide = fused.affine_epilogue(acc, row_scale, row_offset, col_sums, bias, row_term, torch.float64)
    assert wide.dtype == torch.float64 and torch.equal(wide, expected)
    if m > 1 and n > 1:  # a strided product: torch's passes
        assert not fused.epilogue_fusable(acc.T, row_scale, row_offset, col_sums, row_term)


@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (3072, 768), (5, PARALLEL_MIN_ELEMENTS // 4)])
@pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int8])
def test_one_pass_column_sums_equal_torch(shape, code_dtype):
    """``fused.code_column_sums`` gives torch's exact integer column sums, extreme codes included."""
    low, high = (0, 256) if code_dtype == torch.uint8 else (-128, 128)
    codes = torch.randint(low, high, shape, dtype=code_dtype)
    codes[:, 0] = high - 1
    out = fused.code_column_sums(codes)
    assert out.dtype == torch.float32 and out.shape == (1, shape[1])
    assert torch.equal(out, codes.sum(0, keepdim=True, dtype=torch.int64).float())


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 16, 9, 7), (32, 16, 32, 32)])
def test_channel_sums_equal_torch(shape):
    """``fused.channel_sums`` gives torch's exact sums over the channels of uint8 codes (the largest
    shape split over samples)."""
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    codes[:, :, 0, 0] = 255
    expected = codes.sum(1, keepdim=True, dtype=torch.int64).float()
    assert torch.equal(fused.channel_sums(codes), expected)
    assert torch.equal(fused.channel_sums(codes.contiguous(memory_format=torch.channels_last)), expected)


@pytest.mark.parametrize("geometry", [((3, 3), (1, 1), (1, 1), (1, 1)), ((3, 3), (2, 2), (1, 1), (1, 1)),
                                      ((5, 3), (1, 2), (2, 0), (2, 1)), ((1, 1), (2, 2), (0, 0), (1, 1))])
def test_window_sums_equal_a_convolution_with_ones(geometry):
    """``fused.window_sums`` is ``conv2d(values, ones)`` of any stride, padding and dilation, exactly
    (serial, and split over samples)."""
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    kernel_size, stride, padding, dilation = geometry
    values = torch.randint(0, 256 * 64, (3, 1, 11, 10)).float()
    check_window_sums(values, kernel_size, stride, padding, dilation)
    check_window_sums(torch.randint(0, 256 * 64, (32, 1, 34, 33)).float(), kernel_size, stride, padding, dilation)


def check_window_sums(values, kernel_size, stride, padding, dilation):
    expected = torch.nn.functional.conv2d(values.double(), torch.ones((1, 1) + kernel_size, dtype=torch.float64),
                                          None, stride, padding, dilation).float()
    assert torch.equal(fused.window_sums(values, kernel_size, stride, padding, dilation), expected)


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_epilogue_equals_torch_passes(per_sample, with_bias):
    """``fused.conv_epilogue`` reads a channels-last product and writes ``acc * s + w * sums + l *
    border + bias`` channels last, with torch's unfused float64 operations in that order rounded
    once to fp32 (serial and split over samples); float32 coefficients are read in float64."""
    torch.set_num_threads(2)  # the autouse fixture restores the thread count
    n, co, ho, wo = 8, 24, 19, 18  # past PARALLEL_MIN_ELEMENTS: split over samples
    acc = torch.randint(-2**22, 2**22, (n, co, ho, wo)).float().contiguous(memory_format=torch.channels_last)
    per = (n, 1, 1, 1) if per_sample else ()
    row_scale, window_coef = torch.rand(per, dtype=torch.float64) * 1e-3, torch.randn(per, dtype=torch.float64)
    row_offset = torch.randn(per)  # float32: read in float64
    window_sums, border = torch.randint(0, 2**16, (n, 1, ho, wo)).float(), torch.randn(co, ho, wo, dtype=torch.float64)
    bias = torch.nn.Parameter(torch.randn(co)) if with_bias else None
    expected = (acc.double() * row_scale + window_coef * window_sums.double()) + row_offset.double() * border
    if bias is not None:
        expected = expected + bias.detach().double().view(1, -1, 1, 1)
    position_major = border.permute(1, 2, 0).reshape(ho * wo, co)  # the epilogue's (Ho * Wo, Co)
    out = fused.conv_epilogue(acc, row_scale, window_coef, window_sums, row_offset, position_major, bias)
    assert out.is_contiguous(memory_format=torch.channels_last) and torch.equal(out, expected.float())
