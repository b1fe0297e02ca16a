"""The write path of :class:`~.tensorstore_io.TensorStoreIO` (a base class of it): each stored
shard a zarr v3 array, small shards packed, objects framed with their checksum, everything of one
``write`` call in one tensorstore transaction (one OCDBT commit per rank store and call), then the
store's directories fsync'd, so a call returns with everything it wrote durable."""

from __future__ import annotations

import functools
import hashlib
import os
from typing import AbstractSet, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorstore as ts
import torch

from ..core.errors import CheckpointingError
from .array_metadata import chunk_shape, create_metadata, ts_dtype
from .base import ObjectWrite, ShardWrite
from .checksums import frame_object
from .save_token import save_token
from .store import error_said, ours
from .chunk_checksums import chunk_crcs
from .commit import fsync_dir
from . import direct_write, page_cache
from .landed_commit import Arrays, Objects, landed_whole, retried_over_itself
from .layout import object_path, pack_path, rank_dir, tensor_path
from .packs import build_pack, settle, source_numpy

PACK_CHUNK_BYTES = 1024 * 1024  # chunks of pack arrays
PART_BYTES = 32 * 1024 * 1024  # arrays per commit of a write in parts (OCDBT on files)
# OCDBT's default configuration (tensorstore 0.1.x), which every store written before this had
OCDBT_CONFIG = {"compression": {"id": "zstd"}, "max_decoded_node_bytes": 8388608, "max_inline_value_bytes": 100,
                "version_tree_arity_log2": 4}


