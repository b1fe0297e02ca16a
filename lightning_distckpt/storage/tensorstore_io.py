"""Array I/O with tensorstore: each stored shard is a zarr v3 array (raw little-endian bytes, no
compression) in its writer's key-value store; reads copy a slice of a stored array straight into
the destination tensor's memory.

Performance notes (measured with ``benchmarks/``, see docs/benchmarks.md):

* writes hand tensorstore the tensor's memory (``can_reference_source_data_indefinitely``): no
  staging copy; with the cache pool at 0 bytes nothing is retained after the write returns;
* every chunk is stored, zeros included (``store_data_equal_to_fill_value``): no compare-with-fill
  scan; reads refuse missing chunks (``fill_missing_data_reads=False``) instead of returning zeros;
* arrays are created and opened concurrently (one future each): one by one cost ~0.3 ms each;
* small shards (norms, biases: at most ``pack_max_bytes``) are packed into one 1-D array per
  rank and dtype (``p/<dtype>``, :mod:`.packs`): creating an array costs ~0.15-0.2 ms each;
* OCDBT data files are bounded (``data_file_bytes``, 64 MiB): one huge ``writev`` per batch, as
  OCDBT does by default, was slower and far more variable than bounded files written concurrently;
* chunk checksums are ours, in each array's zarr.json (:mod:`.chunk_checksums`); writes
  (:mod:`.tensorstore_write`): one transaction, one OCDBT commit per store and call.
"""

from __future__ import annotations

import copy
import math
import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import tensorstore as ts

from ..core.errors import CheckpointingError, FormatError
from .base import ShardRead
from .options import StorageOptions
from .checksums import unframe_object, verification_enabled
from .array_metadata import (Recorded, RecordedArrays, check_metadata, chunk_shape, metadata_checksums, metadata_key,
                             open_spec, parse_metadata, read_capped, read_metadata, ts_dtype)
from .chunk_checksums import VerifiedRead, VerifiedReads
from .chunk_reads import ReadSession
from .direct_read import DirectChunks, direct_reads_enabled
from .layout import object_path, pack_path, rank_dir, tensor_path
from .paths import PICKLE_CAP, dir_identity
from .save_token import token_now_at
from ..planning.even_index import PackedPlaces, Place
from .packs import copy_out, landing, pack_runs, packed_view, settle, to_numpy
from .tensorstore_write import TensorStoreWrites
from .store import asked, error_said, still_committed

if TYPE_CHECKING:
    from ..planning.metadata import CheckpointIndex
    from .store import CheckpointStore


_FIRST_BATCH = 8  # reads planned before the first direct reads start (then 16, 32, ...)
_PREFETCH_BYTES = 512 << 20  # of chunks read whole, asked of the device before their metadata is read


