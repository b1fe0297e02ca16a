"""The tensor files we read: ``.safetensors`` (through ``safetensors.safe_open``: only the slice's
bytes are read) and ``torch.save`` files (``weights_only``, memory-mapped: only the pages of the
slice are touched). Both :func:`ldc.load <lightning_distckpt.load>` and the rank-0 API
(:mod:`lightning_distckpt.sharding`) open files through these classes."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ...core.errors import FormatError
from ...storage.safe_pickle import load_file
from .safetensors_header import read_header


class SafetensorsFile:
    """A ``.safetensors`` file: its header is checked against the file's size first
    (:func:`~lightning_distckpt.reading.formats.safetensors_header.read_header`: truncation, offsets
    past the end or overlapping, unknown dtypes are FormatErrors naming the tensor); then the
    library reads: tensors are views of its memory map, slices read only their bytes."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        self._entries = {e.name: e for e in sorted(read_header(path), key=lambda e: e.begin)}
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # SafetensorError (and Rust panics surfacing as exceptions)
            raise FormatError(f"{path}: cannot be read as safetensors: {type(e).__name__}: {e}") from None

    def names(self) -> List[str]:
        return list(self._entries)  # file order: reading them in turn reads the map front to back

    def shape_dtype(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        entry = self._entries[name]
        return entry.shape, entry.dtype

    def read(self, name: str, src: Tuple[slice, ...]) -> torch.Tensor:
        if not src:
            return self._file.get_tensor(name)
        return self._file.get_slice(name)[src]


class TorchFile:
    """A ``torch.save`` file: every tensor leaf is named by its path, ``/``-joined (a plain state dict
    keeps its keys: ``"fc.weight"``; a Lightning checkpoint gives ``"state_dict/fc.weight"``); the
    rest (epochs, loops, hyperparameters) is the common state."""

    def __init__(self, path: str, extra_safe_globals: Sequence[Any] = ()) -> None:
        self._take(path, load_file(path, extra_safe_globals))

    @classmethod
    def from_payload(cls, path: str, payload: Any) -> "TorchFile":
        """The file at ``path`` already unpickled (by ``load_file``) as ``payload``: a restore that
        needs the payload itself too unpickles the file once."""
        file = cls.__new__(cls)
        file._take(path, payload)
        return file

    def _take(self, path: str, payload: Any) -> None:
        self.path = path
        self.tensors: Dict[str, torch.Tensor] = {}
        # A plain state dict: a dict of name -> tensor and nothing else (what the rank-0 API takes).
        self.payload_type = type(payload).__name__
        self.is_state_dict = isinstance(payload, dict) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload.items())
        self.common = _split_tensors(payload, (), self.tensors)

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
