"""The tensor files we read: ``.safetensors`` (read with ``pread`` at the offsets of its checked header:
only the rows a slice needs) and ``torch.save`` files (``weights_only``, memory-mapped: only the pages of
the slice are touched). Both :func:`ldc.load <lightning_distckpt.load>` and the rank-0 API
(:mod:`lightning_distckpt.ingest`) open files through these classes. ``root``: where a link may
resolve (:mod:`.model_files`; the default, a file the user named, is read wherever it points)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...core.errors import FormatError
from ...core.tensor_bytes import numpy_view
from ...core.tree_walk import CONTAINERS, fold, rebuilt_tuple, walk_paths
from ...storage.checksums import verification_enabled
from ...storage.safetensors_crcs import check_tensor, recorded_crcs
from ...storage.paths import ANYWHERE, INFLATED_FACTOR, INFLATED_FLOOR
from ...storage.safe_pickle import load_file
from .model_files import open_model_file
from .safetensors_header import HeaderEntry, read_open_header
from .tensor_files import check_shape

_READ_BYTES = 64 << 20  # a slice's rows are read at most this many bytes at a time


class SafetensorsFile:
    """A ``.safetensors`` file: its header is checked against the file's size first
    (:func:`~lightning_distckpt.reading.formats.safetensors_header.read_open_header`: truncation,
    offsets past the end, overlapping or leaving gaps, unknown dtypes are FormatErrors naming the
    tensor); then tensors are read from the file kept open, with ``pread``: a slice reads only its
    rows, except where the file records the tensor's CRC-32C (we wrote it): then the tensor is read
    whole and checked. A file cut short meanwhile (by another process) is a FormatError: read from a
    memory map it killed the reader with SIGBUS. ``mapped`` (the rank-0 API, whose tensors are handed
    out unread): tensors are views of safetensors' own memory map of the file (``safe_open``), which
    are exposed to that (docs/safety.md, "Limits")."""

    def __init__(self, path: str, root: str = ANYWHERE, mapped: bool = False) -> None:
        self.path = path
        self._file = open_model_file(path, "safetensors file", root)  # kept open: every read is from this file
        try:
            header = read_open_header(self._file, path)
            self._mapped = _safe_open(_same_file(self._file, path), path) if mapped else None
        except BaseException:
            self._file.close()
            raise
        self._entries = {e.name: e for e in sorted(header.entries, key=lambda e: e.begin)}
        self._start = header.data_start
        self._crcs = recorded_crcs(header.metadata, path)  # a file we wrote: each tensor's CRC-32C

    def __del__(self) -> None:  # the file lives as long as its reader: closed with it, not left to the GC
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()

    def names(self) -> List[str]:
        return list(self._entries)  # file order: reading them in turn reads the file front to back

    def shape_dtype(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        entry = self._entries[name]
        return entry.shape, entry.dtype

    def read(self, name: str, src: Tuple[slice, ...]) -> torch.Tensor:
        entry = self._entries[name]
        shape = entry.shape
        whole = not src or all(s.indices(n)[:2] == (0, n) for s, n in zip(src, shape))
        if not whole and (name not in self._crcs or not verification_enabled()):  # nothing to check its bytes by
            return self._mapped.get_slice(name)[src] if self._mapped is not None else self._slice(entry, src)
        # a slice of a tensor whose CRC is recorded: read whole, checked
        tensor = self._mapped.get_tensor(name) if self._mapped is not None else \
            self._rows(entry, 0, shape[0] if shape else 1)
        check_tensor(name, tensor, self._crcs, self.path)
        return tensor if not src else tensor[src]

    def _rows(self, entry: HeaderEntry, first: int, last: int) -> torch.Tensor:
        """Rows ``first:last`` of the tensor ``entry`` (all of a 0-d one), read from the file."""
        shape = entry.shape
        row = entry.dtype.itemsize * (int(torch.Size(shape[1:]).numel()) if shape else 1)
        nbytes = (last - first) * row
        out = torch.empty(((last - first),) + tuple(shape[1:]) if shape else (), dtype=entry.dtype)
        if nbytes:
            buf = numpy_view(out.view(-1).view(torch.uint8))  # not .numpy(): the loaded tensor stays resizable
            got = os.preadv(self._file.fileno(), [buf], self._start + entry.begin + first * row)
            if got != nbytes:
                raise FormatError(f"{self.path}: tensor {entry.name!r}: the file ends before its data ({got} of "
                                  f"{nbytes} bytes read; cut short while it was read)")
        return out

    def _slice(self, entry: HeaderEntry, src: Tuple[slice, ...]) -> torch.Tensor:
        """``tensor[src]``, reading only the rows it spans, at most :data:`_READ_BYTES` of rows at a time."""
        first, stop, step = src[0].indices(entry.shape[0]) if entry.shape else (0, 1, 1)
        if not entry.shape or step < 1:
            return self._rows(entry, 0, entry.shape[0] if entry.shape else 1)[src]
        out = torch.empty(torch.empty(entry.shape, dtype=entry.dtype, device="meta")[src].shape, dtype=entry.dtype)
        rows, rest = range(first, stop, step), (slice(None, None, step),) + tuple(src[1:])
        row_bytes = (entry.end - entry.begin) // max(1, entry.shape[0])
        per_read = max(1, _READ_BYTES // max(1, row_bytes * step))
        for at in range(0, len(rows), per_read):
            part = rows[at:at + per_read]
            out[at:at + len(part)] = self._rows(entry, part[0], part[-1] + 1)[rest]
        return out


def _same_file(opened: Any, path: str) -> str:
    """A name for the file ``opened`` (checked) itself: by name, ``path`` may name another file by now (a
    rename over it, a link swapped), which safetensors would map unchecked. Linux's ``/proc/self/fd``."""
    own = f"/proc/self/fd/{opened.fileno()}"
    return own if os.path.exists(own) else path


