"""The wire format of one gossip message: one contiguous ``uint8`` buffer per node per step.

A message carries, for every *segment* (one parameter tensor, or the whole model for codecs that
are not layer-wise, plus one final segment holding the push-sum weight), the fields its
compressor declares (values, indices, scales...). All sizes follow from the parameter shapes and
the compressor settings, so sender and receiver agree on the layout without a header and no size
is ever exchanged at run time. Fields are grouped by element size, largest first, so every typed
view into the byte buffer is naturally aligned and no padding byte is sent: the message's length
is exactly the sum of its fields' sizes, and that length is what ``bytes_sent`` reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Field:
    """One typed array of a message: ``count`` elements of ``dtype`` for segment ``segment``."""

    segment: int
    name: str
    dtype: torch.dtype
    count: int

    @property
    def nbytes(self) -> int:
        """Bytes of the field on the wire: ``count`` elements of ``dtype``."""
        return self.count * self.dtype.itemsize


class MessageLayout:
    """Byte offsets of every field of a message.

    Args:
        fields_per_segment: for each segment, the list of ``(name, dtype, count)`` its codec
            declares (in the segment order that encode/decode use).
    Attributes:
        nbytes: total message length in bytes.
        fields: the :class:`Field` list in wire order.
        offsets: byte offset of each field in :attr:`fields`.
    """

    def __init__(self, fields_per_segment: list[list[tuple[str, torch.dtype, int]]]):
        fields = [Field(s, name, dtype, int(count))
                  for s, decl in enumerate(fields_per_segment) for name, dtype, count in decl]
        # Largest element size first: every offset is then a multiple of its field's itemsize.
        self.fields = sorted(fields, key=lambda f: -f.dtype.itemsize)
        self.offsets = []
        pos = 0
        for f in self.fields:
            self.offsets.append(pos)
            pos += f.nbytes
        self.nbytes = pos
        self.num_segments = len(fields_per_segment)

    def views(self, buffer: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Typed 1-D views into ``buffer`` (``uint8``, ``(nbytes,)``), one dict per segment."""
        if buffer.dtype != torch.uint8 or buffer.shape != (self.nbytes,):
            raise ValueError(f"buffer must be a uint8 tensor of shape ({self.nbytes},), "
                             f"got {buffer.dtype} {tuple(buffer.shape)}")
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_segments)]
        for f, off in zip(self.fields, self.offsets):
            out[f.segment][f.name] = buffer[off:off + f.nbytes].view(f.dtype)
        return out


class Message:
    """A message buffer with its typed field views (allocated once, reused every step)."""

    def __init__(self, layout: MessageLayout, device: torch.device):
        self.layout = layout
        self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        self.fields = layout.views(self.buffer)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message buffer (every field of every segment): what is sent."""
        return self.layout.nbytes


def index_dtype(numel: int) -> torch.dtype:
    """The smallest unsigned integer type that can hold every index ``0 .. numel - 1``."""
    for dtype, limit in ((torch.uint8, 2**8), (torch.uint16, 2**16), (torch.uint32, 2**32)):
        if numel <= limit:
            return dtype
    return torch.int64


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes taken by ``count`` codes of ``bits`` bits each, packed ``8 // bits`` to a byte."""
    per = 8 // bits
    return -(-count // per)


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Write integer-valued float ``codes`` (``(count,)``, each in ``[0, 2^bits)``) into ``out``.

    ``bits`` is 1, 2, 4 or 8; element ``k`` of a byte's group sits at bit ``bits * k`` (little
    end first). ``out`` is ``uint8`` of ``packed_nbytes(count, bits)``.
    """
    if bits == 8:
        out.copy_(codes)
        return
    per = 8 // bits
    place = torch.tensor([float(2 ** (bits * k)) for k in range(per)], dtype=codes.dtype, device=codes.device)
    full = codes.numel() // per
    if full:
        out[:full].copy_(codes[: full * per].view(full, per) @ place)
    tail = codes.numel() - full * per
    if tail:
        out[full:].copy_(codes[full * per:] @ place[:tail])


def unpack_codes(packed: torch.Tensor, bits: int, count: int, out: torch.Tensor) -> None:
    """Inverse of :func:`pack_codes`: write ``count`` codes from ``packed`` into float ``out``."""
    if bits == 8:
        out.copy_(packed)
        return
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts) & (2**bits - 1)
    out.copy_(codes.view(-1)[:count])
