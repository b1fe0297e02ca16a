"""PyTorch DCP's ``.metadata`` file, parsed without running code from it.

``torch.distributed.checkpoint``'s ``FileSystemWriter`` pickles a
``torch.distributed.checkpoint.metadata.Metadata``: for each fully qualified name either a
``TensorStorageMetadata`` (global size, dtype, chunks: offsets and sizes) or a
``BytesStorageMetadata`` (an object DCP stored with ``torch.save``), and ``storage_data``, which
maps ``MetadataIndex(fqn, chunk offset)`` to ``_StorageInfo(relative_path, offset, length)``: the
byte range of the item in one ``.distcp`` file.

The pickle is read by an unpickler that resolves only the DCP metadata classes and a few torch
values (dtypes, ``torch.Size``, layouts); any other global (a function that would run code) is
refused with :class:`~lightning_distckpt.core.errors.UnsafeContentError`. What it builds is then
checked field by field into the typed records below, since a pickle can put anything in a field.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import reprlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...core.errors import FormatError, UnsafeContentError
from ...storage.paths import ANYWHERE, METADATA_CAP
from ...storage.pickle_scan import check_hashed
from .dcp_transforms import ZSTD_RATIO, checked_transforms
from .model_files import read_model_file
from .tensor_files import check_shape

METADATA_NAME = ".metadata"

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    # Megatron-Core keeps every rank's save plan in the metadata (``all_local_plans``, to reuse it)
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.serialization": ("_get_layout",),  # layout by name: a lookup in torch's table
    "pathlib": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),  # StorageMeta.checkpoint_id
    "collections": ("OrderedDict",),
}
# Megatron-Core's own classes in the ``torch_dist`` ``.metadata`` of each release that wrote one
# (fixtures of 0.12-0.16 in tests/fixtures/megatron/): 0.15 pickles its Metadata subclass, which
# only adds ``mcore_data`` (a dict of plain values per tensor); 0.12-0.15 keep every rank's save
# plan in the metadata (``all_local_plans``, for reuse) as ``MCoreSavePlan``, a SavePlan plus
# ``mcore_data``; 0.16 pickles torch's classes only. Each is mapped, by name, to a record of our
# own or DCP's: megatron-core is never imported and none of its code runs.
_MCORE_MODULE = "megatron.core.dist_checkpointing.strategies.torch"


class _InertRecord:
    """A Megatron-Core record that nothing reads (a rank's save plan): its pickled state is kept as
    it is, and no class of the checkpoint's is looked up or called to make it."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _mcore_classes() -> Dict[str, type]:
    from torch.distributed.checkpoint.metadata import Metadata  # only a DCP checkpoint needs it

    return {"MCoreMetadata": Metadata, "MCoreSavePlan": _InertRecord}


@dataclass(frozen=True)
class DcpItem:
    """Where one stored item lives: ``length`` bytes at ``offset`` of ``file`` (relative to the checkpoint)."""

    file: str
    offset: int
    length: int
    transforms: Tuple[str, ...] = ()  # DCP's stream transforms: ('stream.zstd/1',) when compressed
    raw: bool = False  # the chunk's elements, row-major (DCP's SAFETENSORS format), not a torch.save archive


@dataclass(frozen=True)
class DcpChunk:
    """One stored chunk of a tensor: its box in the global tensor and where its bytes are."""

    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    item: DcpItem


@dataclass(frozen=True)
class DcpTensor:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    chunks: List[DcpChunk] = field(default_factory=list)
    # chunks of no elements that name a stored item: never read by a load, so checked apart (a lie
    # that shrinks a stored chunk to nothing would otherwise load as an empty tensor)
    stored_empty: List[DcpChunk] = field(default_factory=list)


@dataclass(frozen=True)
class DcpMetadata:
    """A DCP checkpoint's contents by fully qualified name: tensors and (``torch.save``d) objects."""

    tensors: Dict[str, DcpTensor]
    objects: Dict[str, DcpItem]
    mcore_data: Dict[str, Any] = field(default_factory=dict)  # Megatron-Core's per-tensor notes, if any


class _AllowListUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Resolves only the DCP metadata classes and torch values; refuses every other global.

    Python's own unpickler, not the C one: the C unpickler keeps its memo in an array and grows it to
    twice any index a ``BINPUT`` / ``LONG_BINPUT`` names, so a few bytes of a 1 KB file
    (``LONG_BINPUT 2**31``) had it allocate and clear many GB (18 s here, an out-of-memory kill on a
    smaller host). This one keeps the memo in a dict; it unpickles about half as fast (a 20 MB
    ``.metadata`` of 128,000 chunks: 4.4 s against 2.1 s).

    The opcodes that change an object already on the stack (``BUILD``, ``SETITEM(S)``,
    ``APPEND(S)``, ``ADDITEMS``) act only on objects this unpickling made, of the kinds that opcode
    fills in (see :meth:`_check_target`): ``BUILD`` on a class ``find_class`` returned would set its
    attributes for the whole process (``PurePosixPath._str``: every path the process makes)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self._where = where
        # what this unpickling made, by id; kept alive, so no other object can take one of these ids
        self._made: Dict[int, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == _MCORE_MODULE and name in ("MCoreMetadata", "MCoreSavePlan"):
            return _mcore_classes()[name]
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout)):
                return value
        elif name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeContentError(f"{self._where}: refused to load global {module}.{name}: a DCP .metadata holds "
                                 "only DCP metadata records, torch dtypes and sizes (loading runs no code from it)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeContentError(f"{self._where}: unexpected persistent id in a DCP .metadata pickle")

    def _check_target(self, opcode: str, target: Any, kinds: Tuple[type, ...]) -> None:
        """Refuse ``opcode`` changing ``target`` unless this unpickling made it and it is of ``kinds``
        (exactly: an enum class called returns its existing member, which must stay unchanged too)."""
        if self._made.get(id(target)) is not target or type(target) not in kinds:
            raise UnsafeContentError(f"{self._where}: the DCP .metadata pickle's {opcode} would change "
                                     f"{_show_target(target)}, which the pickle did not create as a record or "
                                     "container of its own (a pickle may only fill in what it builds)")


def _show_target(target: Any) -> str:
    if isinstance(target, type):
        return f"class {target.__module__}.{target.__qualname__}"
    return f"an object of type {type(target).__module__}.{type(target).__qualname__}"


def _making(load: Any) -> Any:
    """``load`` (an opcode that pushes a new object), recording what it pushed as made here."""
    def handler(self: _AllowListUnpickler) -> None:
        load(self)
        self._made[id(self.stack[-1])] = self.stack[-1]
    return handler


def _changing(load: Any, opcode: str, depth: int, marked: bool, kinds: Any) -> Any:
    """``load`` (an opcode that changes the object ``depth`` below the top of the stack, or just
    below the MARK when ``marked``), run only on what :meth:`_AllowListUnpickler._check_target`
    allows; ``kinds``: a function of no arguments giving the types it may change."""
    def handler(self: _AllowListUnpickler) -> None:
        stack = (self.metastack[-1] if self.metastack else []) if marked else self.stack
        if len(stack) >= depth:  # else the opcode itself fails on the short stack (a damaged file)
            self._check_target(opcode, stack[-depth], kinds())
            if opcode == "BUILD":
                _check_state(self, self.stack[-1])
        load(self)
    return handler


def _check_state(unpickler: _AllowListUnpickler, state: Any) -> None:
    """A ``BUILD`` state names only plain fields (no ``__class__``, ``__dict__``, ...)."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if isinstance(part, dict) and not all(type(k) is str and not k.startswith("__") for k in part):
            raise UnsafeContentError(f"{unpickler._where}: the DCP .metadata pickle's BUILD sets attributes "
                                     f"{shown_value(list(part)[:8])}, which are not record fields")


@functools.lru_cache(maxsize=None)
def _record_types() -> Tuple[type, ...]:
    """The classes whose instances a ``BUILD`` may fill in: DCP's records (not its enums) and ours."""
    import enum
    import importlib

    out: List[type] = [_InertRecord]
    for module, names in _DCP_CLASSES.items():
        if module.startswith("torch.distributed.checkpoint"):
            found = (getattr(importlib.import_module(module), name) for name in names)
            out += [c for c in found if isinstance(c, type) and not issubclass(c, enum.Enum)]
    return tuple(out)


def _setup_dispatch() -> None:
    from collections import OrderedDict

    op, table, base = pickle, _AllowListUnpickler.dispatch, pickle._Unpickler  # type: ignore[attr-defined]
    for code, name in ((op.REDUCE, "load_reduce"), (op.NEWOBJ, "load_newobj"), (op.NEWOBJ_EX, "load_newobj_ex"),
                       (op.OBJ, "load_obj"), (op.INST, "load_inst"), (op.EMPTY_DICT, "load_empty_dictionary"),
                       (op.DICT, "load_dict"), (op.EMPTY_LIST, "load_empty_list"), (op.LIST, "load_list"),
                       (op.EMPTY_SET, "load_empty_set")):
        table[code[0]] = _making(getattr(base, name))
    dicts, lists, sets = (lambda: (dict, OrderedDict)), (lambda: (list,)), (lambda: (set,))
    for code, name, depth, marked, kinds in (
            (op.BUILD, "load_build", 2, False, _record_types), (op.SETITEM, "load_setitem", 3, False, dicts),
            (op.SETITEMS, "load_setitems", 1, True, dicts), (op.APPEND, "load_append", 2, False, lists),
            (op.APPENDS, "load_appends", 1, True, lists), (op.ADDITEMS, "load_additems", 1, True, sets)):
        table[code[0]] = _changing(getattr(base, name), name[5:].upper(), depth, marked, kinds)
    # what each of these hashes (keys, set items), checked before it is hashed (storage/pickle_scan.py)
    for code, hashed in ((op.SETITEM, lambda s: s[-2:-1]), (op.SETITEMS, lambda s: s[::2]),
                         (op.DICT, lambda s: s[::2]), (op.ADDITEMS, lambda s: s), (op.FROZENSET, lambda s: s)):
        table[code[0]] = _hashing(table[code[0]], hashed)


def _hashing(load: Any, hashed: Any) -> Any:
    """``load`` (an opcode that hashes ``hashed(stack)``: for one after a MARK, the items since it), run
    once what it hashes is within bounds (:func:`~lightning_distckpt.storage.pickle_scan.check_hashed`:
    Python hashes a tuple recursing in C, past any recursion limit)."""
    def handler(self: _AllowListUnpickler) -> None:
        check_hashed(hashed(self.stack), self._where)
        load(self)
    return handler


_setup_dispatch()


def read_metadata(path: str, root: str = ANYWHERE) -> DcpMetadata:
    """Parse and check the DCP ``.metadata`` file at ``path`` (a regular file; a link only into
    ``root``, see :mod:`.model_files`)."""
    data = read_model_file(path, "DCP .metadata", root, METADATA_CAP)
    try:
        raw = _AllowListUnpickler(io.BytesIO(data), path).load()
    except FormatError:
        raise
    except Exception as e:  # truncated or corrupted pickle
        raise FormatError(f"{path}: not a readable DCP .metadata ({type(e).__name__}: {e})") from None
    try:
        return _checked(raw, path, len(data))
    except FormatError:
        raise
    except Exception as e:  # a record the pickle left without a field its class has, or of odd values
        raise FormatError(f"{path}: malformed DCP .metadata ({type(e).__name__}: {e})") from None


def _checked(raw: Any, path: str, size: int) -> DcpMetadata:
    """The unpickled ``Metadata`` (of ``size`` bytes), checked field by field into our records."""
    from torch.distributed.checkpoint import metadata as m  # imported here: only a DCP checkpoint needs it
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(raw, m.Metadata) or not isinstance(getattr(raw, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(raw, "storage_data", None), dict):
        raise FormatError(f"{path}: not a DCP Metadata record written by FileSystemWriter "
                          f"(got {type(raw).__name__})")
    items = _storage_items(raw.storage_data, m.MetadataIndex, _StorageInfo, path)
    tensors: Dict[str, DcpTensor] = {}
    objects: Dict[str, DcpItem] = {}
    # Each chunk a list names takes at least 2 bytes of the pickle (a memo reference); lists shared by
    # tensors (one list of 1,000 empty chunks under 1,000 names: 40 kB) would be walked once per name.
    chunks = 0
    for fqn, entry in raw.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise FormatError(f"{path}: state_dict_metadata key {shown_value(fqn)} is not a string")
        if isinstance(entry, m.BytesStorageMetadata):
            objects[fqn] = _item(items, fqn, None, path)
        elif isinstance(entry, m.TensorStorageMetadata):
            chunks += len(entry.chunks) if isinstance(entry.chunks, list) else 0
            if chunks > size // 2:
                raise FormatError(f"{path}: its tensors name {chunks} chunks or more, more than its {size} bytes "
                                  f"hold (chunk lists shared between tensors): not written by DCP; refused")
            tensors[fqn] = _tensor(entry, fqn, items, path)
        else:
            raise FormatError(f"{path}: entry {fqn!r} is a {type(entry).__name__}, not tensor or bytes metadata")
    used = {(k, None) for k in objects} | {(k, c.offset) for k, t in tensors.items() for c in t.chunks + t.stored_empty}
    if set(items) - used:  # each record DCP writes is an entry's: one left over is an entry lost (a name twice)
        raise FormatError(f"{path}: storage_data records {sorted(set(items) - used, key=str)[:3]} belong to no entry")
    mcore_data = getattr(raw, "mcore_data", None) or {}
    if not isinstance(mcore_data, dict):
        raise FormatError(f"{path}: Megatron-Core's mcore_data must be a dict, got {type(mcore_data).__name__}")
    return DcpMetadata(tensors, objects, mcore_data)


_ItemKey = Tuple[str, Optional[Tuple[int, ...]]]


class _Shown(reprlib.Repr):
    """``repr`` of what a pickle built, bounded in depth and width: a pickle's memo shares one list under
    many (``x = [x, x]`` 40 times: a few hundred bytes), and ``repr`` writes each place it is reached
    (2**40 items). Records are shown by their fields, as bounded; other objects by their type."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 4, 8, 8, 8, 8
        self.maxstring, self.maxother, self.maxlong = 120, 120, 40

    def repr1(self, x: Any, level: int) -> str:
        for kind, show in ((dict, self.repr_dict), (list, self.repr_list), (tuple, self.repr_tuple),
                           (set, self.repr_set), (frozenset, self.repr_frozenset)):
            if isinstance(x, kind):  # subclasses too (torch.Size, OrderedDict): as their base
                return show(x, level)
        if isinstance(x, (str, bytes, int, float, bool, type(None), torch.dtype)):
            return super().repr1(x, level)
        fields = getattr(x, "__dict__", None)
        if not isinstance(fields, dict) or level <= 0:
            return f"<{type(x).__name__}>"
        shown = [f"{k}={self.repr1(v, level - 1)}" for k, v in list(fields.items())[:self.maxdict]]
        return f"{type(x).__name__}({', '.join(shown)}{', ...' if len(fields) > self.maxdict else ''})"


_SHOWN = _Shown()


def shown_value(value: Any) -> str:
    """``repr(value)`` of what a pickle built, for a message: bounded in depth, width and length whatever
    the value (:class:`_Shown`); a value whose repr fails is named by its type."""
    try:
        text = _SHOWN.repr(value)
    except Exception:  # noqa: BLE001 - hostile: any repr may fail
        return f"<{type(value).__name__} with missing fields>"
    return text if len(text) <= 200 else text[:200] + "..."


def _ints(value: Any, what: str, path: str) -> Tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(i) is int and i >= 0 for i in value):
        raise FormatError(f"{path}: {what} must be a sequence of non-negative ints, got {shown_value(value)}")
    return tuple(value)


def _storage_items(storage_data: Dict[Any, Any], index_cls: type, info_cls: type, path: str) -> Dict[_ItemKey, DcpItem]:
    """``storage_data`` as (fqn, chunk offset or None) -> checked byte range."""
    out: Dict[_ItemKey, DcpItem] = {}
    for index, info in storage_data.items():
        if not isinstance(index, index_cls) or not isinstance(index.fqn, str) or not isinstance(info, info_cls):
            raise FormatError(f"{path}: storage_data entry {shown_value(index)} -> {shown_value(info)} is not "
                              "MetadataIndex -> _StorageInfo")
        offset = None if index.offset is None else _ints(index.offset, f"{index.fqn!r} offset", path)
        where = f"{path}: {index.fqn!r}" + ("" if offset is None else f" chunk at {list(offset)}")
        transforms = checked_transforms(getattr(info, "transform_descriptors", None), where)  # zstd or none
        rel, start, length = getattr(info, "relative_path", None), getattr(info, "offset", None), \
            getattr(info, "length", None)
        if not isinstance(rel, str) or type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise FormatError(f"{where}: malformed storage record {shown_value(info)}")
        out[(index.fqn, offset)] = DcpItem(rel, start, length, transforms)
    return out


def _item(items: Dict[_ItemKey, DcpItem], fqn: str, offset: Optional[Tuple[int, ...]], path: str) -> DcpItem:
    try:
        return items[(fqn, offset)]
    except KeyError:
        at = "" if offset is None else f" chunk at {list(offset)}"
        raise FormatError(f"{path}: {fqn!r}{at} has no storage record (storage_data)") from None


def _tensor(entry: Any, fqn: str, items: Dict[_ItemKey, DcpItem], path: str) -> DcpTensor:
    shape = _ints(entry.size, f"{fqn!r} size", path)
    # torch's strides are int64: a shape beyond them (even of no elements, [0, 2**64]) is no tensor.
    # Counted in elements, not bytes: torch makes an empty [0, 2**62] float32 tensor, which loads.
    check_shape(f"{path}: {fqn!r}", shape, 1)
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{path}: {fqn!r} has no dtype in its properties")
    if not isinstance(entry.chunks, list):
        raise FormatError(f"{path}: {fqn!r} chunks must be a list")
    out = DcpTensor(shape, dtype)
    for chunk in entry.chunks:
        offset = _ints(getattr(chunk, "offsets", None), f"{fqn!r} chunk offsets", path)
        sizes = _ints(getattr(chunk, "sizes", None), f"{fqn!r} chunk sizes", path)
        if len(offset) != len(shape) or len(sizes) != len(shape) or \
                any(o + s > n for o, s, n in zip(offset, sizes, shape)):
            raise FormatError(f"{path}: {fqn!r} chunk at {list(offset)} of shape {list(sizes)} "
                              f"lies outside the tensor's shape {list(shape)}")
        if math.prod(sizes) == 0:  # an empty shard (a rank holding no rows): nothing to read
            if (fqn, offset) in items:
                out.stored_empty.append(DcpChunk(offset, sizes, items[(fqn, offset)]))
            continue
        item = _item(items, fqn, offset, path)
        # A chunk is a torch.save'd tensor of its own (its storage cloned to its numel): its item holds
        # at least its elements' bytes. A claim beyond the item's bytes would size a reader's buffers
        # by the claim, not by what is stored (the items themselves are checked against the files' sizes).
        claimed = math.prod(sizes) * dtype.itemsize
        if claimed > item.length * (ZSTD_RATIO if item.transforms else 1):  # zstd inflates at most ZSTD_RATIO x
            raise FormatError(f"{path}: {fqn!r} chunk at {list(offset)} of shape {list(sizes)} claims {claimed} "
                              f"bytes of {dtype} but its stored item ({item.file!r}) holds {item.length} bytes")
        out.chunks.append(DcpChunk(offset, sizes, item))
    return out
