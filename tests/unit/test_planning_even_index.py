"""Even dim-0 splits as one index entry (format 4, ``planning/even_index.py``): the plan of marked
records lists the same stored shards, writers and pack offsets as the plan of every rank's own
records, metadata.json round-trips them, loads plan the same reads, and damaged entries are
FormatErrors naming the field."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.planning.even import mark_even
from lightning_distckpt.planning.even_index import PackedPlaces
from lightning_distckpt.planning.groups import RankRecords, RecordGroup, layout_digest, representatives
from lightning_distckpt.planning.load_plan import plan_tensor_read
from lightning_distckpt.planning.metadata import CheckpointIndex, ShardRecord
from lightning_distckpt.planning.save_plan import make_save_plan
from lightning_distckpt.saving.save_coordinate import CoordinatorOptions, plan_for_ranks

# key -> (rows, cols, dtype); keys sorted: explicit and even keys interleave in the packing order
EVEN = {"b": (22, 3, "float32"), "d": (16, 5, "bfloat16"), "f": (40, 9, "float32"), "h": (5, 2, "float32")}


def _ranks(world):
    """Each rank's own records: EVEN keys split evenly over ``world`` ranks, 'a' whole on rank 0,
    'c' a replicated norm (main on rank 0), 'g' split in two halves over ranks 0 and 1."""
    per_rank = []
    for rank in range(world):
        recs = [ShardRecord("a", "float32", (4,), (0,), (4,), None, True, rank)] if rank == 0 else []
        recs.append(ShardRecord("c", "bfloat16", (6,), (0,), (6,), None, rank == 0, rank))
        for key, (rows, cols, dtype) in EVEN.items():
            chunk = -(-rows // world)
            lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
            if hi > lo:
                recs.append(ShardRecord(key, dtype, (rows, cols), (lo, 0), (hi - lo, cols), None, True, rank))
        if rank < 2:
            recs.append(ShardRecord("g", "float32", (4, 2), (2 * rank, 0), (2, 2), None, True, rank))
        recs.sort(key=lambda r: r.key)
        per_rank.append(RankRecords(recs, []))
    return per_rank


def _marked_plan(per_rank, pack):
    world = len(per_rank)
    sent = [mark_even(r, world) for r in per_rank]
    digests = [layout_digest(r) for r in sent]
    groups = [RecordGroup(sent[ranks[0]], ranks) for ranks in representatives(digests).values()]
    plan, parts = plan_for_ranks(groups, world, "/ck", CoordinatorOptions(True, True, pack))
    assert plan is not None
    writes = {rank: plan.writes.get(0, []) if rank == 0 else parts[rank].writes_of(sent[rank], rank, pack)
              for rank in range(world)}
    return plan, {rank: w for rank, w in writes.items() if w}


def _reread(index):
    return CheckpointIndex.from_json(json.loads(json.dumps({"format_version": 4, **index.to_json()})), "ck")


@pytest.mark.parametrize("world", [3, 8, 13])
@pytest.mark.parametrize("pack", [0, 40, 100, 1 << 20])
def test_even_entries_list_the_shards_of_the_plain_plan(world, pack):
    """Packing all, some (only a shorter last chunk) or none of the chunks: the compact index
    lists what the plan of unmarked records lists, also after metadata.json, and each rank's
    writes are the same."""
    per_rank = _ranks(world)
    plain = make_save_plan([r for recs in per_rank for r in recs.tensors], [], world, True, pack)
    marked, writes = _marked_plan(per_rank, pack)
    assert all(marked.index.tensors[k].even is not None for k in EVEN)
    assert marked.index == plain.index and writes == plain.writes
    text = marked.index.to_json()
    assert all("shards" not in text["tensors"][k] and text["tensors"][k]["even"]["over"] == world for k in EVEN)
    again = _reread(marked.index)
    assert again == plain.index and again.bytes_per_writer() == plain.index.bytes_per_writer()
    assert all(again.tensors[k].nbytes == plain.index.tensors[k].nbytes for k in plain.index.tensors)
    assert len(json.dumps(text)) < len(json.dumps(plain.index.to_json()))
    for key in EVEN:  # the chunks holding a range of rows, as the whole list has them
        rows = EVEN[key][0]
        for lo, hi in [(0, rows), (1, 2), (rows - 1, rows), (3, rows + 4), (4, 5)]:
            want = [s for s in plain.index.tensors[key].shards if s.offset[0] < hi and lo < s.offset[0] + s.shape[0]]
            got = again.tensors[key].shards_in_rows(lo, hi)
            assert [s for s in got if s.offset[0] < hi and lo < s.offset[0] + s.shape[0]] == want


def test_loads_plan_the_same_reads_from_an_even_entry():
    per_rank = _ranks(8)
    plain = make_save_plan([r for recs in per_rank for r in recs.tensors], [], 8, True, 40)
    even = _reread(_marked_plan(per_rank, 40)[0].index)
    rows, cols, dtype = EVEN["f"]
    requests = [((0, 0), (rows, cols)), ((7, 3), (11, 2)), ((39, 0), (1, cols))]
    for offset, shape in requests:
        req = ldc.ShardedTensor.from_offsets("f", torch.empty(shape), (rows, cols), offset)
        assert plan_tensor_read(req, even.tensors["f"], "ck") == plan_tensor_read(req, plain.index.tensors["f"], "ck")
    flat = ldc.ShardedTensor(key="f", data=torch.empty(90), dtype=torch.float32, local_shape=(rows, cols),
                             global_shape=(rows, cols), global_offset=(0, 0), flattened_range=slice(10, 100))
    flat_even, flat_plain = (plan_tensor_read(flat, e.tensors["f"], "ck") for e in (even, plain.index))
    assert repr(flat_even) == repr(flat_plain)  # FlatReadPlan compares by identity


def _meta(**change):
    per_rank = _ranks(4)
    meta = {"format_version": 4, **_marked_plan(per_rank, 100)[0].index.to_json()}
    for path, value in change.items():
        key, field = path.split(".")
        meta["tensors"][key][field] = value
    return meta


@pytest.mark.parametrize("change, message", [
    ({"b.even": {"over": 0, "packed_from": 0}}, "field tensors['b'].even.over must be an int in [1, 1048576]"),
    ({"b.even": {"over": 4, "packed_from": 5}}, "field tensors['b'].even.packed_from must be an int in [0, 4]"),
    ({"b.even": [4, 0]}, "field tensors['b'].even must be an object"),
    ({"b.shards": []}, "field tensors['b'] has both shards and even"),
    ({"a.even": {"over": 4, "packed_from": 0}, "a.shards": None}, "tensors['a'] has both shards and even"),
])
def test_damaged_even_entries_are_format_errors(change, message):
    with pytest.raises(FormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        CheckpointIndex.from_json(_meta(**change), "ck")


def test_even_entries_need_format_4_and_packed_shards_must_follow_the_rule():
    meta = _meta()
    CheckpointIndex.from_json(meta, "ck")
    with pytest.raises(FormatError, match=r"field tensors\['b'\]\.shards must be a list"):
        CheckpointIndex.from_json({**meta, "format_version": 3}, "ck")  # format 3 knows no even entries
    moved = _meta()
    (shard,) = moved["tensors"]["g"]["shards"][:1]
    shard["packed"] += 1
    with pytest.raises(FormatError, match=r"tensors\['g'\]\.shards\[0\]\.packed .* not where the packing rule"):
        CheckpointIndex.from_json(moved, "ck")
    split = {"global_shape": [1 << 20], "dtype": "uint8", "even": {"over": 1 << 20, "packed_from": 0}}
    huge = {"format_version": 4, "tensors": {f"x{i}": split for i in range(65)}, "objects": {}}  # 2**26 + 2**20
    with pytest.raises(FormatError, match="even splits claim more than"):
        CheckpointIndex.from_json(huge, "ck")


def test_packed_places_list_an_even_split_per_writer_asked():
    """TensorStoreIO's map of packed shards: the listed ones at once, an even split's chunks of a
    writer when that writer is asked about, with the offsets the whole list has."""
    per_rank = _ranks(8)
    plain = make_save_plan([r for recs in per_rank for r in recs.tensors], [], 8, True, 100)
    index = _reread(_marked_plan(per_rank, 100)[0].index)
    places = PackedPlaces(index, lambda key, i: f"{key}/{i}")
    want = {(s.writer, f"{k}/{s.index}"): (e.dtype, s.packed, tuple(s.shape))
            for k, e in plain.index.tensors.items() for s in e.shards if s.packed is not None}
    assert len(places._places) < len(want)  # the even splits' chunks not listed yet
    for handle, place in want.items():
        assert handle in places and places.get(handle) == place and places[handle] == place
    assert places.get((3, "zzz/3")) is None and (99, "b/99") not in places
    assert places._places == want


_tensor = st.tuples(st.integers(1, 40), st.integers(0, 4), st.sampled_from(["float32", "int8"]))  # rows, cols, dtype


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12), st.lists(_tensor, min_size=1, max_size=4), st.sampled_from([0, 8, 30, 100, 1 << 20]))
def test_random_even_splits_index_as_the_plain_plan(world, tensors, pack):
    """Any rows (fewer than the ranks too), empty rows, dtypes and packing: the compact index and
    its metadata.json are the plain plan's index, and each rank's writes the same."""
    per_rank = []
    for rank in range(world):
        recs = [ShardRecord("a", "float32", (3,), (0,), (3,), None, True, rank)] if rank == world - 1 else []
        for k, (rows, cols, dtype) in enumerate(tensors):
            chunk = -(-rows // world)
            lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
            if hi > lo:
                recs.append(ShardRecord(f"t{k}", dtype, (rows, cols), (lo, 0), (hi - lo, cols), None, True, rank))
        per_rank.append(RankRecords(recs, []))
    plain = make_save_plan([r for recs in per_rank for r in recs.tensors], [], world, True, pack)
    marked, writes = _marked_plan(per_rank, pack)
    assert marked.index == plain.index and writes == plain.writes
    assert _reread(marked.index) == plain.index
