"""Planning is plain data in, plain data out: tested without files or processes."""

import pytest
import torch

from lightning_distckpt import ShardedTensor
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.planning.load_plan import plan_tensor_read
from lightning_distckpt.planning.metadata import CheckpointIndex, ObjectRecord, ShardRecord
from lightning_distckpt.planning.save_plan import make_save_plan
from lightning_distckpt.planning.validation import validate_object_records, validate_tensor_records


def rec(key, offset, shape, rank, main=True, global_shape=(8, 4), dtype="float32", flat=None):
    return ShardRecord(key, dtype, tuple(global_shape), tuple(offset), tuple(shape), flat, main, rank)


def test_exact_tiling_is_valid():
    recs = [rec("w", (0, 0), (4, 4), 0), rec("w", (4, 0), (4, 4), 1)]
    assert validate_tensor_records(recs) == []


def test_gap_overlap_and_disagreement_are_reported():
    gap = validate_tensor_records([rec("w", (0, 0), (4, 4), 0)])
    assert any("cover 16 of 32" in p for p in gap)
    overlap = validate_tensor_records([rec("w", (0, 0), (5, 4), 0), rec("w", (4, 0), (4, 4), 1)])
    assert any("overlap" in p and "ranks [0]" in p and "ranks [1]" in p for p in overlap)
    shape = validate_tensor_records([rec("w", (0, 0), (4, 4), 0), rec("w", (4, 0), (4, 4), 1, global_shape=(8, 5))])
    assert any("disagree on global shape" in p for p in shape)
    dtype = validate_tensor_records([rec("w", (0, 0), (4, 4), 0), rec("w", (4, 0), (4, 4), 1, dtype="bfloat16")])
    assert any("disagree on dtype" in p for p in dtype)
    dup = validate_tensor_records([rec("w", (0, 0), (8, 4), 0), rec("w", (0, 0), (8, 4), 1)])
    assert any("main replica on ranks 0 and 1" in p for p in dup)


def test_flat_ranges_must_cover_shard_once():
    ok = [rec("w", (0, 0), (8, 4), 0, flat=(0, 10)), rec("w", (0, 0), (8, 4), 1, flat=(10, 32))]
    assert validate_tensor_records(ok) == []
    gap = [rec("w", (0, 0), (8, 4), 0, flat=(0, 10)), rec("w", (0, 0), (8, 4), 1, flat=(12, 32))]
    assert any("gap at element 10" in p for p in validate_tensor_records(gap))
    over = [rec("w", (0, 0), (8, 4), 0, flat=(0, 12)), rec("w", (0, 0), (8, 4), 1, flat=(10, 32))]
    assert any("overlap" in p for p in validate_tensor_records(over))


def test_objects_unique_and_complete():
    objs = [ObjectRecord("rng", (2,), (0,), True, 0), ObjectRecord("rng", (2,), (0,), True, 1)]
    problems = validate_object_records(objs)
    assert any("main replica on ranks 0 and 1" in p for p in problems)
    assert any("only 1 elements" in p for p in problems)


def test_replicated_writes_are_spread_by_bytes():
    # 4 tensors, each fully replicated on 2 ranks (DP=2): each rank should write half the bytes.
    recs = []
    for i, rows in enumerate([8, 8, 4, 4]):
        for rank in range(2):
            recs.append(rec(f"t{i}", (0, 0), (rows, 4), rank, main=rank == 0, global_shape=(rows, 4)))
    plan = make_save_plan(recs, [], world_size=2)
    assert plan.bytes_per_rank == {0: 12 * 16, 1: 12 * 16}
    written = sorted(item.key for writes in plan.writes.values() for item in writes)
    assert written == ["t0", "t1", "t2", "t3"]  # each unique shard once
    main_only = make_save_plan(recs, [], world_size=2, balance_writes=False)
    assert main_only.bytes_per_rank == {0: 24 * 16, 1: 0}


def test_plan_items_point_at_the_writers_own_records():
    # Ranks' records interleaved (any order within the list, each rank's own in its list order):
    # every write names the position of the writer's record, so the writer needs no lookup.
    per_rank = {
        0: [rec("a", (0, 0), (4, 4), 0), rec("rep", (0,), (6,), 0, global_shape=(6,)), rec("b", (0,), (8,), 0,
                                                                                          global_shape=(8,))],
        1: [rec("rep", (0,), (6,), 1, main=False, global_shape=(6,)), rec("a", (4, 0), (4, 4), 1)],
    }
    interleaved = [per_rank[0][0], per_rank[1][0], per_rank[0][1], per_rank[1][1], per_rank[0][2]]
    objs = [ObjectRecord("rng", (2,), (1,), True, 1), ObjectRecord("rng", (2,), (0,), True, 0),
            ObjectRecord("opt", (1,), (0,), False, 0), ObjectRecord("opt", (1,), (0,), True, 1)]
    plan = make_save_plan(interleaved, objs, world_size=2, pack_max_bytes=16)
    seen = []
    for writer, items in plan.writes.items():
        for item in items:
            source = per_rank[writer][item.source]
            assert (source.key, source.shard_id) == (item.key, item.shard_id)
            stored = plan.index.tensors[item.key].shards[item.index]
            assert (stored.writer, stored.packed) == (writer, item.packed)
            seen.append(item.key)
    assert sorted(seen) == ["a", "a", "b", "rep"]
    own_objects = {0: [objs[1], objs[2]], 1: [objs[0], objs[3]]}
    for writer, items in plan.object_writes.items():
        for item in items:
            source = own_objects[writer][item.source]
            assert (source.key, source.offset, source.main) == (item.key, item.offset, True)
            assert plan.index.objects[item.key].shards[item.index].writer == writer
    assert sorted((i.key, i.offset) for items in plan.object_writes.values() for i in items) == [
        ("opt", (0,)), ("rng", (0,)), ("rng", (1,))]


