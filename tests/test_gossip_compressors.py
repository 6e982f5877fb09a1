"""Compressors: what is decoded from the real wire buffer, and how many bytes that buffer has (SPEC 3)."""
import math

import numpy as np
import pytest
import torch

from lp_decentral_nlp.gossip import QSGD, Identity, MessageLayout, Quantize, RandomK, TopK, index_dtype
from lp_decentral_nlp.gossip.codec_kernels import add_decoded, encode_affine8, largest_in_band, split_by_magnitude
from lp_decentral_nlp.gossip.wire import Message, pack_codes, unpack_codes


def roundtrip(comp, x, seed=0):
    """Encode ``x`` into a real message buffer, decode it back; returns (C(x), message)."""
    msg = Message(MessageLayout([comp.fields(x.numel(), x.dtype)]), x.device)
    gen = torch.Generator().manual_seed(seed) if comp.stochastic else None
    comp.encode(x, msg.fields[0], torch.empty_like(x), gen)
    out = torch.zeros_like(x)
    comp.decode_add(msg.fields[0], out, 1.0, torch.empty_like(x))
    return out, msg


def top_k(a, k, b=None, value_bits=None):
    """The public TopK's message of the ``k`` largest ``|a|`` (``|a - b|`` with `b`: Choco's
    ``encode_difference``, which reads both tensors): ``(indices as int64, values decoded)``."""
    comp = TopK(k / a.numel(), value_bits=value_bits)
    assert comp.num_kept(a.numel()) == k
    msg = Message(MessageLayout([comp.fields(a.numel(), a.dtype)]), a.device)
    if b is None:
        comp.encode(a, msg.fields[0], torch.empty_like(a), None)
    else:
        assert comp.encode_difference(a, b, msg.fields[0], torch.empty_like(a), None)
    indices = msg.fields[0]["indices"].to(torch.int64)
    decoded = torch.zeros_like(a)
    comp.decode_add(msg.fields[0], decoded, 1.0, torch.empty_like(a))
    return indices, decoded[indices]


def test_index_dtype_is_the_smallest_unsigned_type_that_fits():
    assert index_dtype(256) == torch.uint8
    assert index_dtype(257) == torch.uint16
    assert index_dtype(65536) == torch.uint16
    assert index_dtype(65537) == torch.uint32
    assert index_dtype(2**32 + 1) == torch.int64


def test_identity_is_exact_and_sends_numel_floats():
    x = torch.randn(1000)
    out, msg = roundtrip(Identity(), x)
    assert torch.equal(out, x) and msg.nbytes == 4000
    out64, msg64 = roundtrip(Identity(), x.double())
    assert msg64.nbytes == 8000


@pytest.mark.parametrize("numel,index_bytes", [(200, 1), (5000, 2), (70000, 4)])
def test_topk_keeps_exactly_the_largest_magnitudes_with_smallest_indices(numel, index_bytes):
    x = torch.randn(numel)
    comp = TopK(0.01)
    k = math.ceil(0.01 * numel)
    out, msg = roundtrip(comp, x)
    expected = torch.zeros_like(x)
    top = x.abs().topk(k).indices
    expected[top] = x[top]
    assert torch.equal(out, expected)
    assert msg.nbytes == k * 4 + k * index_bytes
    assert msg.fields[0]["indices"].dtype == index_dtype(numel)


