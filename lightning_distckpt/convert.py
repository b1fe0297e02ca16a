"""Converting checkpoints: between storage layouts, to one ``torch.save`` file, and from one.

* :func:`relayout_checkpoint` copies every stored shard, object and the common state as they are into a
  checkpoint of another storage layout (``ocdbt`` <-> ``zarr``, other chunk or data-file sizes).
  Nothing is deserialized, so flattened optimizer shards, objects and the Lightning manifest
  survive exactly; the result still loads under any split.
* :func:`export_torch_file` consolidates a checkpoint into one file for tools that expect
  ``torch.load``: ``{"tensors": {key: tensor}, "objects": {key: {offset: object}}, "common": common_state}``.
* :func:`import_torch_file` turns such a file into a checkpoint directory.

These are the core cases of the public :func:`lightning_distckpt.export.to_torch_file` /
:func:`~lightning_distckpt.export.from_torch_file` (which also export Lightning checkpoints as
Lightning's own checkpoint dict and import any ``torch.save``'d dict) and
:func:`~lightning_distckpt.export.relayout`: call those.

Single process, no process group. Everything is read before anything is written, except in
:func:`relayout_checkpoint`, which streams shard by shard. Outputs appear atomically (staging directory or
temporary file, then a rename), and an existing output is replaced only after the new one is
complete, and only if it is a checkpoint (a file output: a ``torch.save`` file). Files are read with
``weights_only=True``: no code from them runs.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .core.arguments import require, require_globals
from .core.errors import CheckpointingError, FormatError
from .core.mapping import ShardedObject, ShardedTensor
from .planning.metadata import StoredShard
from .comm import Comm
from .core.state_dict import iter_leaves
from .progress import Progress, add_total, advance, set_total
from .serialization import load_common_state_dict, load_plain_tensors
from .storage import commit as commit_mod
from .core.format_versions import written_version
from .storage.layout import COMMON_FILE
from .storage.outputs import check_output
from .storage.output_files import check_torch_file_target, make_dirs, open_new, remove_made_dirs, \
    write_file_atomic
from .storage.paths import checkpoint_location, local_path
from .storage.save_token import TOKEN_FIELD
from .storage.store import called
from .storage.stores import open_store
from .reading.formats.files import check_torch_payload
from .storage.safe_pickle import load_file, loads
from .storage.base import ObjectWrite, ShardRead, ShardWrite
from .storage.tensorstore_io import StorageOptions, TensorStoreIO
from .reading.checkpoint import OpenedCheckpoint, open_checkpoint
from .saving.save import prepare_save, write_and_commit
from .saving.store_calls import check_committed, discard_quietly
from .saving.stats import format_bytes

logger = logging.getLogger("lightning_distckpt")

# Keys of the file export_torch_file writes for checkpoints that are not Lightning checkpoints.
EXPORT_KEYS = ("tensors", "objects", "common")
# Where import_torch_file puts an export's tensors and objects in the saved tree. Sharded leaves only,
# so the key never reaches the common state (containers left empty there are dropped).
_IMPORTED = "__distckpt_imported__"
_BATCH_BYTES = 256 << 20  # relayout: shards written per tensorstore call


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion did (returned by the :mod:`lightning_distckpt.export` functions).

    Attributes:
        source: the checkpoint or file read.
        destination: the checkpoint or file written.
        kind: ``"relayout"``, ``"lightning"``, ``"tensors"`` or ``"tree"`` (see :func:`from_torch_file`).
        tensors: the number of tensors written.
        objects: the number of objects (ShardedObject elements) written.
        bytes: the tensor bytes written.
        seconds: the wall time of the conversion.
    """

    source: str
    destination: str
    kind: str  # "relayout", "lightning", "tensors" (the EXPORT_KEYS structure) or "tree"
    tensors: int
    objects: int
    bytes: int
    seconds: float

    def describe(self) -> str:
        """One line for the command line: source, destination, kind, counts, bytes and seconds."""
        return (f"{self.source} -> {self.destination} ({self.kind}): {self.tensors} tensor(s), {self.objects} "
                f"object(s), {format_bytes(self.bytes)} in {self.seconds:.2f} s")