class TensorStoreIO(TensorStoreWrites):
    """Reads and writes stored shards and objects of one checkpoint directory (``ShardWriter`` and
    ``ShardReader``), in the key-value store its :class:`~lightning_distckpt.storage.store.CheckpointStore` gives."""

    backend: ClassVar[str] = "tensorstore"

    def __init__(self, checkpoint_dir: str, options: StorageOptions = StorageOptions(),
                 index: Optional["CheckpointIndex"] = None, check_sizes: bool = True,
                 store: Optional["CheckpointStore"] = None) -> None:
        """``index``: the checkpoint's index, needed to read packed shards (a reader passes it, a writer
        does not). A reader checks each store before it opens it (no links; with ``check_sizes``, no more
        bytes claimed by the index than stored).
        ``store``: whose key-value store holds the arrays (default: the one serving ``checkpoint_dir``)."""
        if store is None:
            from .stores import open_store  # the stores open this class

            store = open_store(checkpoint_dir, options)
        self.store = store
        self.files = store.file_system  # chunk files of our own: direct reads, no links, own checksums
        self.root = os.path.abspath(checkpoint_dir) if self.files else checkpoint_dir
        self.options = options
        # (writer, (key, index)) -> (dtype, offset, shape): keyed by shard, not by its path (no key encoding per read)
        self._packed = PackedPlaces(index, _shard_id)
        self._recorded = RecordedArrays(index)  # what each array's zarr.json must say (array_metadata.check_metadata)
        self._reading = index is not None
        self.verify = verification_enabled(options.verify)
        self._index_checksums = index is not None and index.checksums and self.verify
        self._claimed = index.bytes_per_writer() if index is not None and check_sizes else {}
        self._root_id = dir_identity(self.root) if self._reading and self.files else None
        self._fresh_state()

    def _fresh_state(self) -> None:
        """What each reader (or writer) keeps of its own: its tensorstore context, opened stores and
        arrays, the writers it checked."""
        # One context per directory: all arrays of a rank share one OCDBT database instance, and
        # the I/O concurrency applies to the whole save or load. No chunk cache: checkpoint data
        # is written or read once, and caching would keep references to the caller's tensors.
        self.context = asked(self.store, "ts_context()", self.store.ts_context, self.options)
        self._kvstores: Dict[int, Any] = {}
        self._arrays: Dict[Tuple[int, str], Any] = {}  # opened in tensorstore (what tensorstore reads)
        self._crcs: Dict[Tuple[int, str], Tuple[int, ...]] = {}  # chunk checksums kept in an array's metadata
        self._metadata: Dict[Tuple[int, str], Dict[str, Any]] = {}  # each array's zarr.json, as read and checked
        self._contained: Set[int] = set()  # writers whose store was checked for links
        root, metadata = self.root, self._metadata  # not ``self``: no reference cycle for the collector to find
        self.direct = DirectChunks(lambda w: rank_dir(root, w), self.options.layout,
                                   min(self.options.io_concurrency, 8), lambda w, path: metadata[(w, path)]) \
            if self._reading and self.files and direct_reads_enabled(self.options.direct_reads) else None

    def sibling(self) -> "TensorStoreIO":
        """Another reader of the same checkpoint, for another thread (a reader is used by one thread
        at a time): its own context, stores and arrays, but what this one derived from the index
        (packed places, recorded shapes, claimed sizes: a pass over every key) shared, not redone."""
        other = copy.copy(self)
        other._fresh_state()
        return other

    # -- specs --------------------------------------------------------------------------
    def kvstore_spec(self, writer: int) -> Dict[str, Any]:
        """The key-value store holding ``writer``'s arrays and objects."""
        path = rank_dir(self.root, writer)
        base = asked(self.store, f"kvstore_spec({path!r})", self.store.kvstore_spec, path)
        if self.options.layout == "ocdbt":
            return {"driver": "ocdbt", "base": base, "target_data_file_size": self.options.data_file_bytes,
                    **self.store.ocdbt_options}
        return base

    def array_spec(self, writer: int, path: str) -> Dict[str, Any]:
        """Spec to open the zarr v3 array at ``path`` of ``writer``'s store for reading: a missing
        chunk is an error (never silently the fill value)."""
        return {"driver": "zarr3", "kvstore": self.kvstore_spec(writer), "path": path + "/",
                "fill_missing_data_reads": False}

    def own_checksums(self, arr: np.ndarray, chunk_bytes: Optional[int] = None) -> bool:
        """Whether we checksum ``arr``'s chunks (``storage/chunk_checksums.py``), not the ``crc32c``
        codec (it does for object stores, packs and empty arrays)."""
        return self.files and chunk_bytes is None and arr.nbytes > 0

    def _chunk_rows(self, arr: np.ndarray) -> int:
        return chunk_shape(arr.shape, arr.itemsize, self.options.chunk_bytes)[0] if arr.ndim else 1

    # -- reading ------------------------------------------------------------------------
    def _check_contained(self, writer: int) -> None:
        """Before a reader touches ``writer``'s store: no links out, no more bytes claimed than stored."""
        if not self._reading or writer in self._contained:
            return
        try:
            asked(self.store, f"check_writer({self.root!r}, {writer})", self.store.check_writer, self.root, writer,
                  self._claimed.get(writer, 0))
        except FormatError:  # fewer bytes than claimed: another save's store, if one replaced the checkpoint
            self._check_not_replaced(thorough=True)
            raise
        self._contained.add(writer)

    def _read_error(self, message: str) -> CheckpointingError:
        """A read failure, saying so when the checkpoint was replaced meanwhile (a consequence, not damage)."""
        if self._replaced(thorough=True):
            return CheckpointingError(f"checkpoint {self.root} was replaced while being read (a newer save committed "
                                      f"to the same path); load it again. ({message})")
        return CheckpointingError(message)

    def _replaced(self, thorough: bool) -> bool:
        """The checkpoint at the path is not the one read: another directory (a stat), or, ``thorough``, another
        save's metadata.json (one that committed after the load opened it, before this reader was made)."""
        if not self.files:
            return thorough and self._reading and still_committed(self.store, self.root) is False
        return (self._root_id is not None and dir_identity(self.root) != self._root_id) or (
            thorough and self._recorded.token is not None and token_now_at(self.root) != self._recorded.token)

    def _check_not_replaced(self, thorough: bool = False) -> None:
        """After reads, or a FormatError (``thorough``): what was read is the opened checkpoint's, or it raises."""
        if self._replaced(thorough):
            raise self._read_error("its files changed under this load")

    def _kvstore(self, writer: int) -> Any:
        if writer not in self._kvstores:
            self._check_contained(writer)
            try:
                self._kvstores[writer] = ts.KvStore.open(self.kvstore_spec(writer), context=self.context).result()
            except Exception as e:
                where = f"the store of rank {writer} ({rank_dir(self.root, writer)})"
                raise CheckpointingError(f"checkpoint {self.root}: {where} cannot be opened: "
                                         f"{error_said(self.store, e)}") from e
        return self._kvstores[writer]

    def open_arrays(self, shards: Iterable[Tuple[int, str, int]], tensorstore: bool = True) -> None:
        """Open ``(writer, key, index)`` stored shards concurrently (cached for this reader): each
        array's zarr.json read and checked against metadata.json, and, with ``tensorstore``, the
        array opened in tensorstore (direct reads need only the checked zarr.json). A packed shard
        opens as a view of its range of the pack array, in the shard's own shape."""
        pending: Dict[Tuple[int, str], Tuple[str, Recorded]] = {}
        views: Dict[Tuple[int, str], Tuple[Tuple[int, str], int, Tuple[int, ...]]] = {}
        pack_keys: Dict[Tuple[int, str], List[Tuple[str, int]]] = {}
        for writer, key, index in shards:
            handle = (writer, tensor_path(key, index))
            if handle in self._arrays or handle in pending or handle in views or (
                    not tensorstore and handle in self._metadata):
                continue
            self._check_contained(writer)
            packed = self._packed.shard(writer, key, index)
            if packed is not None:
                views[handle] = ((writer, packed[0]), packed[1], packed[2])
                pack_keys.setdefault((writer, packed[0]), []).append((key, packed[1] + math.prod(packed[2])))
                continue
            what = f"{key!r} shard {index} (written by rank {writer})"
            pending[handle] = (what, self._recorded.shard(writer, key, index, f"checkpoint {self.root}: {what}"))
        for handle, metadata in self._read_checked({h: w for h, w in pending.items()
                                                    if h not in self._metadata}).items():
            crcs = metadata_checksums(metadata, f"checkpoint {self.root}: {pending[handle][0]}", self._index_checksums)
            if crcs is not None:
                self._crcs[handle] = crcs
            self._metadata[handle] = metadata  # accepted: checked, its checksums too
        if tensorstore:
            self._arrays.update(self._open_checked({h: w for h, (w, _) in pending.items()}))
        self._open_packs(pack_keys)
        for handle, ((writer, dtype), offset, shape) in views.items():
            self._arrays[handle] = packed_view(self._arrays[(writer, pack_path(dtype))], offset, shape)

    def chunk_file(self, writer: int, key: str, index: int) -> Optional[Callable[[int], str]]:
        """Chunk number -> the file holding it, where each chunk is a file (the ``zarr`` layout)."""
        if not self.files or self.options.layout == "ocdbt":
            return None
        arr_dir, rank = os.path.join(rank_dir(self.root, writer), tensor_path(key, index)), len(self._metadata[
            (writer, tensor_path(key, index))]["shape"])
        return lambda c: os.path.join(arr_dir, "c", *([str(c)] + ["0"] * (rank - 1) if rank else []))

    def stored_crcs(self, writer: int, key: str, index: int) -> Optional[Tuple[int, ...]]:
        """The chunk checksums an opened shard's metadata records (format 5), else None."""
        return self._crcs.get((writer, tensor_path(key, index)))

    def open_array(self, writer: int, key: str, index: int) -> Any:
        """Open stored shard ``index`` of ``key`` (cached for this reader)."""
        self.open_arrays([(writer, key, index)])
        return self._arrays[(writer, tensor_path(key, index))]

    def read_into(self, reads: Iterable[ShardRead]) -> int:
        """Perform the :class:`ShardRead` s; each ``dest`` (a CPU tensor view) receives
        ``stored[src]`` converted to its dtype. Returns bytes read. Packed shards: :func:`pack_runs`."""
        places = [(r, self._packed.shard(r.writer, r.key, r.index)) for r in reads]
        plain, packed = [r for r, p in places if p is None], [(r, p) for r, p in places if p is not None]
        session, plain = self._start_direct(plain)
        nbytes, futures, casts = 0, [], []  # futures: tensorstore's reads into the destinations, run while ours do
        try:
            crcs = [self._crcs.get((r.writer, tensor_path(r.key, r.index))) for r in plain]
            for key, writer, index, src, dest in (r for r, c in zip(plain, crcs) if c is None):
                store = self.open_array(writer, key, index)[src]
                into = dest if ts_dtype(dest.dtype) == store.dtype.name else landing(store.dtype.name, dest, casts)
                target = ts.array(to_numpy(into), copy=False, write=True, context=self.context)
                futures.append((f"reading {key!r} shard {index} (written by rank {writer})", target.write(store)))
                nbytes += dest.numel() * dest.element_size()
            runs = self._read_pack_runs(packed)
            futures += [(what, fut) for what, fut, _ in runs]
            # Left to tensorstore, of arrays checksummed in their metadata: whole chunks, verified by us
            more, errors = VerifiedReads().run([VerifiedRead(
                f"reading {r.key!r} shard {r.index} (written by rank {r.writer})",
                self.open_array(r.writer, r.key, r.index), c, tuple(r.src), r.dest,
                self.chunk_file(r.writer, r.key, r.index))
                for r, c in zip(plain, crcs) if c is not None], self.verify)
        except BaseException:  # (a later array failing to open): none may write into a destination after we raise
            settle(fut for _, fut in futures)
            raise
        finally:  # (on failures too: the direct reads write into the destinations until they end)
            got, failed = session.finish() if session is not None else (0, [])
        nbytes, errors = nbytes + more + got, errors + failed
        for what, fut in futures:
            try:
                fut.result()
            except Exception as e:
                errors.append(f"{what} failed: {error_said(self.store, e)}")
        if errors:
            raise self._read_error(f"checkpoint {self.root}: " + "; ".join(errors[:5])
                                   + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""))
        self._check_not_replaced()
        for into, dest in casts:  # converted by torch, as every other read converts
            dest.copy_(into)
        for _, fut, pieces in runs:
            nbytes += copy_out(fut.result(), pieces)
        return nbytes

    def _start_direct(self, plain: List[ShardRead]) -> Tuple[Optional[ReadSession], List[ShardRead]]:
        """Start the direct reads of ``plain`` (whole chunks straight into the destinations,
        storage/direct_read.py): every array's zarr.json read and checked at once (concurrently,
        before any chunk: behind chunk reads on the device, each would wait for megabytes), then the
        reads planned and started batch by batch, the first chunks on their way while later ones are
        planned. Returns the session (None without direct reads) and the reads left to tensorstore,
        their arrays opened there."""
        if self.direct is None:
            self.open_arrays((r.writer, r.key, r.index) for r in plain)
            return None, plain
        for writer in {r.writer for r in plain}:
            self._check_contained(writer)  # before anything of its store is read
        self.direct.prefetch([(r.writer, tensor_path(r.key, r.index)) for r in plain
                              if self._recorded.read_whole(r.writer, r.key, r.index, r.src)], _PREFETCH_BYTES)
        self.open_arrays(((r.writer, r.key, r.index) for r in plain), tensorstore=False)
        session, rest, start, size = self.direct.reader.start(self.verify), [], 0, _FIRST_BATCH
        try:
            while start < len(plain):
                batch, start, size = plain[start:start + size], start + size, size * 2
                try:
                    tasks, left = self.direct.split(batch, tensor_path)
                except CheckpointingError as e:
                    raise self._read_error(f"checkpoint {self.root}: {e}") from e
                session.submit(tasks)
                rest += left
            self.open_arrays((r.writer, r.key, r.index) for r in rest)
        except BaseException:
            session.finish()  # what it read is of no use now: the error is raised
            raise
        return session, rest

    def _read_pack_runs(self, reads: Sequence[Tuple[ShardRead, Place]]) -> List[Any]:
        """Start one read per run of nearby packed shards (:func:`~.packs.pack_runs`); ``reads``:
        each read with its place in its pack."""
        keys: Dict[Tuple[int, str], List[Tuple[str, int]]] = {}
        for r, (dtype, offset, shape) in reads:
            keys.setdefault((r.writer, dtype), []).append((r.key, offset + math.prod(shape)))
        self._open_packs(keys)
        return pack_runs(reads, lambda writer, dtype: self._arrays[(writer, pack_path(dtype))])

    def _open_packs(self, packs: Dict[Tuple[int, str], List[Tuple[str, int]]]) -> None:
        """Open the pack arrays ``(writer, dtype)`` concurrently, given the ``(key, end element)`` of
        the packed shards read from each (it must hold them); errors name the keys."""
        pending = {}
        for (writer, dtype), keys in packs.items():
            handle, end = (writer, pack_path(dtype)), max(e for _, e in keys)
            if handle not in self._arrays or end > self._arrays[handle].shape[0]:
                names = sorted({k for k, _ in keys})  # (the 5 first)
                what = f"the pack of shards ({', '.join(map(repr, names[:5]))}; {dtype}) written by rank {writer}"
                if handle in self._arrays:  # opened, its zarr.json checked, for other shards
                    raise FormatError(f"checkpoint {self.root}: {what} holds {self._arrays[handle].shape[0]} elements, "
                                      f"fewer than the {end} metadata.json packs in it: damaged")
                pending[handle] = (what, Recorded(dtype, (end,), True, self._recorded.token))
        for handle, metadata in self._read_checked(pending).items():
            where = f"checkpoint {self.root}: {pending[handle][0]}"
            if metadata_checksums(metadata, where, self._index_checksums) is not None:
                raise FormatError(f"{where}: its zarr.json records chunk checksums, which packs never do (they keep "
                                  f"the crc32c codec): not as our writer stores it")
            self._metadata[handle] = metadata
        self._arrays.update(self._open_checked({h: w for h, (w, _) in pending.items()}))

    def _read_checked(self, wanted: Dict[Tuple[int, str], Tuple[str, Recorded]]
                      ) -> Dict[Tuple[int, str], Dict[str, Any]]:
        """Read the zarr.json of the arrays ``(writer, path) -> (what, recorded)`` concurrently, each
        checked against what metadata.json records (:mod:`.array_metadata`); errors name ``what``.
        The caller keeps each in ``_metadata`` once it accepts its checksums."""
        for handle in wanted:
            self._check_contained(handle[0])
        reads, out = read_metadata({h: (self._kvstore(h[0]), h[1], w[1]) for h, w in wanted.items()}), {}
        for handle, fut in reads.items():
            where = f"checkpoint {self.root}: {wanted[handle][0]}"
            try:
                metadata = parse_metadata(fut.result(), where, wanted[handle][1])
                if metadata is not None:
                    check_metadata(metadata, wanted[handle][1], where)  # before anything is read through it
            except FormatError:
                self._check_not_replaced(thorough=True)  # another save's arrays: a save replaced the checkpoint
                raise
            except Exception as e:
                raise self._read_error(f"{where} is missing or unreadable: {error_said(self.store, e)}") from e
            if metadata is None:
                raise self._read_error(f"{where} is missing or unreadable: no {metadata_key(handle[1])}")
            out[handle] = metadata
        return out

    def _open_checked(self, wanted: Dict[Tuple[int, str], str]) -> Dict[Tuple[int, str], Any]:
        """Open the arrays ``(writer, path) -> what`` in tensorstore concurrently (those not open yet),
        from their zarr.json as :meth:`_read_checked` read and checked it: tensorstore does not read
        it again (``assume_metadata``); errors name ``what``."""
        opens = {}
        for handle, what in wanted.items():
            if handle in self._arrays:
                continue
            where = f"checkpoint {self.root}: {what}"
            try:  # a spec tensorstore refuses at once (a pack's zarr.json naming 2**62 elements) raises here
                opens[handle] = (where, ts.open(open_spec(self.array_spec(*handle), self._metadata[handle]),
                                                open=True, read=True, assume_metadata=True, context=self.context))
            except Exception as e:
                raise self._read_error(f"{where} is missing or unreadable: {error_said(self.store, e)}") from e
        out = {}
        for handle, (where, fut) in opens.items():
            try:
                out[handle] = fut.result()
            except Exception as e:
                raise self._read_error(f"{where} is missing or unreadable: {error_said(self.store, e)}") from e
        return out

    def read_object(self, writer: int, key: str, index: int) -> bytes:
        """The bytes of ShardedObject element ``index`` of ``key``."""
        try:
            res = read_capped(self._kvstore(writer), object_path(key, index), PICKLE_CAP,
                              f"checkpoint {self.root}: object {key!r} #{index} (written by rank {writer})")
        except CheckpointingError:
            raise
        except Exception as e:
            raise CheckpointingError(f"checkpoint {self.root}: reading object {key!r} #{index} failed: "
                                     f"{error_said(self.store, e)}") from e
        if res.state != "value":
            raise self._read_error(f"checkpoint {self.root}: object {key!r} #{index} (written by rank {writer}) "
                                   "is missing")
        self._check_not_replaced()
        return unframe_object(bytes(res.value), f"checkpoint {self.root}: object {key!r} #{index} (written by rank "
                              f"{writer})", self._index_checksums, self.verify, self._recorded.token)


def _shard_id(key: str, index: int) -> Tuple[str, int]:
    return (key, index)
