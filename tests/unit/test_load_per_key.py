"""The load's per-key shortcuts give what the general code gives: the replay of even splits' pack
offsets in plain ints (few chunks) against the vectorised one, the bytes per writer, a request
that is a stored shard planned as one whole item, the exchange plan's buckets, and pieces copied
out of a pack run by numpy against torch."""

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.core.mapping import ShardedTensor
from lightning_distckpt.planning import even_index
from lightning_distckpt.planning.even_index import EvenSplit, chunks_count
from lightning_distckpt.planning.exchange_plan import ChunkRequest, plan_exchange
from lightning_distckpt.planning.load_plan import plan_tensor_read
from lightning_distckpt.planning.metadata import CheckpointIndex, StoredShard, TensorEntry
from lightning_distckpt.storage.layout import _max_depth
from lightning_distckpt.storage.packs import copy_out, to_numpy

_even = st.tuples(st.integers(0, 30), st.integers(0, 3), st.integers(1, 9), st.integers(0, 12))  # rows, cols, over, first
_listed = st.tuples(st.integers(0, 12), st.integers(1, 5))  # writer, numel
_entry = st.tuples(st.sampled_from(["float32", "bfloat16"]), st.one_of(_even, _listed))


def _index(entries):
    """An index of even splits and listed packed shards, packed by the rule (PackEnds, as a save plans)."""
    tensors = {}
    for k, (dtype, spec) in enumerate(entries):
        if len(spec) == 4:
            rows, cols, over, first = spec
            shape = (rows, cols) if cols else (rows,)
            tensors[f"k{k:02d}"] = TensorEntry(shape, dtype, even=EvenSplit(over, min(first, chunks_count(shape, over))))
        else:
            writer, numel = spec
            tensors[f"k{k:02d}"] = TensorEntry((numel,), dtype, [StoredShard((0,), (numel,), None, writer, 0, None)])
    chunks = [chunks_count(e.global_shape, e.even.over) for e in tensors.values() if e.even is not None]
    packs = even_index.PackEnds(max(chunks, default=1))
    for key in sorted(tensors):
        e = tensors[key]
        if e.even is not None:
            packs.take_even(e.dtype, e.even.numels(e.global_shape), e.even.packed_from)
        else:
            s = e.shards[0]
            e.shards[0] = StoredShard(s.offset, s.shape, None, s.writer, 0, packs.take(s.writer, e.dtype, s.numel))
    return tensors


def _replayed(tensors, small):
    out = copy.deepcopy(tensors)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(even_index, "_SMALL_SPLITS", 1 << 30 if small else 0)
        even_index.replay_packs(out, "ck")
    return {k: e.even.packed.tolist() for k, e in out.items() if e.even is not None}


@settings(max_examples=150, deadline=None)
@given(st.lists(_entry, min_size=1, max_size=12), st.data())
def test_small_splits_replay_as_the_vectorised_rule(entries, data):
    tensors = _index(entries)
    assert _replayed(tensors, True) == _replayed(tensors, False)
    listed = [k for k, e in tensors.items() if e.even is None]
    if listed and len(listed) < len(tensors):  # a listed shard moved off the rule is refused by both (where
        # the index has even splits: the replay is theirs)
        key = data.draw(st.sampled_from(listed))
        s = tensors[key].shards[0]
        tensors[key].shards[0] = StoredShard(s.offset, s.shape, None, s.writer, 0, s.packed + 1)
        for small in (True, False):
            with pytest.raises(FormatError, match="packing rule"):
                _replayed(tensors, small)


@settings(max_examples=100, deadline=None)
@given(st.lists(_entry, max_size=12), st.sampled_from([1, 2, 70, 300]))
def test_bytes_per_writer_sums_every_chunk(entries, over):
    """Splits over few ranks (plain ints) and over many (numpy): each writer's bytes, counted chunk by chunk."""
    index = CheckpointIndex(tensors=_index(entries))
    for e in index.tensors.values():
        if e.even is not None:
            e.even = EvenSplit(over if e.even.over > 4 else e.even.over, 0)
    want = {}
    for e in index.tensors.values():
        shards = e.shards if e.even is None else e.shards_in_rows(0, e.global_shape[0] if e.global_shape else 0)
        for s in shards:
            want[s.writer] = want.get(s.writer, 0) + s.numel * (2 if e.dtype == "bfloat16" else 4)
    assert index.bytes_per_writer() == {w: n for w, n in want.items() if n}


def test_a_request_that_is_a_stored_shard_is_one_whole_item():
    entry = TensorEntry((6, 4), "float32", even=EvenSplit(3, 3))
    request = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, 1, 3))
    plan = plan_tensor_read(request, entry, "ck")
    assert plan.whole and not plan.zero_fill and len(plan.items) == 1
    item = plan.items[0]
    assert (item.writer, item.index) == (1, 1) and item.src == item.dst == (slice(0, 2), slice(0, 4))
    resharded = plan_tensor_read(ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), (0, 1, 2)), entry, "ck")
    assert not resharded.whole and [(i.writer, i.src, i.dst) for i in resharded.items] == [
        (1, (slice(1, 2), slice(0, 4)), (slice(0, 1), slice(0, 4))), (2, (slice(0, 2), slice(0, 4)),
                                                                      (slice(1, 3), slice(0, 4)))]


def test_exchange_buckets_hold_at_most_bucket_bytes_in_chunk_order():
    requests = [[ChunkRequest((f"k{i:05d}", (0,), (4,), None, "float32"), 16) for i in range(5000)]] * 2
    plan = plan_exchange(requests, bucket_bytes=1000)
    assert all(op.nbytes <= 1000 for op in plan.ops)
    assert sorted(c[0] for op in plan.ops for c in op.chunks) == [f"k{i:05d}" for i in range(5000)]
    assert max(len(op.chunks) for op in plan.ops) == 62


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
def test_pieces_copied_out_of_a_pack_run(dtype):
    run = torch.arange(40).to(dtype)
    big = torch.zeros(6, 4, dtype=dtype)
    pieces = [(0, (2, 3), (slice(0, 2), slice(1, 3)), big[1:3, 0:2]),  # a part into a strided view
              (6, (4,), (slice(0, 4),), torch.zeros(4, dtype=dtype)),
              (10, (), (), torch.zeros((), dtype=dtype)),
              (11, (3,), (slice(0, 3),), torch.zeros(3, dtype=torch.float64))]  # converted by torch
    flat = run.clone()
    assert copy_out(to_numpy(run), pieces) == 2 * 2 * run.element_size() + 4 * run.element_size() + run.element_size() + 24
    assert torch.equal(big[1:3, 0:2], flat[0:6].view(2, 3)[:, 1:3]) and big[0].eq(0).all() and big[3:].eq(0).all()
    assert torch.equal(pieces[1][3], flat[6:10]) and torch.equal(pieces[2][3], flat[10])
    assert torch.equal(pieces[3][3], flat[11:14].to(torch.float64))


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.one_of(st.none(), st.integers(), st.text(alphabet='[]{}"ab:,\\ ', max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(alphabet='[]{}"ab\\', max_size=4), inner,
                                                            max_size=3)), max_leaves=12))
def test_json_nesting_depth(value):
    """Counted over the text, brackets inside strings (escaped quotes too) skipped."""
    def depth(v):
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        return 0

    raw = json.dumps(value).encode()
    assert _max_depth(raw) == depth(value)
    assert _max_depth(json.dumps(value, ensure_ascii=False).encode()) == depth(value)
