"""Affine quantization primitives of SPEC 4: grids, stochastic rounding, ranges."""
import pytest
import torch

from lp_decentral_nlp.quant.functional import (
    fake_quantize,
    mean_sample_range,
    quantize_codes,
    sample_range,
    tensor_range,
    update_running_range,
)


def assert_on_grid(values, lo, scale, bits=8):
    """Every value is lo + k * scale with integer k in [0, 2**bits - 1]."""
    k = (values - lo) / scale
    assert torch.allclose(k, k.round(), atol=1e-3), "values off the affine grid"
    assert k.round().min() >= 0 and k.round().max() <= 2**bits - 1
    assert k.round().unique().numel() <= 2**bits


@pytest.mark.parametrize("bits", [8, 4])
def test_nearest_rounding_lands_on_grid_within_half_a_step(bits):
    x = torch.randn(1000) * 3
    lo, hi = tensor_range(x)
    x_hat = fake_quantize(x, lo, hi, bits)
    scale = (hi - lo) / (2**bits - 1)
    assert_on_grid(x_hat, lo, scale, bits)
    assert (x_hat - x).abs().max() <= scale / 2 + 1e-6
    assert x_hat.min() == pytest.approx(lo.item()) and x_hat.max() == pytest.approx(hi.item(), rel=1e-6)


def test_codes_are_integers_in_range_and_clamped_outside():
    x = torch.tensor([-5.0, 0.0, 0.2, 0.71, 1.0, 7.0])
    codes, scale = quantize_codes(x, torch.tensor(0.0), torch.tensor(1.0), 8)
    assert codes.tolist() == [0, 0, 51, 181, 255, 255]  # round(0.71 * 255 = 181.05)
    assert scale.item() == pytest.approx(1 / 255)
    signed, _ = quantize_codes(x, torch.tensor(0.0), torch.tensor(1.0), 8, signed=True)  # the int8 kernel's codes
    assert signed.tolist() == [-128, -128, -77, 53, 127, 127]


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    lo, hi = torch.tensor(0.0), torch.tensor(1.0)
    scale = 1 / 255
    # Values sitting 0.1, 0.3, 0.7 and 0.9 of a step above a grid point.
    x = torch.tensor([10.1, 40.3, 100.7, 200.9]) * scale
    n = 20000
    draws = fake_quantize(x.expand(n, -1), lo, hi, 8, stochastic=True)
    assert_on_grid(draws, lo, torch.tensor(scale))
    assert ((draws - x).abs() < scale + 1e-7).all(), "stochastic rounding moves at most one step"
    # Standard error of the mean is at most scale / (2 sqrt(n)); allow 6 of them.
    tol = 6 * scale / (2 * n**0.5)
    assert torch.allclose(draws.mean(0), x, atol=tol)
    nearest = fake_quantize(x, lo, hi, 8)
    assert ((nearest - x).abs() > 2 * tol).all(), "the same check would catch nearest rounding's bias"


def test_stochastic_rounding_draws_from_torch_rng():
    x = torch.randn(256)
    lo, hi = tensor_range(x)
    torch.manual_seed(1)
    a = fake_quantize(x, lo, hi, 8, stochastic=True)
    torch.manual_seed(1)
    b = fake_quantize(x, lo, hi, 8, stochastic=True)
    c = fake_quantize(x, lo, hi, 8, stochastic=True)
    assert torch.equal(a, b)
    assert not torch.equal(b, c)


def test_zero_width_range_returns_the_constant():
    x = torch.full((4, 3), 2.5)
    lo, hi = tensor_range(x)
    for stochastic in (False, True):
        assert torch.equal(fake_quantize(x, lo, hi, 8, stochastic), x)


def test_mean_sample_range_is_the_batch_mean_of_per_sample_extremes():
    x = torch.randn(5, 7, 3)
    lo, hi = mean_sample_range(x, batched=True)
    assert lo.item() == pytest.approx(torch.stack([s.min() for s in x]).mean().item())
    assert hi.item() == pytest.approx(torch.stack([s.max() for s in x]).mean().item())
    assert lo > x.min() and hi < x.max()  # the mean of extremes is inside the batch's full range
    lo1, hi1 = mean_sample_range(x[0], batched=False)
    assert (lo1, hi1) == (x[0].min(), x[0].max())
    s_lo, s_hi = sample_range(x)
    assert s_lo.shape == (5,) and torch.equal(s_hi, x.flatten(1).max(1).values)


def test_running_range_uses_pytorch_momentum_convention():
    rmin, rmax, n = torch.zeros(()), torch.zeros(()), torch.zeros((), dtype=torch.long)
    update_running_range(rmin, rmax, n, torch.tensor(-2.0), torch.tensor(4.0), 0.1)
    assert (rmin.item(), rmax.item(), n.item()) == (-2.0, 4.0, 1)  # first batch initialises
    update_running_range(rmin, rmax, n, torch.tensor(-1.0), torch.tensor(6.0), 0.1)
    # new = (1 - m) * old + m * batch: the newest batch weighs 0.1, not 0.9.
    assert rmin.item() == pytest.approx(0.9 * -2.0 + 0.1 * -1.0)
    assert rmax.item() == pytest.approx(0.9 * 4.0 + 0.1 * 6.0)
    assert n.item() == 2
    update_running_range(rmin, rmax, n, torch.tensor(float("nan")), torch.tensor(6.0), 0.1)
    assert n.item() == 2 and rmin.item() == pytest.approx(0.9 * -2.0 + 0.1 * -1.0)  # a NaN batch is left out


