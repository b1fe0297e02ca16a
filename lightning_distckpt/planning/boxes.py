"""Box geometry shared by the read planners: a box is (offset, shape) in global coordinates."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def intersect(a_off: Sequence[int], a_shape: Sequence[int],
              b_off: Sequence[int], b_shape: Sequence[int]) -> Optional[Box]:
    """Intersection of two boxes as (offset, shape), or None when empty."""
    lo = [max(a, b) for a, b in zip(a_off, b_off)]
    hi = [min(a + sa, b + sb) for a, sa, b, sb in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))