def test_small_shards_are_packed_per_writer_and_dtype():
    recs = [
        rec("norm", (0,), (16,), 0, global_shape=(16,)),  # 64 B fp32, written by rank 0
        rec("bias", (0,), (8,), 1, global_shape=(8,), dtype="bfloat16"),  # 16 B bf16, rank 1
        rec("scale", (), (), 0, global_shape=()),  # a scalar, 4 B
        rec("w", (0, 0), (64, 64), 0, global_shape=(128, 64)),  # 16 KiB: too big to pack at 4 KiB
        rec("w", (64, 0), (64, 64), 1, global_shape=(128, 64)),
        rec("m", (0, 0), (2, 4), 0, flat=(0, 5)),  # flattened pieces are never packed
        rec("m", (0, 0), (2, 4), 1, flat=(5, 8)),
        rec("empty", (0,), (0,), 1, global_shape=(0,)),  # nothing to pack
    ]
    plan = make_save_plan(recs, [], world_size=2, pack_max_bytes=4096)
    packed = {(k, sh.writer): sh.packed for k, e in plan.index.tensors.items() for sh in e.shards}
    # rank 0's float32 pack: "norm" (16 elements) then "scale" (1), in key order; rank 1's bf16 pack: "bias"
    assert packed[("norm", 0)] == 0 and packed[("scale", 0)] == 16 and packed[("bias", 1)] == 0
    assert packed[("w", 0)] is None and packed[("w", 1)] is None
    assert packed[("m", 0)] is None and packed[("m", 1)] is None and packed[("empty", 1)] is None
    # the same records plan the same packing on every rank, and 0 packs nothing
    assert make_save_plan(list(reversed(recs)), [], world_size=2, pack_max_bytes=4096).index == plan.index
    none = make_save_plan(recs, [], world_size=2, pack_max_bytes=0)
    assert all(sh.packed is None for e in none.index.tensors.values() for sh in e.shards)
    # metadata round trip keeps the offsets; unpacked shards carry no "packed" field (as in format 1)
    js = plan.index.to_json()
    assert CheckpointIndex.from_json(js, "ck") == plan.index
    assert "packed" not in js["tensors"]["w"]["shards"][0] and js["tensors"]["scale"]["shards"][0]["packed"] == 16
    for bad in (-1, "3", 1.5):
        broken = plan.index.to_json()
        broken["tensors"]["norm"]["shards"][0]["packed"] = bad
        with pytest.raises(FormatError, match="packed"):
            CheckpointIndex.from_json(broken, "ck")
    broken = plan.index.to_json()
    broken["tensors"]["m"]["shards"][0]["packed"] = 0
    with pytest.raises(FormatError, match="both flattened and packed"):
        CheckpointIndex.from_json(broken, "ck")


def _index_for(shards, global_shape=(8, 4)):
    recs = [rec("w", off, shape, rank, global_shape=global_shape) for rank, (off, shape) in enumerate(shards)]
    return make_save_plan(recs, [], world_size=len(shards)).index


def test_load_plan_reshards_rows_to_columns():
    index = _index_for([((0, 0), (4, 4)), ((4, 0), (4, 4))])
    want = ShardedTensor.from_rank_offsets("w", torch.zeros(8, 2), (1, 1, 2))
    plan = plan_tensor_read(want, index.tensors["w"], "ck")
    assert [(i.writer, i.src, i.dst) for i in plan.items] == [
        (0, (slice(0, 4), slice(2, 4)), (slice(0, 4), slice(0, 2))),
        (1, (slice(0, 4), slice(2, 4)), (slice(4, 8), slice(0, 2))),
    ]
    assert not plan.zero_fill


def test_load_plan_shape_mismatch_pads_or_refuses():
    index = _index_for([((0, 0), (8, 4))])
    bigger = ShardedTensor.from_rank_offsets("w", torch.zeros(10, 4), allow_shape_mismatch=True)
    plan = plan_tensor_read(bigger, index.tensors["w"], "ck")
    assert plan.zero_fill and plan.items[0].dst == (slice(0, 8), slice(0, 4))
    strict = ShardedTensor.from_rank_offsets("w", torch.zeros(10, 4))
    try:
        plan_tensor_read(strict, index.tensors["w"], "ck")
    except Exception as e:
        assert "global shape (8, 4)" in str(e) and "(10, 4)" in str(e) and "'w'" in str(e)
    else:
        raise AssertionError("shape mismatch was accepted")


