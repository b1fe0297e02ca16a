"""A PyTorch DCP checkpoint (``torch.distributed.checkpoint.save`` with its ``FileSystemWriter``:
a ``.metadata`` file and ``.distcp`` files) as a checkpoint source.

Each tensor of DCP's metadata becomes a tensor entry under its fully qualified name (mapped by
``key_map``), each stored chunk a stored shard: ``writer`` is the number of its ``.distcp`` file,
``index`` its position among the tensor's chunks. The reading pipeline plans every rank's reads
from these shards (resharding included); the reader reads, of each needed chunk's byte range,
only the span that holds the pieces asked for (:mod:`.dcp_chunks`).
Objects DCP stored as bytes (``BytesStorageMetadata``) are the common state: a flat dict
``{fqn: value}``, deserialized safely. A Lightning ``ModelParallelStrategy`` / ``FSDPStrategy``
sharded checkpoint is a DCP directory plus ``meta.pt`` (the rest of the Trainer checkpoint:
epoch, global_step, loops, callbacks, hyperparameters); its entries join the common state.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, BinaryIO, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ...core.shown import shown
from ...core.errors import CheckpointingError, FormatError, ShardingError
from ...planning.metadata import CheckpointIndex, StoredShard, TensorEntry, dtype_name
from ...storage.base import ShardRead
from ...storage.paths import PICKLE_CAP, model_root
from ...storage.safe_pickle import load_file, loads, torch_message
from ...storage.zip_records import check_records
from .dcp_chunks import SAFETENSORS_FORMAT, ChunkLayout, chunk_layout, read_pieces, safetensors_at
from .dcp_metadata import METADATA_NAME, DcpChunk, DcpItem, DcpMetadata, read_metadata
from .dcp_safetensors import resolve_safetensors
from .dcp_transforms import chunk_limit, decompressed
from .model_files import check_model_file, open_model_file
from .tensor_files import KeyMap, check_key, map_key

logger = logging.getLogger(__name__)

LIGHTNING_META_NAME = "meta.pt"  # what Lightning's sharded (DCP) checkpoints keep beside the DCP files


def is_dcp_dir(path: str) -> bool:
    """A directory holding DCP's ``.metadata`` (whatever it is: a special file or a link out of the
    directory in its place is refused when the directory is opened, naming it)."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, METADATA_NAME))


@dataclass(frozen=True)
class _StoredChunk:
    """A stored shard of the index, as the reader finds it: the tensor's DCP name and the chunk."""

    fqn: str
    chunk: DcpChunk
    dtype: torch.dtype  # the tensor's, as .metadata declares it: what the stored chunk must hold


