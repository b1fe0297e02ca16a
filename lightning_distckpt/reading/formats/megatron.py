"""A Megatron-Core ``torch_dist`` checkpoint (``megatron.core.dist_checkpointing.save``) as a
checkpoint source.

Layout: Megatron's ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (the
common state, ``torch.save``), and a PyTorch DCP checkpoint (``.metadata`` + ``.distcp`` files)
holding every ShardedTensor under its key and every ShardedObject as a DCP bytes entry named by
Megatron's unique key ``<key>/shard_<offset>_<global shape>`` (``torch.save`` of a one-element list).

Tensors are read by the DCP source (any split, byte ranges only). Objects become ShardedObject
entries of the index (keys, offsets and global shapes from their names); the common state is
``common.pt``, read with ``weights_only`` (Megatron-LM's own common state holds an
``argparse.Namespace``: pass ``extra_safe_globals=[argparse.Namespace]`` if the checkpoint is
trusted; importing megatron-core allows it in torch itself). Refused with a :class:`FormatError`
naming what and why: other backends (``zarr``), and tensors Megatron-Core <= 0.15 stored in the N-D reformulated
flattened form of the distributed
optimizer (``nd_reformulated_orig_global_shape``): only the fully reshardable form is read. A
``metadata.json`` beside DCP files that is not Megatron's config (over 1 MiB, not JSON, without
``sharded_backend``) and an object name whose numbers are not ASCII digits (at most 18) are
FormatErrors too: never a read as plain DCP, never a number Python cannot convert.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from ...core.errors import FormatError
from ...planning.metadata import ObjectEntry, StoredObject
from ...storage.layout import parse_json
from ...storage.paths import MEGATRON_CONFIG_CAP, model_root
from ...storage.safe_pickle import dumps, load_file, loads
from .dcp import DcpReader, DcpSource, is_dcp_dir
from .dcp_metadata import METADATA_NAME, DcpItem, shown_value
from .model_files import read_model_file
from .tensor_files import KeyMap, map_key

CONFIG_NAME = "metadata.json"
COMMON_NAME = "common.pt"
TORCH_DIST = "torch_dist"
# Megatron-Core's ShardedObject.unique_key: <key>/shard_<offset, dot-separated>_<global shape>
# Numbers of ASCII digits, at most _MAX_DIGITS each (int(): no ValueError past 4300 digits, no other
# scripts' digits); the whole name matched (fullmatch: "$" also matches before a final newline).
_MAX_DIGITS = 18
_NUMBER = rf"[0-9]{{1,{_MAX_DIGITS}}}"
_NUMBERS = rf"{_NUMBER}(?:\.{_NUMBER})*"
_UNIQUE_KEY = re.compile(rf"(?P<key>.+)/shard_(?P<offset>{_NUMBERS})_(?P<shape>{_NUMBERS})")
_CONFIG_FIELDS = {"sharded_backend": str, "sharded_backend_version": int, "common_backend": str,
                  "common_backend_version": int}


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-Core's ``metadata.json`` (its ``CheckpointingConfig``)."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def megatron_config(path: str) -> Optional[MegatronConfig]:
    """The Megatron-Core config of directory ``path``; None when its ``metadata.json`` is missing or,
    in a directory without DCP's ``.metadata``, not Megatron's (ours is also named ``metadata.json``:
    Megatron's has ``sharded_backend``). Beside DCP files, a ``metadata.json`` can only be Megatron's:
    one that is too large, unreadable or not its config is a FormatError naming it, never a read of
    the directory as plain DCP (which would silently drop ``common.pt``, the common state)."""
    config = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(path) or not os.path.lexists(config):
        return None
    if not is_dcp_dir(path):
        return _config_beside_ours(path, config)
    what = "Megatron-Core config"  # beside DCP files: a special file, a link out, too many bytes are refused
    raw = parse_json(read_model_file(config, what, model_root(path), MEGATRON_CONFIG_CAP), config)
    if not isinstance(raw, dict) or "sharded_backend" not in raw:
        raise FormatError(f"{what} {config}: not Megatron-Core's config (a JSON object with 'sharded_backend'), "
                          f"beside DCP's {METADATA_NAME}: damaged, or another tool's file; the directory is not "
                          "read as plain DCP, which would drop Megatron's common state")
    return _config_fields(raw, config)


def _config_beside_ours(path: str, config: str) -> Optional[MegatronConfig]:
    """``metadata.json`` of a directory without DCP files: Megatron's config (then the DCP reader
    says what is missing), or None for anything else (ours: our own reader says what is wrong with it)."""
    if os.path.isfile(config) and os.path.getsize(config) > MEGATRON_CONFIG_CAP.limit():
        return None  # ours may be large: never read twice
    # A special file or a link out of the directory is a FormatError naming it (never a wait). Ours is
    # also named metadata.json: a link to a file inside the directory is read here, and refused by
    # our own reader if the directory is ours.
    text = read_model_file(config, CONFIG_NAME, model_root(path), MEGATRON_CONFIG_CAP)
    if b"sharded_backend" not in text and b"\\u" not in text:
        return None  # not Megatron's (its key, unescaped, is not there): ours is parsed once, by our reader
    try:
        # Nesting bounded before parsing: a hostile metadata.json (ours or Megatron's) must not
        # drive the JSON parser into deep recursion.
        raw = parse_json(text, config)
    except FormatError:
        return None  # not Megatron's config: our own reader says what is wrong with it
    if not isinstance(raw, dict) or "sharded_backend" not in raw:
        return None
    return _config_fields(raw, config)


def _config_fields(raw: Dict[str, Any], config: str) -> MegatronConfig:
    """Megatron's ``CheckpointingConfig`` fields, each of its type (other keys are left alone)."""
    fields = {}
    for name, kind in _CONFIG_FIELDS.items():
        if name not in raw:
            continue
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise FormatError(f"{config}: {name} must be {'a string' if kind is str else 'an integer'}, "
                              f"got {_short(value)}")
        fields[name] = value
    return MegatronConfig(**fields)