def test_index_json_round_trip_and_rejects_bad_types():
    index = _index_for([((0, 0), (4, 4)), ((4, 0), (4, 4))])
    again = CheckpointIndex.from_json(index.to_json(), "ck")
    assert again.to_json() == index.to_json()
    bad = index.to_json()
    bad["tensors"]["w"]["shards"][0]["writer"] = "../../etc"
    try:
        CheckpointIndex.from_json(bad, "ck")
    except Exception as e:
        assert "writer" in str(e)
    else:
        raise AssertionError("malformed writer accepted")


def test_common_differences_names_paths_and_ranks():
    from lightning_distckpt.planning.common_check import common_differences, leaf_records

    def leaf_digests(common):
        return {path: leaf.digest for path, leaf in leaf_records(common).items()}

    same = {"opt": {"param_groups": [{"lr": 0.1}]}, "step": 3}
    ranks = [leaf_digests(same), leaf_digests(same), leaf_digests({**same, "step": 4}),
             leaf_digests({"opt": same["opt"], "step": 3, "extra": 1})]
    assert set(ranks[0]) == {"opt.param_groups.0.lr", "step"}
    assert common_differences(ranks[:2]) == []
    assert common_differences(ranks) == [
        "'extra': not on rank 0, only on ranks [3] (not saved)",
        "'step': differs from rank 0's value on ranks [2]",
    ]
    missing = [leaf_digests(same), leaf_digests({"step": 3})]
    assert common_differences(missing) == ["'opt.param_groups.0.lr': missing on ranks [1]"]
    many = [{f"k{i}": "a" for i in range(15)}, {f"k{i}": "b" for i in range(15)}]
    lines = common_differences(many, limit=10)
    assert len(lines) == 11 and lines[-1] == "... and 5 more"


def test_rank_differences_are_written_as_megatron_core_writes_them():
    """planning/common_check.rank_differences: Megatron-Core's diff() lists, as its log line writes
    them (its own tests compare the whole line): a missing sub-tree is named once, where it is missing."""
    from lightning_distckpt.planning.common_check import leaf_records, rank_differences

    zero = {"opt": {"groups": [{"lr": 0.1}], "kind": "adam"}, "step": 3, "rank": 0}
    one = {"opt": {"kind": "adam"}, "step": 4.0, "rank": 1, "extra": {"a": 1, "b": [2]}}
    per_rank = [leaf_records(zero), leaf_records(one)]
    assert rank_differences(per_rank, 1) == (
        "[('opt', 'groups')]", "[('extra',)]",
        "[(('rank',), <class 'int'>, <class 'int'>), (('step',), <class 'int'>, <class 'float'>)]")
    assert rank_differences([leaf_records(zero)] * 2, 1) == ("[]", "[]", "[]")


def test_common_digest_compares_values_not_objects_and_calls_no_torch_save(monkeypatch):
    """planning/common_check.common_digest: equal common states digest alike whatever their tensors'
    memory (separate copies, strides); any change of a tensor's values, dtype, shape, type or
    requires_grad, or of another leaf, changes it; torch.save is never called (only rank 0's
    archive is written); what pickle cannot serialize raises."""
    import pytest

    from lightning_distckpt.planning.common_check import common_digest

    def state(step=3.0, moments=None):
        return {"optimizer_states": [{"state": {f"p{i}": {"step": torch.tensor(step)} for i in range(4)},
                                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999)}]}],
                "loops": {"epoch": 2}, "buf": torch.arange(12.0).reshape(3, 4) if moments is None else moments}

    saves = []
    monkeypatch.setattr(torch, "save", lambda *a, **k: saves.append(1))
    ref = common_digest(state())
    assert common_digest(state()) == ref  # other tensor objects, same values
    strided = torch.arange(12.0).reshape(3, 4).t().contiguous().t()  # the same values, column-major
    assert not strided.is_contiguous() and common_digest(state(moments=strided)) == ref
    changed = [state(step=4.0), state(moments=torch.arange(12.0).reshape(3, 4).double()),
               state(moments=torch.arange(12.0).reshape(4, 3)),
               state(moments=torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))),
               state(moments=torch.arange(12.0).reshape(3, 4).requires_grad_()), {**state(), "loops": {"epoch": 3}}]
    assert len({ref, *map(common_digest, changed)}) == len(changed) + 1
    odd = {"bf16": torch.ones(5, dtype=torch.bfloat16), "empty": torch.empty(0, 3), "bool": torch.tensor([True]),
           "meta": torch.empty(2, device="meta"), "c": torch.tensor([1 + 2j]).conj()}
    assert common_digest(odd) == common_digest({k: v.clone() if not v.is_meta else v for k, v in odd.items()})
    assert not saves
    with pytest.raises(Exception):
        common_digest({"hook": lambda x: x})
