"""Validation and planning at many ranks: the sort-and-sweep overlap search agrees with comparing
all pairs, and big regular layouts validate (speed is measured in benchmarks/bench_planning.py)."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_distckpt.planning.metadata import ShardRecord
from lightning_distckpt.planning.tiling import overlapping_pairs
from lightning_distckpt.planning.validation import validate_tensor_records


def _all_pairs(boxes):
    def overlap(a, b):
        return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))

    return [(i, j) for i, j in itertools.combinations(range(len(boxes)), 2) if overlap(boxes[i], boxes[j])]


_box = st.integers(1, 3).flatmap(lambda ndim: st.tuples(
    st.tuples(*[st.integers(0, 6)] * ndim), st.tuples(*[st.integers(0, 4)] * ndim)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_box, min_size=0, max_size=12))
def test_overlapping_pairs_match_all_pairs(boxes):
    ndim = len(boxes[0][0]) if boxes else 0
    boxes = sorted({b for b in boxes if len(b[0]) == ndim})  # validation passes distinct boxes of one rank
    assert overlapping_pairs(boxes) == _all_pairs(boxes)


def _rec(key, offset, shape, rank, global_shape, flat=None, main=True):
    return ShardRecord(key, "float32", global_shape, offset, shape, flat, main, rank)


def test_thousands_of_ranks_validate_dim0_grids_and_flat_ranges():
    ranks = 4096
    dim0 = [_rec(f"t{k}", (r * 2, 0), (2, 8), r, (ranks * 2, 8)) for k in range(4) for r in range(ranks)]
    assert validate_tensor_records(dim0) == []
    grid = [_rec("g", (i * 3, j * 5), (3, 5), i * 64 + j, (192, 320)) for i in range(64) for j in range(64)]
    assert validate_tensor_records(grid) == []
    flat = [_rec("f", (0, 0), (64, 64), r, (64, 64), flat=(r, r + 1)) for r in range(4096)]
    assert validate_tensor_records(flat) == []
    replicas = [_rec("d", (0, 0), (64, 64), r, (64, 64), main=r == 0) for r in range(ranks)]
    assert validate_tensor_records(replicas) == []


def test_one_bad_box_among_thousands_is_named():
    ranks = 4096
    recs = [_rec("w", (r * 2, 0), (2, 8), r, (ranks * 2, 8)) for r in range(ranks)]
    recs[100] = _rec("w", (200, 0), (3, 8), 100, (ranks * 2, 8))  # reaches into rank 101's rows
    recs[3000] = _rec("w", (6000, 0), (1, 8), 3000, (ranks * 2, 8))  # leaves a row out
    problems = validate_tensor_records(recs)
    assert problems == [
        "'w': main replicas overlap: offset (200, 0) shape (3, 8) (ranks [100]) and offset (202, 0) shape (2, 8) "
        "(ranks [101])",
    ]  # the extra row of rank 100 makes up for rank 3000's missing one: covered == total, no gap reported
    recs[100] = _rec("w", (200, 0), (2, 8), 100, (ranks * 2, 8))
    (gap,) = validate_tensor_records(recs)
    assert gap.startswith("'w': main replicas cover 65528 of 65536 elements")
