"""Export to a PyTorch Distributed Checkpoint (DCP) directory, written by DCP's own
``FileSystemWriter``, that ``torch.distributed.checkpoint.load`` reads under any DTensor split.

One process writes it (``no_dist=True``) in one ``dcp.save``. The state dict handed to DCP holds,
for each stored tensor, a tensor on the ``meta`` device (shape and dtype only, for DCP's plan); the
planner reads each tensor whole from the checkpoint only when DCP's writer asks for its data. DCP's
writer keeps every tensor of a file alive until that file is closed, so the export asks for one
``.distcp`` file per tensor (``single_file_per_rank=False``): memory holds about one tensor at a time.

Entries: every tensor under its stored key (a Lightning Trainer checkpoint's module weights under
``state_dict.<module key>``, as Lightning's own DCP checkpoints name them); the common state's
entries (a dict's items, Lightning's manifest left out) as DCP bytes entries, except 0-d tensors,
which DCP stores as tensors. ShardedObjects are not exported (logged). The directory appears
atomically: DCP writes a staging directory beside ``out_dir`` (a fresh random name), renamed into place
when complete; an existing ``out_dir`` is replaced only if it is empty or a DCP (or Megatron-Core
``torch_dist``) checkpoint, checked by what it holds (:func:`_check_target`), not by a file's name.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..convert import ConvertReport, directory_bytes
from ..core.shown import shown as shown_name  # a directory's names are anyone's
from ..core.errors import ArgumentError, CheckpointingError
from ..reading.checkpoint import CheckpointSource
from ..reading.formats import KeyMap
from ..reading.formats.dcp_metadata import read_metadata
from ..reading.formats.megatron import COMMON_NAME, CONFIG_NAME, megatron_config
from ..progress import Progress, advance, set_total
from ..storage.swap import swap_into_place
from ..storage.output_files import make_dirs, remove_made_dirs, temp_name
from ..storage.safe_pickle import write_file_durable
from .select import selection
from .tensors import (LIGHTNING_MANIFEST_KEY, MODULE_ENTRY, ExportTensor, add_meta_placeholders, export_arguments,
                      export_tensors, open_source, read_whole)

logger = logging.getLogger(__name__)

DCP_METADATA = ".metadata"
# what a DCP checkpoint holds besides its *.distcp files (with Megatron-Core's two files of a torch_dist one)
_CHECKPOINT_FILES = (DCP_METADATA, COMMON_NAME, CONFIG_NAME)


def _lazy_planner(source: CheckpointSource, by_id: Dict[int, ExportTensor], flatten: bool,
                  progress: Optional[Progress] = None) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LazyReadPlanner(DefaultSavePlanner):
        """DCP's default planner; a ``meta`` tensor is read from the checkpoint when its data is needed."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=flatten)
            self._reader = source.reader()

        def lookup_object(self, index: Any) -> Any:
            obj = super().lookup_object(index)
            export = by_id.get(id(obj)) if isinstance(obj, torch.Tensor) and obj.is_meta else None
            if export is None:
                return obj
            data = read_whole(source, [export], self._reader)[export.name]
            advance(progress, export.nbytes)
            return data

    return LazyReadPlanner()


def _common_entries(source: CheckpointSource, extra_safe_globals: Sequence[Any]) -> Dict[str, Any]:
    common = source.load_common(extra_safe_globals)
    if not isinstance(common, Mapping):
        return {} if common is None else {"common": common}
    out: Dict[str, Any] = {}
    keys: Dict[str, Any] = {}
    for k, v in common.items():
        if k == LIGHTNING_MANIFEST_KEY:
            continue
        if str(k) in out:  # DCP's keys are strings: 1 and "1" would be one entry, the other's value lost
            raise CheckpointingError(f"checkpoint {source.path}: the common state's keys {keys[str(k)]!r} and {k!r} "
                                     f"are both {str(k)!r} in DCP, which would keep only one; rename one of them")
        out[str(k)], keys[str(k)] = v, k
    return out


