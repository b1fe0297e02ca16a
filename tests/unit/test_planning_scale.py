"""Validation and planning at many ranks: the sort-and-sweep overlap search agrees with comparing
all pairs, big regular layouts validate, groups of ranks with the same records validate and plan
as every rank's records would, and the coordinator's errors keep their type (speed is measured in
benchmarks/bench_planning.py)."""

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_distckpt.comm import Comm
from lightning_distckpt.core.errors import CheckpointingError, ValidationError
from lightning_distckpt.planning.even import mark_even, resolve_even
from lightning_distckpt.planning.groups import RankRecords, RecordGroup, layout_digest, representatives
from lightning_distckpt.planning.metadata import ShardRecord
from lightning_distckpt.planning.save_plan import make_save_plan, plan_record_groups
from lightning_distckpt.planning.tiling import overlapping_pairs
from lightning_distckpt.planning.validation import validate_record_groups, validate_tensor_records
from lightning_distckpt.saving.save_coordinate import CoordinatorOptions, coordinate_plan, plan_for_ranks


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


def _groups_and_ranks():
    """TP 2 x DP 3 over 6 ranks plus a rank 6 describing itself exactly as rank 0 does (main
    replicas included): layouts shared by several ranks, and duplicate main replicas."""
    per_rank = []
    for rank in range(7):
        tp, dp = rank % 2, (rank // 2 if rank < 6 else 0)
        recs = [_rec("w", (tp * 4, 0), (4, 8), rank, (8, 8), main=dp == 0),
                _rec("n", (0,), (8,), rank, (8,), main=rank in (0, 6))]
        per_rank.append(RankRecords(recs, []))
    digests = [layout_digest(r) for r in per_rank]
    groups = [RecordGroup(per_rank[ranks[0]], ranks) for ranks in representatives(digests).values()]
    return per_rank, groups


def test_groups_validate_and_plan_as_every_rank_would():
    per_rank, groups = _groups_and_ranks()
    assert sorted(g.ranks for g in groups) == [[0, 6], [1], [2, 4], [3, 5]]
    every = [r for recs in per_rank for r in recs.tensors]
    problems = validate_record_groups(groups)
    assert problems == validate_tensor_records(every)
    assert sum("main replica on ranks 0 and 6" in p for p in problems) == 2  # 'n' and 'w' 
    ok_groups = [g._replace(ranks=[rk for rk in g.ranks if rk < 6]) for g in groups]  # rank 6 gone
    assert validate_record_groups(ok_groups) == []
    flat = [r for recs in per_rank[:6] for r in recs.tensors]
    for balance in (True, False):
        grouped = plan_record_groups(ok_groups, 6, balance, pack_max_bytes=64)
        assert grouped == make_save_plan(flat, [], 6, balance, pack_max_bytes=64)


def test_coordinator_errors_reach_every_rank_with_their_type():
    one = Comm(None, 0, 1)
    options = CoordinatorOptions(validate=True, balance_writes=True, pack_max_bytes=0)
    gap = RankRecords([_rec("w", (0, 0), (4, 8), 0, (8, 8))], [])
    with pytest.raises(ValidationError, match="'w': main replicas cover 32 of 64 elements") as e:
        coordinate_plan(one, "/ck", gap, [layout_digest(gap)], options)
    assert str(e.value).startswith("sharded state dict for checkpoint /ck is inconsistent; nothing was written")
    # a failure that is not a library error (here: a dtype planning cannot size) names rank 0
    odd = RankRecords([ShardRecord("w", "complex32", (8,), (0,), (8,), None, True, 0)], [])
    with pytest.raises(CheckpointingError, match="save to /ck failed before writing: rank 0: KeyError") as e:
        coordinate_plan(one, "/ck", odd, [layout_digest(odd)], options)
    assert list(e.value.failures) == [0] and e.value.failures[0].type_name == "KeyError"
    ok = RankRecords([_rec("w", (0, 0), (8, 8), 0, (8, 8))], [])
    plan = coordinate_plan(one, "/ck", ok, [layout_digest(ok)], options)
    assert [(i.key, i.source) for i in plan.writes[0]] == [("w", 0)] and list(plan.index.tensors) == ["w"]


def _fsdp_ranks(world, rows=(20, 7, 64), extra=True):
    """Every rank's own records: tensors split evenly on dim 0 over ``world`` ranks (chunks of
    ceil(rows / world), the last ones shorter), plus a tensor every rank holds whole (main on
    rank 0 only), and, with ``extra``, one only rank 0 holds."""
    per_rank = []
    for rank in range(world):
        recs = []
        for k, n in enumerate(rows):
            chunk = -(-n // world)
            lo, hi = min(rank * chunk, n), min((rank + 1) * chunk, n)
            if hi > lo:
                recs.append(_rec(f"t{k}", (lo, 0), (hi - lo, 3), rank, (n, 3)))
        recs.append(_rec("norm", (0,), (5,), rank, (5,), main=rank == 0))
        if extra and rank == 0:
            recs.append(_rec("step", (0,), (1,), rank, (1,)))
        per_rank.append(RankRecords(recs, []))
    return per_rank


def _coordinate(per_rank, mark, balance=True, validate=True):
    """plan_for_ranks on the coordinator's groups, with or without marking even chunks."""
    world = len(per_rank)
    sent = [mark_even(r, world) if mark else r for r in per_rank]
    digests = [layout_digest(r) for r in sent]
    groups = [RecordGroup(sent[ranks[0]], ranks) for ranks in representatives(digests).values()]
    options = CoordinatorOptions(validate=validate, balance_writes=balance, pack_max_bytes=48)
    plan, parts = plan_for_ranks(groups, world, "/ck", options)
    if plan is not None:  # the writes as each rank ends up with them (some add their even chunks')
        seen = {rank: plan.writes.get(0, []) if rank == 0 else parts[rank].writes_of(sent[rank], rank, 48)
                for rank in range(world)}
        plan = replace(plan, writes={rank: w for rank, w in seen.items() if w})
    return len(groups), plan, [(p.nbytes, p.object_writes, p.error) for p in parts]


@pytest.mark.parametrize("rows, drop, even", [((16, 22, 64), None, ["step", "t0", "t1", "t2"]),
                                              ((20, 7, 64), None, ["step", "t0", "t1", "t2"]),
                                              ((16, 22, 64), (3, "t1"), ["step", "t0", "t2"])])
def test_even_splits_share_one_layout_and_plan_as_every_rank_would(rows, drop, even):
    """Over 8 ranks, 16 / 22 / 64 rows split in chunks of 2 / 3 (rank 7: 1) / 8 are even keys
    (and 'step', one row, whole on rank 0); so are 20 and 7 rows, where rank 7 holds no row and
    describes nothing. 'norm', whole on every rank, is not. When rank 3 leaves its chunk of t1 out, t1 is
    validated and planned from every rank's own records. Either way the plan is the one without
    marks."""
    per_rank = _fsdp_ranks(8, rows)
    if drop is not None:
        per_rank[drop[0]] = RankRecords([r for r in per_rank[drop[0]].tensors if r.key != drop[1]], [])
    sent = [mark_even(r, 8) for r in per_rank]
    digests = [layout_digest(r) for r in sent]
    groups = [RecordGroup(sent[ranks[0]], ranks) for ranks in representatives(digests).values()]
    assert sorted(resolve_even(groups, 8)[1]) == even
    check = drop is None  # a chunk left out is a gap: compare the plans made without validation
    n_marked, marked, parts = _coordinate(per_rank, mark=True, balance=False, validate=check)
    n_plain, plain, plain_parts = _coordinate(per_rank, mark=False, balance=False, validate=check)
    assert n_plain == 8 and n_marked < 8  # ranks holding the same chunks' pattern share a layout
    assert marked is not None and marked == plain and parts == plain_parts
    # balanced: the same stored shards and packing, every byte written once
    _, marked_b, _ = _coordinate(per_rank, mark=True, validate=check)
    _, plain_b, _ = _coordinate(per_rank, mark=False, validate=check)
    def strip(plan):
        return {k: [(s.offset, s.shape, s.index) for s in e.shards] for k, e in plan.index.tensors.items()}

    assert strip(marked_b) == strip(plain_b)
    assert sum(marked_b.bytes_per_rank.values()) == sum(plain_b.bytes_per_rank.values())
    # a pure FSDP layout: one layout whatever the ranks, the very same plan
    pure = [RankRecords([r for r in recs.tensors if r.key == "t2"], [])
            for recs in _fsdp_ranks(64, rows=(64, 64, 128))]
    n, plan, _ = _coordinate(pure, mark=True)
    assert n == 1 and plan == _coordinate(pure, mark=False)[1]
    assert [s.writer for s in plan.index.tensors["t2"].shards] == list(range(64))


def _message(parts):
    assert parts[0][2] is not None and len({p[2] for p in parts}) == 1
    return parts[0][2].message


def test_even_splits_report_the_same_problems():
    good = _fsdp_ranks(8, rows=(16, 24, 64), extra=False)
    bad_cases = []
    overlap = [RankRecords(list(r.tensors), []) for r in good]
    overlap[5].tensors[0] = _rec("t0", (9, 0), (2, 3), 5, (16, 3))  # reaches into rank 4's rows... and leaves row 11
    bad_cases.append(overlap)
    missing = [RankRecords([r for r in recs.tensors if not (rank == 3 and r.key == "t1")], [])
               for rank, recs in enumerate(good)]
    bad_cases.append(missing)
    shape = [RankRecords(list(r.tensors), []) for r in good]
    shape[6].tensors[2] = _rec("t2", (48, 0), (8, 3), 6, (65, 3))
    bad_cases.append(shape)
    twice = [RankRecords(list(r.tensors) + ([r.tensors[0]] if rank == 2 else []), []) for rank, r in enumerate(good)]
    bad_cases.append(twice)
    for case in bad_cases:
        plain = _message(_coordinate(case, mark=False)[2])
        assert _message(_coordinate(case, mark=True)[2]) == plain
        every = [r for recs in case for r in recs.tensors]
        assert all(p in plain for p in validate_tensor_records(every))
    # validation off: still planned as without the marks
    assert _coordinate(missing, mark=True, validate=False)[1] == _coordinate(missing, mark=False, validate=False)[1]


def test_mark_even_marks_exactly_the_chunks_of_an_even_split():
    recs = RankRecords([
        _rec("a", (6, 0), (3, 3), 2, (10, 3)),  # rows 6..8 of 10 over 4 ranks (chunks of 3): rank 2's
        _rec("b", (9, 0), (1, 3), 2, (10, 3)),  # rank 3's chunk, described by rank 2
        _rec("c", (6, 0), (3, 3), 2, (10, 3), main=False),  # a replica
        _rec("d", (0, 0), (3, 3), 2, (10, 3), flat=(0, 4)),  # flattened
        _rec("e", (0,), (0,), 2, (0,)),  # empty
        _rec("f", (), (), 2, ()),  # scalar
    ], [])
    assert mark_even(recs, 4).even == (0,) and mark_even(recs, 4).even_over == 4
    assert mark_even(recs, 1) == recs and mark_even(recs, 5).even == ()  # chunks of 2 over 5 ranks
    # the digest leaves the marked chunk's offset out: rank 1's chunk of 'a' gives the same layout
    other = RankRecords([_rec("a", (3, 0), (3, 3), 1, (10, 3))] + recs.tensors[1:], [])
    assert layout_digest(mark_even(other, 4)) == layout_digest(mark_even(recs, 4))
    assert layout_digest(other) != layout_digest(recs)
