"""Checking a ``.safetensors`` header before anything else touches the file.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor to
its dtype, shape and ``[begin, end)`` byte range in the data section, then the data. A bad header
(truncated file, offsets past the end or overlapping, an unknown dtype) would otherwise surface
as a Rust panic deep in ``safe_open``, or as a huge allocation: here it is a :class:`FormatError`
naming the file and the tensor, raised after reading only the header.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Dict, List, NamedTuple, Optional, Tuple

import torch

from ...core.errors import FormatError
from ...storage.layout import parse_json
from ...storage.paths import ANYWHERE, SAFETENSORS_HEADER_BYTES
from .model_files import open_model_file
from .tensor_files import check_shape

# The dtypes of the safetensors format that torch has.
DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    # newer names of the format (safetensors 0.8 writes them)
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
# The header is JSON text; real ones are kilobytes to a few MB. Bigger is corruption, and reading
# it would be the large allocation this check exists to prevent (the cap: storage/paths.py).
MAX_HEADER_BYTES = SAFETENSORS_HEADER_BYTES


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: where its bytes are, relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int
    end: int


class Header(NamedTuple):
    """A safetensors file's header, checked: its tensors, its ``__metadata__`` (a string map) and where
    its data section starts in the file."""

    entries: List[HeaderEntry]
    metadata: Optional[Dict[str, str]]
    data_start: int


def read_header(path: str, root: str = ANYWHERE) -> List[HeaderEntry]:
    """The tensors of the safetensors file ``path``, checked against the file's size; raises
    :class:`FormatError` naming the file (and the tensor) when the header is not sound, or when
    ``path`` is not a regular file or links out of ``root`` (see :mod:`.model_files`)."""
    with open_model_file(path, "safetensors file", root) as f:
        return read_open_header(f, path).entries


def read_open_header(f: BinaryIO, path: str, start: int = 0) -> Header:
    """The checked header of the safetensors file open as ``f`` (named ``path``): as :func:`read_header`,
    and the data section must hold the tensors back to back from its start to its end, as the format
    (and its own reader) requires. ``start``: where the safetensors file begins in ``f`` (it runs to
    the end of ``f``: DCP's SAFETENSORS format appends one to each ``.distcp`` file)."""
    size = os.fstat(f.fileno()).st_size - start
    head = os.pread(f.fileno(), 8, start)
    if len(head) < 8:
        raise FormatError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise FormatError(
            f"{path}: safetensors header length {n} does not fit the file of {size} bytes "
            f"(truncated or not a safetensors file)")
    raw = os.pread(f.fileno(), n, start + 8)
    if len(raw) != n:
        raise FormatError(f"{path}: the file ends inside its safetensors header (cut short while it was read)")
    # nesting checked before parsing (a header nests 3 levels; a deep one must not drive json into
    # deep recursion): a FormatError naming the file, like any header that is not JSON
    header = parse_json(raw, f"{path}: safetensors header", unique_keys=True)
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header must be a JSON object, got {type(header).__name__}")
    data_bytes = size - 8 - n
    entries = [_entry(path, name, info, data_bytes) for name, info in header.items() if name != "__metadata__"]
    _check_overlaps(path, entries)
    _check_packed(path, entries, data_bytes)
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise FormatError(f"{path}: the safetensors header's __metadata__ must map strings to strings")
    return Header(entries, metadata, start + 8 + n)


def _check_packed(path: str, entries: List[HeaderEntry], data_bytes: int) -> None:
    """The tensors' bytes tile the data section exactly (what safetensors' own reader requires: a gap
    or trailing bytes are not its format)."""
    end = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != end:
            raise FormatError(f"{path}: tensor {e.name!r} starts at byte {e.begin} of the data section, not at "
                              f"{end} where the previous one ends (a gap: not a safetensors file as written)")
        end = e.end
    if end != data_bytes:
        raise FormatError(f"{path}: the tensors end at byte {end} of the data section of {data_bytes} bytes "
                          f"(trailing bytes: not a safetensors file as written)")


def _entry(path: str, name: str, info: Any, data_bytes: int) -> HeaderEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise FormatError(f"{where}: header entry must be an object, got {info!r:.100}")
    name_of_dtype = info.get("dtype")
    # a list or an object there is no dict key: looked up, it raised a raw TypeError
    dtype = DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
    if dtype is None:
        raise FormatError(f"{where}: unknown dtype {name_of_dtype!r:.100} (known: {', '.join(DTYPES)})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise FormatError(f"{where}: shape must be a list of non-negative integers, got {shape!r:.100}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise FormatError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r:.100}")
    check_shape(where, shape, dtype.itemsize)
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise FormatError(
            f"{where}: data_offsets [{begin}, {end}) hold {end - begin} bytes but {info['dtype']} {tuple(shape)} "
            f"needs {expected}")
    if end > data_bytes:
        raise FormatError(
            f"{where}: data_offsets [{begin}, {end}) point past the end of the data section ({data_bytes} bytes; "
            f"the file is truncated or corrupt)")
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


def _check_overlaps(path: str, entries: List[HeaderEntry]) -> None:
    ordered = sorted((e for e in entries if e.end > e.begin), key=lambda e: e.begin)
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.begin < prev.end:
            raise FormatError(
                f"{path}: tensor {cur.name!r} (bytes [{cur.begin}, {cur.end})) overlaps tensor {prev.name!r} "
                f"(bytes [{prev.begin}, {prev.end})); the header is corrupt")
