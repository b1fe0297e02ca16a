"""Reading an ordinary checkpoint on rank 0: a ``torch.save`` file, a ``.safetensors`` file or a
Hugging Face model directory, memory-mapped so that only the pages actually sent are read."""

from __future__ import annotations

import logging
import os
from typing import Dict, Mapping, Optional, Union

import torch

from ..comm import get_comm
from ..core.errors import ArgumentError, CheckpointingError, FormatError
from ..reading.formats.detect import HF_INDEXES, HF_SINGLE_FILES, open_tensor_files
from ..reading.formats.files import TorchFile
from ..reading.formats.tensor_files import check_key
from ..storage.paths import local_path

logger = logging.getLogger(__name__)

Device = Union[int, str, torch.device]
DeviceMap = Union[Device, Mapping[str, Device]]

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


def load_state_dict(checkpoint_file: Union[str, os.PathLike],
                    device_map: Optional[DeviceMap] = None) -> Dict[str, torch.Tensor]:
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
    path = local_path(checkpoint_file, "checkpoint_file")
    state: Dict[str, torch.Tensor] = {}
    error: Optional[BaseException] = None
    if comm.rank == 0:
        try:
            state = _read(path, device_map)
        except CheckpointingError as e:
            error = e
        except OSError as e:
            error = FormatError(f"{path}: cannot be read: {e}")
        except Exception as e:  # MemoryError, ...: reported through the collective the other ranks wait in
            error = FormatError(f"{path}: cannot be read: {type(e).__name__}: {e}")
    comm.agree(f"load_state_dict({path!r}) on rank 0", error, default=FormatError)
    if comm.rank == 0:
        logger.info("load_state_dict: %d tensors from %s", len(state), path)
    return state


def _read(path: str, device_map: Optional[DeviceMap]) -> CheckpointStateDict:
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such file or directory")
    opened = open_tensor_files(path, mapped=True)  # views of the files' memory maps: nothing read until used
    if opened is None:
        raise FormatError(f"{path}: not a Hugging Face model directory "
                          f"(none of {', '.join(HF_INDEXES + HF_SINGLE_FILES)})")
    files: Dict[str, str] = {}
    tensors: Dict[str, torch.Tensor] = {}
    for f, listed in opened:
        if isinstance(f, TorchFile) and not f.is_state_dict:
            raise FormatError(f"{f.path}: holds a {f.payload_type}, not a flat state dict of name -> tensor "
                              "(a training "
                              f"checkpoint keeps its weights under a key such as 'state_dict': ldc.load reads those)")
        present = set(f.names())
        for key in f.names() if listed is None else listed:
            if key not in present:
                raise FormatError(f"{f.path}: tensor {key!r}, listed in the index of {path}, is not in the file")
            check_key(f.path, key, key)  # the error ldc.load and load_plain_tensors give: '' is no key
            tensors[key], files[key] = f.read(key, ()), f.path  # views of the file's memory map
    if device_map is not None:
        tensors = {k: _place(k, t, device_map) for k, t in tensors.items()}
    return CheckpointStateDict(path, files, tensors)


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
