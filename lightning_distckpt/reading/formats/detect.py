"""Which source reads a path: a ``torch.save`` file, a ``.safetensors`` file, a Hugging Face model
directory, a Megatron-Core ``torch_dist`` directory, a PyTorch DCP directory, or (None) our own
checkpoint directory."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Sequence, Set, Union

from ...core.errors import FormatError
from ...storage.layout import parse_json
from ...storage.paths import ANYWHERE, HF_INDEX_CAP, model_root
from .dcp import DcpSource, is_dcp_dir
from .files import SafetensorsFile, TorchFile
from .megatron import MegatronSource, megatron_config
from .model_files import open_model_file, read_model_file
from .tensor_files import IndexedFile, KeyMap, TensorFile, TensorFileSource

HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
# The weights a directory holding several of these is read from: the first present, in the order
# transformers' from_pretrained looks for them (a single model.safetensors wins over any index; a stale
# index save_pretrained leaves beside it, or a .bin set beside a converted one, is not read).
HF_WEIGHTS_ORDER = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")


def detect(path: str, key_map: KeyMap = None,
           extra_safe_globals: Sequence[Any] = ()) -> Optional[Union[TensorFileSource, DcpSource]]:
    """The source for ``path`` when it is a tensor file, a Hugging Face directory, a Megatron-Core
    directory or a DCP directory; None otherwise (then it is read as our own checkpoint directory,
    with its errors)."""
    config = megatron_config(path)  # before DCP: torch_dist is DCP files plus Megatron's own
    if config is not None:
        return MegatronSource(path, config, key_map, extra_safe_globals)
    if is_dcp_dir(path):
        return DcpSource(path, key_map)
    files = open_tensor_files(path, extra_safe_globals)
    if files is None:
        return None
    only = files[0].file if len(files) == 1 and not os.path.isdir(path) else None
    common = only.common if isinstance(only, TorchFile) else {}
    return TensorFileSource(path, files, key_map, common=common)


def is_hf_model_directory(path: str) -> bool:
    """A directory as Hugging Face's ``save_pretrained`` leaves it: ``config.json`` beside
    ``.safetensors`` or ``pytorch_model*.bin`` weights (for messages: what a path is instead)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return "config.json" in names and any(n.endswith(".safetensors")
                                          or (n.startswith("pytorch_model") and n.endswith(".bin"))
                                          for n in names)


def open_tensor_files(path: str, extra_safe_globals: Sequence[Any] = (),
                      mapped: bool = False) -> Optional[List[IndexedFile]]:
    """The tensor files of a file path or of a Hugging Face directory (with the names its index
    assigns to each); None for anything else. A file path given may be a link (the user chose it);
    in a directory, links are followed only inside its root (:func:`model_root`: a Hugging Face
    cache snapshot's root is its cache repo folder), and a special file in a model file's place is
    a FormatError naming it (see :mod:`.model_files`). ``mapped``: see :class:`.files.SafetensorsFile`."""
    if not os.path.isdir(path):
        if not os.path.exists(path):
            return None
        return [IndexedFile(open_file(path, extra_safe_globals, mapped=mapped), None)]  # a FIFO: refused there
    root = model_root(path)
    for name in HF_WEIGHTS_ORDER:
        if not os.path.lexists(os.path.join(path, name)):
            continue
        if name in HF_SINGLE_FILES:
            return [IndexedFile(open_file(os.path.join(path, name), extra_safe_globals, root, mapped), None)]
        index = _index_files(path, name, root)
        opened = [IndexedFile(open_file(f, extra_safe_globals, root, mapped), keys) for f, keys in index.items()]
        return _with_unlisted_tensors(os.path.join(path, name), opened)
    return None


def is_safetensors(path: str, root: str = ANYWHERE) -> bool:
    """By suffix, or by the header: a little-endian length followed by a JSON object."""
    if path.endswith(".safetensors"):
        return True
    with open_model_file(path, "model file", root) as f:
        try:
            head = f.read(9)
        except OSError as e:  # EIO from the device, or a file that refuses reads (/proc/self/mem)
            raise FormatError(f"model file {path} cannot be read: {e.strerror or e}") from None
        size = os.fstat(f.fileno()).st_size
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size


