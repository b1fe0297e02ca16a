"""Which rows of a tensor its stored shards do not hold: a reader that allocates a tensor of the
global shape an index claims (``load_plain_tensors``, the exports) first checks that the shards
cover it, so that the claim is backed by stored bytes (a 1e11 x 1024 global shape over one small
shard is refused here, not allocated).

Pure functions of a :class:`~lightning_distckpt.planning.metadata.TensorEntry`. Each row of dim 0
is covered when the shards crossing it hold at least a row's worth of elements there (a sweep over
the shards' row ranges; flattened shards count the part of each row they hold). Overlapping shards
could make a row look covered that is not: the reader still allocates no more than the shards'
bytes, which the stores' sizes back.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Dict, List, Sequence, Tuple

from ..core.errors import FormatError
from .tiling import overlapping_pairs

Rows = Tuple[int, int]  # [start, stop) of dim 0


def uncovered_rows(entry: Any) -> List[Rows]:
    """The row ranges of ``entry``'s global tensor that its stored shards do not fully hold, in
    order (for a 0-d tensor, ``[(0, 1)]`` when nothing is stored)."""
    shape = tuple(entry.global_shape)
    if math.prod(shape) == 0:
        return []
    if entry.even is not None:
        return []  # the chunks of an even split tile dim 0 by construction
    if not shape:
        return [] if any(s.numel > 0 for s in entry.shards) else [(0, 1)]
    per_row = math.prod(shape[1:])
    full: Dict[int, int] = defaultdict(int)  # row -> change of the elements held per row from there on
    partial: Dict[int, int] = defaultdict(int)  # row -> elements held in that row alone
    for s in entry.shards:
        _add(s, full, partial)
    return _gaps(shape[0], per_row, full, partial)


def _add(shard: Any, full: Dict[int, int], partial: Dict[int, int]) -> None:
    """Record what ``shard`` holds: whole rows of its box (or of its flat range's part of it)."""
    first, rows = shard.offset[0], shard.shape[0]
    width = math.prod(shard.shape[1:])
    if rows == 0 or width == 0:
        return
    lo, hi = (0, rows * width) if shard.flat is None else shard.flat
    if hi <= lo:
        return
    a, b = -(-lo // width), hi // width  # the box's rows held whole: [a, b)
    if a < b:
        full[first + a] += width
        full[first + b] -= width
    if lo // width == (hi - 1) // width and not (a < b):  # inside one row of the box
        partial[first + lo // width] += hi - lo
        return
    if lo % width:
        partial[first + lo // width] += width - lo % width
    if hi % width:
        partial[first + hi // width] += hi % width


def _gaps(nrows: int, per_row: int, full: Dict[int, int], partial: Dict[int, int]) -> List[Rows]:
    """The rows of ``[0, nrows)`` holding fewer than ``per_row`` elements, merged into ranges."""
    cuts = sorted({0, nrows, *(r for r in full if 0 <= r <= nrows), *(r for r in partial if 0 <= r < nrows)})
    out: List[Rows] = []
    held = sum(d for r, d in full.items() if r < 0)
    for start, stop in zip(cuts, cuts[1:]):
        held += full.get(start, 0)
        if start in partial:  # one row with its own count, then the rest of the segment
            if held + partial[start] < per_row:
                _push(out, start, start + 1)
            start += 1
        if start < stop and held < per_row:
            _push(out, start, stop)
    return out


def _push(out: List[Rows], start: int, stop: int) -> None:
    if out and out[-1][1] == start:
        out[-1] = (out[-1][0], stop)
    else:
        out.append((start, stop))


def describe_rows(ranges: List[Rows], limit: int = 3) -> str:
    """``rows [0, 5), [9, 10) and 2 more ranges`` (at most ``limit`` shown)."""
    shown = ", ".join(f"[{a}, {b})" for a, b in ranges[:limit])
    more = f" and {len(ranges) - limit} more range(s)" if len(ranges) > limit else ""
    return f"rows {shown}{more}"


def check_disjoint(shards: Sequence[Any], key: str, checkpoint_dir: str) -> None:
    """The stored shards a read plan takes elements from hold no element twice. The plans count the
    elements the shards give and compare with what was asked for: shards that overlap (a
    metadata.json that lies) would make up for a gap of the same size, leaving part of the
    destination unread (the template's values, or uninitialized memory) with no error. FormatError
    naming the key and two overlapping shards. Shards of one box (flattened pieces) overlap where
    their flat ranges do; shards of different boxes where the boxes do (``tiling.overlapping_pairs``)."""
    if len(shards) < 2:
        return
    boxes: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], List[Any]] = defaultdict(list)
    for s in shards:
        boxes[(tuple(s.offset), tuple(s.shape))].append(s)
    for pieces in boxes.values():
        ordered = sorted(pieces, key=lambda p: p.flat or (0, math.prod(p.shape)))
        for a, b in zip(ordered, ordered[1:]):
            if a.flat is None or b.flat is None or b.flat[0] < a.flat[1]:
                _overlap(a, b, key, checkpoint_dir)
    keys = list(boxes)
    pairs = overlapping_pairs(keys)
    if pairs:
        i, j = pairs[0]
        _overlap(boxes[keys[i]][0], boxes[keys[j]][0], key, checkpoint_dir)


def _overlap(a: Any, b: Any, key: str, checkpoint_dir: str) -> None:
    def shown(s: Any) -> str:
        flat = f" flat {s.flat[0]}:{s.flat[1]}" if s.flat else ""
        return f"offset {tuple(s.offset)} shape {tuple(s.shape)}{flat} (written by rank {s.writer})"

    raise FormatError(f"checkpoint {checkpoint_dir}: metadata.json: {key!r}: stored shards overlap: {shown(a)} and "
                      f"{shown(b)}; the checkpoint is corrupt (nothing was read for it)")
