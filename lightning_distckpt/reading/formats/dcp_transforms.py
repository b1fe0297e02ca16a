"""Items of a DCP checkpoint stored through a stream transform: DCP's ZStandard extension.

``FileSystemWriter(path, _extensions=[ZStandard()])`` writes each item (a ``torch.save``d chunk, or
an object's bytes) as one zstd frame and records ``transform_descriptors=['stream.zstd/1']`` in its
``_StorageInfo``; the item's byte range is the compressed frame. Reading it means decompressing the
frame whole (zstd has no random access), then reading the result as an uncompressed item.

What the decompressed item may hold is bounded before it is made: a tensor chunk is a ``torch.save``
of the chunk's own elements (DCP clones a chunk to its numel before saving), so its archive holds
the chunk's bytes plus a few kB of zip records and ``data.pkl`` (:data:`ARCHIVE_MARGIN`); an
object, at most what a pickled state may (``PICKLE_CAP``). The frame's declared content size, when
the frame records one, is checked first; zstd then decompresses into a buffer of at most the bound
and fails a frame that would write past it (a decompression bomb): nothing beyond the bound is
produced. A frame cut short, or followed by other bytes inside the item, is refused. Only what
torch's own ``ZStandard`` writes is read: any other transform name (which torch would resolve
through its extension registry, running that extension's code) is refused.

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
# A zstd block yields at most 128 KiB from at least 4 input bytes: a frame inflates at most this many
# times its size, which bounds what .metadata may claim of a compressed item.
ZSTD_RATIO = (128 << 10) // 4


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
    more than ``limit`` bytes."""
    zstd = _zstandard(where)
    f.seek(offset)
    item = f.read(length)
    if len(item) != length:
        raise FormatError(f"{where}: the file ends inside the item's zstd frame (truncated?)")
    try:
        declared = zstd.get_frame_parameters(item[:18]).content_size  # a frame header is at most 18 bytes
    except zstd.ZstdError as e:
        raise FormatError(f"{where}: not a zstd frame as DCP's ZStandard extension writes ({e})") from None
    if declared != zstd.CONTENTSIZE_UNKNOWN and declared > limit:
        raise FormatError(f"{where}: its zstd frame declares {declared} bytes, more than the {limit} the item "
                          "can hold; refused before decompressing (damaged or hostile)")
    try:
        # One call, bounded: its output buffer is the declared size (checked above) or, undeclared, ``limit``;
        # a frame that would write past it, is cut short, or lies about its size fails.
        out = zstd.ZstdDecompressor().decompress(item, max_output_size=limit, allow_extra_data=False)
        # That call does not see bytes after an undeclared frame, nor after one declaring 0 bytes (and
        # python-zstandard has no public ZSTD_findFrameCompressedSize): the frame just decoded is walked.
        rest = len(item) - _frame_end(zstd, item)
    except zstd.ZstdError as e:
        raise FormatError(f"{where}: damaged zstd frame, or one decompressing to more than the {limit} bytes the "
                          f"item can hold (a decompression bomb, or metadata that does not match the data): "
                          f"{e}") from None
    if rest:
        raise FormatError(f"{where}: bytes follow the item's zstd frame inside the item (DCP writes one frame)")
    return out


def _frame_end(zstd: Any, frame: bytes) -> int:
    """Where the zstd frame at the start of ``frame`` ends (RFC 8878, 3.1.1): its header, then blocks (a
    3-byte header each: last-block bit, type, size; an RLE block holds 1 byte, others ``size``) up to the
    last, then a 4-byte checksum if the header says so. Only for a frame libzstd has just decoded whole,
    so every header read here is one it accepted; a few thousand blocks for a GB of output."""
    pos = zstd.frame_header_size(frame)
    while pos + 3 <= len(frame):
        header = int.from_bytes(frame[pos:pos + 3], "little")
        pos += 3 + (1 if (header >> 1) & 3 == 1 else header >> 3)
        if header & 1:
            return pos + (4 if zstd.get_frame_parameters(frame[:18]).has_checksum else 0)
    raise zstd.ZstdError("its blocks run past the item")  # not for a frame libzstd decoded: a guard


def chunk_limit(numel: int, itemsize: int) -> int:
    """The most bytes the decompressed ``torch.save`` archive of a chunk of ``numel`` elements holds."""
    return numel * itemsize + ARCHIVE_MARGIN