def test_running_range_on_a_device_reads_no_value_back():
    """Off the CPU the update is device ops only (a CPU range is read on the host, a device's would
    wait for it): meta tensors, whose values cannot be read, run it."""
    rmin, rmax, n = (torch.zeros((), device="meta", dtype=dtype) for dtype in (torch.float32, torch.float32, torch.long))
    update_running_range(rmin, rmax, n, torch.zeros((), device="meta"), torch.ones((), device="meta"), 0.1)
    with pytest.raises(RuntimeError, match="meta"):
        rmin.item()  # what the CPU path does, refused here


def test_stochastic_rounding_of_a_strided_tensor_uses_every_element_once():
    # the 16-bit dithers are laid out contiguously; a transposed input still gets one per element
    lo, hi = torch.tensor(0.0), torch.tensor(1.0)
    scale = 1 / 255
    x = torch.full((3000, 5), 0.5 * scale).T  # every value half a step above 0
    torch.manual_seed(0)
    draws = fake_quantize(x, lo, hi, 8, stochastic=True)
    assert draws.shape == x.shape
    up = (draws > 0).float()
    assert draws.unique().tolist() == [0.0, pytest.approx(scale)]
    assert abs(up.mean().item() - 0.5) < 6 * 0.5 / (up.numel() ** 0.5)
    assert 0.3 < up.mean(1).min() and up.mean(1).max() < 0.7  # no row left without its own dithers


def test_a_range_per_column_is_read_by_broadcasting_whatever_the_layout():
    """A (4,) range against a (4, 4) tensor broadcasts along the last dim (one range per column);
    the one-pass CPU path read it as one range per row, so a contiguous tensor and a strided copy
    of it got different values, and a (4,) range against a (4, 3) tensor, which cannot broadcast,
    was taken."""
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    lo, hi = torch.tensor([-3.0, -1.0, -0.5, -2.0]), torch.tensor([3.0, 1.0, 0.5, 2.0])
    codes, step = quantize_codes(x, lo, hi, 8)
    by_broadcasting = codes * step + lo
    assert torch.equal(fake_quantize(x, lo, hi, 8), by_broadcasting)  # the one-pass path
    assert torch.equal(fake_quantize(x.t().contiguous().t(), lo, hi, 8), by_broadcasting)  # the torch passes
    with pytest.raises(RuntimeError, match="must match"):
        fake_quantize(torch.randn(4, 3), lo, hi, 8)
    rows = (lo.reshape(4, 1), hi.reshape(4, 1))  # one range per row: the one-pass path's shape
    assert torch.equal(fake_quantize(x, *rows, 8), fake_quantize(x.t().contiguous().t(), *rows, 8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_quantized_in_float32(dtype):
    """A float16/bfloat16 input was scaled and rounded in its own dtype, which cannot tell 256
    levels apart: 6% (float16) and 13% (bfloat16) of nearest codes were wrong, and stochastic
    rounding was biased by up to a third of a step."""
    torch.manual_seed(0)
    x = torch.randn(4096).to(dtype)
    lo, hi = tensor_range(x.float())
    codes, _ = quantize_codes(x, lo, hi, 8)
    assert torch.equal(codes, quantize_codes(x.float(), lo, hi, 8)[0])
    values = fake_quantize(x, lo, hi, 8)
    assert values.dtype == dtype and torch.equal(values, fake_quantize(x.float(), lo, hi, 8).to(dtype))
    exact = (x.float() - lo) / ((hi - lo) / 255)
    draws = torch.stack([quantize_codes(x, lo, hi, 8, stochastic=True)[0] for _ in range(200)])
    assert (draws.mean(0) - exact).abs().mean() < 0.05  # unbiased: the mean of 200 draws within noise


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])  # the one-pass CPU path, the torch passes
def test_a_range_far_from_zero_is_quantized_as_the_spec_formula(stochastic, contiguous):
    """``x * inv - lo * inv`` cancels when |lo| is large against the range: for values in
    [1000, 1000.01], 69% of nearest codes were wrong and stochastic rounding was off by 1.4 steps.
    The codes are now those of SPEC 4's ``(x - lo) / s`` computed in float64."""
    torch.manual_seed(0)
    x = 1000 + 0.01 * torch.rand(64, 64)
    if not contiguous:
        x = x.t().contiguous().t()
    lo, hi = tensor_range(x)
    exact = (x.double() - lo.double()) / ((hi.double() - lo.double()) / 255)
    if stochastic:
        draws = torch.stack([quantize_codes(x, lo, hi, 8, stochastic=True)[0] for _ in range(100)])
        assert (draws.double().mean(0) - exact).abs().mean() < 0.05
    else:
        codes = quantize_codes(x, lo, hi, 8)[0]
        assert (codes.double() - exact.round()).abs().max() <= 1  # a tie may round either way
        assert (codes.double() != exact.round()).float().mean() < 0.001
        assert torch.equal(fake_quantize(x, lo, hi, 8), codes * ((hi - lo) / 255) + lo)


def test_a_range_too_narrow_for_a_float32_reciprocal_is_a_constant():
    """A range under ~3e-36 has a subnormal step whose reciprocal overflows: the codes were garbage
    (the values off by 144 steps). It now dequantizes to its minimum, as a zero-width range."""
    x = torch.tensor([1e-37, 2e-37, 3e-37])
    lo, hi = tensor_range(x)
    for values in (fake_quantize(x, lo, hi, 8), fake_quantize(x.expand(2, 3).t(), lo, hi, 8)):
        assert torch.equal(values, torch.full_like(values, 1e-37))
