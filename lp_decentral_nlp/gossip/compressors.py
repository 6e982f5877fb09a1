"""Compression operators ``C`` (SPEC 3), encoding one tensor into real wire fields and back.

A compressor works on one *segment*: a 1-D float tensor ``x`` of ``numel`` elements (one
parameter tensor flattened; SPEC 3 compresses layer-wise). It declares the typed fields its
encoding needs (:meth:`Compressor.fields`), writes them (:meth:`Compressor.encode`) into views
of the message buffer (see :mod:`.wire`), and adds ``alpha * C(x)`` back into a dense target
from those fields (:meth:`Compressor.decode_add`). The receiver and the sender both decode from
the same bytes, so everyone holding a copy of ``C(x)`` agrees on it exactly.

Wire formats (per tensor of ``numel`` elements, ``k = ceil(keep * numel)``, ``F`` = bytes of the
model's float type promoted to at least fp32, ``I`` = bytes of the smallest unsigned integer
holding ``numel - 1``). Every message also carries the push-sum weight (``F`` bytes), uncompressed:

=================================  =============================================================
``Identity()``                     ``numel * F``
``TopK(keep)`` / ``RandomK(keep)`` ``k * F`` values + ``k * I`` indices
``... value_bits=8``               ``k`` uint8 values + ``k * I`` indices + 4 (scale) + 4 (zero point)
``Quantize(bits)``                 ``ceil(numel * bits / 8)`` packed codes + 4 (scale) + 4 (zero point)
``QSGD(levels)``                   ``ceil(numel * b / 8)`` packed codes (``b`` = 2, 4 or 8 bits for the
                                   ``2 * levels + 1`` signed levels) + 4 per bucket of ``bucket_size``
                                   entries (norms)
=================================  =============================================================
"""
from __future__ import annotations

import math
import numbers

import numpy as np

import torch

from ..checks import NUMBER_FIELDS, Number, check_flag, check_number
from .wire import index_dtype, pack_codes, packed_nbytes, unpack_codes

Fields = list[tuple[str, torch.dtype, int]]


