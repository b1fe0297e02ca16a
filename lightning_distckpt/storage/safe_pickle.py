"""Common state and ShardedObjects: written with ``torch.save``, read with ``weights_only=True``.

Loading never runs code from the checkpoint: only tensors, containers, primitives and the
allow-listed types below can be restored. Users add their own with ``extra_safe_globals``.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import re
import threading
import typing
import zipfile
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from ..core.errors import FormatError, UnsafeContentError, allow_type_advice, naming_file
from ..core.tree_walk import check_tree, fold
from .omegaconf_check import check_nodes, node_type
from .file_kind import HEAD_BYTES, not_a_torch_file, starts_with_legacy_magic
from .paths import ANYWHERE, check_regular
from .pickle_scan import check_archive_pickle, check_stream_pickles
from .zip_records import check_records, check_storage_sizes


def default_safe_globals(omegaconf: bool = True) -> List[Any]:
    """Types that training state commonly holds: omegaconf containers (Lightning hparams),
    ordered/default dicts, enums of our own, ``typing.Any`` (omegaconf metadata).
    ``omegaconf=False`` leaves omegaconf out (importing it costs ~0.15 s)."""
    allowed: List[Any] = [collections.OrderedDict, collections.defaultdict, typing.Any, dict, list, set, tuple,
                          int, float, str, bool, slice]
    if not omegaconf:
        return allowed
    try:
        from omegaconf import DictConfig, ListConfig, nodes
        from omegaconf.base import ContainerMetadata, Metadata

        allowed += [DictConfig, ListConfig, ContainerMetadata, Metadata]
        allowed += [getattr(nodes, n) for n in ("AnyNode", "IntegerNode", "FloatNode", "StringNode", "BooleanNode",
                                                "BytesNode", "PathNode", "EnumNode", "ValueNode") if hasattr(nodes, n)]
    except ImportError:  # omegaconf is a dependency, but keep loading usable without it
        pass
    return allowed


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes, where: str, extra_safe_globals: Sequence[Any] = ()) -> Any:
    """Deserialize ``data`` without running code; a refused type is a clear CheckpointingError."""
    # The pickle names every global it needs in plain text: import omegaconf only when needed.
    return _safe_load(io.BytesIO(data), where, extra_safe_globals, omegaconf=b"omegaconf" in data)


def load_file(path: str, extra_safe_globals: Sequence[Any] = (), root: Optional[str] = ANYWHERE) -> Any:
    """A ``torch.save`` file, deserialized without running code; memory-mapped when it is a zip
    archive (the pre-1.6 legacy format cannot be mapped: it is read whole). Checked first to be a
    regular file (a FIFO would block ``torch.load`` forever) and, where it is a link, to resolve
    inside ``root`` (:func:`~lightning_distckpt.storage.paths.open_regular`; the default: a file
    the user named, followed wherever it points). A missing or unreadable file is a FormatError."""
    try:
        check_regular(path, "torch.save file", root)
    except OSError as e:
        raise FormatError(f"torch.save file {path} cannot be read: {e.strerror or e}") from None
    try:
        if _is_zip_file(path):
            return _safe_load(path, path, extra_safe_globals, omegaconf=True, mmap=True)
        return _load_not_zip(path, extra_safe_globals)
    except OSError as e:  # EIO from the device, or a file that refuses reads (/proc/self/mem)
        raise FormatError(f"torch.save file {path} cannot be read: {e.strerror or e}") from None
    except FormatError as e:  # UnsafeContentError included: say what the file is when it is no torch.save file
        raise (not_a_torch_file(path, root) or e) from None


def _load_not_zip(path: str, extra_safe_globals: Sequence[Any]) -> Any:
    """A file that is no zip archive: in torch's pre-1.6 format, read from an open file so that
    :func:`_safe_load` can see where its data ends; anything else by name, as torch.load decides
    (torch reads a safetensors file named by its path, and says what is wrong with other files)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise FormatError(f"torch.save file {path} cannot be read: {e.strerror or e}") from None
    with f:
        if starts_with_legacy_magic(f.read(HEAD_BYTES)):
            f.seek(0)
            return _safe_load(f, path, extra_safe_globals, omegaconf=True)
    return _safe_load(path, path, extra_safe_globals, omegaconf=True)


def _check_legacy_end(source: Any, where: str) -> None:
    """torch's pre-1.6 format is pickles, then each storage's size and bytes, nothing after. No
    checksum covers it, but torch reads the storages one after another, so bytes inserted into or
    dropped from the data show as a stream that does not end where the last storage does (torch
    ignores what follows it: a tensor shifted by one byte loaded as its values)."""
    end = source.tell()
    size = source.seek(0, io.SEEK_END)
    if end != size:
        raise FormatError(f"{where}: a torch.save file in the pre-1.6 format whose last tensor's data ends at byte "
                          f"{end} of {size}: bytes were inserted, dropped or appended; refused")