def test_topk_fast_cpu_selection_is_an_exact_top_k_on_large_and_adversarial_inputs():
    torch.manual_seed(3)
    # sizes at the smallest sample (40k: 4096 entries), in between, and at the largest (17M: 65536)
    for x in (torch.randn(1_000_003), torch.randn(600_000).exp(), torch.arange(700_000.0).flip(0),
              torch.cat([torch.zeros(500_000), torch.ones(1000) * 3, torch.randn(100_000) * 0.01]),
              torch.randn(40_000), torch.randn(17_000_000), torch.randint(0, 50, (300_000,)).float()):
        for k in (1, 77, 1000, 9_999, 12_345, 100_000, 140_000):  # up to keep = 23%: the bracket path
            if 4 * k >= x.numel():
                continue
            got, values = top_k(x, k)
            assert got.unique().numel() == k  # every place written, no repeats
            kth = x.abs().topk(k).values[-1]
            assert torch.all(x[got].abs() >= kth)  # an exact top-k (ties may pick other indices)
            assert torch.equal(values, x[got])
            if k > 1:  # 8-bit TopK gathers the values in its scratch: the band must not overwrite them
                got8, values8 = top_k(x, k, value_bits=8)
                # within half a step of the 8-bit grid, up to the fp32 rounding of the decode
                bound = (values.max() - values.min()) / 255 / 2 + 1e-6 * values.abs().max()
                assert torch.equal(got8, got) and torch.all((values8 - values).abs() <= bound)


def test_topk_of_a_difference_selects_and_gathers_like_the_written_difference():
    """Choco's C(x~ - x^): the scan reads both tensors; the same positions and values as the
    top-k of ``a - b`` written out, in the bracket path and in the exact one."""
    torch.manual_seed(4)
    for n, k in ((1_000_003, 100_001), (2_000, 200), (50_000, 20_000)):  # bracket, small, k >= n / 4
        for dtype in (torch.float32, torch.float64):
            a = torch.randn(n, dtype=dtype)
            b = a + torch.randn(n, dtype=dtype) * torch.rand(n, dtype=dtype)
            before = (a.clone(), b.clone())
            got, values = top_k(a, k, b)
            assert torch.equal(a, before[0]) and torch.equal(b, before[1])
            want, want_values = top_k(a - b, k)
            assert torch.equal(got.sort().values, want.sort().values)  # no ties among random floats
            assert torch.equal(values, (a - b)[got])


@pytest.mark.parametrize("dtype,band_dtype", [(np.float32, np.int32), (np.float64, np.int64)])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4099])  # partial, whole and whole + partial 64-entry words
@pytest.mark.parametrize("difference", [False, True])
def test_split_by_magnitude_splits_positions_and_values_by_magnitude_like_numpy(dtype, band_dtype, n, difference):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(dtype)
    x[::7] = np.nan  # NaNs count above t_hi, as torch.topk ranks NaN above every number
    x[1::11] = 1.0  # entries exactly at a threshold: >= t_lo is in the band, > t_hi is above
    if difference:  # x = a - b exactly: b's entries are small integers, a = x + b is exact
        b = rng.integers(-4, 5, n).astype(dtype)
        a, x = x + b, (x + b) - b
    else:
        a, b = x, None
    for t_lo, t_hi in ((0.5, 1.0), (1.0, 1.0), (0.0, math.inf), (3.0, 9.0)):
        above, band = np.zeros(n, np.uint32), np.zeros(n, band_dtype)
        above_values, band_values = np.zeros(n, dtype), np.zeros(n, dtype)
        num_above, num_band = split_by_magnitude(a, b, t_lo, t_hi, above, above_values, band, band_values)
        magnitude = np.abs(x)
        expected_above = np.flatnonzero((magnitude > t_hi) | np.isnan(magnitude))
        expected_band = np.flatnonzero((magnitude >= t_lo) & (magnitude <= t_hi))
        assert np.array_equal(above[:num_above], expected_above)
        assert np.array_equal(band[:num_band], expected_band)
        assert np.array_equal(above_values[:num_above], x[expected_above], equal_nan=True)
        assert np.array_equal(band_values[:num_band], x[expected_band])