class DcpSource:
    """A :class:`~lightning_distckpt.reading.checkpoint.CheckpointSource` over a DCP directory. Its
    files are regular files, links among them followed only inside the directory's root
    (:mod:`.model_files`)."""

    def __init__(self, path: str, key_map: KeyMap = None) -> None:
        self.path = path
        self.root = model_root(path)
        meta = read_metadata(os.path.join(path, METADATA_NAME), self.root)
        self._mcore_data = meta.mcore_data
        self._files = sorted({c.item.file for t in meta.tensors.values() for c in [*t.chunks, *t.stored_empty]}
                             | {item.file for item in meta.objects.values()})
        self._sizes: Dict[str, int] = {}
        self._full_paths = {rel: self._checked_file(rel) for rel in self._files}
        resolve_safetensors(meta, self._full_paths, self.open_file)  # DCP's SAFETENSORS format: raw byte ranges
        self._check_ranges(meta)
        self._lightning_meta = self._optional_file(LIGHTNING_META_NAME)
        self._objects: Dict[str, Tuple[str, DcpItem]] = {}  # key -> (fqn, item)
        for fqn, item in meta.objects.items():
            key = map_key(key_map, fqn)
            if key is not None:
                check_key(self.path, fqn, key, "object")
            if key in self._objects:  # key_map joined two objects: one would silently replace the other
                raise FormatError(f"{self.path}: two DCP entries map to key {key!r} (one is {fqn!r}); fix key_map")
            if key is not None:
                self._objects[key] = (fqn, item)
        self.index = CheckpointIndex()
        self._chunks: Dict[str, List[_StoredChunk]] = {}
        self._build_index(meta, key_map)
        self._check_empty_chunks(meta)
        logger.debug("DCP checkpoint %s: %d tensors, %d objects in %d files", path, len(self.index.tensors),
                     len(self._objects), len(self._files))

    def _build_index(self, meta: DcpMetadata, key_map: KeyMap) -> None:
        file_number = {rel: i for i, rel in enumerate(self._files)}
        for fqn, tensor in meta.tensors.items():
            key = map_key(key_map, fqn)
            if key is None:
                continue
            check_key(self.path, fqn, key)  # DCP takes any str, "" too
            if key in self.index.tensors or key in self._objects:
                raise FormatError(f"{self.path}: two DCP entries map to key {key!r} (one is {fqn!r}); fix key_map")
            try:
                stored_dtype = dtype_name(tensor.dtype, fqn)
            except ShardingError:
                raise FormatError(f"{self.path}: tensor {fqn!r} has dtype {tensor.dtype}, which lightning_distckpt "
                                  "cannot load") from None
            shards = [StoredShard(c.offset, c.shape, None, file_number[c.item.file], i)
                      for i, c in enumerate(tensor.chunks)]
            self.index.tensors[key] = TensorEntry(tensor.shape, stored_dtype, shards)
            self._chunks[key] = [_StoredChunk(fqn, c, tensor.dtype) for c in tensor.chunks]

    def _check_empty_chunks(self, meta: DcpMetadata) -> None:
        """A chunk of no elements is never read (nothing to copy): what its stored item holds is
        checked here instead (its zip directory and ``data.pkl``, a few hundred bytes), so that metadata
        shrinking a stored chunk to nothing is refused, not loaded as an empty tensor."""
        reader = DcpReader(self)
        for fqn, tensor in meta.tensors.items():
            for chunk in tensor.stored_empty:
                what = f"{self._full_paths[chunk.item.file]}: tensor {fqn!r} chunk at {list(chunk.offset)}"
                with self.open_file(self._full_paths[chunk.item.file]) as f:
                    reader.check_stored(f, _StoredChunk(fqn, chunk, tensor.dtype), what)

    def _checked_file(self, rel: str) -> str:
        """The full path of ``rel``: named inside the directory, a regular file (through links only
        inside the root); its size is kept."""
        parts = rel.replace("\\", "/").split("/")
        if os.path.isabs(rel) or any(p in ("", ".", "..") for p in parts):
            raise FormatError(f"{self.path}: .metadata names file {rel!r}, which is not inside the checkpoint")
        full = os.path.join(self.path, *parts)
        if not os.path.lexists(full):
            raise FormatError(f"{self.path}: .metadata names file {rel!r}, which is missing")
        self._sizes[rel] = check_model_file(full, "DCP data file", self.root).st_size
        return full

    def _optional_file(self, name: str) -> Optional[str]:
        """``name`` in the directory when present (checked as every file is), else None."""
        full = os.path.join(self.path, name)
        if not os.path.lexists(full):
            return None
        check_model_file(full, "file", self.root)
        return full

    def open_file(self, full: str) -> BinaryIO:
        """One of the checkpoint's data files, opened as the rule says (see :mod:`.model_files`)."""
        return open_model_file(full, "DCP data file", self.root)

    def _check_ranges(self, meta: DcpMetadata) -> None:
        """Every item's byte range lies inside its file (a truncated file is found here, before reading),
        and no two items share a byte: DCP writes each item once, so chunks naming the same bytes are
        a forgery that would load one stored chunk as many (rows repeated, or a small file declaring a
        tensor of many times its size). This bounds what the metadata declares by the bytes stored."""
        sizes = {rel: self._sizes[rel] for rel in self._full_paths}
        named = [(f"tensor {fqn!r} chunk at {list(c.offset)}", c.item) for fqn, t in meta.tensors.items()
                 for c in [*t.chunks, *t.stored_empty]]
        named += [(f"object {fqn!r}", item) for fqn, item in meta.objects.items()]
        by_file: Dict[str, List[Tuple[int, int, str]]] = defaultdict(list)
        for what, item in named:
            if item.offset + item.length > sizes[item.file]:
                raise FormatError(f"{shown(self._full_paths[item.file])}: {what} is stored at bytes "
                                  f"[{item.offset}, {item.offset + item.length}) but the file has "
                                  f"{sizes[item.file]} bytes (truncated?)")
            if item.length:  # an empty item holds no byte to share (DCP's SAFETENSORS format: an empty tensor)
                by_file[item.file].append((item.offset, item.offset + item.length, what))
        for rel, ranges in by_file.items():
            ranges.sort()
            # sorted by start, ranges are disjoint when each pair of neighbours is
            for (start0, end0, what0), (start1, end1, what1) in zip(ranges, ranges[1:]):
                if start1 < end0 or (start1, end1) == (start0, end0):
                    self._refuse_safetensors_format(rel, start1, what1)
                    raise FormatError(f"{shown(self._full_paths[rel])}: {what1} is stored at bytes [{start1}, {end1}), "
                                      f"which overlap those of {what0} at [{start0}, {end0}): in a DCP checkpoint "
                                      "each stored item has bytes of its own (.metadata forged or damaged)")

    def _refuse_safetensors_format(self, rel: str, start: int, what: str) -> None:
        """Items sharing their start are what DCP's SAFETENSORS format records (every tensor at the start
        of the file's one safetensors blob): refused for that reason, not as forged metadata."""
        with self.open_file(self._full_paths[rel]) as f:
            if safetensors_at(f, start):
                raise FormatError(f"{shown(self._full_paths[rel])}: {what}: {SAFETENSORS_FORMAT}")

    def reader(self) -> "DcpReader":
        return DcpReader(self)

    def read_item(self, f: BinaryIO, item: DcpItem, limit: Optional[int] = None, what: str = "item") -> bytes:
        """The item's bytes, decompressed when DCP compressed it (to at most ``limit`` bytes; None: an
        object's, at most ``PICKLE_CAP``); ``what``: the item, for errors."""
        if item.transforms:
            where = f"{shown(self._full_paths[item.file])}: {what} (zstd-compressed at bytes [{item.offset}, " \
                    f"{item.offset + item.length}))"
            return decompressed(f, item.offset, item.length, PICKLE_CAP.limit() if limit is None else limit, where)
        f.seek(item.offset)
        data = f.read(item.length)
        if len(data) != item.length:
            raise FormatError(f"{shown(self._full_paths[item.file])}: expected {item.length} bytes at {item.offset}, "
                              f"got {len(data)} (truncated?)")
        return data

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Dict[str, Any]:
        """Lightning's ``meta.pt`` entries (if any) and the objects DCP stored as bytes
        (``{key: value}``), each deserialized with ``weights_only``."""
        out: Dict[str, Any] = {}
        if self._lightning_meta is not None:
            meta = load_file(self._lightning_meta, extra_safe_globals, self.root)
            if not isinstance(meta, dict):
                raise FormatError(f"{self._lightning_meta}: holds a {type(meta).__name__}, not a dict of "
                                  "checkpoint entries")
            out.update(meta)
        for key, (fqn, item) in self._objects.items():
            with self.open_file(self._full_paths[item.file]) as f:
                blob = self.read_item(f, item, None, f"object {fqn!r}")
            out[key] = loads(blob, f"{shown(self._full_paths[item.file])}: object {fqn!r}", extra_safe_globals)
        return out

    def stored_chunk(self, key: str, index: int) -> _StoredChunk:
        return self._chunks[key][index]

    def full_path(self, rel: str) -> str:
        return self._full_paths[rel]

    def data_files(self) -> List[str]:
        """Full paths of the data files, in the order their numbers (a stored shard's ``writer``) follow."""
        return [self._full_paths[rel] for rel in self._files]