def _safe_load(source: Any, where: str, extra_safe_globals: Sequence[Any], omegaconf: bool, mmap: bool = False) -> Any:
    """torch.load with weights_only. A refused type (the weights-only unpickler raises
    UnpicklingError) is an UnsafeContentError; anything else that fails is a damaged archive. A zip
    archive's records are checked first (:mod:`.zip_records`): torch reads damaged ones as values."""
    zipped = mmap or _is_zip_buffer(source)
    call_only = not _bytes_trusted(extra_safe_globals)  # b"" (a call of bytes()) loads; no other call of bytes
    if zipped:
        check_records(source, where)
        check_archive_pickle(source, where, call_only)  # nothing torch's unpickler would hash without bound
    elif hasattr(source, "read"):
        check_stream_pickles(source, where, bytes_call_only=call_only)
    allowed = default_safe_globals(omegaconf=omegaconf) + list(extra_safe_globals)
    try:
        with _allowed(allowed + [_EMPTY_BYTES] if call_only else allowed):
            # mapped, torch takes each storage's claimed bytes unchecked (unmapped, it checks them)
            mapped = mmap and check_storage_sizes(source, where)
            payload = torch.load(source, map_location="cpu", weights_only=True, mmap=mapped or None)
    except FormatError:
        raise
    except RecursionError:
        raise FormatError(f"{where}: nested too deeply to deserialize; refused") from None
    except pickle.UnpicklingError as e:
        raise UnsafeContentError(f"{where}: {_refusal(e)}") from None
    except Exception as e:  # torch raises RuntimeError / EOFError / ... for damaged archives
        raise FormatError(f"{where}: not a readable torch.save archive: {type(e).__name__}: {_first_line(e)}") from None
    if not zipped and hasattr(source, "tell"):  # an open file or a buffer in the pre-1.6 format
        _check_legacy_end(source, where)
    # What a few bytes can describe (shared references 40 deep, cycles, deep nesting) is refused
    # here, once for every reader, before anything walks it (core/tree_walk.py). The same walk
    # collects omegaconf nodes: their interpolations would run resolvers when read (omegaconf_check.py).
    check_loaded_tree(payload, where)
    return payload


def _empty_bytes(*args: Any) -> bytes:
    """``builtins.bytes`` as a load allows it: ``bytes()``, how protocol 2 (``torch.save``'s) writes ``b""``
    (a non-empty value is ``_codecs.encode(str, "latin1")``, which torch allows). The pre-scan lets no other
    call through (:func:`~.pickle_opcodes._bytes_call`); this refuses one all the same: while a load of ours
    runs it is in torch's process-wide allow-list, which other threads' ``torch.load`` calls read too."""
    if args:
        raise pickle.UnpicklingError("builtins.bytes called with arguments: only bytes() (b'') loads")
    return b""


#: how torch's weights-only unpickler is given it: under the name the pickle's GLOBAL spells
_EMPTY_BYTES = (_empty_bytes, "builtins.bytes")


def _bytes_trusted(extra: Sequence[Any]) -> bool:
    """Whether the user allowed ``builtins.bytes`` (``extra_safe_globals`` or torch's process-wide list): it
    then loads as torch's unpickler has it, calls with arguments included, and :data:`_EMPTY_BYTES` stays out
    of the list (torch would take either of two entries of one name)."""
    for g in list(extra) + list(torch.serialization.get_safe_globals()):
        if g is bytes or (isinstance(g, tuple) and len(g) == 2 and g[1] == "builtins.bytes" and g != _EMPTY_BYTES):
            return True
    return False


def check_loaded_tree(tree: Any, where: str) -> None:
    """:func:`~lightning_distckpt.core.tree_walk.check_tree` of loaded state, whose one walk also
    collects the omegaconf nodes for :func:`.omegaconf_check.check_nodes`."""
    node = node_type()
    nodes: List[Any] = []
    if node is None:
        check_tree(tree, where, types=_LOADED_CONTAINERS)
    else:
        fold(tree, lambda leaf: isinstance(leaf, node) and nodes.append(leaf), _ignore, where=where,
             types=_LOADED_CONTAINERS)
        check_nodes(nodes, where)


def _ignore(*_: Any) -> None:
    return None


_LOADED_CONTAINERS = (dict, list, tuple, set, frozenset)