def test_split_by_magnitude_reports_a_class_without_room_and_names_bad_arrays():
    x = np.arange(1, 201, dtype=np.float32)  # 50 entries above 150, 150 in the band [0, 150]

    def split(room_above, room_band, a=x, b=None, values_dtype=np.float32, positions_dtype=np.int32):
        return split_by_magnitude(a, b, 0.0, 150.0, np.empty(room_above, np.int64), np.empty(room_above, values_dtype),
                                  np.empty(room_band, positions_dtype), np.empty(room_band, values_dtype))

    assert split(50, 150) == (50, 150)
    assert split(49, 150)[0] == -1
    assert split(50, 149)[1] == -1
    with pytest.raises(ValueError, match="contiguous 1-D float32 or float64"):
        split(50, 150, a=x[::2])
    with pytest.raises(ValueError, match="b must be a contiguous float32 array of shape"):
        split(50, 150, b=x[:100])
    with pytest.raises(ValueError, match="above_values must be a float32 array"):
        split(50, 150, values_dtype=np.float64)
    with pytest.raises(ValueError, match="band must be a 1-D integer array that holds position 199"):
        split(50, 150, positions_dtype=np.float32)
    with pytest.raises(ValueError, match="band must be a 1-D integer array that holds position 299"):
        split_by_magnitude(np.ones(300, np.float32), None, 0.0, 1.0, np.empty(1, np.int64),
                           np.empty(1, np.float32), np.empty(1, np.uint8), np.empty(1, np.float32))


@pytest.mark.parametrize("comp", [TopK(0.1), TopK(0.01, value_bits=8)])
@pytest.mark.parametrize("numel", [300, 70_000, 1_000_003])  # the exact top-k, the smallest bracket, a large one
def test_topk_encodes_a_difference_into_the_same_bytes_as_the_written_difference(comp, numel):
    torch.manual_seed(numel)
    a, b = torch.randn(numel), torch.randn(numel)
    layout = MessageLayout([comp.fields(numel, a.dtype)])
    fused, written = Message(layout, a.device), Message(layout, a.device)
    assert comp.encode_difference(a, b, fused.fields[0], torch.empty_like(a), None)
    comp.encode(a - b, written.fields[0], torch.empty_like(a), None)
    decoded = [torch.zeros(numel) for _ in range(2)]
    for msg, out in zip((fused, written), decoded):
        comp.decode_add(msg.fields[0], out, 1.0, torch.empty_like(a))
    assert torch.equal(decoded[0], decoded[1])  # the same C(a - b): same entries, same values
    # the same positions (in the scan's order, so the same bytes) and the same value codes
    assert torch.equal(fused.buffer, written.buffer)


def test_codecs_without_a_difference_path_decline_it_and_write_nothing():
    a, b = torch.randn(100_000), torch.randn(100_000)
    for comp, x, y in ((TopK(0.1), a.half(), b.half()), (TopK(0.1), a[::2], b[::2]),
                       (TopK(0.1), a.clone().requires_grad_(), b), (RandomK(0.1), a, b), (Quantize(8), a, b), (Identity(), a, b)):
        msg = Message(MessageLayout([comp.fields(x.numel(), x.dtype)]), x.device)
        msg.buffer.fill_(7)
        assert not comp.encode_difference(x, y, msg.fields[0], torch.empty_like(x), None)
        assert bool((msg.buffer == 7).all())


def test_keep_fraction_rounds_up_and_never_below_one():
    comp = TopK(0.01)
    assert comp.num_kept(100) == 1 and comp.num_kept(101) == 2 and comp.num_kept(3) == 1
    assert comp.num_kept(768) == 8 and TopK(1.0).num_kept(10) == 10


def test_topk_with_8_bit_values_sends_uint8_values_plus_scale_and_zero_point():
    x = torch.randn(5000)
    comp = TopK(0.02, value_bits=8)
    out, msg = roundtrip(comp, x)
    k = 100
    assert msg.nbytes == k * 1 + k * 2 + 4 + 4
    assert msg.fields[0]["values"].dtype == torch.uint8
    top = x.abs().topk(k).indices
    kept = x[top]
    step = (kept.max() - kept.min()) / 255
    assert torch.equal(out.nonzero().squeeze(1).sort().values, top.sort().values)
    assert torch.all((out[top] - kept).abs() <= step / 2 + 1e-6)
    # decoded values lie on the 8-bit grid of the wire's scale / zero point
    codes = (out[top] - msg.fields[0]["zero_point"]) / msg.fields[0]["scale"]
    torch.testing.assert_close(codes, codes.round(), atol=1e-3, rtol=0)


