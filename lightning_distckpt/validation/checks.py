"""Validation of our own checkpoints: read back every byte and report what is missing or damaged.

Checks, in order: ``metadata.json`` against the SHA-256 its commit marker records (on open); the
index (every tensor tiled exactly once by its stored shards, shards inside their global shape,
every object element present); no link in any store, and every store holds at least the bytes its
shards claim; every stored shard's zarr.json is as our writer stores the array the index records (dtype, shape,
chunk grid, codecs: the check a load makes, ``storage/array_metadata.check_metadata``); every chunk of
every shard is read, concurrently under a bound on bytes in flight, and its CRC32C verified (a
missing chunk is an error, never the fill value; a damaged one names its file); every object's
CRC-32 and the common state's SHA-256 are verified, their archives' zip checksums too, then they
are unpickled with the same allow-list as ``load`` (a type that needs ``extra_safe_globals`` is a
warning, not damage). A checkpoint of format 1 or 2 carries no checksums: a warning, or a problem
with ``require_checksums``."""

from __future__ import annotations

import io
import math
import os
import time
from collections import Counter
import zipfile
from typing import AbstractSet, Any, Callable, List, Optional, Tuple

from ..core.errors import CheckpointingError, FormatError, UnsafeContentError
from ..planning.metadata import ObjectRecord, ShardRecord, StoredShard, element_size
from ..planning.validation import validate_object_records, validate_tensor_records
from ..storage.checksums import check_sha256
from ..storage.chunk_checksums import VerifiedReads, check_reads
from ..storage.direct_read import ChunkTask, DirectReader
from ..storage.layout import COMMON_FILE, rank_dir, tensor_path
from ..storage.safe_pickle import loads
from ..storage.tensorstore_io import TensorStoreIO
from ..reading.checkpoint import OpenedCheckpoint
from ..progress import Progress, add_total, set_total
from .report import ValidationReport, short_error


def validate_checkpoint(checkpoint_dir: str, max_inflight_bytes: int = 256 << 20,
                        on_key: Optional[Callable[[str], None]] = None, require_checksums: bool = False,
                        progress: Optional[Progress] = None,
                        writers: Optional[AbstractSet[int]] = None) -> ValidationReport:
    """Check everything ``checkpoint_dir`` stores (see module docstring). Raises
    IncompleteCheckpointError / FormatError when it is not a readable committed checkpoint.
    ``require_checksums``: a checkpoint written before checksums (format 1 or 2) is a problem,
    not a warning. ``on_key(key)`` is called as each key's shards are checked; ``progress``
    (:mod:`lightning_distckpt.progress`) counts the bytes read. ``writers``: only these ranks' stores
    (their shards and objects; not the index nor the common state): a partial copy, as a node-local tier
    holds, checked store by store."""
    t0 = time.perf_counter()
    ckpt = OpenedCheckpoint.open(checkpoint_dir)
    report = ValidationReport(ckpt.path, progress=progress)
    set_total(progress, sum(e.nbytes for e in ckpt.index.stored_tensors().values()))
    if not ckpt.index.checksums:
        (report.problems if require_checksums else report.warnings).append(
            f"format {ckpt.meta.get('format_version')}: written before checksums, damaged bytes in it may go "
            f"undetected")
    if writers is None:
        check_index(ckpt, report)
        _note_foreign_entries(ckpt, report)
    tio = ckpt.reader(check_sizes=False)  # damage named shard by shard
    dead = _check_writer_stores(ckpt, report, writers)
    stored = ckpt.index.stored_tensors()  # an alias (format 8) stores nothing of its own: its target is read
    todo = [(key, shard) for key in sorted(stored) for shard in stored[key].shards
            if shard.writer not in dead and (writers is None or shard.writer in writers)]
    try:  # open every array at once (concurrently); failures are reported shard by shard below
        tio.open_arrays((shard.writer, key, shard.index) for key, shard in todo)
    except CheckpointingError:
        pass
    window = _ReadWindow(report, max_inflight_bytes)
    for i, (key, shard) in enumerate(todo):
        report.shards += 1
        _read_shard(tio, key, ckpt.index.tensors[key].dtype, shard, report, window)
        if on_key and (i + 1 == len(todo) or todo[i + 1][0] != key):
            on_key(key)
    window.drain()
    _check_objects(ckpt, tio, dead, report, writers)
    if writers is None:
        _check_common(ckpt, report)
    report.seconds = time.perf_counter() - t0
    return report


