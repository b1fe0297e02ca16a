"""Which source reads a path: a ``torch.save`` file, a ``.safetensors`` file, a Hugging Face model
directory, a PyTorch DCP directory, or (None) our own checkpoint directory."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from ...core.errors import FormatError
from .dcp import DcpSource, is_dcp_dir
from .files import SafetensorsFile, TorchFile
from .tensor_files import KeyMap, TensorFile, TensorFileSource

HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_MAX_INDEX_BYTES = 64 << 20


def detect(path: str, key_map: KeyMap = None,
           extra_safe_globals: Sequence[Any] = ()) -> Optional[Union[TensorFileSource, DcpSource]]:
    """The source for ``path`` when it is a tensor file, a Hugging Face directory or a DCP directory
    (one holding DCP's ``.metadata``); None otherwise (then it is read as our own checkpoint
    directory, with that format's errors)."""
    if os.path.isfile(path):
        file = _open_file(path, extra_safe_globals)
        return TensorFileSource(path, [file], key_map, common=file.common if isinstance(file, TorchFile) else {})
    if not os.path.isdir(path):
        return None
    if is_dcp_dir(path):
        return DcpSource(path, key_map)
    for name in HF_INDEXES:
        if os.path.isfile(os.path.join(path, name)):
            files = [_open_file(f, extra_safe_globals) for f in _index_files(path, name)]
            return TensorFileSource(path, files, key_map)
    for name in HF_SINGLE_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return TensorFileSource(path, [_open_file(os.path.join(path, name), extra_safe_globals)], key_map)
    return None


def is_safetensors(path: str) -> bool:
    """By suffix, or by the header: a little-endian length followed by a JSON object."""
    if path.endswith(".safetensors"):
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(path)


def _open_file(path: str, extra_safe_globals: Sequence[Any]) -> TensorFile:
    return SafetensorsFile(path) if is_safetensors(path) else TorchFile(path, extra_safe_globals)


def _index_files(directory: str, index_name: str) -> List[str]:
    """The files an index's ``weight_map`` names: plain names inside ``directory`` only."""
    index_path = os.path.join(directory, index_name)
    if os.path.getsize(index_path) > _MAX_INDEX_BYTES:
        raise FormatError(f"{index_path}: larger than {_MAX_INDEX_BYTES >> 20} MiB; not an index")
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map: Dict[str, Any] = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{index_path}: malformed index ({type(e).__name__}: {e})") from None
    for name in names:
        if not isinstance(name, str) or os.path.basename(name) != name or name in (".", ".."):
            raise FormatError(f"{index_path}: weight_map names {name!r}, not a file of this directory")
        full = os.path.join(directory, name)
        if os.path.islink(full) or not os.path.isfile(full):
            raise FormatError(f"{index_path}: weight_map names {name!r}, which is missing or a symlink")
    return [os.path.join(directory, n) for n in names]