def test_randomk_draws_k_distinct_uniform_entries_seeded_and_unbiased_scaling():
    x = torch.randn(3000)
    comp = RandomK(0.1)
    out, msg = roundtrip(comp, x, seed=5)
    kept = out.nonzero().squeeze(1)
    assert kept.numel() == 300 and torch.equal(out[kept], x[kept])
    assert msg.nbytes == 300 * 4 + 300 * 2
    again, _ = roundtrip(comp, x, seed=5)
    other, _ = roundtrip(comp, x, seed=6)
    assert torch.equal(out, again) and not torch.equal(out, other)
    unbiased, _ = roundtrip(RandomK(0.1, unbiased=True), x, seed=5)
    torch.testing.assert_close(unbiased, out * 10)
    # every index equally likely: over many seeds each entry is kept ~10% of the time
    counts = torch.zeros(3000)
    for s in range(200):
        counts += roundtrip(comp, torch.ones(3000), seed=s)[0]
    assert counts.sum() == 200 * 300
    assert 0.07 < counts.mean() / 200 < 0.13 and counts.max() < 60


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantize_is_affine_on_a_2_pow_bits_grid_with_packed_codes(bits):
    x = torch.randn(1001) * 3 + 1
    out, msg = roundtrip(Quantize(bits), x)
    assert msg.nbytes == math.ceil(1001 * bits / 8) + 8
    levels = 2**bits - 1
    scale = (x.max() - x.min()) / levels
    assert torch.all((out - x).abs() <= scale / 2 + 1e-5)
    codes = (out - x.min()) / scale
    torch.testing.assert_close(codes, codes.round().clamp(0, levels), atol=1e-3, rtol=0)
    assert out.min() == x.min()


def test_quantize_8_bit_is_4x_smaller_than_fp32_and_constant_tensors_are_exact():
    x = torch.randn(4096)
    assert roundtrip(Quantize(8), x)[1].nbytes * 4 == roundtrip(Identity(), x)[1].nbytes + 4 * 8
    const = torch.full((10,), 2.5)
    assert torch.equal(roundtrip(Quantize(8), const)[0], const)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_8_bit_codes_are_the_torch_formula_s_codes(dtype):
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4001, dtype=dtype) * 3, torch.tensor([0.5, 1.5, 2.5], dtype=dtype)])  # .5 ties
    lo, hi = torch.aminmax(x)
    scale = (hi - lo) / 255
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    assert encode_affine8(x.numpy(), lo.item(), hi.item(), codes.numpy()) == scale.item()  # bit for bit
    assert torch.equal(codes, ((x - lo) * (1 / scale)).round().clamp(0, 255).to(torch.uint8))
    ties = torch.tensor([0.0, 127.5, 1.5, 2.5, 3.5, 255.0], dtype=dtype)  # scale exactly 1
    assert encode_affine8(ties.numpy(), 0.0, 255.0, codes[:6].numpy()) == 1.0
    assert codes[:6].tolist() == [0, 128, 2, 2, 4, 255]  # round half to even, as torch.round
    assert encode_affine8(torch.full((5,), 2.5, dtype=dtype).numpy(), 2.5, 2.5, codes[:5].numpy()) == 0.0
    assert codes[:5].tolist() == [0] * 5  # a constant tensor: all codes 0, decoded exactly
    assert math.isnan(encode_affine8(ties.numpy(), math.nan, math.nan, codes[:6].numpy()))  # aminmax of a NaN
    assert codes[:6].tolist() == [0] * 6
    target = torch.randn(x.numel(), dtype=dtype)
    expected = target + -0.25 * (codes.to(dtype) * scale + lo)
    add_decoded(codes.numpy(), -0.25, target.numpy(), scale=scale.item(), zero_point=lo.item())
    # the same operations in the same order: at most a last-bit difference where torch fuses a multiply-add
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(target, expected, rtol=2 * eps, atol=2 * eps)
    with pytest.raises(ValueError, match="values must be a uint8 array of shape"):
        add_decoded(codes[:-1].numpy(), 1.0, target.numpy(), scale=1.0, zero_point=0.0)
    with pytest.raises(ValueError, match="lo must be <= hi"):
        encode_affine8(x.numpy(), 1.0, 0.0, codes.numpy())