def check_index(ckpt: Any, report: ValidationReport) -> None:
    """Every tensor tiled exactly once by its stored shards, inside its global shape; every object element
    present (``ckpt``: any checkpoint source, ours or another format's)."""
    records = []
    for key, e in ckpt.index.tensors.items():
        for s in e.shards:
            if len(s.offset) != len(e.global_shape) or len(s.shape) != len(e.global_shape) or any(
                    o + n > g for o, n, g in zip(s.offset, s.shape, e.global_shape)):
                report.problems.append(f"index: {key!r} shard {s.index} (rank {s.writer}) at offset {list(s.offset)} "
                                       f"shape {list(s.shape)} lies outside global shape {list(e.global_shape)}")
                continue
            records.append(ShardRecord(key, e.dtype, tuple(e.global_shape), tuple(s.offset), tuple(s.shape),
                                       tuple(s.flat) if s.flat else None, True, s.writer))
    objects = [ObjectRecord(key, tuple(o.global_shape), tuple(s.offset), True, s.writer)
               for key, o in ckpt.index.objects.items() for s in o.shards]
    report.problems += [f"index: {p}" for p in validate_tensor_records(records) + validate_object_records(objects)]


def _check_writer_stores(ckpt: OpenedCheckpoint, report: ValidationReport,
                         only: Optional[AbstractSet[int]] = None) -> set:
    """Writers whose store directory is gone (reported once, not once per shard); ``only``: of these."""
    writers = {s.writer for e in ckpt.index.stored_tensors().values() for s in e.shards}
    writers |= {s.writer for o in ckpt.index.objects.values() for s in o.shards}
    writers = writers if only is None else writers & set(only)
    dead = set()
    claimed = ckpt.index.bytes_per_writer()
    # one pass, not one per rank
    counts = Counter(s.writer for e in ckpt.index.stored_tensors().values() for s in e.shards)
    for w in sorted(writers):
        n = counts[w]
        try:
            stored = ckpt.writer_store(w)  # as its store knows it: an object store lists no sizes
        except CheckpointingError as e:  # a link out of the checkpoint: nothing in it is read
            dead.add(w)
            report.problems.append(f"rank {w}: {e} ({n} stored shard(s) not read)")
            continue
        if not stored.exists:
            dead.add(w)
            report.problems.append(f"rank {w}: {stored.missing or 'nothing stored under ' + rank_dir(ckpt.path, w)} "
                                   f"({n} stored shard(s) lost)")
        elif stored.nbytes is not None and stored.nbytes < claimed.get(w, 0):  # still read: damage named below
            report.problems.append(f"rank {w}: its store holds {stored.nbytes} bytes, less than the {claimed[w]} "
                                   f"bytes of tensor data metadata.json claims in it")
    return dead


class _ReadWindow:
    """Chunk reads in flight across shards, at most ``max_bytes`` at once (one bigger read alone)."""

    def __init__(self, report: ValidationReport, max_bytes: int) -> None:
        self.report = report
        self.max_bytes = max_bytes
        self.pending: List[Tuple[Any, str, int]] = []
        self.direct: List[ChunkTask] = []
        self.reader = DirectReader(8, scratch_bytes=max_bytes)
        self.inflight = 0

    def submit(self, piece: Any, where: str, nbytes: int) -> None:
        if (self.pending or self.direct) and self.inflight + nbytes > self.max_bytes:
            self.drain()
        self.pending.append((piece.read(), where, nbytes))
        self.inflight += nbytes
        self.report.chunks += 1

    def submit_direct(self, tasks: List[ChunkTask]) -> None:
        """Chunks read and verified by the direct reader (storage/direct_read.py) at the next drain."""
        for t in tasks:
            if (self.pending or self.direct) and self.inflight + t.loc.length > self.max_bytes:
                self.drain()
            self.direct.append(t)
            self.inflight += t.loc.length
            self.report.chunks += 1

    def drain(self) -> None:
        for fut, where, nbytes in self.pending:
            try:
                fut.result()
                self.report.count(nbytes)
            except Exception as e:
                self.report.problems.append(f"{where} unreadable: {short_error(e)}")
        self.pending.clear()
        nbytes, errors = self.reader.run(self.direct)
        self.report.count(nbytes)
        self.report.problems += errors
        self.direct.clear()
        self.inflight = 0


