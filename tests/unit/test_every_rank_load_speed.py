"""The every-rank and fully-parallel loaders' per-key shortcuts give what the general code gives:
a request that is a stored shard found without a plan (``whole_stored`` against
``plan_tensor_read``), an even split's packed chunk placed by its rule (``PackedPlaces.shard``
against the per-writer listing), and a plain CPU tensor read into as itself (``destination``)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.core.mapping import ShardedTensor
from lightning_distckpt.planning import even_index
from lightning_distckpt.planning.even_index import EvenSplit, PackedPlaces, chunks_count
from lightning_distckpt.planning.load_plan import plan_tensor_read, whole_stored
from lightning_distckpt.planning.metadata import CheckpointIndex, StoredShard, TensorEntry
from lightning_distckpt.reading.reads import destination

# off0, rows, off1, cols
_box = st.tuples(st.integers(-1, 12), st.integers(0, 12), st.integers(0, 3), st.integers(0, 4))


def _request(global_shape, box, mismatch):
    off0, rows, off1, cols = box
    if len(global_shape) == 1:
        return ShardedTensor("w", None, torch.float32, (rows,), global_shape, (off0,), allow_shape_mismatch=mismatch)
    return ShardedTensor("w", None, torch.float32, (rows, cols), global_shape, (off0, off1),
                         allow_shape_mismatch=mismatch)


def _planned_whole(request, entry):
    try:
        plan = plan_tensor_read(request, entry, "ck")
    except CheckpointingError:  # refused (shape mismatch, not covered): the shortcut must not take it
        return "refused"
    if getattr(plan, "whole", False):
        return (plan.items[0].writer, plan.items[0].index)
    return None


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 12), st.integers(0, 3), st.integers(1, 6), _box, st.booleans(), st.booleans(), st.booleans())
def test_whole_stored_is_plan_tensor_reads_whole_plan(rows, cols, over, box, listed, other_shape, mismatch):
    """Even splits and one-shard listed entries, requests of any box (a chunk, several, a part, off
    the tensor), the template's global shape as saved or not: the shortcut names a shard exactly where
    the plan is one whole item of it, and never takes a request the plan refuses or slices (a global
    shape other than saved, even where allowed, is always the plan's)."""
    shape = (rows, cols) if cols else (rows,)
    if listed:
        entry = TensorEntry(shape, "float32", [StoredShard((0,) * len(shape), shape, None, 3, 0, None)])
    else:
        entry = TensorEntry(shape, "float32", even=EvenSplit(over, chunks_count(shape, over)))
    asked = ((rows + 1,) + shape[1:]) if other_shape else shape
    try:
        request = _request(asked, box, mismatch)
    except Exception:  # a box the ShardedTensor itself refuses
        return
    planned, shortcut = _planned_whole(request, entry), whole_stored(request, entry)
    if shortcut is not None or not other_shape:  # another global shape (allowed to differ) is left to the plan
        assert shortcut == (planned if planned != "refused" else None)


def test_whole_stored_leaves_flattened_and_multi_shard_entries_to_the_plan():
    flat = TensorEntry((8,), "float32", [StoredShard((0,), (8,), (0, 4), 0, 0, None),
                                         StoredShard((0,), (8,), (4, 8), 1, 1, None)])
    two = TensorEntry((8,), "float32", [StoredShard((0,), (4,), None, 0, 0, None),
                                        StoredShard((4,), (4,), None, 1, 1, None)])
    request = ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, 0, 2))
    assert whole_stored(request, flat) is None and whole_stored(request, two) is None
    assert not plan_tensor_read(request, two, "ck").whole  # listed shards are planned (not a chunk rule)
    whole = ShardedTensor.from_rank_offsets("w", torch.zeros(8))
    one = TensorEntry((8,), "float32", [StoredShard((0,), (8,), None, 5, 2, 16)])
    assert whole_stored(whole, one) == (5, 2)
    flat_request = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (8,), (0, 0, 1),
                                                        flattened_range=slice(0, 4))
    assert whole_stored(flat_request, one) is None


