"""The tensor files we read: ``.safetensors`` (through ``safetensors.safe_open``: only the slice's
bytes are read) and ``torch.save`` files (``weights_only``, memory-mapped: only the pages of the
slice are touched)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ...core.errors import FormatError
from ...storage.safe_pickle import load_file

_SAFETENSORS_DTYPES: Dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}


class SafetensorsFile:
    """A ``.safetensors`` file; the library checks its header (offsets inside the file, no overlaps)
    when it is opened, before any tensor is read."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # SafetensorError: header too large, offsets past the end, overlaps, ...
            raise FormatError(f"{path}: not a valid safetensors file: {e}") from None

    def names(self) -> List[str]:
        return list(self._file.keys())

    def shape_dtype(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        piece = self._file.get_slice(name)
        dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise FormatError(f"{self.path}: tensor {name!r} has dtype {piece.get_dtype()}, which lightning_distckpt "
                              f"cannot load (supported: {sorted(_SAFETENSORS_DTYPES)})")
        return tuple(int(n) for n in piece.get_shape()), dtype

    def read(self, name: str, src: Tuple[slice, ...]) -> torch.Tensor:
        if not src:
            return self._file.get_tensor(name)
        return self._file.get_slice(name)[src]


class TorchFile:
    """A ``torch.save`` file: every tensor leaf is named by its path, ``/``-joined (a plain state dict
    keeps its keys: ``"fc.weight"``; a Lightning checkpoint gives ``"state_dict/fc.weight"``); the
    rest (epochs, loops, hyperparameters) is the common state."""

    def __init__(self, path: str, extra_safe_globals: Sequence[Any] = ()) -> None:
        self.path = path
        self.tensors: Dict[str, torch.Tensor] = {}
        self.common = _split_tensors(load_file(path, extra_safe_globals), (), self.tensors)

    def names(self) -> List[str]:
        return list(self.tensors)

    def shape_dtype(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        t = self.tensors[name]
        return tuple(t.shape), t.dtype

    def read(self, name: str, src: Tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][src]


_DROP = object()


def _split_tensors(node: Any, path: Tuple[str, ...], out: Dict[str, torch.Tensor]) -> Any:
    """Move the tensor leaves of ``node`` into ``out`` by path; return what is left (containers
    left empty are dropped, except at the top)."""
    if isinstance(node, torch.Tensor):
        name = "/".join(path)
        if name in out:
            raise FormatError(f"two tensors of the file are both named {name!r}")
        out[name] = node
        return _DROP
    if isinstance(node, dict):
        kept = {k: _split_tensors(v, path + (str(k),), out) for k, v in node.items()}
        kept = {k: v for k, v in kept.items() if v is not _DROP}
        return kept if kept or not path or not node else _DROP
    if isinstance(node, (list, tuple)):
        parts = [_split_tensors(v, path + (str(i),), out) for i, v in enumerate(node)]
        if all(p is _DROP for p in parts) and node:
            return _DROP
        return type(node)(None if p is _DROP else p for p in parts) if isinstance(node, tuple) else \
            [None if p is _DROP else p for p in parts]
    return node