def _check_target(out: str, shown: Optional[str] = None) -> None:
    """Refuse (ArgumentError) to replace anything but nothing, an empty directory, or a DCP or
    Megatron-Core ``torch_dist`` checkpoint: a directory (not a link) holding only regular files of
    such a checkpoint's names (``.metadata``, ``*.distcp``; ``common.pt`` and ``metadata.json``,
    Megatron's), whose ``.metadata`` parses as DCP metadata and whose ``metadata.json``, if any, is
    Megatron's config. A file merely named ``.metadata`` proves nothing: whatever else is there
    may be a user's files, which a replacement would delete. ``shown``: the name to give ``out`` by."""
    shown = shown or out
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    except NotADirectoryError:  # a component on the way is a file (plain.pt/x)
        raise ArgumentError(f"{shown}: a component of the path is a file, not a directory") from None
    if not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise ArgumentError(f"{shown}: exists and is {what}; refusing to replace it")
    try:
        with os.scandir(out) as entries:
            found = {e.name: e.is_file(follow_symlinks=False) for e in entries}
    except OSError as e:
        raise ArgumentError(f"{shown}: cannot list what the directory holds ({e.strerror or e}); "
                            "refusing to replace it") from None
    if not found:
        return
    odd = sorted(f"{n} (not a regular file)" if _checkpoint_name(n) else n
                 for n, regular in found.items() if not regular or not _checkpoint_name(n))
    listed = ", ".join(map(shown_name, odd[:5])) + (" ..." if len(odd) > 5 else "")
    why = (f"it holds {listed}, which a DCP checkpoint does not" if odd
           else f"it has no {DCP_METADATA}" if DCP_METADATA not in found else _not_dcp(out))
    if why:
        raise ArgumentError(f"{shown}: directory exists, is not empty and is not a DCP checkpoint ({why}); "
                            "refusing to replace it (move its contents away, or export elsewhere)")


def _checkpoint_name(name: str) -> bool:
    """A name a DCP (or Megatron-Core ``torch_dist``) checkpoint directory holds."""
    return name in _CHECKPOINT_FILES or name.endswith(".distcp")


def _not_dcp(out: str) -> str:
    """Why the directory ``out`` of checkpoint names is not a DCP checkpoint, or "" when it is one."""
    try:
        read_metadata(os.path.join(out, DCP_METADATA), root=out)  # no code from it runs
        if os.path.lexists(os.path.join(out, CONFIG_NAME)) and megatron_config(out) is None:
            return f"its {CONFIG_NAME} is not Megatron-Core's config"
    except CheckpointingError as e:  # FormatError, UnsafeContentError: what is wrong with it
        return str(e)
    return ""


def _swap_in(staging: str, out: str) -> None:
    """Rename ``staging`` to ``out``; an existing ``out`` (checked before anything was written) is
    swapped out (:func:`swap_into_place`: one atomic exchange where the file system has one), checked
    again there (the directory removed is the one checked), then removed."""
    old = swap_into_place(staging, out, temp_name(out, "old"), check_old=lambda path: _check_target(path, shown=out))
    if old is not None:
        shutil.rmtree(old)


def _unwrapped(e: CheckpointException, out: str) -> CheckpointingError:
    """The library error that failed inside ``dcp.save`` as it was raised, else a CheckpointingError
    naming the first failure (its message, not DCP's traceback)."""
    failures = [exc for exc, _ in e.failures.values()]
    if len(failures) == 1 and isinstance(failures[0], CheckpointingError):
        return failures[0]
    first = failures[0] if failures else e
    return CheckpointingError(f"{out}: writing the DCP checkpoint failed: {type(first).__name__}: {first}")