def relayout_checkpoint(source: str, destination: str, storage: StorageOptions,
                        progress: Optional[Progress] = None) -> ConvertReport:
    """Copy the checkpoint ``source`` into ``destination`` stored with ``storage`` (same shards, same
    writer ranks, same index; only the storage layout changes). ``progress``
    (:mod:`lightning_distckpt.progress`) counts the bytes copied."""
    t0 = time.perf_counter()
    require(storage, StorageOptions, "storage", "a StorageOptions")
    check_output(destination, [("source", source)], "destination")  # nothing of the source is written over
    ckpt = OpenedCheckpoint.open(source)
    store = open_store(destination, storage, "destination")
    destination = store.location
    called(store, "check_target")
    staging = called(store, "new_staging")  # the same steps as a save's (saving/save_commit.py), by one process
    try:
        called(store, "begin", staging, 0)
        src, dst = ckpt.reader(), store.open_writer(staging)
        set_total(progress, sum(e.nbytes for e in ckpt.index.stored_tensors().values()))
        nbytes = _copy_shards(ckpt, src, dst, progress) + _copy_objects(ckpt, src, dst, progress)
        common = ckpt.common_bytes()  # contained and verified: no copy of damage
        called(store, "write_blob", staging, COMMON_FILE, common)
        # rewritten now, with checksums: the copy is of the current format whatever the source's
        meta = dict(ckpt.meta, format_version=written_version(bool(ckpt.index.aliases)),
                    storage={"backend": dst.backend, **storage.to_json()},
                    converted_unix=time.time(), **{TOKEN_FIELD: dst.token})  # the token its stores record
        marker = {k: v for k, v in ckpt.marker.items() if k != "version"}  # an s3:// source's version
        marker.update(committed_unix=time.time())
        called(store, "commit", staging, json.dumps(meta), marker)
    except BaseException as e:
        discard_quietly(store, staging)  # a store's error here must not replace the relayout's own
        if isinstance(e, Exception) and not isinstance(e, CheckpointingError):  # tensorstore's, OSError
            raise CheckpointingError(f"relayout of {ckpt.path} to {destination} failed, nothing was committed: "
                                     f"{type(e).__name__}: {e}") from e
        raise
    lie = check_committed(store, staging, dst.token)  # a third party's commit that returned without committing
    if lie is not None:
        raise lie
    n_objects = sum(len(o.shards) for o in ckpt.index.objects.values())
    return ConvertReport(ckpt.path, destination, "relayout", len(ckpt.index.tensors), n_objects,
                         nbytes + len(common), time.perf_counter() - t0)


def _copy_shards(ckpt: OpenedCheckpoint, src: TensorStoreIO, dst: TensorStoreIO,
                 progress: Optional[Progress] = None) -> int:
    """Copy every stored shard to the same writer, index and pack offset; own arrays in batches of
    about ``_BATCH_BYTES``, each writer's packed (small) shards in one write (it makes the packs)."""
    by_writer: Dict[int, List[Tuple[str, StoredShard, torch.dtype]]] = {}
    for key, entry in ckpt.index.stored_tensors().items():  # aliases stay aliases (format 8), copied in meta
        for s in entry.shards:
            by_writer.setdefault(s.writer, []).append((key, s, entry.torch_dtype))
    total = 0
    for writer, shards in sorted(by_writer.items()):
        packed: List[ShardWrite] = []
        batch: List[ShardWrite] = []
        batch_bytes = 0
        packed_reads = []
        for key, s, dtype in shards:
            shape = (s.flat[1] - s.flat[0],) if s.flat is not None else tuple(s.shape)
            data = torch.empty(shape, dtype=dtype)
            read = ShardRead(key, writer, s.index, tuple(slice(0, n) for n in shape), data)
            if s.packed is not None:  # read together below: each pack once
                packed_reads.append(read)
                packed.append(ShardWrite(key, s.index, data, s.packed))
                continue
            src.read_into([read])
            batch.append(ShardWrite(key, s.index, data))
            batch_bytes += data.numel() * data.element_size()
            if batch_bytes >= _BATCH_BYTES:
                total += dst.write(writer, batch)
                advance(progress, batch_bytes)
                batch, batch_bytes = [], 0
        src.read_into(packed_reads)
        if batch or packed:
            total += dst.write(writer, batch + packed)
            advance(progress, batch_bytes + sum(w.data.numel() * w.data.element_size() for w in packed))
    return total


def _copy_objects(ckpt: OpenedCheckpoint, src: TensorStoreIO, dst: TensorStoreIO,
                  progress: Optional[Progress] = None) -> int:
    by_writer: Dict[int, List[ObjectWrite]] = {}
    for key, entry in ckpt.index.objects.items():
        for s in entry.shards:  # bytes as stored: nothing is unpickled
            by_writer.setdefault(s.writer, []).append(ObjectWrite(key, s.index,
                                                                  src.read_object(s.writer, key, s.index)))
    total = 0
    for writer, objects in sorted(by_writer.items()):
        nbytes = dst.write(writer, [], objects)
        add_total(progress, nbytes)
        advance(progress, nbytes)
        total += nbytes
    return total


