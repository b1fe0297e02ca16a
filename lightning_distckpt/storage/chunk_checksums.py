"""Chunk checksums kept in each array's ``zarr.json`` (format 5), computed with the CPU's CRC-32C
instructions while the chunk's bytes are still the caller's tensor.

Format 3 checksummed every chunk with the zarr v3 ``crc32c`` codec, which tensorstore's wheel
computes in portable code while it encodes: about a sixth of a tensor-parallel save's time on two
vCPUs (docs/benchmarks.md). A local save now computes the same CRC-32C of each stored chunk (its
rows, the edge chunk padded with zeros as zarr stores it) with :data:`crc32c`, in place,
and records the list under ``attributes.lightning_distckpt.crc32c`` of the array's metadata; the
chunks are stored plain. Readers verify it: the direct reads (:mod:`.direct_read`) as they read
each chunk, and :class:`VerifiedReads` for what tensorstore reads (a cast, a value held inline in
the OCDBT index, an object store, ``LIGHTNING_DISTCKPT_DIRECT_READS=0``), which reads whole chunks
and checks them before anything reaches the destination. Object-store saves and the small-shard
packs keep the codec: their checksum costs little beside the network or the pack's size.

:data:`crc32c` is the ``crc32c-rs`` package where it is installed (Python 3.11+): it folds with
carry-less multiplies (VPCLMULQDQ, PMULL), about 2.5x the ``crc32c`` package's CRC32 instruction
loop on data in cache (68 against 28 GB/s on the AMD EPYC we measure on), which is where a load
checksums each piece it has just read. Otherwise the ``crc32c`` package. Both give the same CRC-32C
(tested), release the GIL and continue from a previous value.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ..core.errors import FormatError
from .packs import as_tensor

try:
    from crc32c_rs import crc32c as _fast_crc32c
except ImportError:  # Python 3.10, or a platform without its wheel
    _fast_crc32c = None
import crc32c as _crc32c_package

#: ``crc32c(data, value=0) -> int``: CRC-32C of a C-contiguous buffer, continued from ``value``.
crc32c: Callable[..., int] = _fast_crc32c or _crc32c_package.crc32c
CRC_IMPLEMENTATION = "crc32c-rs" if _fast_crc32c else "crc32c"

ATTRIBUTE = "lightning_distckpt"
_ZEROS = memoryview(bytes(1 << 20))


def padded_crc(data: Any, pad: int, crc: int = 0) -> int:
    """CRC-32C of ``data`` followed by ``pad`` zero bytes."""
    crc = crc32c(data, crc)
    while pad > 0:
        crc = crc32c(_ZEROS[:min(pad, len(_ZEROS))], crc)  # a view: no copy
        pad -= len(_ZEROS)
    return crc


def chunk_crcs(arr: np.ndarray, chunk_rows: int) -> List[int]:
    """CRC-32C of each stored chunk of the C-contiguous ``arr`` cut every ``chunk_rows`` rows (the
    last one padded with zeros to whole chunk rows, as zarr stores it)."""
    flat = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    if arr.ndim == 0:
        return [crc32c(flat)]
    step = chunk_rows * (arr.nbytes // max(1, arr.shape[0]))
    return [padded_crc(flat[o:o + step], o + step - min(o + step, arr.nbytes))
            for o in range(0, max(arr.nbytes, 1) if arr.shape[0] else 0, max(step, 1))]


def crc_attributes(crcs: Optional[Sequence[int]], token: Optional[str] = None) -> Dict[str, Any]:
    """The ``attributes`` of an array's metadata recording ``crcs`` and the save's ``token`` (either may be None)."""
    record: Dict[str, Any] = {} if crcs is None else {"crc32c": [int(c) for c in crcs]}
    return {ATTRIBUTE: record if token is None else {**record, "save": token}}


def attribute_crcs(metadata: Any, chunks: int, where: str) -> Optional[Tuple[int, ...]]:
    """The chunk checksums recorded in an array's metadata (its zarr.json), or
    None when it records none. FormatError when the record is malformed (data, checked as data)."""
    attrs = metadata.get("attributes") if isinstance(metadata, dict) else None
    if not isinstance(attrs, dict) or ATTRIBUTE not in attrs:
        return None
    record = attrs[ATTRIBUTE]
    if isinstance(record, dict) and "crc32c" not in record and "save" in record:
        return None  # the save's token alone (format 7: packs, object stores; storage/save_token.py)
    crcs = record.get("crc32c") if isinstance(record, dict) else None
    if not isinstance(crcs, list) or len(crcs) != chunks or \
            not all(type(c) is int and 0 <= c < 1 << 32 for c in crcs):
        raise FormatError(f"{where}: zarr.json attribute {ATTRIBUTE}.crc32c is malformed (want {chunks} CRC-32C "
                          f"values, one per chunk): damaged")
    return tuple(crcs)


def array_checksums(arr: Any, metadata: Dict[str, Any], where: str, required: bool) -> Optional[Tuple[int, ...]]:
    """The chunk checksums an opened array records in ``metadata`` (its zarr.json as read), or None
    (then the ``crc32c`` codec checksums its chunks, or nothing does). FormatError when ``required``
    (the checkpoint records checksums) and the array has none: its zarr.json was changed."""
    try:
        rows = int(arr.chunk_layout.read_chunk.shape[0]) if arr.rank else 1
    except Exception as e:
        raise FormatError(f"{where}: unreadable array metadata: {e}") from e
    crcs = attribute_crcs(metadata, chunk_count(arr.shape, rows), where)
    codecs = metadata.get("codecs")
    if crcs is None and required and not (isinstance(codecs, list) and {"name": "crc32c"} in codecs):
        raise FormatError(f"{where} is stored without checksums although the checkpoint records them (its zarr.json "
                          f"was changed): damaged")
    return crcs


def chunk_count(shape: Sequence[int], chunk_rows: int) -> int:
    """Chunks of an array cut along its first axis every ``chunk_rows`` rows (a 0-d array: one)."""
    return 1 if len(shape) == 0 else -(-int(shape[0]) // max(1, chunk_rows))


class VerifiedRead(NamedTuple):
    """Deliver ``arr[src]`` into ``dest`` (None: check only), ``arr``'s chunks checked against
    ``crcs``. ``chunk_file(chunk)``, where known, names the file holding a chunk (for errors)."""

    what: str
    arr: Any
    crcs: Tuple[int, ...]
    src: Tuple[slice, ...]
    dest: Optional[torch.Tensor]
    chunk_file: Optional[Callable[[int], str]] = None


def check_reads(what: str, arr: Any, crcs: Tuple[int, ...],
                chunk_file: Optional[Callable[[int], str]] = None) -> List[VerifiedRead]:
    """Reads for :class:`VerifiedReads` that check every chunk of ``arr`` (one read per chunk)."""
    if arr.rank == 0:
        return [VerifiedRead(f"{what}: chunk 0", arr, crcs, (), None, chunk_file)]
    rows, n = max(1, int(arr.chunk_layout.read_chunk.shape[0])), int(arr.shape[0])
    return [VerifiedRead(f"{what}: chunk rows {r}:{min(r + rows, n)}", arr, crcs, (slice(r, min(r + rows, n)),),
                         None, chunk_file) for r in range(0, n, rows)]


class VerifiedReads:
    """Reads of arrays whose checksums are in their metadata, done by tensorstore: each read is
    widened to whole chunks, every chunk's CRC-32C checked, then ``stored[src]`` copied into its
    destination (converted to its dtype). At most ``max_bytes`` of chunks are held at once (one
    larger read alone)."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes

    def run(self, reads: Sequence[VerifiedRead], verify: bool = True) -> Tuple[int, List[str]]:
        """(bytes delivered or checked, an error message per failed read)."""
        nbytes, errors, batch, held = 0, [], [], 0
        for r in list(reads) + [None]:  # type: ignore[list-item]
            size = 0 if r is None else _widened_bytes(r.arr, r.src)
            if batch and (r is None or held + size > self.max_bytes):
                for item in batch:
                    outcome = _finish(*item, verify)
                    if isinstance(outcome, str):
                        errors.append(outcome)
                    else:
                        nbytes += outcome
                batch, held = [], 0
            if r is not None:
                batch.append(_start(r))
                held += size
        return nbytes, errors


