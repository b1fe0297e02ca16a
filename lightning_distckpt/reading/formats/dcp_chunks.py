"""Reading parts of one DCP chunk without loading the whole chunk through ``torch.load``.

DCP's ``FileSystemWriter`` stores each chunk as a ``torch.save`` zip archive at a byte range of a
``.distcp`` file. Its tensor data is one uncompressed zip record. :func:`chunk_layout` finds that
record (the zip directory, a few hundred bytes) and the tensor's layout (``torch.load`` with
``weights_only=True`` under ``torch.serialization.skip_data``, which reads ``data.pkl`` and no
tensor bytes). :func:`read_pieces` then reads the record with one seek and one read and copies the
requested pieces out: the whole record, whose CRC-32 is then checked (a piece of it alone cannot be),
or, with verification off (``LIGHTNING_DISTCKPT_VERIFY=0``) or no CRC recorded, only the span that
holds the pieces. A chunk this does not cover (a non-contiguous stored
tensor, several storages, big-endian data) has no layout; the reader loads it whole.
"""

from __future__ import annotations

import io
import math
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO, List, Optional, Sequence, Tuple

import torch

from ...core.errors import FormatError
from ...storage.base import ShardRead
from ...storage.checksums import verification_enabled
from ...storage.zip_records import crc32, data_start, following

# DCP's FileSystemWriter(serialization_format=SAFETENSORS) appends one safetensors file to each
# .distcp file and records every tensor of it at the file's start, with the tensor's byte count as
# length; such files are read as that (.dcp_safetensors). A chunk found at a safetensors file's start
# otherwise (.metadata recording the file's tensors apart, or through transforms: that format combined
# with compression, which torch's FileSystemReader cannot read either) is refused with this reason.
SAFETENSORS_FORMAT = ("the chunk is in a safetensors file, as DCP's FileSystemWriter(serialization_format="
                      "SAFETENSORS) writes it, but .metadata does not record it as that format does (every tensor "
                      "of the file at the safetensors file's start, without transforms such as compression); "
                      "re-save with serialization_format=TORCH_SAVE, or without _extensions")


def safetensors_at(f: BinaryIO, start: int) -> bool:
    """Whether the bytes at ``start`` of the seekable file ``f`` begin a safetensors file: an 8-byte
    little-endian header length that fits the file, then the header's JSON object. The header may end
    the file: a safetensors file of an empty tensor alone holds no data bytes (of a bool scalar, one)."""
    size = f.seek(0, io.SEEK_END)
    f.seek(start)
    head = f.read(10)
    return len(head) == 10 and head[8:10] == b'{"' and 0 < int.from_bytes(head[:8], "little") <= size - start - 8


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``start`` of an open file."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


@dataclass(frozen=True)
class ChunkLayout:
    """A chunk's tensor as stored: its data record at file offset ``data_start`` (``nbytes``
    long), its element type and its row-major shape (contiguous, from ``storage_offset``)."""

    data_start: int
    nbytes: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    storage_offset: int
    crc32: int = 0  # the record's CRC-32 as the zip directory gives it (0: not recorded)


