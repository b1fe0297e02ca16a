"""A tensor's bytes as a flat uint8 tensor, for code that moves or checksums bytes whatever the dtype."""

from __future__ import annotations

import torch


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy): collectives and checksums move bytes, so
    any dtype goes over any backend."""
    # Not t.reshape(-1): torch calls a tensor contiguous whatever the strides of its size-1 axes
    # (one element, stride 2: a view of every other element), reshape keeps such a stride and
    # view(uint8) refuses it. Contiguous, the elements are numel() consecutive ones from the offset.
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)