class Compressor:
    """Base class of the layer-wise codecs. A codec of one's own subclasses it and implements
    :meth:`fields`, :meth:`encode` and :meth:`decode_add` (the engine counts the bytes of the
    fields it declares). Its ``repr`` is its identity: a gossip checkpoint resumes only into the
    same one and every rank of a distributed run must build the same one, so the default names
    the class and its public attributes (``Sign(scale=0.5)``; those named ``_...``, e.g. a cache
    or a generator, are left out); a subclass whose attributes do not say what it sends overrides
    ``__repr__``.

    Attributes:
        layerwise: False for codecs whose result does not depend on tensor boundaries
            (``Identity``): the engine then treats the whole model as one segment.
        stochastic: True when :meth:`encode` draws random numbers (it then gets a generator
            seeded per node and per step, so every backend draws the same numbers).
    """

    layerwise = True
    stochastic = False

    def fields(self, numel: int, dtype: torch.dtype) -> Fields:
        """The ``(name, dtype, count)`` fields encoding a segment of ``numel`` elements of ``dtype``."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: dict[str, torch.Tensor], work: torch.Tensor,
               generator: torch.Generator | None) -> None:
        """Write ``C(x)`` into the field views ``out``.

        Args:
            x: ``(numel,)`` float segment (not modified).
            out: field name -> 1-D view into the message buffer (see :meth:`fields`).
            work: ``(numel,)`` scratch of ``x``'s dtype (contents are overwritten).
            generator: a seeded generator on ``x``'s device for stochastic codecs, else None.
        """
        raise NotImplementedError

    def encode_difference(self, a: torch.Tensor, b: torch.Tensor, out: dict[str, torch.Tensor],
                          work: torch.Tensor, generator: torch.Generator | None) -> bool:
        """Write ``C(a - b)`` into ``out`` without writing ``a - b`` anywhere (Choco-SGD sends
        ``C(x~ - x^)``), where this codec has such a path; the same message as :meth:`encode` of
        ``a - b``.

        Args: ``a`` and ``b`` as ``x`` in :meth:`encode` (same shape, dtype and device; neither
            is modified); the rest as in :meth:`encode`.
        Returns:
            True when written; False, having written nothing, when this codec has no such path
            for these tensors (the caller then writes ``a - b`` and calls :meth:`encode`).
        """
        return False

    def decode_add(self, msg: dict[str, torch.Tensor], target: torch.Tensor, alpha: float,
                   work: torch.Tensor) -> None:
        """``target += alpha * C(x)`` for the ``C(x)`` encoded in ``msg``.

        Args:
            msg: field name -> view into a received (or the node's own) message.
            target: ``(numel,)`` float tensor, updated in place.
            alpha: the coefficient (a mixing weight, or -1).
            work: ``(numel,)`` scratch of ``target``'s dtype.
        """
        raise NotImplementedError

    def __repr__(self):
        settings = ", ".join(f"{name}={value!r}" for name, value in sorted(vars(self).items())
                             if not name.startswith("_"))
        return f"{type(self).__qualname__}({settings})"


class Identity(Compressor):
    """No compression: the values in the model's float type (``numel * F`` bytes)."""

    layerwise = False

    def fields(self, numel, dtype):
        return [("values", dtype, numel)]

    def encode(self, x, out, work, generator):
        out["values"].copy_(x)

    def decode_add(self, msg, target, alpha, work):
        target.add_(msg["values"], alpha=alpha)

    def __repr__(self):
        return "Identity()"


class Quantize(Compressor):
    """Deterministic uniform affine quantization to ``bits`` bits with a per-tensor scale and
    zero point (SPEC 3 low-precision payloads, SPEC 4's affine quantizer):
    ``q = clamp(round((x - min) / s), 0, 2^bits - 1)``, ``s = (max - min) / (2^bits - 1)``,
    decoded as ``q * s + min``. ``Quantize(bits=8)`` sends 1 byte per element + 8 bytes.

    Args:
        bits: 1, 2, 4 or 8 (codes are packed ``8 // bits`` to a byte).
    """

    def __init__(self, bits: int = 8):
        if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in (1, 2, 4, 8):
            raise ValueError(f"bits must be one of (1, 2, 4, 8), got {bits!r}")
        self.bits = int(bits)

    def fields(self, numel, dtype):
        return [("codes", torch.uint8, packed_nbytes(numel, self.bits)),
                ("scale", torch.float32, 1), ("zero_point", torch.float32, 1)]

    def encode(self, x, out, work, generator):
        _affine_encode(x, self.bits, out["codes"], out["scale"], out["zero_point"], work)

    def decode_add(self, msg, target, alpha, work):
        if self.bits == 8 and _compiled(target):  # one fused pass
            from .codec_kernels import add_decoded
            add_decoded(msg["codes"].numpy(), alpha, target.numpy(), scale=msg["scale"].item(),
                        zero_point=msg["zero_point"].item())
            return
        _affine_decode(msg["codes"], msg["scale"], msg["zero_point"], self.bits, work)
        target.add_(work, alpha=alpha)

    def __repr__(self):
        return f"Quantize(bits={self.bits})"


class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017) with ``levels`` levels, per bucket of ``bucket_size`` entries:
    unbiased stochastic rounding of ``levels * x_b / ||x_b||_2`` to an integer in
    ``[-levels, levels]`` for each bucket ``x_b`` of the flattened tensor (the last one may be
    shorter); wire = one packed code per element (2 bits for 1 level, 4 bits up to 7, 8 bits up to
    127) + one fp32 norm per bucket.

    Unbiased, with variance up to ``omega * ||x||^2``, ``omega = min(m / levels^2, sqrt(m) /
    levels)`` at the bucket size ``m``: not a contraction when ``omega >= 1``, and Choco-SGD's
    public copies then diverge whatever ``gamma``. ``scaled=True`` (the default) sends
    ``Q(x_b) / (1 + omega)`` instead (the scaled QSGD of Koloskova et al. 2019), a contraction; the
    scale rides in the norm field, so the wire size is unchanged. Buckets keep ``omega`` (and so the consensus step) the same
    for a 1,000-entry bias and a 30-million-entry embedding table: with one norm per tensor it grew
    with ``sqrt(numel)``, and the step that suited a small tensor made a large one diverge
    (docs/consensus_step.md, "QSGD").

    Args:
        levels: ``s``, an int in [1, 127].
        scaled: divide by ``1 + omega``, the contraction Choco-SGD and Deep-Squeeze need (both
            refuse ``scaled=False``, the original unbiased QSGD).
        bucket_size: entries per norm, an int >= 1 (the QSGD paper's bucket size ``d``); the
            norms add ``4 / bucket_size`` bytes per entry.
    """

    stochastic = True

    def __init__(self, levels: int, scaled: bool = True, bucket_size: int = 1024):
        levels = check_number("levels", levels, NUMBER_FIELDS["qsgd_levels"])
        self.levels = levels
        self.scaled = check_flag("scaled", scaled)
        self.bucket_size = check_number("bucket_size", bucket_size, Number(integer=True, low=1))
        self.bits = next(b for b in (2, 4, 8) if 2 * levels + 1 <= 2**b)

    def omega(self, numel: int) -> float:
        """The variance bound ``omega`` of a bucket of ``numel`` entries (``min(numel, bucket_size)``)."""
        m, s = min(numel, self.bucket_size), self.levels
        return min(m / s**2, math.sqrt(m) / s)

    def fields(self, numel, dtype):
        return [("codes", torch.uint8, packed_nbytes(numel, self.bits)),
                ("norms", torch.float32, -(-numel // self.bucket_size))]

    def _buckets(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Views of the flat `t` as rows of buckets: ``(full buckets, bucket_size)``, then the
        shorter last bucket ``(1, rest)`` if any."""
        full = t.numel() // self.bucket_size * self.bucket_size
        rows = [t[:full].view(-1, self.bucket_size)] if full else []
        return rows + ([t[full:].view(1, -1)] if full < t.numel() else [])

    def encode(self, x, out, work, generator):
        s = self.levels
        work.uniform_(generator=generator)
        norms = out["norms"]
        first = 0
        for x_rows, work_rows in zip(self._buckets(x), self._buckets(work)):
            # in float64: a float32 sum of squares overflows from entries near 1e19 (the message was
            # NaN/Inf) and underflows below 1e-19 (a zero message: nothing was sent)
            norm = torch.linalg.vector_norm(x_rows, dim=1, dtype=torch.float64)
            per_unit = torch.where(norm > 0, s / norm, torch.zeros_like(norm)).to(x.dtype)
            # floor(y + u), u ~ U[0, 1), rounds y = s * x / ||x|| stochastically and unbiasedly.
            work_rows.addcmul_(x_rows, per_unit[:, None]).floor_().add_(s).clamp_(0, 2 * s)
            if self.scaled:
                norm = norm / (1.0 + self.omega(x_rows.shape[1]))
            norms[first:first + len(norm)].copy_(norm)
            first += len(norm)
        pack_codes(work, self.bits, out["codes"])

    def decode_add(self, msg, target, alpha, work):
        unpack_codes(msg["codes"], self.bits, work.numel(), work)
        first = 0
        for codes, target_rows in zip(self._buckets(work), self._buckets(target.view(-1))):
            scale = (msg["norms"][first:first + len(codes)] / self.levels)[:, None]
            target_rows.addcmul_(codes.sub_(self.levels), scale, value=alpha)
            first += len(codes)

    def __repr__(self):
        return f"QSGD(levels={self.levels}, scaled={self.scaled}, bucket_size={self.bucket_size})"


class _Sparsifier(Compressor):
    """Keeps ``k = ceil(keep * numel)`` entries of each tensor; sends their values and indices."""

    def __init__(self, keep: float, value_bits: int | None = None):
        """
        Args:
            keep: fraction of entries kept, in (0, 1] (``--comp 99``, the trainer's
                ``compression=99`` percent dropped, is ``keep=0.01``).
            value_bits: None sends values in the model's float type; 8 sends them as uint8 with a
                per-tensor fp32 scale and zero point (affine, like :class:`Quantize`).
        """
        keep = check_number("keep", keep, Number(low=0, low_open=True, high=1, what="a fraction"))
        if value_bits is not None and (isinstance(value_bits, bool) or not isinstance(value_bits, numbers.Integral)
                                       or value_bits != 8):
            raise ValueError(f"value_bits must be None (model float type) or 8, got {value_bits!r}")
        self.keep = float(keep)
        self.value_bits = None if value_bits is None else int(value_bits)

    def num_kept(self, numel: int) -> int:
        """``k = ceil(keep * numel)`` (at least 1), robust to ``keep * numel`` rounding up past an integer."""
        return max(1, min(numel, math.ceil(self.keep * numel * (1 - 1e-12))))

    def fields(self, numel, dtype):
        k = self.num_kept(numel)
        if self.value_bits is None:
            values = [("values", dtype, k)]
        else:
            values = [("values", torch.uint8, k), ("scale", torch.float32, 1), ("zero_point", torch.float32, 1)]
        return [("indices", index_dtype(numel), k)] + values

    def _select(self, x, indices, values, work, generator) -> None:
        """Write the positions of the kept entries of ``x`` into ``indices`` (the message's ``(k,)``
        index field) and ``x`` at them into ``values`` (``(k,)``); ``work`` is ``(numel,)``
        scratch of ``x``'s dtype whose first ``k`` entries may be ``values``."""
        raise NotImplementedError

    def _value_scale(self, numel: int, k: int) -> float:
        return 1.0

    def encode(self, x, out, work, generator):
        values = self._values_buffer(out, work)
        self._select(x, out["indices"], values, work, generator)
        self._encode_values(values, x.numel(), out)

    def _values_buffer(self, out, work) -> torch.Tensor:
        """Where the kept values are gathered: the message's value field (full-precision values),
        or the first ``k`` entries of ``work`` (8-bit values, encoded from there)."""
        return out["values"] if self.value_bits is None else work[:out["indices"].numel()]

    def _encode_values(self, values, numel, out) -> None:
        """Scale the gathered ``values`` in place and, for 8-bit values, encode them into ``out``."""
        scale = self._value_scale(numel, values.numel())
        if scale != 1.0:
            values.mul_(scale)
        if self.value_bits is not None:
            _affine_encode(values, 8, out["values"], out["scale"], out["zero_point"], values)

    def decode_add(self, msg, target, alpha, work):
        if _compiled(target):  # decoded and added in one pass over the kept entries
            from .codec_kernels import add_decoded
            affine = {} if self.value_bits is None else {"scale": msg["scale"].item(),
                                                         "zero_point": msg["zero_point"].item()}
            add_decoded(msg["values"].numpy(), alpha, target.numpy(), indices=msg["indices"].numpy(), **affine)
            return
        idx = _as_index(msg["indices"], target.numel())
        if self.value_bits is None:
            vals = msg["values"]
        else:
            vals = work[: idx.numel()]
            _affine_decode(msg["values"], msg["scale"], msg["zero_point"], 8, vals)
        target.index_add_(0, idx, vals, alpha=alpha)


class TopK(_Sparsifier):
    """Top-k: the ``ceil(keep * numel)`` largest-magnitude entries of each tensor (SPEC 3)."""

    def _select(self, x, indices, values, work, generator):
        _largest_abs_k(x, None, indices, values, work)

    def encode_difference(self, a, b, out, work, generator):
        # the compiled scan reads a and b; the top-k of a - b is selected as for encode(a - b)
        if not (_compiled(a) and _compiled(b) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        values = self._values_buffer(out, work)
        _largest_abs_k(a, b, out["indices"], values, work)
        self._encode_values(values, a.numel(), out)
        return True

    def __repr__(self):
        return f"TopK(keep={self.keep}, value_bits={self.value_bits})"


class RandomK(_Sparsifier):
    """Random-k: ``ceil(keep * numel)`` entries drawn uniformly without replacement per tensor.

    ``unbiased=True`` scales the kept values by ``numel / k`` (an unbiased estimate of ``x``);
    the default keeps them as they are (a biased contraction, the usual choice for Choco-SGD).
    The indices are sent explicitly (not regenerated from the seed by the receiver).
    """

    stochastic = True

    def __init__(self, keep: float, unbiased: bool = False, value_bits: int | None = None):
        """
        Args:
            keep: fraction of entries kept, in (0, 1] (``keep=0.01`` keeps 1%).
            unbiased: scale the kept values by ``numel / k`` (no contraction: Choco-SGD and
                Deep-Squeeze refuse it).
            value_bits: None (the model's float type) or 8 (uint8 values, per-tensor scale and
                zero point), as :class:`TopK`.
        """
        super().__init__(keep, value_bits)
        self.unbiased = check_flag("unbiased", unbiased)

    def _select(self, x, indices, values, work, generator):
        chosen = _random_subset(indices.numel(), work, generator)  # (before values, which may be work[:k])
        indices.copy_(chosen)
        # index_select, not x[idx]: advanced indexing is ~100x slower on CPU
        torch.index_select(x, 0, chosen, out=values)

    def _value_scale(self, numel, k):
        return numel / k if self.unbiased else 1.0

    def __repr__(self):
        return f"RandomK(keep={self.keep}, unbiased={self.unbiased}, value_bits={self.value_bits})"


# -- shared helpers ----------------------------------------------------------------------------

def _as_index(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Wire indices into a segment of ``numel`` elements as an ``index_add_`` index: uint32 is
    reinterpreted as int32 without a copy when every index fits (``numel <= 2^31``), narrower
    types are widened to int32, int64 is used as it is."""
    if indices.dtype == torch.int64:
        return indices
    if indices.dtype == torch.uint32:
        return indices.view(torch.int32) if numel <= 2**31 else indices.long()
    return indices.int()


def _affine_encode(x, bits, codes_out, scale_out, zero_out, work) -> None:
    """SPEC 4 affine quantization of ``x`` to ``bits``-bit codes with one scale and zero point."""
    lo, hi = torch.aminmax(x)
    if bits == 8 and _compiled(x):  # the same scale and codes in one fused pass
        from .codec_kernels import encode_affine8
        lo = lo.item()
        scale_out.fill_(encode_affine8(x.numpy(), lo, hi.item(), codes_out.numpy()))
        zero_out.fill_(lo)
        return
    levels = 2**bits - 1
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))  # constant x: all codes 0
    torch.sub(x, lo, out=work)
    work.mul_(inv).round_().clamp_(0, levels)
    pack_codes(work, bits, codes_out)
    scale_out.copy_(scale)
    zero_out.copy_(lo)


# the float dtypes of the compiled kernels -> the integer dtype of the same width (top-k band positions in work)
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def _compiled(x: torch.Tensor) -> bool:
    """Whether ``x`` (a 1-D segment) takes the compiled CPU kernels of :mod:`.codec_kernels`."""
    return x.device.type == "cpu" and x.dtype in _SAME_WIDTH_INT and x.is_contiguous() and not x.requires_grad


def _affine_decode(codes, scale, zero_point, bits, out) -> None:
    """``out = code * scale + zero_point`` for the ``out.numel()`` codes packed in ``codes``."""
    unpack_codes(codes, bits, out.numel(), out)
    out.mul_(scale).add_(zero_point)


def _random_subset(k: int, work: torch.Tensor, generator) -> torch.Tensor:
    """``k`` distinct indices in ``[0, n)``, ``n = work.numel()``, drawn uniformly without replacement.

    On CPU, for small ``k / n``: draws ``m`` indices with replacement and drops repeats (keeping
    first occurrences), which is sequential sampling without replacement; first occurrences are
    found with a scatter-min of draw positions into ``work`` (one memset of ``work`` instead of
    ``n`` random numbers, which CPU generators make slow). If fewer than ``k`` distinct values
    come out (rare: ``m`` covers twice the expected repeats), it draws again with a larger ``m``.
    On CUDA: the ``k`` largest of ``n`` uniform keys (no host sync).
    """
    n, device = work.numel(), work.device
    if device.type == "cuda":
        return work.uniform_(generator=generator).topk(k, sorted=False).indices
    if 4 * k >= n or k >= 2**22:  # draw positions (< 1.5 k) must be exact in float32
        return torch.randperm(n, generator=generator, device=device)[:k]
    m = k + 2 * (k * k) // n + 16
    while True:
        draws = torch.randint(n, (m,), generator=generator, device=device)
        order = torch.arange(m, dtype=work.dtype, device=device)
        first = work.fill_(m).scatter_reduce_(0, draws, order, "amin").index_select(0, draws)
        distinct = draws.index_select(0, torch.nonzero(first == order).squeeze(1))
        if distinct.numel() >= k:
            return distinct[:k]
        m *= 2


# The CPU top-k's threshold sample: at least _MIN_SAMPLE, at most _MAX_SAMPLE entries (_sample_size).
_MIN_SAMPLE, _MAX_SAMPLE = 4096, 65536


def _sample_size(n: int) -> int:
    """Entries of the CPU top-k's threshold sample for a tensor of ``n``: ``n^(2/3)`` clamped to
    [4096, 65536]. Sampling costs ~``m`` cache misses and the band to rank shrinks like
    ``n / sqrt(m)``; the two costs balance near ``m = n^(2/3)``."""
    return min(_MAX_SAMPLE, max(_MIN_SAMPLE, round(n ** (2 / 3))))


def _largest_abs_k(a: torch.Tensor, b: torch.Tensor | None, indices: torch.Tensor, values: torch.Tensor,
                   work: torch.Tensor) -> None:
    """Write into ``indices`` (``(k,)``, any integer dtype) the positions of the ``k`` entries of
    the 1-D ``x = a`` (or ``x = a - b``) with the largest magnitudes, in no particular order, and
    ``x`` at them into ``values`` (``(k,)``, ``a``'s dtype): SPEC 3's top-k.

    ``work`` is ``(n,)`` scratch of ``a``'s dtype whose first ``k`` entries may be ``values``.
    ``b`` needs the compiled kernels' path (:func:`_compiled`). Off that path (CUDA, dtypes other
    than float32/float64), for small tensors and for ``k >= n / 4`` this is ``torch.topk`` of
    ``|x|`` (with ``b``, ``x`` is then written into fresh memory). On the CPU ``torch.topk`` is a
    single-threaded partial sort (about 0.4 s for k = 10% of DistilBERT's 23M-entry embedding),
    so a strided sample of ``|x|`` (:func:`_sample_size`: ``n^(2/3)`` entries, 4096 to 65536)
    brackets the k-th largest magnitude between two thresholds ``t_lo <= t_hi`` (4 binomial
    standard deviations either side of the expected sample rank, both from one ``numpy.partition``), and
    one compiled scan (:func:`.codec_kernels.split_by_magnitude`) writes every position and value
    above ``t_hi`` straight into ``indices`` and ``values`` and those in the thin band
    ``[t_lo, t_hi]`` (1-5% of the entries at keep = 10%) into ``work``; the band's largest
    magnitudes (:func:`.codec_kernels.largest_in_band`, one selection and one compiled pass) fill
    the remaining places. The scan reads ``a`` (and ``b``) once, computes ``a - b``
    entry by entry, and touches no fresh memory (large fresh allocations page-fault on every
    gossip step once training has handed the memory back to the system). If the sample misjudges
    the bracket (fewer than ``k`` entries reach ``t_lo``) it is widened and the scan repeated; if
    more than ``k`` exceed ``t_hi``, the band outgrows ``work``, or the bracket is the whole
    sample, ``torch.topk`` decides. The result is an exact top-k (ties at the k-th value may be
    broken differently), with the same values as indexing ``x``.
    """
    n, k = a.numel(), indices.numel()
    if (not _compiled(a) or n <= 8 * _MIN_SAMPLE or 4 * k >= n or n >= 2**31
            or not all(t.is_contiguous() for t in (indices, values, work))):
        _exact_largest_abs_k(a if b is None else a - b, indices, values, work)
        return
    from .codec_kernels import largest_in_band, split_by_magnitude  # numba: imported on the first CPU top-k

    stride = n // _sample_size(n)
    sample = (torch.abs(a[::stride]) if b is None else torch.sub(a[::stride], b[::stride]).abs_()).numpy()
    m = sample.size
    rank = k * m / n  # expected sample entries at or above the k-th largest magnitude
    margin = 4 * math.sqrt(rank) + 16
    # the band's positions and values in the two halves of work[k:] (work[:k] may be values)
    room = (n - k) // 2
    band = work[k:k + room].view(_SAME_WIDTH_INT[a.dtype])
    band_values = work[k + room:k + 2 * room]
    indices_np, values_np, band_np, band_values_np = arrays = (indices.numpy(), values.numpy(), band.numpy(),
                                                               band_values.numpy())
    while True:
        above, reach = max(0, math.floor(rank - margin)), min(m, math.ceil(rank + margin))
        # the reach-th and the above-th largest sample magnitudes, in one O(m) selection
        ordered = np.partition(sample, [m - reach] + ([m - above] if above > 0 else []))
        t_lo, t_hi = float(ordered[m - reach]), float(ordered[m - above]) if above > 0 else math.inf
        num_sure, num_band = split_by_magnitude(a.numpy(), None if b is None else b.numpy(), t_lo, t_hi, *arrays)
        # num_sure < 0: the sample set t_hi too low (more than k entries exceed it); num_band < 0:
        # the band outgrew its room; reach == m: only NaNs leave fewer than k entries at or above
        # the smallest sample value
        if num_sure < 0 or num_band < 0 or (num_sure + num_band < k and reach == m):
            _exact_largest_abs_k(a if b is None else a - b, indices, values, work)
            return
        if num_sure + num_band >= k:
            break
        margin *= 4
    largest_in_band(band_np[:num_band], band_values_np[:num_band], indices_np[num_sure:], values_np[num_sure:])


def _exact_largest_abs_k(x: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, work: torch.Tensor) -> None:
    """:func:`_largest_abs_k` of ``x`` by ``torch.topk`` of ``|x|`` (``work`` holds ``|x|``)."""
    chosen = torch.topk(torch.abs(x, out=work), indices.numel(), sorted=False).indices
    indices.copy_(chosen)
    torch.index_select(x, 0, chosen, out=values)