def _read_shard(tio: TensorStoreIO, key: str, dtype: str, shard: StoredShard, report: ValidationReport,
                window: _ReadWindow) -> None:
    where = f"{key!r} shard {shard.index} (rank {shard.writer}{', packed' if shard.packed is not None else ''})"
    try:  # its zarr.json checked against the index first, as a load checks it (array_metadata.check_metadata)
        store = tio.open_array(shard.writer, key, shard.index)
    except CheckpointingError as e:
        report.problems.append(f"{where}: cannot open: {short_error(e.__cause__ or e)}")
        return
    if shard.packed is None and tio.direct is not None:
        try:
            tasks = tio.direct.check_tasks(shard.writer, tensor_path(key, shard.index), store, where)
        except CheckpointingError as e:  # a missing chunk: the message names the shard and the rows
            report.problems.append(str(e))
            return
        if tasks is not None:
            window.submit_direct(tasks)
            return
    crcs = tio.stored_crcs(shard.writer, key, shard.index) if shard.packed is None else None
    if crcs is not None:  # checksums in its zarr.json, read by tensorstore: whole chunks, checked here
        nbytes, errors = VerifiedReads(window.max_bytes).run(  # validate checks whatever the switch says
            check_reads(where, store, crcs, tio.chunk_file(shard.writer, key, shard.index)), verify=True)
        report.chunks += len(crcs)
        report.count(nbytes)
        report.problems += errors
        return
    if shard.packed is not None:  # a small range of the writer's pack array: one read
        pieces: List[Tuple[Any, str]] = [(store, f"packed at element {shard.packed}")]
    elif store.rank == 0 or math.prod(store.shape) == 0:
        pieces = [(store, "all")] if store.rank == 0 else []
    else:
        rows = max(1, int(store.chunk_layout.read_chunk.shape[0]))
        n = int(store.shape[0])
        pieces = [(store[r:min(r + rows, n)], f"rows {r}:{min(r + rows, n)}") for r in range(0, n, rows)]
    row_bytes = math.prod(store.shape[1:]) * element_size(dtype) if store.rank else element_size(dtype)
    for piece, what in pieces:
        nbytes = math.prod(piece.shape) * element_size(dtype) if shard.packed is not None else (
            (piece.shape[0] * row_bytes) if piece.rank else row_bytes)
        window.submit(piece, f"{where}: chunk {what}", nbytes)


def _check_blob(blob: bytes, where: str, report: ValidationReport) -> None:
    """A torch.save archive: verify its zip checksums, then unpickle it safely."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            bad = zf.testzip()
        if bad is not None:
            report.problems.append(f"{where}: archive member {bad} fails its checksum")
            return
    # NotImplementedError: a zip version or compression method zipfile does not read
    except (zipfile.BadZipFile, NotImplementedError, OSError, EOFError, ValueError) as e:
        report.problems.append(f"{where}: not a readable torch.save archive ({e})")
        return
    try:
        loads(blob, where)
    except UnsafeContentError as e:
        # the refusal names the type and every argument / config that allows it
        report.warnings.append(f"{where}: holds types outside the safe allow-list: {str(e).removeprefix(where + ': ')}")
    except CheckpointingError as e:
        report.problems.append(str(e))


def _check_objects(ckpt: OpenedCheckpoint, tio: TensorStoreIO, dead: set, report: ValidationReport,
                   only: Optional[AbstractSet[int]] = None) -> None:
    for key in sorted(ckpt.index.objects):
        for s in ckpt.index.objects[key].shards:
            if s.writer in dead or (only is not None and s.writer not in only):
                continue
            where = f"object {key!r} element {list(s.offset)} (rank {s.writer})"
            try:
                blob = tio.read_object(s.writer, key, s.index)
            except CheckpointingError as e:
                report.problems.append(f"{where}: {short_error(e.__cause__ or e)}")
                continue
            report.objects += 1
            add_total(report.progress, len(blob))
            report.count(len(blob))
            _check_blob(blob, where, report)


def _note_foreign_entries(ckpt: OpenedCheckpoint, report: ValidationReport) -> None:
    """A warning for each entry of ``data/`` that no save writes (as ``inspect`` lists them): a load
    never reads it, so it is no damage. A store's own faults are reported store by store below."""
    try:
        foreign = ckpt.storage_facts().foreign
    except (CheckpointingError, OSError):
        return
    report.warnings.extend(f"{entry}: not written by a save (a load never reads it; left alone)" for entry in foreign)


def _check_common(ckpt: OpenedCheckpoint, report: ValidationReport) -> None:
    path = os.path.join(ckpt.path, COMMON_FILE)
    try:
        blob = ckpt.read_blob(COMMON_FILE)  # from its store: a regular file of the checkpoint, or an object
        if blob is None:
            raise FileNotFoundError(2, "no such file or object")
    except CheckpointingError as e:  # a link (FormatError), or an object store's failure
        report.problems.append(str(e))
        return
    except OSError as e:
        report.problems.append(f"common state {path}: missing or unreadable ({e.strerror or e})")
        return
    add_total(report.progress, len(blob))
    report.count(len(blob))
    if "common_sha256" in ckpt.marker:
        try:
            check_sha256(blob, ckpt.marker["common_sha256"], f"common state {path}")
        except FormatError as e:
            report.problems.append(str(e))
            return
    _check_blob(blob, f"common state {path}", report)
