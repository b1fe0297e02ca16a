"""CRC-32C of each tensor in the ``.safetensors`` files we write, checked when they are read back.

The safetensors format holds no checksum: a changed byte inside a tensor's data reads back as a
value. Files written by :mod:`lightning_distckpt.export` record each tensor's CRC-32C in the header's
``__metadata__`` (a string map: one JSON object under :data:`CRC_KEY`); other readers ignore it. Our
reader checks every tensor it reads against it, reading a tensor whole where a load asks for a slice
(a slice cannot be checked alone); ``LIGHTNING_DISTCKPT_VERIFY=0`` skips the check (and slices read
only their bytes).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Optional

import torch

from ..core.tensor_bytes import byte_view
from ..core.errors import FormatError
from .checksums import verification_enabled
from .chunk_checksums import crc32c
from .json_bounds import parse_json

CRC_KEY = "lightning_distckpt.crc32c"


def tensor_crc(t: torch.Tensor) -> int:
    """CRC-32C of the tensor's bytes in row-major order (as safetensors stores them)."""
    return crc32c(byte_view(t.detach().contiguous()).numpy())  # byte_view: a one-element view may have any stride


def crc_metadata(tensors: Mapping[str, torch.Tensor]) -> Dict[str, str]:
    """The ``__metadata__`` entry recording every tensor's CRC-32C."""
    return {CRC_KEY: json.dumps({name: tensor_crc(t) for name, t in tensors.items()}, separators=(",", ":"))}


def recorded_crcs(metadata: Optional[Mapping[str, Any]], where: str) -> Dict[str, int]:
    """The CRC-32Cs a file's ``__metadata__`` records (none for a file we did not write)."""
    raw = (metadata or {}).get(CRC_KEY)
    if raw is None:
        return {}
    try:  # checked as any JSON from disk is: a text of empty lists parses into 22 bytes a byte
        crcs = parse_json(raw.encode("utf-8", "surrogatepass"), where) if isinstance(raw, str) else None
    except FormatError:
        crcs = None
    if not isinstance(crcs, dict) or not all(
            isinstance(k, str) and type(v) is int and 0 <= v < 1 << 32 for k, v in crcs.items()):
        raise FormatError(f"{where}: malformed {CRC_KEY} in the header's __metadata__ (a JSON object of "
                          "tensor name -> CRC-32C expected)")
    return crcs


def check_tensor(name: str, t: torch.Tensor, crcs: Mapping[str, int], where: str) -> None:
    """Raise a FormatError naming the tensor unless its bytes match the CRC-32C recorded for it."""
    expected = crcs.get(name)
    if expected is not None and verification_enabled() and tensor_crc(t) != expected:
        raise FormatError(f"{where}: tensor {name!r} is damaged: its bytes do not match the CRC-32C recorded "
                          "when lightning_distckpt wrote the file")
