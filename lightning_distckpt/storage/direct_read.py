"""Whole chunks read straight from a rank's files into the destination tensors, checksums
verified with the CPU's CRC-32C instructions.

Our arrays are plain zarr v3 (``bytes`` codec, little-endian, then ``crc32c``) cut along their
first axis only, so every stored chunk is a run of whole rows followed by its 4-byte checksum.
In an OCDBT store each chunk lies whole in one data file; ``tensorstore.ocdbt.dump`` lists where
(:func:`ocdbt_locations`); in the ``zarr`` layout it is a file of its own. A chunk read whole
goes by ``os.preadv`` into the destination's own memory (no intermediate buffer) and its
checksum is computed over those bytes (:data:`.chunk_checksums.crc32c`); a chunk read in part goes
through one scratch buffer (performed by :mod:`.chunk_reads`). tensorstore's wheel computes
CRC-32C in portable code (about 1.5 GB/s here) and decodes each chunk through one more copy:
measured in docs/benchmarks.md.

What cannot be read this way (another codec chain, a packed shard, an object store, an
index this module does not understand) is left to tensorstore (see ``TensorStoreIO.read_into``).
``LIGHTNING_DISTCKPT_DIRECT_READS=0`` leaves everything to tensorstore.
"""

from __future__ import annotations

import math
import os
import re
import stat
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorstore as ts
import torch

from ..core.errors import FormatError
from .chunk_checksums import attribute_crcs, chunk_count
from .chunk_reads import ChunkLocation, ChunkTask, DirectReader, Geometry, advise_willneed, torch_dtype
from .paths import kind_of
from .ts_context import child_context

DIRECT_ENV = "LIGHTNING_DISTCKPT_DIRECT_READS"
_PLAIN = [{"configuration": {"endian": "little"}, "name": "bytes"}]
_CRC = {"name": "crc32c"}
_DATA_FILE = re.compile(r"d/[0-9a-f]{1,64}")  # OCDBT data files, relative to the store


def direct_reads_enabled(wanted: bool = True) -> bool:
    """``wanted`` (the reader's ``StorageOptions.direct_reads``), unless ``LIGHTNING_DISTCKPT_DIRECT_READS``
    is ``0`` / ``false`` / ``no`` / ``off``: the documented override sending every read through tensorstore."""
    return wanted and os.environ.get(DIRECT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


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
        dtype = torch_dtype(metadata["data_type"])
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
        base = ts.KvStore.open({"driver": "file", "path": store_dir.rstrip("/") + "/"},
                               context=child_context({})).result()
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
            and torch_dtype(geo.dtype) == dest.dtype
        loc = locate(chunk_key(geo, c))
        if loc is None:  # kept inline in the store's index
            return None
        tasks.append(ChunkTask(f"{where} chunk {c}", loc, geo, slice(a - c0, b - c0), full[1:], part, direct, c))
    return tasks


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
        self._arrays: Dict[int, Dict[str, List[Tuple[str, ChunkLocation]]]] = {}  # (:meth:`_by_array`)

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

    def prefetch(self, arrays: Sequence[Tuple[int, str]], limit: int) -> None:
        """Start the device reading the arrays ``(writer, array path)`` that are about to be read
        whole, in this order, up to ``limit`` bytes of chunks (:func:`.chunk_reads.advise_willneed`):
        their zarr.json first (small, read next), then their chunks. OCDBT stores, whose index lists
        where each value is (found once per writer, as :meth:`split` needs it anyway)."""
        if self.layout != "ocdbt" or limit <= 0:
            return
        metadata: List[ChunkLocation] = []
        chunks: List[ChunkLocation] = []
        for writer, arr_path in arrays:
            values = self._by_array(writer).get(arr_path, [])
            metadata += [loc._replace(length=min(loc.length, 1 << 16)) for key, loc in values if key == "zarr.json"]
            for key, loc in values:
                if key != "zarr.json" and limit > 0:
                    chunks.append(loc)
                    limit -= loc.length
        advise_willneed(metadata + chunks)

    def _by_array(self, writer: int) -> Dict[str, List[Tuple[str, ChunkLocation]]]:
        """Array path -> (key in the array, location) of each value ``writer``'s OCDBT index lists
        out of line, in the order of the index (chunks in order, then zarr.json)."""
        if writer not in self._arrays:
            if writer not in self._locations:
                self._locations[writer] = ocdbt_locations(self.store_dir(writer))
            out: Dict[str, List[Tuple[str, ChunkLocation]]] = {}
            for key, loc in (self._locations[writer] or {}).items():
                arr_path, sep, rest = key.rpartition("/c/") if "/c/" in key else key.rpartition("/")
                if loc is not None and arr_path:
                    out.setdefault(arr_path, []).append(("c/" + rest if sep == "/c/" else rest, loc))
            self._arrays[writer] = out
        return self._arrays[writer]

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


def _castable(stored: str, dest: torch.dtype) -> bool:
    """Whether a chunk of ``stored`` dtype is delivered into ``dest`` here: any dtype torch knows.
    A cast goes through the scratch buffer and ``Tensor.copy_``, which converts each value as
    ``Tensor.to(dtype)`` does (floats rounded to nearest even, floats into integers truncated toward
    zero, anything into bool as ``!= 0``); which casts a load may ask for is decided before the
    reads (``planning.load_plan.check_dtype_conversion``)."""
    return torch_dtype(stored) is not None


def _chunk_file(path: str) -> ChunkLocation:
    """A chunk that is a file of its own (the ``zarr`` layout): a regular file, not a link."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise FormatError(f"chunk {path} is missing or unreadable ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"chunk {path} is {kind_of(st.st_mode)}, not a regular file; refused")
    return ChunkLocation(path, 0, st.st_size)