def _safe_open(name: str, path: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(name, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError (and Rust panics surfacing as exceptions)
        raise FormatError(f"{path}: cannot be read as safetensors: {type(e).__name__}: {e}") from None


class TorchFile:
    """A ``torch.save`` file: every tensor leaf is named by its path, ``/``-joined (a plain state dict
    keeps its keys: ``"fc.weight"``; a Lightning checkpoint gives ``"state_dict/fc.weight"``); the
    rest (epochs, loops, hyperparameters) is the common state."""

    def __init__(self, path: str, extra_safe_globals: Sequence[Any] = (), root: str = ANYWHERE) -> None:
        self._take(path, load_file(path, extra_safe_globals, root))

    @classmethod
    def from_payload(cls, path: str, payload: Any, containers: Tuple[type, ...] = CONTAINERS) -> "TorchFile":
        """The file at ``path`` already unpickled (by ``load_file``) as ``payload``: a restore that
        needs the payload itself too unpickles the file once. Only tensors reached through ``containers``
        are named (a Lightning restore passes dicts and lists: a tuple, tensors and all, stays in the common
        state as it was, as a checkpoint the strategies write keeps it)."""
        file = cls.__new__(cls)
        file._take(path, payload, containers)
        return file

    def _take(self, path: str, payload: Any, containers: Tuple[type, ...] = CONTAINERS) -> None:
        self.path = path
        self.tensors: Dict[str, torch.Tensor] = {}
        # A plain state dict: a dict of name -> tensor and nothing else (what the rank-0 API takes).
        self.payload_type = type(payload).__name__
        self.is_state_dict = isinstance(payload, dict) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload.items())
        self.common = _split_tensors(payload, path, self.tensors, containers)

    def names(self) -> List[str]:
        return list(self.tensors)

    def shape_dtype(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        t = self.tensors[name]
        return tuple(t.shape), t.dtype

    def read(self, name: str, src: Tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][src]


_DROP = object()
# bytes any torch file may expand to past what it stores (see _check_views): as much as its compressed records may
VIEW_BUDGET_FLOOR, VIEW_BUDGET_FACTOR = INFLATED_FLOOR, INFLATED_FACTOR


def _split_tensors(payload: Any, path: str, out: Dict[str, torch.Tensor],
                   containers: Tuple[type, ...] = CONTAINERS) -> Any:
    """Move the tensor leaves of ``payload`` reached through ``containers`` into ``out``, each named by
    its path (``/``-joined; a tensor under two paths, tied weights, under both); return what is left
    (containers left empty are dropped, except at the top; other values, tensors inside, as they are).
    Every tensor of the file is checked (:func:`check_torch_payload`), kept in the common state or not.
    Bounded walks (:mod:`~lightning_distckpt.core.tree_walk`): a tree too deep, cyclic or shared beyond
    what the file stores is a FormatError naming ``path``."""
    where = f"{path}: torch.save payload"
    kept = fold(payload, _kept_leaf, _kept_node, where=where, types=containers)
    tensors = check_torch_payload(path, payload)
    if containers != CONTAINERS:  # only those named through ``containers``; the rest stay in their values
        named = {"/".join(map(str, p)) for p, leaf in walk_paths(payload, where=where, types=containers)
                 if isinstance(leaf, torch.Tensor)}
        tensors = {name: t for name, t in tensors.items() if name in named}
    out.update(tensors)
    if kept is _DROP:
        return {} if isinstance(payload, dict) else None
    return kept


def check_torch_payload(path: str, payload: Any) -> Dict[str, torch.Tensor]:
    """The tensor leaves of ``payload``, unpickled from the ``torch.save`` file ``path``, each named
    by its path, once they pass the checks every reader of such a file needs (FormatErrors naming
    ``path`` and the tensor): a tree within the walk's bounds, dense CPU tensors with data
    (:func:`_check_kind`), shapes torch can allocate, and no more bytes to copy out than the
    budget allows (:func:`_check_views`). Call it on any payload read by ``load_file`` before
    copying, converting or handing out its tensors."""
    out: Dict[str, torch.Tensor] = {}
    for steps, leaf in walk_paths(payload, where=f"{path}: torch.save payload"):
        if isinstance(leaf, torch.Tensor):
            name = "/".join(map(str, steps))
            if name in out:
                raise FormatError(f"{path}: two tensors of the file are both named {name!r}")
            _check_kind(path, name, leaf)
            out[name] = leaf
    _check_views(path, out)
    return out


def _kept_leaf(leaf: Any) -> Any:
    return _DROP if isinstance(leaf, torch.Tensor) else leaf


def _kept_node(node: Any, keys: Optional[List[Any]], parts: List[Any]) -> Any:
    """A container without its tensors (its dropped children: removed from a dict, None in a sequence)."""
    if keys is not None:
        kept = {k: v for k, v in zip(keys, parts) if v is not _DROP}
        return kept if kept or not node else _DROP
    if node and all(p is _DROP for p in parts):
        return _DROP
    rest = [None if p is _DROP else p for p in parts]
    return rebuilt_tuple(node, rest) if isinstance(node, tuple) else rest  # a namedtuple stays one


def _check_kind(path: str, name: str, t: torch.Tensor) -> None:
    """Refuse a tensor that is not dense data on the CPU, before anything touches its storage: a
    sparse, nested or other non-strided tensor has no storage of its shape (reading it raised
    torch's NotImplementedError), and a meta tensor has a shape and no data at all (a tiny file
    claiming 2**40 elements; copying it out raises, loading it would allocate the claim)."""
    where = f"{path}: tensor {name!r}"
    if t.layout is not torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
        raise FormatError(f"{where} is a {kind} tensor; lightning_distckpt reads dense (strided) tensors only "
                          "(save it with .to_dense())")
    if t.device.type != "cpu":  # map_location="cpu" moved every tensor with data: this one has none
        raise FormatError(f"{where} of shape {tuple(t.shape)} is on the {t.device.type} device: the file holds "
                          "no data for it")
    check_shape(where, tuple(t.shape), t.element_size())


def _check_views(path: str, tensors: Dict[str, torch.Tensor]) -> None:
    """Refuse a file whose tensors, copied out, would take more bytes than it stores beyond a budget.

    A reader (``load_plain_tensors``, ``convert``) materialises every name as its own tensor of
    ``numel x itemsize`` bytes. Two ways cost more than the file stores: a view with zero or
    overlapping strides (``torch.zeros(1).expand(10**12)``: a few bytes in the file), which costs
    all it claims; and one storage under many names (``{f"k{i}": t for i in range(4000)}``), where
    the storage's bytes are free once and every byte its tensors claim past them costs. All of it
    together may be at most ``max(VIEW_BUDGET_FACTOR x the file's bytes, VIEW_BUDGET_FLOOR)``: far
    more than legitimate sharing needs (tied weights, as Hugging Face models save tied embeddings,
    cost one extra copy of one tensor, less than the file; views of a flat buffer cost the buffer
    once more), while 4000 names of a 1 MiB storage (4 GiB from a 1 MB file) are refused. An
    ``expand`` of a size-1 dim (a ``position_ids`` buffer) costs what it stores and is always
    fine. Past the budget a FormatError names the tensor, what it claims and the bytes stored."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    budget = max(VIEW_BUDGET_FACTOR * size, VIEW_BUDGET_FLOOR)
    sharing: Dict[int, List[str]] = {}  # storage (by address) -> the names within it
    for name, t in tensors.items():
        sharing.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    free = {ptr: tensors[names[0]].untyped_storage().nbytes() for ptr, names in sharing.items()}
    spent = 0
    for name, t in tensors.items():
        claimed = t.numel() * t.element_size()
        storage = t.untyped_storage()
        ptr, stored = storage.data_ptr(), storage.nbytes()
        if claimed > stored:  # a view past its storage: all of it is materialised from nothing
            spent += claimed
        else:  # within its storage: the storage's bytes once, shared by all its names, then it costs
            spent += max(0, claimed - free[ptr])
            free[ptr] = max(0, free[ptr] - claimed)
        if spent > budget:
            raise FormatError(f"{path}: {_claim(name, t, stored, sharing[ptr], tensors)}, past the {budget} bytes "
                              f"this file's tensors may take beyond what it stores (max({VIEW_BUDGET_FACTOR} x "
                              f"the file's {size} bytes, {VIEW_BUDGET_FLOOR}))")


def _claim(name: str, t: torch.Tensor, stored: int, names: List[str], tensors: Dict[str, torch.Tensor]) -> str:
    """What tensor ``name`` claims, for the message refusing it (``names``: all within its storage)."""
    claimed = t.numel() * t.element_size()
    if claimed > stored:
        return (f"tensor {name!r} is a view of shape {tuple(t.shape)} (strides {t.stride()}): it claims "
                f"{claimed} bytes over {stored} bytes stored")
    together = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    shown = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"tensor {name!r} shares one storage of {stored} bytes with {len(names) - 1} other names ({shown}), "
            f"each copied out whole: together they claim {together} bytes over {stored} bytes stored")