def export_torch_file(source: str, destination: str, extra_safe_globals: Sequence[Any] = (),
                      progress: Optional[Progress] = None) -> ConvertReport:
    """Consolidate the checkpoint ``source`` into the ``torch.save`` file ``destination`` as
    ``{"tensors", "objects", "common"}`` (the core case of :func:`lightning_distckpt.export.to_torch_file`,
    which also writes a Lightning checkpoint as Lightning's own dict).
    ``progress`` counts the bytes written."""
    t0 = time.perf_counter()
    source, destination = check_export(source, destination, extra_safe_globals)
    common = load_common_state_dict(source, extra_safe_globals, plain_tensors=False)  # "tensors" holds them
    # a torch.save / .safetensors file or Hugging Face directory too (anything ldc.load reads): no objects there
    opened = open_checkpoint(source, extra_safe_globals=extra_safe_globals)
    objects = _read_objects(opened, extra_safe_globals) if isinstance(opened, OpenedCheckpoint) else {}
    payload = {"tensors": load_plain_tensors(source), "objects": objects, "common": common}
    nbytes = save_file_atomic(payload, destination, progress)
    return ConvertReport(source, destination, "tensors", len(payload["tensors"]),
                         sum(len(v) for v in objects.values()), nbytes, time.perf_counter() - t0)


def _read_objects(ckpt: OpenedCheckpoint, extra_safe_globals: Sequence[Any]) -> Dict[str, Dict[Tuple[int, ...], Any]]:
    tio = ckpt.reader()
    out: Dict[str, Dict[Tuple[int, ...], Any]] = {}
    for key, entry in sorted(ckpt.index.objects.items()):
        out[key] = {
            tuple(s.offset): loads(tio.read_object(s.writer, key, s.index), f"checkpoint {ckpt.path}: object {key!r}",
                                   extra_safe_globals)
            for s in sorted(entry.shards, key=lambda s: tuple(s.offset))
        }
    return out


def save_file_atomic(payload: Any, destination: str, progress: Optional[Progress] = None) -> int:
    """torch.save into a new temporary file beside ``destination`` (:func:`~.storage.output_files.write_file_atomic`:
    never a planted link), fsync, then rename over it: only nothing or a ``torch.save`` file is replaced
    (:func:`~.storage.output_files.check_torch_file_target`, checked again right before the rename).
    ``progress``: its total is set to the payload's tensor bytes, and the bytes are counted as written."""
    destination = os.path.abspath(local_path(destination, "output file"))
    check_torch_file_target(destination)

    def write(tmp: str) -> None:
        with open_new(tmp) as f:
            if progress is not None:
                set_total(progress, tensor_bytes(payload))
            torch.save(payload, f if progress is None else _CountingFile(f, progress))

    made: List[str] = []
    try:
        made = make_dirs(os.path.dirname(destination))  # as the directory outputs do
        write_file_atomic(destination, write, check_torch_file_target)
        made = []  # they hold the output now
        commit_mod.fsync_dir(os.path.dirname(destination))
    except OSError as e:  # no such directory, a file in the way, permissions, a full disk
        raise CheckpointingError(f"{destination}: cannot write the torch.save output: {e.strerror or e}") from e
    finally:
        remove_made_dirs(made)  # failed or interrupted (Ctrl-C, SIGTERM): no empty folders left on the way
    return os.path.getsize(destination)


class _CountingFile(io.RawIOBase):
    """A writable file that counts the bytes written through it on ``progress`` (torch.save writes
    its zip archive through ``write``; ``seek``/``tell`` go to the real file)."""

    def __init__(self, f: Any, progress: Progress) -> None:
        super().__init__()
        self.f, self.progress = f, progress

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self.f.write(data)
        advance(self.progress, n)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()


def tensor_bytes(tree: Any) -> int:
    """The bytes of the tensors in ``tree`` (each storage once: views and tied weights share one)."""
    storages = {}
    for _, leaf in iter_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(storages.values())