@pytest.mark.parametrize("value_bits", [None, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_sparse_decoding_adds_the_bits_torch_s_index_add_adds(value_bits, dtype):
    torch.manual_seed(1)
    n = 70_000
    x = torch.randn(n, dtype=dtype)
    comp = TopK(0.1, value_bits=value_bits)
    msg = Message(MessageLayout([comp.fields(n, dtype)]), torch.device("cpu"))
    comp.encode(x, msg.fields[0], torch.empty_like(x), None)
    fields = msg.fields[0]
    target = torch.randn(n, dtype=dtype)
    expected = target.clone()  # torch's path: decode into a buffer, then index_add_ with alpha
    if value_bits is None:
        decoded = fields["values"]
    else:
        decoded = fields["values"].to(dtype).mul_(fields["scale"]).add_(fields["zero_point"])
    expected.index_add_(0, fields["indices"].long(), decoded, alpha=-0.3)
    comp.decode_add(fields, target, -0.3, torch.empty_like(x))
    assert torch.equal(target, expected)


def test_compiled_decoding_names_an_index_out_of_range_and_mismatched_arguments():
    target = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match=r"indices\[1\] = 10 is outside \[0, 10\)"):
        add_decoded(np.ones(2, np.float32), 1.0, target, indices=np.array([3, 10], np.uint32))
    assert target.tolist() == [0, 0, 0, 1] + [0] * 6  # entries before the bad one were added
    with pytest.raises(ValueError, match="scale and zero_point must be given together"):
        add_decoded(np.ones(10, np.uint8), 1.0, target, scale=1.0)
    with pytest.raises(ValueError, match="values must be a float32 array of shape"):
        add_decoded(np.ones(10, np.float64), 1.0, target)
    with pytest.raises(ValueError, match="indices must be a 1-D integer array"):
        add_decoded(np.ones(2, np.float32), 1.0, target, indices=np.zeros(2, np.float32))


def test_largest_in_band_keeps_the_largest_magnitudes_in_band_order_and_the_earliest_ties():
    rng = np.random.default_rng(0)
    band_values = rng.standard_normal(5000).astype(np.float32)
    band = np.sort(rng.choice(10**6, 5000, replace=False)).astype(np.int32)
    for count in (0, 1, 17, 2500, 4999, 5000):
        indices, values = np.empty(count, np.uint32), np.empty(count, np.float32)
        largest_in_band(band, band_values, indices, values)
        chosen = np.sort(np.argsort(-np.abs(band_values), kind="stable")[:count])
        assert np.array_equal(indices, band[chosen]) and np.array_equal(values, band_values[chosen])
    ties = np.array([1.0, -2.0, 2.0, 0.5, -2.0, 2.0], np.float64)  # 3 of the 4 entries at |2| fit
    indices, values = np.empty(3, np.int64), np.empty(3, np.float64)
    largest_in_band(np.arange(6) * 10, ties, indices, values)
    assert indices.tolist() == [10, 20, 40] and values.tolist() == [-2.0, 2.0, -2.0]
    largest_in_band(np.arange(6) * 10, np.full(6, -3.0), indices, values)  # one magnitude: one histogram bin
    assert indices.tolist() == [0, 10, 20] and values.tolist() == [-3.0] * 3
    with pytest.raises(ValueError, match="indices must be a 1-D integer array of at most 6 entries"):
        largest_in_band(np.arange(6), ties, np.empty(7, np.int64), np.empty(7, np.float64))
    with pytest.raises(ValueError, match="values must be a float64 array of shape"):
        largest_in_band(np.arange(6), ties, indices, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="band must be an integer array of shape"):
        largest_in_band(np.arange(5), ties, indices, values)


def test_qsgd_is_unbiased_on_its_levels_with_packed_codes():
    torch.manual_seed(0)
    x = torch.randn(500)
    comp = QSGD(levels=4, scaled=False)  # the original QSGD
    out, msg = roundtrip(comp, x)
    assert msg.nbytes == math.ceil(500 * 4 / 8) + 4  # 9 signed levels -> 4-bit codes
    norm = x.norm()
    levels = out / norm * 4
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)
    assert torch.all(torch.sign(out) * torch.sign(x) >= 0)
    mean = sum(roundtrip(comp, x, seed=s)[0] for s in range(2000)) / 2000
    assert (mean - x).abs().max() < 0.15 * norm / 4
    assert roundtrip(QSGD(1), x)[1].nbytes == math.ceil(500 / 4) + 4
    assert roundtrip(QSGD(127), x)[1].nbytes == 500 + 4