def write_dcp_dir(source: CheckpointSource, state: Dict[str, Any], by_id: Dict[int, ExportTensor], out: str,
                  extra_files: Optional[Mapping[str, bytes]] = None, flatten: bool = True,
                  progress: Optional[Progress] = None) -> None:
    """``dcp.save(state)`` into a staging directory beside ``out`` (``meta`` tensors read from
    ``source`` as DCP asks for them, see ``by_id``), then ``extra_files`` (name -> bytes) written
    into it, then the whole directory swapped in as ``out``. ``flatten=False``: each entry of
    ``state`` is stored as it is under its key (DCP does not name the items of its containers).
    ``progress`` counts the bytes of the tensors read from ``source``."""
    import torch.distributed.checkpoint as dcp

    _check_target(out)
    set_total(progress, sum(t.nbytes for t in by_id.values()))
    staging, made, parents = temp_name(out), False, []
    try:
        parents = make_dirs(os.path.dirname(out))  # taken back below if the export does not complete
        # made here, empty, under a random name (mkdir fails on anything already there, a link included):
        # DCP's writer never writes through a link or into a directory someone planted at a guessable name
        os.mkdir(staging)
        made = True
        writer = dcp.FileSystemWriter(staging, single_file_per_rank=False, sync_files=True, thread_count=1)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(state, storage_writer=writer, planner=_lazy_planner(source, by_id, flatten, progress),
                     no_dist=True)
        for name, data in (extra_files or {}).items():
            write_file_durable(os.path.join(staging, name), data)
        _swap_in(staging, out)
        parents = []
    except CheckpointingError:
        raise
    except CheckpointException as e:  # a BaseException wrapping what failed inside dcp.save
        interrupt = [f for f, _ in e.failures.values() if isinstance(f, KeyboardInterrupt)]
        if interrupt:  # Ctrl-C (or the CLI's SIGTERM) inside dcp.save: still an interrupt, not a failed write
            raise interrupt[0] from None
        raise _unwrapped(e, out) from e
    except Exception as e:  # OSError
        raise CheckpointingError(f"{out}: writing the DCP checkpoint failed: {type(e).__name__}: {e}") from e
    finally:
        if made and os.path.isdir(staging) and not os.path.islink(staging):  # ours, not yet swapped in
            shutil.rmtree(staging)
        remove_made_dirs(parents)  # failed or interrupted (Ctrl-C, SIGTERM): no empty folders on the way left


def to_dcp(checkpoint: Any, out_dir: Any, key_map: KeyMap = None,
           extra_safe_globals: Sequence[Any] = (), *, only: Optional[str] = None, include: Sequence[str] = (),
           progress: Optional[Progress] = None) -> ConvertReport:
    """Write ``checkpoint`` (anything ``ldc.load`` reads) as the DCP directory ``out_dir``.

    Single process (call it on one rank). ``key_map`` renames (dict) or leaves out (callable
    returning None) tensors by their export name; ``only="model"`` / ``include`` leave out
    optimizer state / tensors matching no prefix (:mod:`.select`; the common state is written as
    it is). ``progress`` counts the bytes exported. ``extra_safe_globals``: further trusted types its
    objects and common state may hold.
    Returns a :class:`ConvertReport` (kind ``"dcp"``).

    Raises:
        ArgumentError, ArgumentTypeError: an argument that is wrong (naming it), an output over the input.
        CheckpointNotFoundError, IncompleteCheckpointError: nothing, or no committed checkpoint, at the source.
        FormatError: the source fails its checks (UnsafeContentError: a type not allowed to deserialize).
        CheckpointingError: writing failed (naming the file); ``out_dir`` is left as it was.
    """
    t0 = time.perf_counter()
    out = export_arguments(out_dir, key_map, extra_safe_globals)
    select = selection(only, include)
    source = open_source(checkpoint, out)
    tensors = export_tensors(source, key_map, extra_safe_globals, module_prefix=f"{MODULE_ENTRY}.", select=select)
    state: Dict[str, Any] = _common_entries(source, extra_safe_globals)
    by_id = add_meta_placeholders(source, tensors, state, "a common-state entry")
    n_objects = len(source.index.objects)
    if n_objects:
        logger.warning("%s: %d ShardedObject key(s) are not exported to DCP", source.path, n_objects)
    write_dcp_dir(source, state, by_id, out, progress=progress)
    return ConvertReport(source.path, out, "dcp", len(tensors), 0, directory_bytes(out), time.perf_counter() - t0)