# rows, cols, over, first
_even = st.tuples(st.integers(0, 30), st.integers(0, 3), st.integers(1, 9), st.integers(0, 12))
_listed = st.tuples(st.integers(0, 12), st.integers(1, 5))  # writer, numel


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float32", "int8"]), st.one_of(_even, _listed)), min_size=1, max_size=8))
def test_packed_places_shard_is_what_the_per_writer_listing_says(entries):
    """``shard(writer, key, index)`` (an even chunk by its rule) against ``get`` (every chunk of the
    writer listed), for every writer, key and index near the splits, packed or not."""
    tensors = {}
    for k, (dtype, spec) in enumerate(entries):
        if len(spec) == 4:
            rows, cols, over, first = spec
            shape = (rows, cols) if cols else (rows,)
            tensors[f"k{k}"] = TensorEntry(shape, dtype, even=EvenSplit(over, min(first, chunks_count(shape, over))))
        else:
            writer, numel = spec
            tensors[f"k{k}"] = TensorEntry((numel,), dtype, [StoredShard((0,), (numel,), None, writer, 0, None)])
    packs = even_index.PackEnds(16)
    for key in sorted(tensors):  # every shard packed by the rule, as a save plans them
        e = tensors[key]
        if e.even is not None:
            packs.take_even(e.dtype, e.even.numels(e.global_shape), e.even.packed_from)
        else:
            s = e.shards[0]
            e.shards[0] = StoredShard(s.offset, s.shape, None, s.writer, 0, packs.take(s.writer, e.dtype, s.numel))
    even_index.replay_packs(tensors, "ck")
    index = CheckpointIndex(tensors=tensors, objects={})
    fast, listing = PackedPlaces(index, lambda key, i: (key, i)), PackedPlaces(index, lambda key, i: (key, i))
    for writer in range(14):
        for key in [*tensors, "absent"]:
            for i in range(14):
                assert fast.shard(writer, key, i) == listing.get((writer, (key, i)))


def test_destination_is_a_plain_cpu_tensor_itself():
    plain = ShardedTensor.from_rank_offsets("a", torch.zeros(4, 2))
    out, into = destination(plain)
    assert out is plain.data and into is plain.data  # no alias per key
    param = torch.nn.Parameter(torch.zeros(4, 2))
    trained = ShardedTensor.from_rank_offsets("p", param)
    out, into = destination(trained)
    assert out is param and into is not param and not into.requires_grad
    into.fill_(1.0)
    assert bool((param.detach() == 1).all())  # written in place, through a detached alias
    strided = ShardedTensor.from_rank_offsets("t", torch.zeros(2, 4).t())
    out, into = destination(strided)
    assert out is into and out.data_ptr() != strided.data.data_ptr()  # not contiguous: a buffer


def test_every_rank_and_parallel_loads_fill_the_templates_tensors(tmp_path):
    """One process: tiny tensors and a parameter loaded as saved land in the template's own tensors."""
    saved = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((3,), float(i))) for i in range(20)}
    saved["p"] = ShardedTensor.from_rank_offsets("p", torch.nn.Parameter(torch.arange(6.0).reshape(2, 3)))
    ldc.save(saved, str(tmp_path / "ck"))
    for loader in ("every_rank", "parallel"):
        template = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(3)) for i in range(20)}
        param = torch.nn.Parameter(torch.zeros(2, 3))
        template["p"] = ShardedTensor.from_rank_offsets("p", param)
        got = ldc.load(template, str(tmp_path / "ck"), loader=loader)
        for i in range(20):
            assert got[f"t{i}"] is template[f"t{i}"].data and got[f"t{i}"].tolist() == [float(i)] * 3
        assert got["p"] is param and torch.equal(param.detach(), torch.arange(6.0).reshape(2, 3))


if __name__ == "__main__":
    pytest.main([__file__])