def _short(value: Any) -> str:
    """``repr(value)``, cut to 80 characters: a hostile name may be megabytes long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_unique_key(name: str) -> Optional[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]:
    """(key, offset, global shape) of a ShardedObject's unique key; None if ``name`` is not one:
    numbers of ASCII digits only (``int`` would also take other scripts' digits), at most
    :data:`_MAX_DIGITS` each (a longer one is no size any checkpoint has, and ``int`` refuses
    more than 4300 digits with a ValueError)."""
    m = _UNIQUE_KEY.fullmatch(name)
    if m is None:
        return None
    offset = tuple(int(i) for i in m["offset"].split("."))
    shape = tuple(int(i) for i in m["shape"].split("."))
    if len(offset) != len(shape) or any(o >= s for o, s in zip(offset, shape)):
        return None
    return m["key"], offset, shape


def unique_key(key: str, offset: Sequence[int], shape: Sequence[int]) -> str:
    """Megatron-Core's name of one ShardedObject element (the inverse of :func:`parse_unique_key`)."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


class MegatronSource(DcpSource):
    """A :class:`~lightning_distckpt.reading.checkpoint.CheckpointSource` over a Megatron-Core
    ``torch_dist`` directory: tensors and ShardedObjects with Megatron's keys, ``common.pt`` as
    the common state."""

    def __init__(self, path: str, config: MegatronConfig, key_map: KeyMap = None,
                 extra_safe_globals: Sequence[Any] = ()) -> None:
        where = os.path.join(path, CONFIG_NAME)
        if config.sharded_backend != TORCH_DIST:
            raise FormatError(f"{path}: a Megatron-Core checkpoint with sharded_backend "
                              f"{config.sharded_backend!r} ({where}); lightning_distckpt reads only "
                              f"{TORCH_DIST!r} (re-save it with Megatron-Core's torch_dist backend)")
        if config.common_backend != "torch":
            raise FormatError(f"{path}: common_backend {config.common_backend!r} ({where}); only 'torch' "
                              "(common.pt) is read")
        super().__init__(path, key_map=None)  # objects are renamed below, by their parsed key
        self._common = self._optional_file(COMMON_NAME)
        if self._common is None:
            raise FormatError(f"{path}: a Megatron-Core checkpoint without {COMMON_NAME} (incomplete or damaged: "
                              "Megatron writes it before metadata.json)")
        self._extra_safe_globals = tuple(extra_safe_globals)
        self._refuse_reformulated()
        self._rename_tensors(key_map)
        self._object_items: Dict[Tuple[str, int], Tuple[str, DcpItem]] = {}
        self._index_objects(key_map)

    def _refuse_reformulated(self) -> None:
        for fqn, notes in self._mcore_data.items():
            if isinstance(notes, dict) and notes.get("nd_reformulated_orig_global_shape") is not None:
                raise FormatError(
                    f"{self.path}: tensor {shown_value(fqn)} is stored in Megatron-Core's N-D reformulated flattened "
                    f"form (distributed-optimizer state of Megatron-Core <= 0.15, original shape "
                    f"{shown_value(notes['nd_reformulated_orig_global_shape'])}), which lightning_distckpt does "
                    "not reshard; re-save the optimizer with the 'fully_reshardable' sharding type")

    def _rename_tensors(self, key_map: KeyMap) -> None:
        if key_map is None:
            return
        tensors, chunks = self.index.tensors, self._chunks
        self.index.tensors, self._chunks = {}, {}
        for key, entry in tensors.items():
            new = map_key(key_map, key)
            if new is None:
                continue
            if new in self.index.tensors:
                raise FormatError(f"{self.path}: two tensors map to key {new!r} (one is {key!r}); fix key_map")
            self.index.tensors[new], self._chunks[new] = entry, chunks[key]

    def _index_objects(self, key_map: KeyMap) -> None:
        """DCP's bytes entries are Megatron's ShardedObject elements: index them by parsed key."""
        entries = dict(self._objects)
        self._objects = {}  # none of them is common state
        writer_of = {rel: i for i, rel in enumerate(self._files)}
        # an element named twice (a number with leading zeros, or key_map joining two keys) would load
        # one of two values silently; Megatron names each element once, exactly as unique_key writes it
        named: Dict[Tuple[str, Tuple[int, ...]], str] = {}
        for fqn, (_, item) in sorted(entries.items()):
            parsed = parse_unique_key(fqn)
            if parsed is None:
                raise FormatError(f"{self.path}: DCP bytes entry {_short(fqn)} is not a Megatron-Core ShardedObject "
                                  f"(<key>/shard_<offset>_<shape>, numbers of at most {_MAX_DIGITS} ASCII digits, "
                                  "each offset below its size)")
            raw_key, offset, shape = parsed
            key = map_key(key_map, raw_key)
            if key is None:
                continue
            if key in self.index.tensors:
                raise FormatError(f"{self.path}: {key!r} names both a tensor and a ShardedObject")
            first = named.setdefault((key, offset), fqn)
            if first != fqn:
                raise FormatError(f"{self.path}: DCP bytes entries {_short(first)} and {_short(fqn)} are both element "
                                  f"{list(offset)} of ShardedObject {key!r}: which one is meant?")
            entry = self.index.objects.setdefault(key, ObjectEntry(shape))
            if entry.global_shape != shape:
                raise FormatError(f"{self.path}: ShardedObject {key!r} elements disagree on the global shape "
                                  f"({list(entry.global_shape)} and {list(shape)})")
            index = len(entry.shards)
            entry.shards.append(StoredObject(offset, writer_of[item.file], index))
            self._object_items[(key, index)] = (fqn, item)

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        """``common.pt``, deserialized with ``weights_only`` (no code from the checkpoint runs)."""
        return load_file(self._common, tuple(extra_safe_globals) or self._extra_safe_globals, self.root)

    def object_bytes(self, key: str, index: int) -> bytes:
        """One ShardedObject element as ``torch.save`` bytes of its value. Megatron stores a list of
        the element's copies (one with main-replica saving); the first is the value."""
        fqn, item = self._object_items[(key, index)]
        with self.open_file(self.full_path(item.file)) as f:
            blob = self.read_item(f, item, None, f"ShardedObject {fqn!r}")
        where = f"{self.full_path(item.file)}: ShardedObject {fqn!r}"
        value = loads(blob, where, self._extra_safe_globals)
        if not isinstance(value, list) or not value:
            raise FormatError(f"{where}: holds a {type(value).__name__}, not Megatron-Core's list of the element")
        return dumps(value[0])

    def reader(self) -> "MegatronReader":
        return MegatronReader(self)


class MegatronReader(DcpReader):
    """Tensor pieces as the DCP reader reads them; ShardedObject elements from their bytes entries."""

    def __init__(self, source: MegatronSource) -> None:
        super().__init__(source)
        self._megatron = source

    def read_object(self, writer: int, key: str, index: int) -> bytes:
        return self._megatron.object_bytes(key, index)