class TensorStoreWrites:
    """Writing shards and objects into a rank's store; :class:`~.tensorstore_io.TensorStoreIO`
    provides the attributes used (``root``, ``files``, ``options``, ``context``) and the specs."""

    root: str
    files: bool
    store: Any  # the CheckpointStore
    options: Any
    context: Any

    def kvstore_spec(self, writer: int) -> Dict[str, Any]:
        raise NotImplementedError

    @functools.cached_property
    def token(self) -> str:
        """The token binding what this writer stores to its save (``storage/save_token.py``): ``root``
        is the save's staging directory (or object-store version)."""
        return save_token(self.root)

    def own_checksums(self, arr: np.ndarray, chunk_bytes: Optional[int] = None) -> bool:
        raise NotImplementedError

    def _chunk_rows(self, arr: np.ndarray) -> int:
        raise NotImplementedError

    def write_kvstore_spec(self, writer: int) -> Dict[str, Any]:
        """:meth:`kvstore_spec` as written: an OCDBT store is told its configuration
        (``assume_config``), so creating it writes no empty first manifest (a commit of its own: two
        fsyncs and a round trip per rank store and save). OCDBT's defaults, and a database id
        derived from the store's path: every writer of one store in one save gives the same."""
        spec = self.kvstore_spec(writer)
        if spec.get("driver") != "ocdbt":
            return spec
        uuid = hashlib.md5(f"{self.root}\0{writer}".encode()).hexdigest()  # an id, not a secret
        return {**spec, "assume_config": True, "config": {**OCDBT_CONFIG, "uuid": uuid}}

    def create_spec(self, writer: int, path: str, dtype: torch.dtype, shape: Sequence[int],
                    chunk_bytes: Optional[int] = None, crcs: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        """Spec creating the array for one stored shard: raw little-endian bytes, chunks of at most
        ``chunk_bytes`` (default: the options') along the first axis, every chunk stored (zeros too),
        each checksummed: ``crcs`` recorded in its metadata, or else the ``crc32c`` codec."""
        chunks = chunk_shape(shape, dtype.itemsize, chunk_bytes or self.options.chunk_bytes)
        return {"driver": "zarr3", "kvstore": self.write_kvstore_spec(writer), "path": path + "/",
                "store_data_equal_to_fill_value": True,
                "metadata": create_metadata([int(s) for s in shape], ts_dtype(dtype), chunks, crcs, self.token)}

    # -- writing ------------------------------------------------------------------------
    def write(self, writer: int, tensors: Sequence[ShardWrite], objects: Sequence[ObjectWrite] = ()) -> int:
        """Write shards and objects into ``writer``'s store (:meth:`write_once`); returns bytes.

        An OCDBT store on a local file system is written in parts of about :data:`PART_BYTES` of
        arrays, each its own commit, and each part's files leave the page cache once durable
        (:func:`.page_cache.drop`): the next part's writes get the pages just freed, where
        fresh ones cost a host fault each on a VM that hands freed memory back (0.3-0.6 CPU-s per
        200 MB; recycled, a third of it), and a save does not push the training's cached files out.
        """
        parts = self._parts(writer, tensors)
        if len(parts) == 1:
            return self.write_once(writer, tensors, objects)
        # Each part's commit adds a data file that no later commit changes: synced once, not again
        # at every later part (a store of n parts would take n * n / 2 fsyncs, 50 us each).
        nbytes, durable, data_dir = 0, set(), os.path.join(rank_dir(self.root, writer), "d") + os.sep
        for i, part in enumerate(parts):
            written, synced = self._write_part(writer, part, objects if i == 0 else (), durable)
            nbytes += written
            durable.update(path for path in synced if path.startswith(data_dir))
            page_cache.drop(synced)
        return nbytes

    def _parts(self, writer: int, tensors: Sequence[ShardWrite]) -> List[List[ShardWrite]]:
        """``tensors`` cut into the parts :meth:`write` commits one by one: one part unless this is
        an OCDBT store of more than one part's bytes, with ``direct_writes`` on, on a file system
        with a page cache (one that takes ``O_DIRECT``: not tmpfs, whose pages are the files); the
        packed shards in the first part (they make their pack arrays in one call)."""
        if not (self.files and self.options.layout == "ocdbt"
                and sum(w.data.nbytes for w in tensors) > PART_BYTES
                and direct_write.direct_writes_enabled(self.options.direct_writes)):
            return [list(tensors)]
        os.makedirs(rank_dir(self.root, writer), exist_ok=True)
        if not direct_write.supported(rank_dir(self.root, writer)):  # tmpfs: the cache is the file
            return [list(tensors)]
        parts: List[List[ShardWrite]] = [[w for w in tensors if w.packed is not None]]
        size = sum(w.data.nbytes for w in parts[0])
        for w in tensors:
            if w.packed is not None:
                continue
            if size >= PART_BYTES:
                parts.append([])
                size = 0
            parts[-1].append(w)
            size += w.data.nbytes
        return [p for p in parts if p] or [[]]

    def write_once(self, writer: int, tensors: Sequence[ShardWrite], objects: Sequence[ObjectWrite] = ()) -> int:
        """Write shards and objects into ``writer``'s store in one commit; returns bytes.

        ``data`` must be CPU tensors in global-axes shape, left unchanged until this returns
        (tensorstore reads them in place, without a staging copy; packed shards are copied into
        their pack array). All packed shards of a writer go into one call: it creates the pack
        arrays. Everything of one call goes into one tensorstore transaction, committed once:
        one OCDBT commit (a data file, its manifest: four fsyncs) instead of one per batch of
        writes that happened to arrive together (three or four per save, 14 fsyncs). Returns once
        everything is durable: every file it wrote is fsync'd (by tensorstore's file driver, or
        after the commit by the store's ``make_durable``: an OCDBT store's files all at once), and
        every directory of the store (the commit relies on it, :func:`.commit.commit`).
        Several calls into one store (an async save's waves) each commit their own transaction.
        """
        return self._write_part(writer, tensors, objects)[0]

    def _write_part(self, writer: int, tensors: Sequence[ShardWrite], objects: Sequence[ObjectWrite],
                    known_durable: AbstractSet[str] = frozenset()) -> Tuple[int, List[str]]:
        """:meth:`write_once`; also returns the files it made durable (all but ``known_durable``,
        files an earlier part synced that no commit changes since)."""
        if self.files:
            os.makedirs(rank_dir(self.root, writer), exist_ok=True)
        txn = ts.Transaction(atomic=self.options.layout == "ocdbt")  # the zarr layout: many files, not atomic
        try:
            nbytes, pending, staged = self._stage_writes(txn, writer, tensors, objects)
        except BaseException:
            txn.abort()
            raise
        errors, synced, running = [], None, [w for _, w in pending]
        try:
            for key, w in pending:  # wait for all, so no write is still running when we raise
                try:
                    w.result()
                except Exception as e:
                    errors.append(f"{key}: {error_said(self.store, e)}")
            if errors:
                txn.abort()
            else:
                committing = txn.commit_async()
                running.append(committing)
                try:
                    self._sync_dirs(writer)  # while tensorstore commits: concurrent fsyncs share journal commits
                except OSError as e:
                    errors.append(f"making rank {writer}'s store durable: {e}")
                try:
                    committing.result()
                except Exception as e:
                    if not self._landed(writer, e, *staged):
                        errors.append(f"committing rank {writer}'s store: {error_said(self.store, e)}")
                else:
                    try:  # what the store's context left unsynced (LocalStore: an OCDBT store's files)
                        synced = self.store.make_durable(rank_dir(self.root, writer), self.options,
                                                         **({"known_durable": known_durable} if known_durable else {}))
                    except Exception as e:  # a third party's store named, its call too; ours names the path
                        said = str(e) if isinstance(e, OSError) and ours(self.store, "make_durable") else \
                            f"{self.store!r}.make_durable failed: {type(e).__name__}: {e}"
                        errors.append(f"making rank {writer}'s store durable: {said}")
        except BaseException:  # Ctrl-C / SIGTERM (cli.main) mid-way: tensorstore still writes. The caller
            settle(running)  # removes the staging directory: not while files are still being made in it
            raise
        if errors:
            raise CheckpointingError(f"checkpoint {self.root}: writing failed for {'; '.join(errors[:5])}"
                                     + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""))
        return nbytes, list(synced or ())

    def _landed(self, writer: int, error: BaseException, arrays: Arrays, objects: Objects) -> bool:
        """Whether a failed commit of ``writer``'s store is one the object store carried out but answered
        as failed, retried by tensorstore over itself, and everything of it reads back as written
        (:mod:`.landed_commit`): then the write succeeded."""
        return retried_over_itself(error, self.files) and landed_whole(self.write_kvstore_spec(writer), self.context,
                                                                        arrays, objects)

    def _sync_dirs(self, writer: int) -> None:
        """fsync ``data/``, which holds the entry of ``writer``'s store (made before the transaction):
        the commit does not walk the rank stores. Inside an OCDBT store, its commit fsyncs its two
        directories and the file driver its files."""
        if self.files:
            fsync_dir(os.path.dirname(rank_dir(self.root, writer)))

    def _direct_writes(self, writer: int) -> bool:
        """Whether this call writes its large arrays' chunk files itself with ``O_DIRECT``
        (:mod:`.direct_write`): the zarr layout, a local file system that allows it."""
        return (self.files and self.options.layout == "zarr"
                and direct_write.direct_writes_enabled(self.options.direct_writes)
                and direct_write.supported(rank_dir(self.root, writer)))

    def _stage_writes(self, txn: Any, writer: int, tensors: Sequence[ShardWrite],
                      objects: Sequence[ObjectWrite]) -> Tuple[int, List[Tuple[str, Any]], Tuple[Arrays, Objects]]:
        """Open every array of the call in ``txn`` and start its writes (nothing reaches the store
        before the commit); returns the bytes, the ``(what, future)`` of each write, and what a landed
        commit must hold (:mod:`.landed_commit`)."""
        arrays: List[Tuple[str, str, np.ndarray, torch.dtype, Optional[int]]] = []  # what, path, data, dtype, chunk
        packs: Dict[torch.dtype, List[ShardWrite]] = {}
        for w in tensors:
            if w.packed is None:
                arrays.append((repr(w.key), tensor_path(w.key, w.index), source_numpy(w.data), w.data.dtype,
                               None))
            else:
                packs.setdefault(w.data.dtype, []).append(w)
        for dtype, members in packs.items():
            # Small chunks: a reader of a few packed shards fetches about what it needs.
            arrays.append((f"the pack of small {ts_dtype(dtype)} shards", pack_path(ts_dtype(dtype)),
                           build_pack(dtype, members), dtype, min(PACK_CHUNK_BYTES, self.options.chunk_bytes)))
        opens, ours, created = [], [], []
        direct = self._direct_writes(writer)
        for what, path, arr, dtype, chunk_bytes in arrays:
            spec = self.create_spec(writer, path, dtype, arr.shape, chunk_bytes)
            own = self.own_checksums(arr, chunk_bytes)
            if own:  # chunks opened without their zarr.json: it is written with their checksums below
                spec["metadata"]["codecs"] = spec["metadata"]["codecs"][:1]
                ours.append((what, path, arr, dtype))
            if own and direct and direct_write.eligible(arr):  # chunk files of our own, O_DIRECT
                opens.append((what, None, arr, os.path.join(rank_dir(self.root, writer), path)))
                continue
            how = {"open": True, "assume_metadata": True} if own else {"create": True}
            opens.append((what, ts.open(spec, context=self.context, transaction=txn, **how), arr, own))
            if not own:  # what a landed commit must hold (landed_commit)
                created.append((spec, arr))
        writes: List[Tuple[str, Any]] = []
        try:
            return self._start_writes(txn, writer, opens, ours, created, objects, writes)
        except BaseException:  # (an array that cannot be created): the writes started read the caller's
            settle(w for _, w in writes)  # tensors (referenced, not copied): none may run on once we raise
            raise

    def _start_writes(self, txn: Any, writer: int, opens: List[Tuple[str, Any, np.ndarray, Any]],
                      checksummed: List[Tuple[str, str, np.ndarray, torch.dtype]], created: Arrays,
                      objects: Sequence[ObjectWrite], writes: List[Tuple[str, Any]]) -> Tuple[int, Any, Any]:
        """:meth:`_stage_writes`' second half: start each array's write (appended to ``writes`` as it starts)."""
        nbytes, crcs = 0, []
        for key, fut, arr, own in opens:
            # Checksummed just before the array is written (the write copies it out of the cache the checksum filled)
            crcs += [chunk_crcs(arr, self._chunk_rows(arr))] if own else []
            if fut is None:  # ``own`` is the array's directory
                writes.append((key, direct_write.submit_array(own, arr, self._chunk_rows(arr))))
                nbytes += arr.nbytes
                continue
            try:
                store = fut.result()
            except Exception as e:
                raise CheckpointingError(f"checkpoint {self.root}: cannot create array for {key}: "
                                         f"{error_said(self.store, e)}") from e
            writes.append((key, store.write(arr, can_reference_source_data_indefinitely=True)))
            nbytes += arr.nbytes
        writes += [(f"{what} (its zarr.json)", ts.open(self.create_spec(writer, path, dtype, arr.shape, None, c),
                                                       create=True, context=self.context, transaction=txn))
                   for (what, path, arr, dtype), c in zip(checksummed, crcs)]
        framed = [(object_path(key, index), frame_object(blob, self.token)) for key, index, blob in objects]
        if objects:
            kv = ts.KvStore.open(self.write_kvstore_spec(writer), context=self.context, transaction=txn).result()
            for (key, _, blob), (path, frame) in zip(objects, framed):
                writes.append((repr(key), kv.write(path, frame)))
                nbytes += len(blob)
        return nbytes, writes, (created, framed)