def open_file(path: str, extra_safe_globals: Sequence[Any] = (), root: str = ANYWHERE,
              mapped: bool = False) -> TensorFile:
    """A ``.safetensors`` or ``torch.save`` file; links only inside ``root`` (default: anywhere)."""
    if is_safetensors(path, root):
        return SafetensorsFile(path, root, mapped)
    return TorchFile(path, extra_safe_globals, root)


def _index_files(directory: str, index_name: str, root: str) -> Dict[str, List[str]]:
    """{file: the tensor names the index's ``weight_map`` assigns to it}; the files must be plain
    names inside ``directory`` (links to them are followed only inside ``root``)."""
    index_path = os.path.join(directory, index_name)
    raw = read_model_file(index_path, "Hugging Face index", root, max_bytes=HF_INDEX_CAP)
    index = parse_json(raw, index_path)  # nesting checked before parsing: a deep file is a FormatError
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if weight_map is None:
        raise FormatError(f"{index_path}: not a Hugging Face index (JSON with a 'weight_map')")
    if not isinstance(weight_map, dict):
        raise FormatError(f"{index_path}: 'weight_map' must map tensor names to file names")
    if not weight_map:  # Hugging Face writes an index only for tensors; read, this one would give none
        raise FormatError(f"{index_path}: 'weight_map' is empty: the index names no tensor (damaged?)")
    out: Dict[str, List[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise FormatError(f"{index_path}: tensor {key!r}: shard file {name!r} is not a file name in {directory}")
        full = os.path.join(directory, name)
        if not os.path.lexists(full):
            raise FormatError(f"{index_path}: tensor {key!r}: shard file {name!r} is missing")
        out.setdefault(full, []).append(key)
    _check_all_shards_named(directory, index_path, {os.path.basename(f) for f in out})
    return out


def _with_unlisted_tensors(index_path: str, files: List[IndexedFile]) -> List[IndexedFile]:
    """``files`` with each tensor a shard file holds but the index does not list added to that
    file's keys: transformers loads every tensor of the files an index names, so do we. A tensor the
    index gives to another file is refused (FormatError): two different tensors under one name,
    where Hugging Face writes each once, in the file its index names (a damaged index, or shard
    files from two saves)."""
    assigned = {key: f.path for f, keys in files for key in keys or ()}
    out = []
    for f, keys in files:
        listed = set(keys or ())
        unlisted = [name for name in f.names() if name not in listed]
        for name in unlisted:
            other = assigned.get(name)
            if other is not None:
                raise FormatError(f"{index_path}: shard file {os.path.basename(f.path)!r} holds tensor {name!r}, but "
                                  f"the index gives it to {os.path.basename(other)!r}: the index is damaged or the "
                                  "shard files are from two saves")
        out.append(IndexedFile(f, list(keys or ()) + unlisted) if unlisted else IndexedFile(f, keys))
    return out


_NUMBERED = re.compile(r"(?P<stem>.+)-(?P<i>[0-9]{5})-of-(?P<n>[0-9]{5})(?P<ext>\.\w+)")


def _check_all_shards_named(directory: str, index_path: str, named: Set[str]) -> None:
    """A file of a numbered set the index uses (``model-00002-of-00003.safetensors``) that lies in the
    directory but is given no tensor by the index: the index lost entries (damaged, or left from another
    save), and a read of it would silently miss that file's tensors. Hugging Face's sharding writes a
    file only for tensors it holds."""
    sets = {(m["stem"], m["n"], m["ext"]) for m in map(_NUMBERED.fullmatch, named) if m is not None}
    for name in sorted(os.listdir(directory)) if sets else ():
        m = _NUMBERED.fullmatch(name)
        if m is not None and (m["stem"], m["n"], m["ext"]) in sets and name not in named:
            raise FormatError(f"{index_path}: shard file {name!r} is in the directory, but the index gives it no "
                              "tensor: the index is damaged or from another save")