def _is_zip_file(path: str) -> bool:
    """Whether the file ends with a zip directory; one that is there but damaged counts (the record
    check then says what is wrong): ``zipfile.is_zipfile`` raises BadZipFile for some (a zip64 end
    record naming several disks) instead of answering."""
    try:
        return zipfile.is_zipfile(path)
    except zipfile.BadZipFile:
        return True


def _is_zip_buffer(source: Any) -> bool:
    if not hasattr(source, "read"):  # a path: mmap says whether it is a zip
        return False
    head = source.read(4)
    source.seek(0)
    return head == b"PK\x03\x04"

_ALLOW_LOCK = threading.Lock()
#: type -> how many of our loads hold it in torch's allow-list now; only types the list lacked when the
#: first of them began are counted (a type registered by someone else is never taken away)
_HELD: Dict[Any, int] = {}


@contextlib.contextmanager
def _allowed(types: Sequence[Any]) -> Iterator[None]:
    """``types`` allowed for torch's weights-only unpickler while the block runs. Its allow-list is
    process-wide, and torch's ``safe_globals`` context removes on exit every type it was given: a
    user's ``add_safe_globals`` of the same type (Megatron-Core registers ``argparse.Namespace`` and
    more at import) was undone by our load, and of two loads in threads the first to finish took the
    other's types away mid-load. Here a load adds what the list lacks and the last of our loads
    holding a type takes it away; what was registered before stays."""
    with _ALLOW_LOCK:
        present = set(torch.serialization.get_safe_globals())
        mine = [t for t in dict.fromkeys(types) if t in _HELD or t not in present]
        torch.serialization.add_safe_globals([t for t in mine if t not in present])
        for t in mine:
            _HELD[t] = _HELD.get(t, 0) + 1
    try:
        yield
    finally:
        with _ALLOW_LOCK:
            gone = []
            for t in mine:
                _HELD[t] -= 1
                if not _HELD[t]:
                    del _HELD[t]
                    gone.append(t)
            if gone:  # torch's own removal (its context's exit): one assignment, never an empty list between
                torch.serialization.safe_globals(gone).__exit__(None, None, None)


# torch's weights-only unpickler names the type it refused: "Unsupported global: GLOBAL _io.BytesIO ..."
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
# Rebuilds of tensor layouts torch's weights-only list leaves out (from 2.15: nested tensors): allow-listing
# them is no advice, as the loaders refuse the layout anyway.
_NOT_DENSE = {"torch._utils._rebuild_nested_tensor": "a nested tensor"}


def _refusal(e: BaseException) -> str:
    """What was refused and every way a user who trusts the checkpoint can allow it: the argument
    of our calls, the Lightning plugin's and the YAML config's, and torch's process-wide list,
    which also serves calls without such an argument (Megatron-Core-shaped ones)."""
    found = _REFUSED_GLOBAL.search(str(e))
    if found is None:
        return (f"refused to deserialize (only tensors, containers, primitives and allow-listed types load; "
                f"loading runs no code): {_first_line(e)}")
    name = found.group(1)
    if name in _NOT_DENSE:  # no type to allow: a tensor layout this library does not store (torch 2.15 refuses it)
        return (f"refused to deserialize {name}: the file holds {_NOT_DENSE[name]}; dense (strided) tensors only "
                f"(densify it before saving, e.g. tensor.to_padded_tensor(0) or one tensor per component)")
    return (f"refused to deserialize {name}: only tensors, containers, primitives and allow-listed types load "
            f"(loading runs no code). {allow_type_advice(name)}")


# torch's advice to load with weights_only=False (which runs whatever code the file names) and the
# sentences around it: never passed on. What is left says what was refused.
_TORCH_ADVICE = re.compile(
    r"weights_only[`'\s]*(set to|=)\s*`?False|Do it only if|In PyTorch 2\.\d+, we changed|can still be loaded|"
    r"Please file an issue|Check the documentation of torch\.load|do those steps only|Alternatively, to load",
    re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n")
_LIST_MARK = re.compile(r"^\s*\(\d\)\s*")


def torch_message(e: BaseException) -> str:
    """The first sentences of what a torch error says, without torch's advice to retry with
    ``weights_only=False`` (every error of torch.load we pass on goes through here)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:  # the weights-only unpickler's own finding, without the advice
        text = text.split("WeightsUnpickler error:", 1)[1]
    kept = [_LIST_MARK.sub("", part).strip() for part in _SENTENCE_END.split(text)]
    kept = [part for part in kept if part and not _TORCH_ADVICE.search(part)]
    return " ".join(kept)[:500]


def _first_line(e: BaseException) -> str:
    return torch_message(e)


def write_file_durable(path: str, data: bytes) -> None:
    with naming_file(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