def import_torch_file(source: str, destination: str, storage: StorageOptions = StorageOptions(),
                 extra_safe_globals: Sequence[Any] = ()) -> ConvertReport:
    """Save the file ``source`` that :func:`export_torch_file` wrote as the checkpoint directory
    ``destination``: its keys, objects and common state come back (the core case of
    :func:`lightning_distckpt.export.from_torch_file`, which also saves any other ``torch.save``'d dict).
    """
    t0 = time.perf_counter()
    source, destination = check_import(source, destination, storage, extra_safe_globals)
    payload = load_file(source, extra_safe_globals)
    check_torch_payload(source, payload)  # as every reader: dense CPU tensors, shapes, copy-out budget
    return import_export_payload(payload, source, destination, storage, t0)


def check_export(source: Any, destination: Any, extra_safe_globals: Any) -> Tuple[str, str]:
    """The arguments of an export of the checkpoint ``source`` to the file ``destination`` checked
    (types; no output over the input; an existing destination only a ``torch.save`` file: ArgumentTypeError /
    ArgumentError); returns both as absolute paths."""
    require_globals(extra_safe_globals)
    check_output(destination, [("source", source)], "destination")
    destination = os.path.abspath(local_path(destination, "destination"))
    check_torch_file_target(destination)  # before anything is read; again before the rename
    return checkpoint_location(source, "source"), destination


def check_import(source: Any, destination: Any, storage: Any, extra_safe_globals: Any) -> Tuple[str, str]:
    """The arguments of an import of the file ``source`` into the checkpoint directory
    ``destination`` checked (as :func:`check_export`); returns the file's absolute path and the
    checkpoint's location."""
    source = os.path.abspath(local_path(source, "source"))
    require(storage, StorageOptions, "storage", "a StorageOptions")
    require_globals(extra_safe_globals)
    check_output(destination, [("source", source)], "destination")
    return source, checkpoint_location(destination, "destination")


def is_export_payload(payload: Any) -> bool:
    """Whether ``payload`` has the structure :func:`export_torch_file` writes."""
    return isinstance(payload, dict) and set(payload) == set(EXPORT_KEYS) and isinstance(payload["tensors"], dict)


def import_export_payload(payload: Any, source: str, destination: str, storage: StorageOptions,
                          started: float) -> ConvertReport:
    """:func:`import_torch_file` of the already read ``payload`` (``started``: when reading began)."""
    if not isinstance(payload, dict):
        raise CheckpointingError(f"{source}: holds a {type(payload).__name__}, not a dict; nothing to import")
    if not is_export_payload(payload):
        raise FormatError(f"{source}: not a file export_torch_file wrote (keys {sorted(EXPORT_KEYS)}); "
                          "lightning_distckpt.export.from_torch_file saves any dict")
    tree, n_tensors, n_objects = _tree_from_export(payload, source)
    _save_alone(tree, destination, storage)
    return ConvertReport(os.path.abspath(source), checkpoint_location(destination), "tensors", n_tensors, n_objects,
                         directory_bytes(destination), time.perf_counter() - started)


def _save_alone(tree: Dict[str, Any], destination: str, storage: StorageOptions) -> None:
    """Save from this process alone, as a group of one: no collective is entered, whether or not a
    process group is initialized (the converters are single-process tools)."""
    prep = prepare_save(tree, destination, Comm(None, 0, 1), validate_access_integrity=True, balance_writes=False,
                        options=storage)
    write_and_commit(prep)


def directory_bytes(path: str) -> int:
    """The bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _tree_from_export(payload: Dict[str, Any], source: str) -> Tuple[Dict[str, Any], int, int]:
    common = payload["common"] if payload["common"] is not None else {}
    if not isinstance(common, dict) or _IMPORTED in common:
        raise CheckpointingError(f"{source}: 'common' must be a dict without the key {_IMPORTED!r}")
    sharded: Dict[str, Any] = {}
    for key, t in payload["tensors"].items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointingError(f"{source}: tensors[{key!r}] is a {type(t).__name__}, not a tensor")
        sharded[f"t/{key}"] = ShardedTensor.from_rank_offsets(key, t.contiguous())
    n_objects = 0
    for key, shards in (payload["objects"] or {}).items():
        offsets = [tuple(o) for o in shards]
        global_shape = tuple(max(o[i] for o in offsets) + 1 for i in range(len(offsets[0]))) if offsets else ()
        for off, obj in zip(offsets, shards.values()):
            sharded[f"o/{key}/{off}"] = ShardedObject(key, obj, global_shape, off)
            n_objects += 1
    tree = dict(common)
    if sharded:
        tree[_IMPORTED] = sharded
    return tree, len(payload["tensors"]), n_objects
