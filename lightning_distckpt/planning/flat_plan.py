"""What to read for flattened (distributed-optimizer) shards: pure planning, no files.

Geometry. A shard is a *box* (offset, shape) of the global tensor, in global axes. A flattened
piece holds elements ``[a, b)`` of its box in row-major order; on disk it is a 1-D array. A
request is a box too, either whole or a flat range ``[c, d)`` of it, read into a 1-D buffer
("dest-flat": the request box in row-major order, minus ``c``).

Boxes that are sub-boxes of one another order their elements the same way (lexicographically
in global coordinates), which gives the plan its shape: for a request R and a stored shard S,

1. ``X = R ∩ S`` is a box; the elements of X that both flat ranges keep form ONE contiguous run
   ``[lo, hi)`` of X's own row-major order (each range is a lexicographic interval);
2. that run decomposes into at most ``2 * ndim - 1`` boxes (a partial head row, whole rows, a
   partial tail row, recursively); each is read with one strided copy;
3. a box contiguous in S's flat order is one contiguous span of the stored 1-D array; a box
   that is not (the request is narrower than S in a trailing axis, e.g. after a TP change) is
   read as a few spans covering it, splitting it along leading axes only until the bytes read
   stay within ``2 x needed + slack``: each rank reads about what it needs, never whole
   tensors to keep a slice.

All arithmetic is per axis or vectorised with numpy (span starts of many rows at once); nothing
loops per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from ..core.errors import CheckpointingError, ShardingError
from ..core.mapping import ShardedTensor
from .boxes import intersect
from .coverage import check_disjoint
from .metadata import StoredShard, TensorEntry

Shape = Tuple[int, ...]
BoxT = Tuple[Shape, Shape]  # (offset, shape) in global coordinates

DEFAULT_SLACK_ELEMS = 1 << 14
"""Extra elements a span read may fetch beyond twice what it keeps before it is split further:
small tensors are read in one go, large ones never far beyond what is needed."""


# -- geometry helpers (pure, per axis) ------------------------------------------------------
def row_major_strides(shape: Sequence[int]) -> Shape:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= int(s)
    return tuple(reversed(strides))


def flat_index(box: BoxT, point: Sequence[int]) -> int:
    """Row-major index of global ``point`` inside ``box``."""
    off, shape = box
    return sum((p - o) * st for p, o, st in zip(point, off, row_major_strides(shape)))


def flat_to_point(box: BoxT, f: int) -> Optional[Shape]:
    """Global coordinates of row-major element ``f`` of ``box`` (None when ``f`` is past the end)."""
    off, shape = box
    if f >= math.prod(shape):
        return None
    point = []
    for o, st in zip(off, row_major_strides(shape)):
        q, f = divmod(f, st)
        point.append(o + q)
    return tuple(point)


def count_lex_below(box: BoxT, point: Sequence[int]) -> int:
    """How many elements of ``box`` are lexicographically below ``point`` (global coordinates)."""
    off, shape = box
    total = 0
    for k, (o, n, p) in enumerate(zip(off, shape, point)):
        total += min(max(p - o, 0), n) * math.prod(shape[k + 1:])
        if not o <= p < o + n:
            return total
    return total  # point itself lies in the box: it is not below itself


def count_flat_below(inner: BoxT, outer: BoxT, f: int) -> int:
    """Elements of ``inner`` (a sub-box of ``outer``) whose row-major index in ``outer`` is < f."""
    point = flat_to_point(outer, f)
    return math.prod(inner[1]) if point is None else count_lex_below(inner, point)


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> List[BoxT]:
    """Decompose elements ``[lo, hi)`` of a row-major array of ``shape`` into at most
    ``2 * ndim - 1`` boxes (offsets relative to the array), in order."""
    shape = tuple(int(s) for s in shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)

    def in_row(row: int, a: int, b: int) -> List[BoxT]:
        return [((row,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], a, b)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out: List[BoxT] = []
    if c0:
        out += in_row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]))
    if c1:
        out += in_row(r1, 0, c1)
    return out


def is_flattened(entry: TensorEntry) -> bool:
    """Whether ``entry`` was saved as flattened pieces (some stored shard holds a flat range; an
    even split never does)."""
    return entry.even is None and any(s.flat for s in entry.shards)


def _shift(box: BoxT, origin: Sequence[int]) -> BoxT:
    return tuple(o + g for o, g in zip(box[0], origin)), box[1]


# -- plan records ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StridedView:
    """Elements ``offset + sum(i_k * strides[k])`` of a 1-D buffer, ``i`` ranging over ``shape``."""

    offset: int
    shape: Shape
    strides: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_dense(self) -> bool:
        """A plain contiguous run of the buffer."""
        dense = row_major_strides(self.shape)
        return all(st == ds for st, ds, n in zip(self.strides, dense, self.shape) if n != 1)


@dataclass(frozen=True)
class BoxRead:
    """Read ``src`` (slices of a whole, non-flat stored array) straight into ``dst`` of dest-flat."""

    writer: int
    index: int
    src: Tuple[slice, ...]
    dst: StridedView

    @property
    def read_numel(self) -> int:
        return self.dst.numel

    @property
    def numel(self) -> int:
        return self.dst.numel


@dataclass(frozen=True, eq=False)
class SpanRead:
    """Read spans ``[start, start + length)`` of a flattened stored 1-D array, one after another,
    into a buffer of ``len(starts) * length`` elements; then copy each ``(src, dst)`` pair of
    ``copies`` from that buffer into dest-flat. A single span that is exactly one dense copy
    (``direct``) is read straight into the destination."""

    writer: int
    index: int
    starts: np.ndarray  # int64, one per span
    length: int
    copies: Tuple[Tuple[StridedView, StridedView], ...]

    @property
    def read_numel(self) -> int:
        return len(self.starts) * self.length

    @property
    def numel(self) -> int:
        return sum(src.numel for src, _ in self.copies)

    @property
    def direct(self) -> bool:
        if len(self.starts) != 1 or len(self.copies) != 1:
            return False
        src, dst = self.copies[0]
        return src.offset == 0 and src.numel == self.length and src.is_dense() and dst.is_dense()


FlatReadItem = Union[BoxRead, SpanRead]


@dataclass(frozen=True, eq=False)
class FlatReadPlan:
    """Everything to read for one request that involves flattened data (either side)."""

    key: str
    items: Tuple[FlatReadItem, ...]
    zero_fill: bool  # part of the request lies outside the saved tensor
    numel: int  # elements of the request buffer

    @property
    def read_numel(self) -> int:
        return sum(i.read_numel for i in self.items)


# -- planning -------------------------------------------------------------------------------
def _span_reads(
    stored: StoredShard, sbox: BoxT, ybox: BoxT, dst: StridedView, slack: int
) -> SpanRead:
    """Spans of flattened stored shard ``stored`` (box ``sbox``) covering box ``ybox``.

    Splits ``ybox`` into blocks along its leading ``k`` axes for the smallest ``k`` whose spans
    read at most ``2 x numel + slack`` elements (``k = ndim`` reads exactly the elements).
    """
    sstrides = row_major_strides(sbox[1])
    yshape = ybox[1]
    numel = math.prod(yshape)
    base = flat_index(sbox, ybox[0]) - stored.flat[0]
    ndim = len(yshape)
    for k in range(ndim + 1):
        blocks = math.prod(yshape[:k])
        span = sum((n - 1) * st for n, st in zip(yshape[k:], sstrides[k:])) + 1
        if blocks * span <= 2 * numel + slack or k == ndim:
            break
    starts = np.array([base], dtype=np.int64)
    for n, st in zip(yshape[:k], sstrides[:k]):  # vectorised over all rows: one numpy op per axis
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    block_strides = tuple(s * span for s in row_major_strides(yshape[:k]))
    src = StridedView(0, yshape, block_strides + sstrides[k:])
    return SpanRead(stored.writer, stored.index, starts, span, ((src, dst),))


def _check_shapes(request: ShardedTensor, entry: TensorEntry, checkpoint_dir: str) -> None:
    saved = tuple(entry.global_shape)
    if len(saved) != len(request.global_shape) or (saved != tuple(request.global_shape)
                                                   and not request.allow_shape_mismatch):
        raise ShardingError(
            f"checkpoint {checkpoint_dir}: {request.key!r} has global shape {saved} in the checkpoint but "
            f"{request.global_shape} was asked for"
            + ("" if len(saved) != len(request.global_shape) else
               " (to load anyway, zero-padded or truncated: allow_shape_mismatch=True on the ShardedTensor, or the "
               "checkpoint config's allow_shape_mismatch: true)")
        )


def plan_flat_read(
    request: ShardedTensor,
    entry: TensorEntry,
    checkpoint_dir: str,
    *,
    slack_elems: int = DEFAULT_SLACK_ELEMS,
) -> FlatReadPlan:
    """Plan reading ``request`` (flattened or not) from the stored shards of ``entry`` (flattened
    or not, any mix), under any change of box split (TP) or flat ranges (DP).

    Items address dest-flat: the request's box in row-major order, minus the request's flat
    start. With ``allow_shape_mismatch`` the part outside the saved tensor is zero-filled.
    """
    _check_shapes(request, entry, checkpoint_dir)
    key = request.key
    rbox: BoxT = (tuple(request.global_offset), tuple(request.shard_shape))
    rstrides = row_major_strides(rbox[1])
    fr = request.flattened_range
    c, d = (fr.start, fr.stop) if fr is not None else (0, math.prod(rbox[1]))
    items: List[FlatReadItem] = []
    used: List[StoredShard] = []
    covered = 0
    for s in entry.shards_in_rows(rbox[0][0], rbox[0][0] + rbox[1][0]) if rbox[1] else entry.shards:
        sbox: BoxT = (tuple(s.offset), tuple(s.shape))
        inter = intersect(rbox[0], rbox[1], sbox[0], sbox[1])
        if inter is None:
            continue
        xbox: BoxT = inter
        a, b = s.flat if s.flat else (0, math.prod(sbox[1]))
        # Both flat ranges are lexicographic intervals, so what X keeps is one run [lo, hi) of X.
        lo = max(count_flat_below(xbox, sbox, a), count_flat_below(xbox, rbox, c))
        hi = min(count_flat_below(xbox, sbox, b), count_flat_below(xbox, rbox, d))
        if lo >= hi:
            continue
        used.append(s)
        covered += hi - lo
        first = flat_to_point(xbox, lo)
        last = flat_to_point(xbox, hi - 1)
        if s.flat:
            s_first, s_last = flat_index(sbox, first), flat_index(sbox, last)
            r_first, r_last = flat_index(rbox, first), flat_index(rbox, last)
            if s_last - s_first == hi - lo - 1 and r_last - r_first == hi - lo - 1:
                # The usual DP reshard: one contiguous run on both sides, read in place.
                run = StridedView(r_first - c, (hi - lo,), (1,))
                items.append(SpanRead(s.writer, s.index, np.array([s_first - a], dtype=np.int64), hi - lo,
                                      ((StridedView(0, (hi - lo,), (1,)), run),)))
                continue
            boxes = [_shift(y, xbox[0]) for y in flat_range_boxes(xbox[1], lo, hi)]
            if s_last - s_first == hi - lo - 1:
                # Contiguous on disk, scattered in the request (e.g. TP shrink): one span, a copy per box.
                sstrides = row_major_strides(sbox[1])
                copies = tuple(
                    (StridedView(flat_index(sbox, y[0]) - s_first, y[1], sstrides),
                     StridedView(flat_index(rbox, y[0]) - c, y[1], rstrides))
                    for y in boxes
                )
                items.append(SpanRead(s.writer, s.index, np.array([s_first - a], dtype=np.int64), hi - lo, copies))
                continue
            for y in boxes:
                dst = StridedView(flat_index(rbox, y[0]) - c, y[1], rstrides)
                items.append(_span_reads(s, sbox, y, dst, slack_elems))
        else:
            for y in flat_range_boxes(xbox[1], lo, hi):
                y = _shift(y, xbox[0])
                src = tuple(slice(o - so, o - so + n) for o, so, n in zip(y[0], sbox[0], y[1]))
                items.append(BoxRead(s.writer, s.index, src, StridedView(flat_index(rbox, y[0]) - c, y[1], rstrides)))
    saved_box: BoxT = ((0,) * len(entry.global_shape), tuple(entry.global_shape))
    clipped = intersect(rbox[0], rbox[1], saved_box[0], saved_box[1])
    wanted = 0
    if clipped is not None:
        wanted = max(0, count_flat_below(clipped, rbox, d) - count_flat_below(clipped, rbox, c))
    if covered != wanted:
        raise CheckpointingError(
            f"checkpoint {checkpoint_dir}: {key!r}: stored shards cover {covered} of the {wanted} elements asked for "
            f"at offset {rbox[0]} shape {rbox[1]}" + (f" flat range {c}:{d}" if fr is not None else "")
            + "; the checkpoint is incomplete or corrupt"
        )
    check_disjoint(used, key, checkpoint_dir)  # the count above holds when an overlap hides a gap
    return FlatReadPlan(key, tuple(items), zero_fill=wanted < d - c, numel=d - c)
