"""Which boxes of a set overlap, in O(B log B) for the layouts sharding produces.

Validation asks this of the main replicas of every tensor: with B boxes (one per rank of an FSDP
group, say) comparing all pairs costs B^2 / 2 tests, 8 million at 4,096 ranks. Here:

- **grid cells** (every regular split: dim-0 or dim-1 sharding, TP x FSDP grids, uneven splits):
  the boxes' offsets and ends cut each axis into intervals; when every box is exactly one cell of
  the grid those cuts make, distinct boxes are distinct cells and none overlap. One sort per axis.
- **otherwise** a sweep along the axis where offsets are most spread: boxes in order of their
  start there, each compared only with the boxes still open at its start (a heap by end). Exact
  for any boxes; its cost grows with how many boxes are open at once, one or a few for shardings.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from typing import Dict, List, Sequence, Tuple

from .boxes import Box


def overlapping_pairs(boxes: Sequence[Box]) -> List[Tuple[int, int]]:
    """Every pair ``(i, j)``, ``i < j``, of distinct boxes that share an element, in sorted order
    (the order comparing all pairs would report them in)."""
    if len(boxes) < 2 or _grid_cells(boxes):
        return []
    return sorted(_sweep(boxes))


def _grid_cells(boxes: Sequence[Box]) -> bool:
    """True when each box spans exactly one interval between consecutive cuts on every axis."""
    for axis in range(len(boxes[0][0])):
        cuts = sorted({off[axis] for off, _ in boxes} | {off[axis] + shape[axis] for off, shape in boxes})
        for off, shape in boxes:
            at = bisect_left(cuts, off[axis])
            if at + 1 >= len(cuts) or cuts[at + 1] != off[axis] + shape[axis]:
                return False
    return True


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def _sweep(boxes: Sequence[Box]) -> List[Tuple[int, int]]:
    ndim = len(boxes[0][0])
    if ndim == 0:
        return []  # distinct boxes of a scalar cannot exist
    axis = max(range(ndim), key=lambda d: len({off[d] for off, _ in boxes}))
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][axis])
    open_ends: List[Tuple[int, int]] = []  # (end on the axis, box): boxes that may reach later starts
    open_boxes: Dict[int, None] = {}
    pairs: List[Tuple[int, int]] = []
    for i in order:
        start = boxes[i][0][axis]
        while open_ends and open_ends[0][0] <= start:  # ends at or before this start: overlaps nothing later
            open_boxes.pop(heapq.heappop(open_ends)[1], None)
        pairs += [(min(i, j), max(i, j)) for j in open_boxes if _overlap(boxes[i], boxes[j])]
        open_boxes[i] = None
        heapq.heappush(open_ends, (boxes[i][0][axis] + boxes[i][1][axis], i))
    return pairs
