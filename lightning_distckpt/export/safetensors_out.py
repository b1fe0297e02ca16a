"""Export to the Hugging Face safetensors layout: ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), or one
``model.safetensors`` when everything fits one shard.

Streaming: each shard file's tensors are read (whole, from whatever split they were saved in)
and written, then dropped, so memory holds about one shard (``max_shard_size``; one tensor when a
single tensor is larger). Which tensors go in which file, and which rank writes each file, is a pure
function of the sorted names and sizes (:func:`plan_files`, :func:`assign_files`), the same on every
rank; inside a process group each rank writes its own files, ``Comm.agree`` confirms that all were
written, and rank 0 writes the index last. Every file (index and config too) is written under a
temporary name and fsync'd, and renamed into place only once every rank has written all of its own:
an export that fails or is interrupted (Ctrl-C, the command line's SIGTERM) before then replaces
nothing, and removes its temporary files and the output directory if it made it. Only files this
library wrote are replaced or removed (:mod:`.hf_owned`: our files and index carry a mark): another
model's file in the way is an ArgumentError, before anything is written. Our files of an earlier
export that the new one does not name are removed after the index is in place; a reader during the
renames may see a mix of old and new files. An earlier index naming a file the export overwrites is
removed before the renames, so an export failing among them leaves no index over such a mix.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
from decimal import Decimal
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from ..comm import get_comm
from ..convert import ConvertReport
from ..core.errors import ArgumentError, ArgumentTypeError, CheckpointingError
from ..reading.formats import KeyMap
from ..reading.formats.safetensors_header import DTYPES
from ..storage.commit import fsync_dir
from ..storage.output_files import make_dirs, open_new, remove_temp, temp_name
from .placing import Placing
from ..storage.safetensors_crcs import crc_metadata
from ..progress import Progress, advance, set_total
from .hf_owned import CONFIG_FILE, FILE_METADATA, INDEX_FILE, SHARD_NAME, SINGLE_FILE, index_files, index_json, \
    plan_replace, read_config
from .select import selection
from .tensors import ExportTensor, export_arguments, export_tensors, open_source, read_whole

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = "5GB"
# Tensors read per read call: reading costs transient buffers of about the bytes in flight on top
# of the shard being assembled (measured: about 2x with tensorstore's decoding), so read in runs.
READ_BATCH_BYTES = 32 << 20
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class ShardFile:
    """One output file: its name and the tensors it holds, in order."""

    name: str
    tensors: Tuple[ExportTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _replaced_name(name: str) -> bool:
    """An entry of the output directory an export may replace or remove."""
    return name in (SINGLE_FILE, INDEX_FILE) or SHARD_NAME.fullmatch(name) is not None


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``size``: an int, or a string as Hugging Face writes them (``"5GB"`` = 5e9 bytes,
    ``"500MiB"`` = 500 * 2**20, ``"1000"`` = 1000 bytes). Anything else is an ArgumentTypeError, a
    string that is no size or a size below one byte an ArgumentError (all naming ``max_shard_size``)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ArgumentTypeError(f"max_shard_size must be an int of bytes or a str such as '5GB', "
                                f"got {type(size).__name__}")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.fullmatch(size)
        if m is None:
            raise ArgumentError(f"max_shard_size {size!r}: not a size (an int of bytes, or e.g. '5GB', '500MiB')")
        n = int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "").upper()])  # exact: no float overflow
    if n <= 0:
        raise ArgumentError(f"max_shard_size {size!r}: must be at least one byte")
    return n


def plan_files(tensors: Sequence[ExportTensor], max_shard_size: int) -> List[ShardFile]:
    """Fill files in name order, starting a new file when the next tensor would pass
    ``max_shard_size`` (a tensor larger than that gets a file of its own)."""
    groups: List[List[ExportTensor]] = []
    size = 0
    for t in sorted(tensors, key=lambda t: t.name):
        if not groups or (groups[-1] and size + t.nbytes > max_shard_size):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return [ShardFile(SINGLE_FILE, tuple(groups[0]))]
    n = len(groups)
    return [ShardFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def assign_files(files: Sequence[ShardFile], world_size: int) -> List[int]:
    """The rank that writes each file: largest files first, each to the rank with the fewest bytes
    so far (ties: the lowest rank)."""
    load = [0] * world_size
    writer = [0] * len(files)
    for i in sorted(range(len(files)), key=lambda i: (-files[i].nbytes, i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        writer[i] = rank
        load[rank] += files[i].nbytes
    return writer


def _plan_digest(files: Sequence[ShardFile]) -> str:
    text = json.dumps([[f.name, [[t.name, t.key, list(t.shape), str(t.dtype)] for t in f.tensors]] for f in files])
    return hashlib.sha256(text.encode()).hexdigest()


def _write_text(path: str, text: str) -> None:
    with open_new(path) as f:
        f.write(text.encode("utf-8"))


def _write_bytes(path: str, data: bytes) -> None:
    with open_new(path) as f:
        f.write(data)


def _read_batches(tensors: Sequence[ExportTensor]) -> List[List[ExportTensor]]:
    """``tensors`` in runs of at most :data:`READ_BATCH_BYTES` (a larger tensor alone)."""
    batches: List[List[ExportTensor]] = []
    size = 0
    for t in tensors:
        if not batches or (batches[-1] and size + t.nbytes > READ_BATCH_BYTES):
            batches.append([])
            size = 0
        batches[-1].append(t)
        size += t.nbytes
    return batches


@dataclass
class _Plan:
    """What every rank agreed to write."""

    source: Any
    files: List[ShardFile]
    stale: List[str]
    config_text: Optional[bytes]


def _write_files(source: Any, job: Placing, files: Sequence[ShardFile], progress: Optional[Progress] = None) -> None:
    from safetensors import SafetensorError  # its own I/O errors (a full disk) are no OSError
    from safetensors.torch import save_file

    reader = source.reader()
    set_total(progress, sum(f.nbytes for f in files))
    for f in files:
        tensors: Dict[str, Any] = {}
        for batch in _read_batches(f.tensors):  # the reader's transient buffers stay about one batch
            tensors.update(read_whole(source, batch, reader))
            advance(progress, sum(t.nbytes for t in batch))
        try:
            job.write(f.name, functools.partial(save_file, tensors,
                                                metadata={**FILE_METADATA, **crc_metadata(tensors)}))
        except (OSError, SafetensorError) as e:
            raise CheckpointingError(f"{os.path.join(job.out, f.name)}: cannot write ({e})") from e
        logger.debug("wrote %s: %d tensor(s), %d bytes", f.name, len(f.tensors), f.nbytes)


def _output_names(files: Sequence[ShardFile]) -> List[str]:
    """The names an export of ``files`` writes: the files, and the index when there are several."""
    return [f.name for f in files] + ([INDEX_FILE] if len(files) > 1 else [])


def _drop_overwritten_index(job: Placing, files: Sequence[ShardFile]) -> None:
    """Rank 0, once every file is written and before any is renamed into place: move our index of an
    earlier export aside (a hidden name ``clean`` knows) when this export overwrites a file it lists.
    Left in place, an export failing midway (a full disk, a killed rank) would leave that index naming
    a mix of new and old files, which transformers loads without a word; without it the directory is
    visibly incomplete. An export stopped before its first rename puts it back (:meth:`.placing.Placing.take_back`);
    one that completes removes it. (An index naming none of the new files stays: the earlier export is
    still whole if this one fails.)"""
    listed = index_files(job.out)  # plan_replace refused an index that is not ours
    if listed and listed & {f.name for f in files}:
        index = os.path.join(job.out, INDEX_FILE)
        aside = temp_name(index, "old")
        job.aside = aside  # noted first: an interrupt right after the rename still puts it back
        os.rename(index, aside)
        fsync_dir(job.out)
        logger.info("%s: moved %s of an earlier export aside before overwriting its files", job.out, INDEX_FILE)


def _write_extras(plan: _Plan, job: Placing) -> None:
    """Rank 0, beside its shard files: the index (when sharded) and ``config.json``, under temporary names."""
    files = plan.files
    if len(files) > 1:
        text = index_json(sum(f.nbytes for f in files), {t.name: f.name for f in files for t in f.tensors})
        job.write(INDEX_FILE, lambda tmp: _write_text(tmp, text))
    config_text = plan.config_text
    if config_text is not None:
        job.write(CONFIG_FILE, lambda tmp: _write_bytes(tmp, config_text))


def _remove_stale(out_dir: str, stale: Sequence[str], aside: Optional[str]) -> None:
    """Rank 0, after the index is in place: our ``stale`` files of an earlier export removed
    (:func:`~.hf_owned.plan_replace` found them before anything was written), and the earlier index
    moved ``aside``."""
    for n in sorted(stale, key=lambda n: n != INDEX_FILE):  # an old index first: it names old files
        if n == INDEX_FILE and not os.path.lexists(os.path.join(out_dir, n)):
            continue  # moved aside by _drop_overwritten_index
        os.remove(os.path.join(out_dir, n))
        logger.info("%s: removed %s of an earlier export", out_dir, n)
    if aside is not None:
        remove_temp(aside)
    fsync_dir(out_dir)


def _refuse_dtypes(tensors: Sequence[ExportTensor], source_path: str, out: str) -> None:
    """ArgumentError naming the tensors whose dtype the safetensors format (as the installed
    ``safetensors`` writes it) has no name for (complex128; float8 fnuz and complex64 with releases
    before their names), before anything is written: ``save_file`` would fail mid-export."""
    import safetensors.torch

    known = set(DTYPES.values()) & set(getattr(safetensors.torch, "_TYPES", DTYPES).values())
    bad = [t for t in tensors if t.dtype not in known]
    if bad:
        names = ", ".join(f"{t.name!r} ({str(t.dtype).replace('torch.', '')})" for t in bad[:5])
        raise ArgumentError(f"checkpoint {source_path}: cannot export to {out}: safetensors has no dtype for "
                            f"{names}{f' and {len(bad) - 5} more' if len(bad) > 5 else ''}; leave them out (key_map "
                            f"returning None, include=) or export to DCP or a torch file, which store every dtype")


def to_safetensors(checkpoint: Any, out_dir: Any, max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                   key_map: KeyMap = None, process_group: Optional[dist.ProcessGroup] = None,
                   extra_safe_globals: Sequence[Any] = (), *, only: Optional[str] = None,
                   include: Sequence[str] = (), config: Any = None,
                   progress: Optional[Progress] = None) -> ConvertReport:
    """Write the tensors of ``checkpoint`` to ``out_dir`` in the Hugging Face safetensors layout.

    ``checkpoint``: anything ``ldc.load`` reads (a Lightning Trainer checkpoint exports its module
    weights under the LightningModule's keys; see :mod:`lightning_distckpt.export.tensors`).
    ``max_shard_size``: bytes per file, an int or ``"5GB"`` / ``"500MiB"``. ``key_map`` renames (dict)
    or leaves out (callable returning None) tensors by their export name. Collective over
    ``process_group`` when torch.distributed is initialized (call it on every rank, same arguments):
    each rank writes its share of the files. Objects and common state are not exported.
    ``only="model"``: the weights without optimizer state; ``include``: name prefixes, one of which
    each exported tensor's stored key or name starts with (:mod:`.select`). ``config``: the path of
    a Hugging Face ``config.json``, copied beside the weights so ``from_pretrained`` reads the
    directory (an existing different ``config.json`` there is refused, not replaced).
    ``progress`` (:mod:`lightning_distckpt.progress`) counts the bytes this rank exports.
    ``extra_safe_globals``: further trusted types its objects and common state may hold.
    Returns the same :class:`ConvertReport` (kind ``"safetensors"``) on every rank.

    Raises:
        ArgumentError, ArgumentTypeError: an argument that is wrong (naming it), an output over the input.
        CheckpointNotFoundError, IncompleteCheckpointError: nothing, or no committed checkpoint, at the source.
        FormatError: the source fails its checks (UnsafeContentError: a type not allowed to deserialize).
        CheckpointingError: writing failed (naming the file), or no tensor was selected; ``out_dir`` is
            left as it was.

    Collective: what one rank raised, every rank raises (the same class).
    """
    t0 = time.perf_counter()
    out = export_arguments(out_dir, key_map, extra_safe_globals)
    comm = get_comm(process_group)
    job = Placing(out)
    try:
        plan = _plan_export(checkpoint, job, comm, max_shard_size, key_map, extra_safe_globals, only, include, config)
        _write_export(plan, job, comm, progress)
        _place_export(plan, job, comm)
    except BaseException:  # failed or interrupted (Ctrl-C, SIGTERM): nothing replaced, no new file left
        job.take_back()
        raise
    files = plan.files
    return ConvertReport(plan.source.path, out, "safetensors", sum(len(f.tensors) for f in files), 0,
                         sum(f.nbytes for f in files), time.perf_counter() - t0)


def _plan_export(checkpoint: Any, job: Placing, comm: Any, max_shard_size: Union[int, str], key_map: KeyMap,
                 extra_safe_globals: Sequence[Any], only: Optional[str], include: Sequence[str],
                 config: Any) -> _Plan:
    """Every rank's plan of the files, agreed (the same on every rank) before any rank writes one;
    rank 0 makes the output directory."""
    out = job.out
    error: Optional[BaseException] = None
    plan: Optional[_Plan] = None
    digest = ""
    try:
        limit = parse_size(max_shard_size)
        select = selection(only, include)
        config_text = read_config(config, out) if config is not None else None
        # an input inside out_dir is safe unless it is a file this export replaces or removes
        source = open_source(checkpoint, out, replaced=_replaced_name)
        tensors = export_tensors(source, key_map, extra_safe_globals, select=select)
        _refuse_dtypes(tensors, source.path, out)
        if not tensors:
            chosen = f" selected by {select.describe()}" if not select.everything else ""
            raise CheckpointingError(f"checkpoint {source.path}: no tensors{chosen} to export to {out}")
        files = plan_files(tensors, limit)
        digest = _plan_digest(files)
        stale = sorted(plan_replace(out, _output_names(files)))  # nothing but our own files replaced
        if comm.rank == 0:
            job.made = make_dirs(out)
        plan = _Plan(source, files, stale, config_text)
    except Exception as e:  # agreed below: every rank raises it, none waits
        error = e
    agreed = comm.agree(f"export_safetensors to {out}: planning the shard files", error, (digest, bool(job.made)))
    if len({d for d, _ in agreed}) > 1:
        raise CheckpointingError(f"export_safetensors to {out}: the ranks planned different files "
                                 f"(different checkpoints or key_map?)")
    job.fresh = agreed[0][1]  # rank 0 made the directory: everything in it is this export's
    assert plan is not None
    return plan


def _write_export(plan: _Plan, job: Placing, comm: Any, progress: Optional[Progress]) -> None:
    """Each rank writes its files under temporary names (rank 0 the index and config too); then rank 0
    removes an earlier index naming files about to be replaced (a rank renaming first, rank 0 dying,
    would leave it over a mix)."""
    error: Optional[BaseException] = None
    try:
        writers = assign_files(plan.files, comm.size)
        _write_files(plan.source, job, [f for f, w in zip(plan.files, writers) if w == comm.rank], progress)
        if comm.rank == 0:
            _write_extras(plan, job)
    except Exception as e:  # agreed below: every rank raises it, none waits
        error = e
    comm.agree(f"export_safetensors to {job.out}: writing the shard files", error)
    error = None
    if comm.rank == 0:
        try:
            _drop_overwritten_index(job, plan.files)
        except OSError as e:
            error = CheckpointingError(f"{job.out}: cannot remove the earlier {INDEX_FILE} ({e})")
    comm.agree(f"export_safetensors to {job.out}: removing the earlier index", error)


def _place_export(plan: _Plan, job: Placing, comm: Any) -> None:
    """Every rank renames its files into place; then rank 0 its index and config (after every shard
    file: readers follow the index), and removes our stale files of an earlier export."""
    error: Optional[BaseException] = None
    job.renaming = True  # from here any rank may rename: the earlier index is not put back (it would name a mix)
    try:
        job.place([n for n in (f.name for f in plan.files) if os.path.join(job.out, n) in job.temps])
    except OSError as e:
        error = CheckpointingError(f"{job.out}: cannot rename the written files into place ({e})")
    comm.agree(f"export_safetensors to {job.out}: renaming the shard files into place", error)
    error = None
    if comm.rank == 0:
        try:
            job.place([n for n in (INDEX_FILE, CONFIG_FILE) if os.path.join(job.out, n) in job.temps])
            _remove_stale(job.out, plan.stale, job.aside)
        except OSError as e:
            error = CheckpointingError(f"{job.out}: cannot write {INDEX_FILE} or {CONFIG_FILE} ({e})")
    comm.agree(f"export_safetensors to {job.out}: writing the index", error)
    job.done = True
