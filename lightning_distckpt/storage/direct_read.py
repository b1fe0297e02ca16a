"""Whole chunks read straight from a rank's files into the destination tensors, checksums
verified with the CPU's CRC-32C instructions.

Our arrays are plain zarr v3 (``bytes`` codec, little-endian, then ``crc32c``) cut along their
first axis only, so every stored chunk is a run of whole rows followed by its 4-byte checksum.
In an OCDBT store each chunk lies whole in one data file; ``tensorstore.ocdbt.dump`` lists where
(:func:`ocdbt_locations`); in the ``zarr`` layout it is a file of its own. A chunk read whole
goes by ``os.preadv`` into the destination's own memory (no intermediate buffer) and its
checksum is computed over those bytes (:data:`.chunk_checksums.crc32c`); a chunk read in part goes
through one scratch buffer. tensorstore's wheel computes CRC-32C in portable code (about
1.5 GB/s here) and decodes each chunk through one more copy: measured in docs/benchmarks.md.

What cannot be read this way (another codec chain, a packed shard, an object store, an
index this module does not understand) is left to tensorstore (see ``TensorStoreIO.read_into``).
``LIGHTNING_DISTCKPT_DIRECT_READS=0`` leaves everything to tensorstore.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorstore as ts
import torch

from ..core.errors import FormatError
from .chunk_checksums import attribute_crcs, chunk_count, crc32c
from .paths import kind_of, open_regular

DIRECT_ENV = "LIGHTNING_DISTCKPT_DIRECT_READS"
_PLAIN = [{"configuration": {"endian": "little"}, "name": "bytes"}]
_CRC = {"name": "crc32c"}
_DATA_FILE = re.compile(r"d/[0-9a-f]{1,64}")  # OCDBT data files, relative to the store
_CRC_TRAILER = struct.Struct("<I")
_PIECE_BYTES = 1 << 20  # read and checksum a chunk this much at a time


def direct_reads_enabled(wanted: bool = True) -> bool:
    """``wanted`` (the reader's ``StorageOptions.direct_reads``), unless ``LIGHTNING_DISTCKPT_DIRECT_READS``
    is ``0`` / ``false`` / ``no`` / ``off``: the documented override sending every read through tensorstore."""
    return wanted and os.environ.get(DIRECT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class ChunkLocation(NamedTuple):
    """Where a stored chunk's bytes are: ``length`` bytes at ``offset`` of file ``path``."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class Geometry:
    """What a direct read needs to know of a stored array."""

    shape: Tuple[int, ...]
    dtype: str  # tensorstore's name, as ``ts_dtype`` gives for the matching torch dtype
    chunk_rows: int
    row_bytes: int
    checksum: bool  # each chunk ends with its CRC-32C (the ``crc32c`` codec, format 3)
    crcs: Optional[Tuple[int, ...]] = None  # or each chunk's CRC-32C is in the array's metadata (format 5)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one encoded chunk: whole rows (edge chunks padded) plus the checksum."""
        return self.chunk_rows * self.row_bytes + (4 if self.checksum else 0)


def geometry(metadata: Dict[str, Any], where: str = "an array") -> Optional[Geometry]:
    """The geometry of a zarr v3 array from its zarr.json as read and checked against metadata.json
    (``array_metadata.check_metadata``: nothing else is trusted here, and the array need not be
    opened in tensorstore), or None when it is not a plain array chunked along its first axis only
    (then tensorstore reads it). FormatError for malformed checksums."""
    try:
        codecs = metadata.get("codecs")
        encoding = metadata.get("chunk_key_encoding")
        shape = tuple(int(n) for n in metadata["shape"])
        chunks = tuple(int(n) for n in metadata["chunk_grid"]["configuration"]["chunk_shape"])
        dtype = _torch_dtype(metadata["data_type"])
    except Exception:  # not an array as our writers make them: let tensorstore read it
        return None
    if codecs not in (_PLAIN, _PLAIN + [_CRC]) or not shape or dtype is None or chunks[1:] != shape[1:]:
        return None
    if encoding not in (None, {"name": "default"}, {"name": "default", "configuration": {"separator": "/"}}):
        return None
    crcs = attribute_crcs(metadata, chunk_count(shape, chunks[0]), where)
    geo = Geometry(shape, metadata["data_type"], chunks[0], math.prod(shape[1:]) * dtype.itemsize,
                   len(codecs) == 2, crcs)
    return geo if geo.chunk_bytes > 0 else None


def chunk_key(geo: Geometry, row_chunk: int) -> str:
    """The zarr v3 key of a chunk (default encoding), relative to its array."""
    return "c/" + "/".join([str(row_chunk)] + ["0"] * (len(geo.shape) - 1))


def ocdbt_locations(store_dir: str) -> Optional[Dict[str, Optional[ChunkLocation]]]:
    """Key -> location of every value in the OCDBT database at ``store_dir`` (its latest version;
    None for a small value kept inline in the index), or None when the database cannot be listed
    so (tensorstore reads it)."""
    try:
        base = ts.KvStore.open({"driver": "file", "path": store_dir.rstrip("/") + "/"}).result()
        manifest = ts.ocdbt.dump(base).result()
        versions = manifest.get("versions") or []
        if not versions:
            return None
        root = max(versions, key=lambda v: v["generation_number"])["root"]
        out: Dict[str, Optional[ChunkLocation]] = {}
        if "location" in root:
            _walk(base, store_dir, root["location"], b"", out)
        return out
    except Exception:
        return None


def _walk(base: Any, store_dir: str, location: str, prefix: bytes, out: Dict[str, Optional[ChunkLocation]]) -> None:
    node = ts.ocdbt.dump(base, location).result()
    for entry in node["entries"]:
        if node["height"] > 0:
            _walk(base, store_dir, entry["location"], prefix + entry["subtree_common_prefix"], out)
        elif "indirect_value" in entry:
            kind, ref = entry["indirect_value"].split("::", 1)
            name, offset, length = ref.rsplit(":", 2)
            if kind != "value" or not _DATA_FILE.fullmatch(name):
                raise ValueError(f"unexpected value reference {entry['indirect_value']!r}")
            out[(prefix + entry["key"]).decode()] = ChunkLocation(os.path.join(store_dir, name), int(offset),
                                                                 int(length))
        else:  # a value of at most ``max_inline_value_bytes`` kept in the node: tensorstore reads it
            out[(prefix + entry["key"]).decode()] = None


class ChunkTask(NamedTuple):
    """Read chunk number ``chunk`` and deliver ``rows`` (chunk-local) of it, ``trailing``-sliced,
    into ``dest`` (None: read and verify only), converted to its dtype. ``direct``: ``dest`` is the
    chunk's whole rows, contiguous, of the stored dtype: read into it in place."""

    where: str
    loc: ChunkLocation
    geo: Geometry
    rows: slice
    trailing: Tuple[slice, ...]
    dest: Optional[torch.Tensor]
    direct: bool
    chunk: int = 0


def plan_chunks(where: str, geo: Geometry, src: Sequence[slice], dest: torch.Tensor,
                locate: Any) -> Optional[List[ChunkTask]]:
    """The chunk tasks delivering ``stored[src]`` into ``dest``; ``locate(chunk_key)`` gives a
    :class:`ChunkLocation` (None: held inline) or raises. None when ``src`` is not plain slices or
    a chunk is inline (tensorstore reads it)."""
    full = tuple(slice(*s.indices(n)[:2]) for s, n in zip(src, geo.shape)) if len(src) == len(geo.shape) else None
    if full is None or any(s.step not in (None, 1) for s in src):
        return None
    start, stop = full[0].start, full[0].stop
    whole_rows = all(s.start == 0 and s.stop == n for s, n in zip(full[1:], geo.shape[1:]))
    tasks = []
    for c in range(start // geo.chunk_rows, -(-stop // geo.chunk_rows)):
        c0 = c * geo.chunk_rows
        a, b = max(start, c0), min(stop, c0 + geo.chunk_rows, geo.shape[0])
        part = dest[a - start:b - start]
        direct = whole_rows and a == c0 and b == min(c0 + geo.chunk_rows, geo.shape[0]) and part.is_contiguous() \
            and _torch_dtype(geo.dtype) == dest.dtype
        loc = locate(chunk_key(geo, c))
        if loc is None:  # kept inline in the store's index
            return None
        tasks.append(ChunkTask(f"{where} chunk {c}", loc, geo, slice(a - c0, b - c0), full[1:], part, direct, c))
    return tasks


class _Budget:
    """Bytes of scratch buffers in use at once, at most ``limit`` (one request alone may exceed it)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, nbytes: int) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + nbytes <= self.limit)
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self.cond:
                self.used -= nbytes
                self.cond.notify_all()


class DirectReader:
    """Runs :class:`ChunkTask` s on a few threads (``preadv`` and the checksum release the GIL).
    Chunks read in part go through scratch buffers, at most ``scratch_bytes`` of them at once."""

    def __init__(self, threads: int, scratch_bytes: int = 256 << 20) -> None:
        self.threads = max(1, threads)
        self.budget = _Budget(scratch_bytes)

    def run(self, tasks: Sequence[ChunkTask], verify: bool = True) -> Tuple[int, List[str]]:
        """(bytes delivered, an error message per failed chunk)."""
        fds: Dict[str, int] = {}
        try:
            for t in tasks:
                if t.loc.path not in fds:  # a regular file, never through a link, never waiting on a FIFO
                    fds[t.loc.path] = open_regular(t.loc.path, "data file")
            with ThreadPoolExecutor(self.threads, thread_name_prefix="ldc-direct-read") as pool:
                outcomes = list(pool.map(lambda t: self._run(t, fds[t.loc.path], verify), tasks))
        except (OSError, FormatError) as e:
            return 0, [f"{tasks[0].where if tasks else 'a chunk'}: cannot open a data file: {e}"]
        finally:
            for fd in fds.values():
                os.close(fd)
        errors = [o for o in outcomes if isinstance(o, str)]
        return sum(o for o in outcomes if isinstance(o, int)), errors

    def _run(self, task: ChunkTask, fd: int, verify: bool) -> Any:
        if task.direct:
            return _run_one(task, fd, verify)
        with self.budget.take(task.geo.chunk_bytes):
            return _run_one(task, fd, verify)


def _run_one(task: ChunkTask, fd: int, verify: bool) -> Any:
    """Bytes delivered, or an error message."""
    geo, loc = task.geo, task.loc
    if loc.length != geo.chunk_bytes:
        return f"{task.where}: stored as {loc.length} bytes in {loc.path}, expected {geo.chunk_bytes} (damaged)"
    if task.dest is not None and task.direct:
        body = task.dest.view(-1).view(torch.uint8).numpy()
        parts = [body, np.empty(geo.chunk_rows * geo.row_bytes - body.nbytes, dtype=np.uint8)]  # + edge padding
    else:
        body = np.empty(geo.chunk_rows * geo.row_bytes, dtype=np.uint8)
        parts = [body]
    crc, offset = 0, loc.offset
    for part in parts:
        # Piece by piece, each checksummed while still in the CPU's cache (one pass over memory, not two)
        for start in range(0, part.nbytes, _PIECE_BYTES):
            piece = part[start:start + _PIECE_BYTES]
            try:
                got = os.preadv(fd, [piece], offset)
            except OSError as e:
                return f"{task.where}: reading {loc.path} failed: {e}"
            if got != piece.nbytes:
                return f"{task.where}: {loc.path} is truncated (chunk of {loc.length} bytes at offset {loc.offset})"
            offset += got
            if verify and (geo.checksum or geo.crcs is not None):
                crc = crc32c(piece, crc)
    stored: Optional[int] = None if geo.crcs is None else geo.crcs[task.chunk]
    if geo.checksum:
        trailer = os.pread(fd, 4, offset)
        if len(trailer) != 4:
            return f"{task.where}: {loc.path} is truncated (chunk of {loc.length} bytes at offset {loc.offset})"
        stored = _CRC_TRAILER.unpack(trailer)[0]
    if verify and stored is not None and crc != stored:
        return (f"{task.where}: checksum mismatch in {loc.path} at offset {loc.offset} (CRC-32C {crc:#010x}, "
                f"{'recorded in its zarr.json' if geo.crcs is not None else 'stored'} {stored:#010x}): damaged")
    if task.dest is None:  # checked only
        return loc.length
    if not task.direct:
        rows = torch.frombuffer(body, dtype=_torch_dtype(geo.dtype)).view(geo.chunk_rows, *geo.shape[1:])
        task.dest.copy_(rows[(task.rows, *task.trailing)])
    return task.dest.numel() * task.dest.element_size()


class DirectChunks:
    """One checkpoint reader's direct reads: the chunk locations of each writer's store and the
    geometry of each array, found once and kept.

    ``store_dir(writer)`` is the writer's store directory; ``layout`` the checkpoint's layout;
    ``metadata(writer, path)`` the zarr.json of an array opened by the reader, as read."""

    def __init__(self, store_dir: Callable[[int], str], layout: str, threads: int,
                 metadata: Callable[[int, str], Dict[str, Any]]) -> None:
        self.store_dir = store_dir
        self.metadata = metadata
        self.layout = layout
        self.reader = DirectReader(threads)
        self._locations: Dict[int, Optional[Dict[str, Optional[ChunkLocation]]]] = {}
        self._geometry: Dict[Tuple[int, str], Optional[Geometry]] = {}

    def split(self, reads: Sequence[Any], path: Callable[[str, int], str]) -> Tuple[List[ChunkTask], List[Any]]:
        """(chunk tasks for the :class:`~lightning_distckpt.storage.base.ShardRead` s that can be
        read directly, the reads left to tensorstore). ``path(key, index)`` is an array's path in
        the store; its zarr.json (``metadata``) was read and checked. Raises FormatError for a
        missing chunk."""
        tasks: List[ChunkTask] = []
        rest: List[Any] = []
        for r in reads:
            arr_path = path(r.key, r.index)
            where = f"{r.key!r} shard {r.index} (written by rank {r.writer})"
            geo = self._geo(r.writer, arr_path, where)
            ok = geo is not None and r.dest.numel() > 0 and _castable(geo.dtype, r.dest.dtype)
            locate = self._locator(r.writer, arr_path) if ok else None
            planned = plan_chunks(where, geo, r.src, r.dest, locate) if locate is not None else None
            if planned is None:
                rest.append(r)
            else:
                tasks.extend(planned)
        return tasks, rest

    def check_tasks(self, writer: int, arr_path: str, arr: Any, where: str) -> Optional[List[ChunkTask]]:
        """Tasks that read and verify every chunk of an array, delivering nothing (``validate``);
        None when tensorstore must read it. Raises FormatError for a missing chunk. ``arr`` (the
        opened array) is not needed: its checked zarr.json gives the geometry."""
        geo = self._geo(writer, arr_path, where)
        locate = self._locator(writer, arr_path) if geo is not None else None
        if geo is None or locate is None:
            return None
        tasks = []
        for c in range(-(-geo.shape[0] // geo.chunk_rows)):
            what = f"{where}: chunk rows {c * geo.chunk_rows}:{min((c + 1) * geo.chunk_rows, geo.shape[0])}"
            try:
                loc = locate(chunk_key(geo, c))
            except FormatError as e:
                raise FormatError(f"{what}: {e}") from e
            if loc is None:
                return None
            tasks.append(ChunkTask(what, loc, geo, slice(0, 0), (), None, False, c))
        return tasks

    def _geo(self, writer: int, arr_path: str, where: str) -> Optional[Geometry]:
        if (writer, arr_path) not in self._geometry:
            self._geometry[(writer, arr_path)] = geometry(self.metadata(writer, arr_path), where)
        return self._geometry[(writer, arr_path)]

    def _locator(self, writer: int, arr_path: str) -> Optional[Callable[[str], Optional[ChunkLocation]]]:
        root = self.store_dir(writer)
        if self.layout != "ocdbt":
            return lambda key: _chunk_file(os.path.join(root, arr_path, key))
        if writer not in self._locations:
            self._locations[writer] = ocdbt_locations(root)
        index = self._locations[writer]
        if index is None:
            return None

        def locate(key: str) -> Optional[ChunkLocation]:
            if f"{arr_path}/{key}" not in index:
                raise FormatError(f"checkpoint store {root}: chunk {arr_path}/{key} is missing (deleted or never "
                                  f"written)")
            return index[f"{arr_path}/{key}"]
        return locate


def _torch_dtype(name: str) -> Optional[torch.dtype]:
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _castable(stored: str, dest: torch.dtype) -> bool:
    """Whether a chunk of ``stored`` dtype is delivered into ``dest`` here: any dtype torch knows.
    A cast goes through the scratch buffer and ``Tensor.copy_``, which converts each value as
    ``Tensor.to(dtype)`` does (floats rounded to nearest even, floats into integers truncated toward
    zero, anything into bool as ``!= 0``); which casts a load may ask for is decided before the
    reads (``planning.load_plan.check_dtype_conversion``)."""
    return _torch_dtype(stored) is not None


def _chunk_file(path: str) -> ChunkLocation:
    """A chunk that is a file of its own (the ``zarr`` layout): a regular file, not a link."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise FormatError(f"chunk {path} is missing or unreadable ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"chunk {path} is {kind_of(st.st_mode)}, not a regular file; refused")
    return ChunkLocation(path, 0, st.st_size)
