"""Array I/O with tensorstore: each stored shard is a zarr v3 array (raw little-endian bytes, no
compression) in its writer's key-value store; reads copy a slice of a stored array straight into
the destination tensor's memory."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch

from ..core.errors import CheckpointingError
from .layout import object_path, rank_dir, tensor_path

LAYOUTS = ("ocdbt", "zarr")


@dataclass(frozen=True)
class StorageOptions:
    """How arrays are stored.

    layout: ``"ocdbt"`` (default) puts each rank's arrays in one OCDBT database: a handful of
        files per rank whatever the number of tensors. ``"zarr"`` writes plain zarr v3 arrays,
        one directory per stored shard, readable by any zarr v3 tool.
    chunk_bytes: largest zarr chunk; bigger shards are split along their first axis, so a
        resharded read fetches only the chunks it overlaps.
    io_concurrency: tensorstore's file I/O and copy concurrency.
    """

    layout: str = "ocdbt"
    chunk_bytes: int = 64 * 1024 * 1024
    io_concurrency: int = 16

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown storage layout {self.layout!r}; choose one of {LAYOUTS}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be at least 1024, got {self.chunk_bytes}")
        if self.io_concurrency < 1:
            raise ValueError(f"io_concurrency must be >= 1, got {self.io_concurrency}")

    def to_json(self) -> Dict[str, Any]:
        return {"layout": self.layout, "chunk_bytes": self.chunk_bytes}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "StorageOptions":
        return cls(layout=data.get("layout", "ocdbt"), chunk_bytes=int(data.get("chunk_bytes", 64 << 20)))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as ml_dtypes.bfloat16), sharing memory."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> List[int]:
    """Whole trailing axes, the first axis cut so one chunk holds at most ``chunk_bytes``."""
    shape = [max(1, int(s)) for s in shape]
    if not shape:
        return []
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, chunk_bytes // max(1, row))
    return [min(shape[0], rows)] + shape[1:]


class TensorStoreIO:
    """Reads and writes stored shards and objects of one checkpoint directory."""

    def __init__(self, checkpoint_dir: str, options: StorageOptions = StorageOptions()) -> None:
        self.root = os.path.abspath(checkpoint_dir)
        self.options = options
        # One context per directory: all arrays of a rank share one OCDBT database instance, and
        # the I/O concurrency applies to the whole save or load.
        self.context = ts.Context(
            {
                "file_io_concurrency": {"limit": options.io_concurrency},
                "data_copy_concurrency": {"limit": options.io_concurrency},
                "cache_pool": {"total_bytes_limit": 0},
            }
        )
        self._kvstores: Dict[int, Any] = {}
        self._arrays: Dict[Tuple[int, str], Any] = {}

    # -- specs --------------------------------------------------------------------------
    def kvstore_spec(self, writer: int) -> Dict[str, Any]:
        path = rank_dir(self.root, writer)
        if self.options.layout == "ocdbt":
            return {"driver": "ocdbt", "base": {"driver": "file", "path": path + "/"}}
        return {"driver": "file", "path": path + "/"}

    def array_spec(self, writer: int, path: str) -> Dict[str, Any]:
        return {"driver": "zarr3", "kvstore": self.kvstore_spec(writer), "path": path + "/"}

    # -- writing ------------------------------------------------------------------------
    def write(
        self,
        writer: int,
        tensors: Sequence[Tuple[str, int, torch.Tensor]],
        objects: Sequence[Tuple[str, int, bytes]] = (),
    ) -> int:
        """Write ``(key, index, data)`` shards and objects into ``writer``'s store; returns bytes.

        ``data`` must be CPU tensors in global-axes shape. Returns once everything is durable
        (tensorstore fsyncs the files it writes).
        """
        os.makedirs(rank_dir(self.root, writer), exist_ok=True)
        opens = []
        for key, index, data in tensors:
            arr = to_numpy(data.contiguous())
            spec = self.array_spec(writer, tensor_path(key, index))
            fut = ts.open(
                spec,
                create=True,
                dtype=_ts_dtype(data.dtype),
                shape=list(arr.shape),
                chunk_layout=ts.ChunkLayout(chunk_shape=chunk_shape(arr.shape, arr.itemsize, self.options.chunk_bytes)),
                context=self.context,
            )
            opens.append((key, fut, arr))
        writes = []
        nbytes = 0
        for key, fut, arr in opens:
            try:
                store = fut.result()
            except Exception as e:
                raise CheckpointingError(f"checkpoint {self.root}: cannot create array for {key!r}: {e}") from e
            writes.append((key, store.write(arr)))
            nbytes += arr.nbytes
        kv_writes = []
        if objects:
            kv = self._kvstore(writer)
            for key, index, blob in objects:
                kv_writes.append((key, kv.write(object_path(key, index), blob)))
                nbytes += len(blob)
        for key, w in writes + kv_writes:
            try:
                w.result()
            except Exception as e:
                raise CheckpointingError(f"checkpoint {self.root}: writing {key!r} failed: {e}") from e
        return nbytes

    # -- reading ------------------------------------------------------------------------
    def _kvstore(self, writer: int) -> Any:
        if writer not in self._kvstores:
            self._kvstores[writer] = ts.KvStore.open(self.kvstore_spec(writer), context=self.context).result()
        return self._kvstores[writer]

    def open_array(self, writer: int, key: str, index: int) -> Any:
        """Open stored shard ``index`` of ``key`` (cached for this reader)."""
        path = tensor_path(key, index)
        handle = (writer, path)
        if handle not in self._arrays:
            try:
                self._arrays[handle] = ts.open(
                    self.array_spec(writer, path), open=True, read=True, context=self.context
                ).result()
            except Exception as e:
                raise CheckpointingError(
                    f"checkpoint {self.root}: {key!r} shard {index} (written by rank {writer}) is missing or "
                    f"unreadable: {e}"
                ) from e
        return self._arrays[handle]

    def read_into(self, reads: Iterable[Tuple[str, int, int, Tuple[slice, ...], torch.Tensor]]) -> int:
        """Copy ``(key, writer, index, src_slices, dest)`` pieces; ``dest`` is a CPU tensor view that
        receives ``stored[src_slices]`` (converted to dest's dtype). Returns bytes read."""
        futures = []
        nbytes = 0
        for key, writer, index, src, dest in reads:
            store = self.open_array(writer, key, index)[src]
            if _ts_dtype(dest.dtype) != store.dtype.name:
                store = ts.cast(store, _ts_dtype(dest.dtype))
            target = ts.array(to_numpy(dest), copy=False, write=True, context=self.context)
            futures.append((key, index, writer, target.write(store)))
            nbytes += dest.numel() * dest.element_size()
        for key, index, writer, fut in futures:
            try:
                fut.result()
            except Exception as e:
                raise CheckpointingError(
                    f"checkpoint {self.root}: reading {key!r} shard {index} (written by rank {writer}) failed: {e}"
                ) from e
        return nbytes

    def read_array(self, writer: int, key: str, index: int, src: Optional[Tuple[slice, ...]] = None) -> np.ndarray:
        store = self.open_array(writer, key, index)
        return (store[src] if src is not None else store).read().result()

    def read_object(self, writer: int, key: str, index: int) -> bytes:
        try:
            res = self._kvstore(writer).read(object_path(key, index)).result()
        except Exception as e:
            raise CheckpointingError(f"checkpoint {self.root}: reading object {key!r} #{index} failed: {e}") from e
        if res.state != "value":
            raise CheckpointingError(
                f"checkpoint {self.root}: object {key!r} #{index} (written by rank {writer}) is missing"
            )
        return bytes(res.value)


def _ts_dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