def chunk_layout(f: BinaryIO, start: int, length: int, where: str) -> Optional[ChunkLayout]:
    """The layout of the ``torch.save``d tensor at ``[start, start + length)`` of ``f``; None when
    it is not one contiguous little-endian storage (read it whole then)."""
    view = RangeFile(f, start, length)
    try:
        archive = zipfile.ZipFile(view)
        records = [i for i in archive.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
        byteorder = [i for i in archive.infolist() if i.filename.endswith("/byteorder")]
        if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or \
                (byteorder and _record(view, archive, byteorder[0], length, where) != b"little"):
            return None
        record = records[0]
        data_offset = data_start(view, record, following(archive)[record.header_offset], length, where)
    except FormatError:
        raise
    except Exception as e:  # zipfile.BadZipFile, struct.error, ...
        if safetensors_at(f, start):
            raise FormatError(f"{where}: {SAFETENSORS_FORMAT}") from None
        raise FormatError(f"{where}: not a torch.save'd tensor ({type(e).__name__}: {e})") from None
    if data_offset + record.file_size > length:
        raise FormatError(f"{where}: damaged zip record {record.filename!r}")
    meta = _tensor_without_data(view)
    if meta is None or meta.layout != torch.strided or meta.is_quantized or meta.is_conj() or meta.is_neg() or \
            not meta.is_contiguous() or \
            (meta.storage_offset() + meta.numel()) * meta.element_size() > record.file_size:
        return None  # read whole: that load refuses what is not a plain dense tensor, naming it
    return ChunkLayout(start + data_offset, record.file_size, meta.dtype, tuple(meta.shape), meta.storage_offset(),
                       record.CRC)


def _record(view: RangeFile, archive: zipfile.ZipFile, info: zipfile.ZipInfo, length: int, where: str) -> bytes:
    """A small record's bytes as torch reads them. A CRC-32 of 0 is torch.save's mark of none
    (``torch.utils.serialization.config.save.compute_crc32 = False``), which zipfile's reader refuses."""
    if info.CRC or info.compress_type != zipfile.ZIP_STORED:
        return archive.read(info)
    view.seek(data_start(view, info, following(archive)[info.header_offset], length, where))
    return view.read(info.file_size)


def _tensor_without_data(view: RangeFile) -> Optional[torch.Tensor]:
    """The archive's tensor with its storage left unread (``weights_only``); None where this torch
    cannot load without data, or ``data.pkl`` does not load (the whole-chunk load then says why)."""
    skip_data = getattr(torch.serialization, "skip_data", None)
    if skip_data is None:
        return None
    view.seek(0)
    try:
        with warnings.catch_warnings(), skip_data():
            warnings.simplefilter("ignore")
            meta = torch.load(view, map_location="cpu", weights_only=True)
    except Exception:  # any failure: the whole-chunk load reports it
        return None
    return meta if isinstance(meta, torch.Tensor) else None


def _span(layout: ChunkLayout, src: Sequence[slice]) -> Tuple[int, int]:
    """Element range ``[first, last + 1)`` of the storage that holds ``chunk[src]``."""
    strides = [math.prod(layout.shape[i + 1:]) for i in range(len(layout.shape))]
    first = sum(s.start * st for s, st in zip(src, strides))
    last = sum((s.stop - 1) * st for s, st in zip(src, strides))
    return layout.storage_offset + first, layout.storage_offset + last + 1


def read_pieces(f: BinaryIO, layout: ChunkLayout, pieces: List[ShardRead], where: str) -> None:
    """Copy ``chunk[r.src]`` into ``r.dest`` for every piece, from the whole record checked against its
    CRC-32 (or, unverified, from the span that holds them)."""
    wanted = [(r, _span(layout, _full_slices(r.src, layout.shape))) for r in pieces if r.dest.numel()]
    if not wanted:
        return
    isz = layout.dtype.itemsize
    whole = bool(layout.crc32) and verification_enabled()
    if whole:  # the record's CRC-32 covers it only whole: read it all, as DCP's own reader does
        lo, nbytes = 0, layout.nbytes
    else:
        lo, hi = min(s[0] for _, s in wanted), max(s[1] for _, s in wanted)
        nbytes = (hi - lo) * isz
    buf = torch.empty(nbytes, dtype=torch.uint8)
    f.seek(layout.data_start + lo * isz)
    if f.readinto(buf.numpy()) != buf.numel():
        raise FormatError(f"{where}: the file ends inside the chunk's data (truncated?)")
    if whole and crc32(buf.numpy()) != layout.crc32:
        raise FormatError(f"{where}: the chunk's data is damaged: its bytes do not match the CRC-32 of its zip record")
    values = buf[:nbytes - nbytes % isz].view(layout.dtype)
    strides = tuple(math.prod(layout.shape[i + 1:]) for i in range(len(layout.shape)))
    for r, (first, _) in wanted:
        src = _full_slices(r.src, layout.shape)
        r.dest.copy_(values.as_strided(tuple(s.stop - s.start for s in src), strides, first - lo))


def _full_slices(src: Sequence[slice], shape: Tuple[int, ...]) -> Tuple[slice, ...]:
    """``src`` with every axis a plain ``start:stop`` slice (missing axes taken whole)."""
    out = []
    for i, n in enumerate(shape):
        start, stop, _ = (src[i] if i < len(src) else slice(None)).indices(n)  # planning's slices have no step
        out.append(slice(start, max(start, stop)))
    return tuple(out)