@pytest.mark.parametrize("scale", [1e19, 1e-23])
def test_qsgd_sends_entries_whose_float32_squares_overflow_or_underflow(scale):
    """The norm was a float32 sum of squares: entries near 1e19 gave a NaN/Inf message from finite
    values, entries near 1e-23 a zero one (nothing sent)."""
    torch.manual_seed(0)
    x = torch.randn(16) * scale
    out, _ = roundtrip(QSGD(4, scaled=False), x)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    norm = torch.linalg.vector_norm(x, dtype=torch.float64).float()
    torch.testing.assert_close(out / norm * 4, (out / norm * 4).round(), atol=1e-4, rtol=0)  # on its levels


def test_scaled_qsgd_divides_by_one_plus_omega():
    x = torch.randn(400)
    plain, _ = roundtrip(QSGD(2, scaled=False), x, seed=1)
    scaled, _ = roundtrip(QSGD(2), x, seed=1)  # scaled by default
    omega = min(400 / 4, math.sqrt(400) / 2)
    torch.testing.assert_close(scaled, plain / (1 + omega))


def test_qsgd_rounds_each_bucket_on_its_own_norm():
    """One norm per tensor made omega (and the error) grow with sqrt(numel), and put a bucket of
    small entries beside large ones at zero; each bucket of bucket_size entries has its own norm
    (one float32 more per bucket on the wire), and the scaled QSGD divides each by its 1 + omega."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(1024) * 100, torch.randn(1476) * 0.01])
    out, msg = roundtrip(QSGD(4, scaled=False, bucket_size=1024), x)
    assert msg.nbytes == math.ceil(2500 * 4 / 8) + 4 * 3
    for bucket in (slice(0, 1024), slice(1024, 2048), slice(2048, 2500)):
        norm = x[bucket].norm()
        levels = out[bucket] / norm * 4
        torch.testing.assert_close(levels, levels.round(), atol=1e-3, rtol=0)
        assert out[bucket].abs().max() > 0
    mean = sum(roundtrip(QSGD(4, scaled=False, bucket_size=1024), x, seed=s)[0] for s in range(400)) / 400
    assert ((mean - x)[1024:].abs().max() / x[1024:2048].norm()) < 0.2
    plain, _ = roundtrip(QSGD(2, scaled=False, bucket_size=1024), x, seed=1)
    scaled, _ = roundtrip(QSGD(2, scaled=True, bucket_size=1024), x, seed=1)
    for bucket, size in ((slice(0, 1024), 1024), (slice(2048, 2500), 452)):
        torch.testing.assert_close(scaled[bucket], plain[bucket] / (1 + min(size / 4, math.sqrt(size) / 2)))
    assert QSGD(4).bucket_size == 1024 and repr(QSGD(4)) == "QSGD(levels=4, scaled=True, bucket_size=1024)"
    with pytest.raises(ValueError, match="bucket_size must be an integer >= 1"):
        QSGD(4, bucket_size=0)


def test_pack_unpack_roundtrip_for_every_width_and_odd_lengths():
    for bits in (1, 2, 4, 8):
        for count in (1, 7, 8, 9, 33):
            codes = torch.randint(0, 2**bits, (count,)).float()
            packed = torch.zeros(math.ceil(count * bits / 8), dtype=torch.uint8)
            pack_codes(codes, bits, packed)
            back = torch.empty(count)
            unpack_codes(packed, bits, count, back)
            assert torch.equal(back, codes)


def test_decode_add_scales_and_accumulates():
    x = torch.randn(300)
    comp = TopK(0.1)
    msg = Message(MessageLayout([comp.fields(300, torch.float32)]), torch.device("cpu"))
    comp.encode(x, msg.fields[0], torch.empty(300), None)
    target = torch.ones(300)
    comp.decode_add(msg.fields[0], target, -0.5, torch.empty(300))
    q, _ = roundtrip(comp, x)
    torch.testing.assert_close(target, 1 - 0.5 * q)


def test_layout_orders_fields_by_size_so_views_are_aligned_and_unpadded():
    layout = MessageLayout([TopK(0.5, value_bits=8).fields(300, torch.float32),
                            TopK(0.5).fields(100, torch.float32), Identity().fields(1, torch.float64)])
    sizes = [f.dtype.itemsize for f in layout.fields]
    assert sizes == sorted(sizes, reverse=True)
    assert layout.nbytes == sum(f.nbytes for f in layout.fields) == (150 + 150 * 2 + 8) + (50 * 4 + 50) + 8
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    assert views[2]["values"].dtype == torch.float64 and views[0]["indices"].dtype == torch.uint16


@pytest.mark.parametrize("make,match", [
    (lambda: TopK(0), "keep"), (lambda: TopK(1.5), "keep"), (lambda: TopK(0.1, value_bits=4), "value_bits"),
    (lambda: RandomK(0.1, unbiased="yes"), "unbiased"), (lambda: Quantize(3), "bits"),
    (lambda: QSGD(0), "levels"), (lambda: QSGD(128), "levels"),
    # equal to an allowed value but no integer: Quantize(4.0) failed inside the first step, after
    # Deep-Squeeze had changed its error memory
    (lambda: Quantize(4.0), r"^bits must be one of \(1, 2, 4, 8\), got 4.0$"), (lambda: Quantize(True), "bits"),
    (lambda: TopK(0.1, value_bits=8.0), r"^value_bits must be None \(model float type\) or 8, got 8.0$"),
])
def test_bad_compressor_arguments_are_rejected(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_numpy_integers_are_integers_to_the_compressors():
    assert Quantize(np.int64(4)).bits == 4 and type(Quantize(np.int64(4)).bits) is int
    assert TopK(0.1, value_bits=np.int32(8)).value_bits == 8


@pytest.mark.parametrize("n", [1000, 50000])  # torch.topk, and the compiled sample-and-scan path
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_top_k_keeps_a_non_finite_entry_at_every_size(n, bad):
    """The compiled path (tensors over 32768 entries) dropped an infinity or a NaN that torch.topk
    keeps, and an infinity in the band indexed its histogram with int(NaN)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[7] = bad
    k = n // 100
    indices, _ = top_k(x, k)
    assert 7 in indices.tolist()
    expected = torch.topk(x.abs(), k).indices
    assert torch.equal(indices.sort().values, expected.sort().values)


def test_largest_in_band_ranks_an_infinity_above_every_finite_magnitude():
    band_values = np.array([1.0, -np.inf, 3.0, 2.0, np.inf, 0.5])
    indices, values = np.empty(3, np.int64), np.empty(3)
    largest_in_band(np.arange(6) * 10, band_values, indices, values)
    assert indices.tolist() == [10, 20, 40] and values.tolist() == [-np.inf, 3.0, np.inf]
    largest_in_band(np.arange(6) * 10, np.full(6, np.inf), indices[:2], values[:2])  # no finite magnitude
    assert indices[:2].tolist() == [0, 10]
