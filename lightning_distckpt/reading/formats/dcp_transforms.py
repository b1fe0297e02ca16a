"""Items of a DCP checkpoint stored through a stream transform: DCP's ZStandard extension.

``FileSystemWriter(path, _extensions=[ZStandard()])`` writes each item (a ``torch.save``d chunk, or
an object's bytes) as one zstd frame and records ``transform_descriptors=['stream.zstd/1']`` in its
``_StorageInfo``; the item's byte range is the compressed frame. Reading it means decompressing the
frame whole (zstd has no random access), then reading the result as an uncompressed item.

What the decompressed item may hold is bounded before it is made: a tensor chunk is a ``torch.save``
of the chunk's own elements (DCP clones a chunk to its numel before saving), so its archive holds
the chunk's bytes plus a few kB of zip records and ``data.pkl`` (:data:`ARCHIVE_MARGIN`); an
object, at most what a pickled state may (``PICKLE_CAP``). The frame's declared content size, when
the frame records one, is checked first; the output is then produced from small slices of the input
so that a frame decompressing past the bound (a decompression bomb) is refused after producing at
most the bound plus :data:`BOMB_SLACK`. A frame cut short, or followed by other bytes inside the
item, is refused. Only what torch's own ``ZStandard`` writes is read: any other transform name
(which torch would resolve through its extension registry, running that extension's code) is refused.

Checked: zstd's frame structure and, where the writer recorded one, its content checksum (torch's
writer records none); then the decompressed ``torch.save`` archive as any DCP chunk is (its zip
record's CRC-32 when verification is on: :mod:`.dcp_chunks`).
"""

from __future__ import annotations

from typing import Any, BinaryIO, Tuple

from ...core.errors import CheckpointingError, FormatError

ZSTD = "stream.zstd"  # torch.distributed.checkpoint._extension.ZStandard.registry_name()
# Beyond a chunk's element bytes, what its torch.save archive holds: data.pkl (hundreds of bytes),
# the zip records' headers, 64-byte alignment, the central directory.
ARCHIVE_MARGIN = 64 << 10
# A zstd block yields at most 128 KiB from at least 4 input bytes (so a frame at most ZSTD_RATIO times its
# size, which bounds what .metadata may claim of a compressed item): input is fed in slices no larger
# than the remaining output budget / this ratio (at least _MIN_SLICE), so one slice overshoots the
# bound by at most _MIN_SLICE * ratio plus a block.
ZSTD_RATIO = (128 << 10) // 4
_MIN_SLICE, _MAX_SLICE = 256, 4 << 20
BOMB_SLACK = _MIN_SLICE * ZSTD_RATIO + (128 << 10)


def checked_transforms(value: Any, where: str) -> Tuple[str, ...]:
    """The item's ``transform_descriptors`` as a tuple: empty when none, ``('stream.zstd/1',)`` for
    DCP's ZStandard extension (version 1.x, as torch's ``from_descriptor`` accepts); anything else
    is a FormatError naming the item and the transforms."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > 8 or not all(isinstance(d, str) for d in value):
        raise FormatError(f"{where}: malformed transform_descriptors of type {type(value).__name__} "
                          "(DCP records a list of extension names)")
    shown = [d[:100] for d in value]
    name, _, version = value[0].partition("/")
    if len(value) != 1 or name != ZSTD or version.partition(".")[0] != "1":
        raise FormatError(f"{where} is stored through transforms {shown}, which lightning_distckpt cannot read: it "
                          f"reads DCP's ZStandard compression ({ZSTD + '/1'!r}) alone, and runs no other extension")
    return tuple(value)


def _zstandard(where: str) -> Any:
    try:
        import zstandard
    except ImportError:
        raise CheckpointingError(f"{where} is zstd-compressed (DCP's ZStandard extension); reading it needs the "
                                 "zstandard package: pip install zstandard") from None
    return zstandard


def decompressed(f: BinaryIO, offset: int, length: int, limit: int, where: str) -> bytes:
    """The decompressed bytes of the one zstd frame that is ``[offset, offset + length)`` of ``f``;
    a FormatError naming ``where`` when it is no whole frame, has bytes after it, or decompresses to
    more than ``limit`` bytes (refused having produced at most ``limit + BOMB_SLACK``)."""
    zstd = _zstandard(where)
    f.seek(offset)
    head = f.read(min(length, 18))  # a frame header is at most 18 bytes
    try:
        declared = zstd.get_frame_parameters(head).content_size
    except zstd.ZstdError as e:
        raise FormatError(f"{where}: not a zstd frame as DCP's ZStandard extension writes ({e})") from None
    if declared != zstd.CONTENTSIZE_UNKNOWN and declared > limit:
        raise FormatError(f"{where}: its zstd frame declares {declared} bytes, more than the {limit} the item "
                          "can hold; refused before decompressing (damaged or hostile)")
    # zstandard's one-shot decompress() neither bounds an undeclared frame's output while it runs nor
    # notices bytes after such a frame, and its stream_reader() returns a truncated frame's output without
    # an error: a decompressobj fed bounded slices reports both (eof, unused_data).
    inflater = zstd.ZstdDecompressor().decompressobj()
    out, done, f_pos = [], 0, offset
    try:
        while f_pos < offset + length and not inflater.eof:
            size = min(max((limit - done) // ZSTD_RATIO, _MIN_SLICE), _MAX_SLICE, offset + length - f_pos)
            f.seek(f_pos)
            piece = f.read(size)
            if len(piece) != size:
                raise FormatError(f"{where}: the file ends inside the item's zstd frame (truncated?)")
            f_pos += size
            out.append(inflater.decompress(piece))
            done += len(out[-1])
            if done > limit:
                raise FormatError(f"{where}: its zstd frame decompresses to more than the {limit} bytes the item can "
                                  "hold (a decompression bomb, or metadata that does not match the data); refused")
    except zstd.ZstdError as e:
        raise FormatError(f"{where}: damaged zstd frame ({e})") from None
    if not inflater.eof:
        raise FormatError(f"{where}: the item ends inside its zstd frame (truncated or damaged)")
    if f_pos < offset + length or inflater.unused_data:
        raise FormatError(f"{where}: bytes follow the item's zstd frame inside the item (DCP writes one frame)")
    return b"".join(out)


def chunk_limit(numel: int, itemsize: int) -> int:
    """The most bytes the decompressed ``torch.save`` archive of a chunk of ``numel`` elements holds."""
    return numel * itemsize + ARCHIVE_MARGIN
