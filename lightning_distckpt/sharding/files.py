"""Reading an ordinary checkpoint on rank 0: a ``torch.save`` file, a ``.safetensors`` file or a
Hugging Face model directory, memory-mapped so that only the pages actually sent are read."""

from __future__ import annotations

import json
import logging
import os
import pickle
from typing import Dict, List, Mapping, Optional, Union

import torch

from ..comm import get_comm
from ..core.errors import ArgumentError, CheckpointingError, FormatError, UnsafeContentError
from .safetensors_header import read_header

logger = logging.getLogger(__name__)

Device = Union[int, str, torch.device]
DeviceMap = Union[Device, Mapping[str, Device]]

# Hugging Face directory layouts, in the order transformers prefers them.
HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")


class CheckpointStateDict(dict):
    """The state dict read by :func:`load_state_dict` (a plain ``dict`` of tensors), remembering
    where it came from so that errors further on name the file of each key.

    Attributes:
        source: the file or directory given to :func:`load_state_dict`.
        files: the file each key was read from (several for a sharded Hugging Face checkpoint).
    """

    def __init__(self, source: str, files: Dict[str, str], tensors: Dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.source = source
        self.files = files


def load_state_dict(checkpoint_file: Union[str, os.PathLike], device_map: Optional[DeviceMap] = None) -> Dict[str, torch.Tensor]:
    """On global rank 0 the state dict stored in ``checkpoint_file``; ``{}`` on every other rank.

    ``checkpoint_file`` is a ``torch.save`` file (read with ``weights_only=True``: a pickle that
    would run code is refused), a ``.safetensors`` file, or a Hugging Face model directory
    (``model.safetensors.index.json`` / ``pytorch_model.bin.index.json`` with their shard files,
    or a single ``model.safetensors`` / ``pytorch_model.bin``). Tensors are memory-mapped: nothing
    is read until a tensor is used.

    ``device_map`` places tensors: ``None`` keeps them on the CPU (memory-mapped); a device
    (``"cuda:0"``, ``0``, ``torch.device``) moves all of them there; a mapping from module-name
    prefixes to devices moves each tensor to the device of the longest prefix that contains it
    (``""`` matches everything); a tensor no prefix covers is an error.

    Collective when torch.distributed is initialized (every rank calls it): a file rank 0 cannot
    read raises the same :class:`FormatError` on every rank, so no rank waits for a broadcast
    that never comes.
    """
    comm = get_comm()
    path = os.fspath(checkpoint_file)
    state: Dict[str, torch.Tensor] = {}
    error: Optional[BaseException] = None
    if comm.rank == 0:
        try:
            state = _read(path, device_map)
        except CheckpointingError as e:
            error = e
        except OSError as e:
            error = FormatError(f"{path}: cannot be read: {e}")
    comm.agree(f"load_state_dict({path!r}) on rank 0", error, default=FormatError)
    if comm.rank == 0:
        logger.info("load_state_dict: %d tensors from %s", len(state), path)
    return state


def _read(path: str, device_map: Optional[DeviceMap]) -> CheckpointStateDict:
    files: Dict[str, str] = {}
    tensors: Dict[str, torch.Tensor] = {}
    if os.path.isdir(path):
        for file, keys in _hf_files(path).items():
            content = _open(file)
            for key in content if keys is None else keys:
                if key not in content:
                    raise FormatError(f"{file}: tensor {key!r}, listed in the index of {path}, is not in the file")
                tensors[key], files[key] = content[key], file
    elif os.path.exists(path):
        tensors = _open(path)
        files = dict.fromkeys(tensors, path)
    else:
        raise FormatError(f"{path}: no such file or directory")
    if device_map is not None:
        tensors = {k: _place(k, t, device_map) for k, t in tensors.items()}
    return CheckpointStateDict(path, files, tensors)


def _hf_files(directory: str) -> Dict[str, Optional[List[str]]]:
    """{file: its keys (None: all of them)} of a Hugging Face model directory."""
    for index_name in HF_INDEX_FILES:
        index_path = os.path.join(directory, index_name)
        if os.path.exists(index_path):
            return _hf_index(index_path)
    for single in HF_SINGLE_FILES:
        if os.path.exists(os.path.join(directory, single)):
            return {os.path.join(directory, single): None}
    raise FormatError(
        f"{directory}: not a Hugging Face model directory (none of {', '.join(HF_INDEX_FILES + HF_SINGLE_FILES)})")


def _hf_index(index_path: str) -> Dict[str, Optional[List[str]]]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{index_path}: not a Hugging Face index (JSON with a 'weight_map'): {e}") from None
    if not isinstance(weight_map, dict):
        raise FormatError(f"{index_path}: 'weight_map' must map tensor names to file names")
    directory = os.path.dirname(index_path)
    out: Dict[str, Optional[List[str]]] = {}
    for key, name in weight_map.items():
        # A shard file is a plain name in the directory: an index never points elsewhere on disk.
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise FormatError(f"{index_path}: tensor {key!r}: shard file {name!r} is not a file name in {directory}")
        keys = out.setdefault(os.path.join(directory, name), [])
        keys.append(key)  # type: ignore[union-attr]
    return out


def _open(path: str) -> Dict[str, torch.Tensor]:
    return _open_safetensors(path) if path.endswith(".safetensors") else _open_torch(path)


def _open_safetensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors import safe_open

    # FormatError before safe_open sees a bad header; file order, so the map is read front to back.
    entries = sorted(read_header(path), key=lambda e: e.begin)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            # Memory-mapped (private, copy-on-write): pages are read when a tensor is used.
            return {e.name: f.get_tensor(e.name) for e in entries}
    except Exception as e:  # safetensors raises its own SafetensorError (and Rust panics as exceptions)
        raise FormatError(f"{path}: cannot be read as safetensors: {type(e).__name__}: {e}") from None


def _open_torch(path: str) -> Dict[str, torch.Tensor]:
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
            # The legacy (pre-zip, torch < 1.6) format cannot be memory-mapped: read it whole.
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise FormatError(f"{path}: corrupt pickle: {str(e).splitlines()[0][:300]}") from None
        # weights_only refuses any global outside torch's allow-list: the pickle would run code.
        raise UnsafeContentError(
            f"{path}: refused to unpickle (weights_only=True allows tensors, containers and primitives only; "
            f"this file needs code to run): {str(e).splitlines()[0][:300]}") from None
    except Exception as e:  # torch raises RuntimeError / ValueError / EOFError on a truncated or foreign file
        raise FormatError(f"{path}: cannot be read by torch.load (truncated or not a torch file): "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: holds a {type(obj).__name__}, not a state dict (a dict of tensors)")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise FormatError(f"{path}: not a flat state dict: entries {bad[:5]!r} are not str -> tensor "
                          f"(a training checkpoint keeps its weights under a key such as 'state_dict')")
    return obj


def _place(key: str, tensor: torch.Tensor, device_map: DeviceMap) -> torch.Tensor:
    if not isinstance(device_map, Mapping):
        return tensor.to(_device(device_map, "device_map"))
    best = None
    for prefix in device_map:
        if prefix == "" or key == prefix or key.startswith(prefix + "."):
            best = prefix if best is None or len(prefix) > len(best) else best
    if best is None:
        raise ArgumentError(f"device_map covers no prefix of tensor {key!r} (prefixes: {sorted(device_map)[:10]})")
    return tensor.to(_device(device_map[best], f"device_map[{best!r}]"))


def _device(value: Device, what: str) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ArgumentError(f"{what}: {value!r} is not a device: {e}") from None
    if device.type == "meta":
        raise ArgumentError(f"{what}: the meta device holds no data; give a real device")
    return device