class DcpReader:
    """Reads requested pieces of a DCP checkpoint's chunks. For each chunk it reads the chunk's tensor
    data record with one seek and one read and checks its CRC-32 before copying out the pieces asked
    for in one call (with verification off: only the span that holds them); the layout comes from the
    chunk's zip directory and ``data.pkl``, cached per reader. A chunk whose layout that does not
    cover is read whole and loaded with ``weights_only=True``."""

    def __init__(self, source: DcpSource) -> None:
        self._source = source
        self._layouts: Dict[Tuple[str, int], Optional[ChunkLayout]] = {}

    def read_into(self, reads: Iterable[ShardRead]) -> int:
        by_file: Dict[str, Dict[Tuple[str, int], List[ShardRead]]] = defaultdict(lambda: defaultdict(list))
        for r in reads:
            by_file[self._source.stored_chunk(r.key, r.index).chunk.item.file][(r.key, r.index)].append(r)
        nbytes = 0
        for rel, chunks in by_file.items():
            with self._source.open_file(self._source.full_path(rel)) as f:
                for (key, index), pieces in sorted(chunks.items(), key=lambda kv: self._offset(kv[0])):
                    self._read_chunk(f, key, index, pieces)
                    nbytes += sum(r.dest.numel() * r.dest.element_size() for r in pieces)
        return nbytes

    def _offset(self, key_index: Tuple[str, int]) -> int:
        return self._source.stored_chunk(*key_index).chunk.item.offset

    def _read_chunk(self, f: BinaryIO, key: str, index: int, pieces: List[ShardRead]) -> None:
        stored = self._source.stored_chunk(key, index)
        chunk = stored.chunk
        what = f"{self._source.full_path(chunk.item.file)}: tensor {stored.fqn!r} chunk at {list(chunk.offset)}"
        f, stored = self.plain(f, stored, f"tensor {stored.fqn!r} chunk at {list(chunk.offset)}")
        if (key, index) not in self._layouts:
            self._layouts[(key, index)] = self.checked_layout(f, stored, what)
        layout = self._layouts[(key, index)]
        try:
            if layout is not None:
                read_pieces(f, layout, pieces, what)
            else:
                tensor = self._load_whole(f, stored, what)
                for r in pieces:
                    r.dest.copy_(tensor[r.src])
        except RuntimeError as e:  # a destination that cannot take the values
            raise CheckpointingError(f"{what}: copying into the destination failed: {e}") from None

    def plain(self, f: BinaryIO, stored: _StoredChunk, what: str) -> Tuple[BinaryIO, _StoredChunk]:
        """``f`` and ``stored`` as they are, or, for a compressed chunk, its decompressed archive (in memory:
        zstd has no random access) and the chunk as the whole of it."""
        item = stored.chunk.item
        if not item.transforms:
            return f, stored
        data = self._source.read_item(f, item, chunk_limit(math.prod(stored.chunk.shape), stored.dtype.itemsize), what)
        plain = DcpItem(item.file, 0, len(data))
        return io.BytesIO(data), dataclasses.replace(stored, chunk=dataclasses.replace(stored.chunk, item=plain))

    @staticmethod
    def checked_layout(f: BinaryIO, stored: _StoredChunk, what: str) -> Optional[ChunkLayout]:
        """The chunk's layout as stored (None: read it whole), refused when its shape is not the chunk's."""
        chunk = stored.chunk
        if chunk.item.raw:  # DCP's SAFETENSORS format: the elements themselves, checked against the header
            return ChunkLayout(chunk.item.offset, chunk.item.length, stored.dtype, chunk.shape, 0)
        layout = chunk_layout(f, chunk.item.offset, chunk.item.length, what)
        if layout is not None and layout.shape != chunk.shape:
            raise FormatError(f"{what}: holds a tensor of shape {layout.shape}, expected {chunk.shape}")
        if layout is not None and layout.dtype != stored.dtype:  # the bytes would be read as another type
            raise FormatError(f"{what}: holds a tensor of dtype {layout.dtype}, but .metadata declares {stored.dtype}")
        return layout

    def check_stored(self, f: BinaryIO, stored: _StoredChunk, what: str) -> None:
        """Refuse a chunk whose stored item holds a tensor of another shape, reading no tensor bytes
        where its layout allows (else the item whole)."""
        f, stored = self.plain(f, stored, f"tensor {stored.fqn!r} chunk at {list(stored.chunk.offset)}")
        if self.checked_layout(f, stored, what) is None:
            self._load_whole(f, stored, what)  # checks the shape too

    def _load_whole(self, f: BinaryIO, stored: _StoredChunk, what: str) -> torch.Tensor:
        blob = self._source.read_item(f, stored.chunk.item)
        check_records(io.BytesIO(blob), what)  # torch.load reads a damaged record as values
        try:
            tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:  # damaged bytes, or not a torch.save'd tensor
            raise FormatError(f"{what}: not a torch.save'd tensor ({type(e).__name__}: {torch_message(e)})") from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != stored.chunk.shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise FormatError(f"{what}: holds {got}, expected a tensor of shape {stored.chunk.shape}")
        # copied out as it is: another dtype would be converted (complex to its real parts, float64 narrowed)
        if tensor.dtype != stored.dtype:
            raise FormatError(f"{what}: holds a tensor of dtype {tensor.dtype}, but .metadata declares {stored.dtype}")
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided \
                or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
            raise FormatError(f"{what}: holds a {type(tensor).__name__} of layout {tensor.layout}, not the plain "
                              "dense tensor DCP stores")
        return tensor

    def read_object(self, writer: int, key: str, index: int) -> bytes:
        raise FormatError(f"{self._source.path}: a DCP checkpoint holds no sharded objects (asked for {key!r})")
