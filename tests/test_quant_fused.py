"""The one-pass quantizer (``quant/fused.py``, via ``functional.quantize_fused``) gives bit for bit
the codes, values and row sums of the torch passes of ``functional.quantize_codes``."""
import pytest
import torch

from lp_decentral_nlp.quant.functional import grad_range, quantize_codes, quantize_fused, tensor_range
from lp_decentral_nlp.quant import fused
from lp_decentral_nlp.quant.fused import PARALLEL_MIN_ELEMENTS
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