def _span(arr: Any, src: Sequence[slice]) -> Tuple[int, int, int, int]:
    """(chunk rows, first row of ``src``, first and end row of the whole chunks holding it)."""
    if arr.rank == 0:
        return 1, 0, 0, 1
    rows, n = max(1, int(arr.chunk_layout.read_chunk.shape[0])), int(arr.shape[0])
    start, stop = src[0].indices(n)[:2]
    return rows, start, start // rows * rows, min(-(-stop // rows) * rows, n)


def _widened_bytes(arr: Any, src: Sequence[slice]) -> int:
    _, _, lo, hi = _span(arr, src)
    return max(0, hi - lo) * math.prod(arr.shape[1:]) * np.dtype(arr.dtype.numpy_dtype).itemsize


def _start(r: VerifiedRead) -> Tuple[Any, ...]:
    rows, start, lo, hi = _span(r.arr, r.src)
    return r, (r.arr.read() if r.arr.rank == 0 else r.arr[lo:hi].read()), lo, rows, start


def _finish(r: VerifiedRead, fut: Any, lo: int, rows: int, start: int, verify: bool) -> Any:
    """Bytes delivered, or an error message."""
    what, crcs, src, dest = r.what, r.crcs, r.src, r.dest
    try:
        data = fut.result()
        data = data if data.flags.c_contiguous else data.copy()  # (not ascontiguousarray: it makes 0-d 1-d)
    except Exception as e:
        return f"{what} failed: {e}"
    if verify:  # whole chunks from ``lo``: the last padded as stored only where the array ends
        for chunk, got in enumerate(chunk_crcs(data, rows), start=lo // rows):
            if got != crcs[chunk]:
                file = f" ({r.chunk_file(chunk)})" if r.chunk_file is not None else ""
                return (f"{what}: checksum mismatch in chunk {chunk}{file} (CRC-32C {got:#010x}, recorded "
                        f"{crcs[chunk]:#010x} in its zarr.json): damaged")
    if dest is None:  # checked only
        return data.nbytes
    stored = as_tensor(data)
    part = stored if data.ndim == 0 else stored[(slice(start - lo, start - lo + dest.shape[0]), *src[1:])]
    dest.copy_(part.reshape(dest.shape))
    return dest.numel() * dest.element_size()

