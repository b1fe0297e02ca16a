"""Flattened (distributed-optimizer) shards: pure planning checked against numpy on random
layouts, validation of flat ranges, and real saves/loads across DP and TP changes on gloo groups."""

import math
import random

import numpy as np
import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.planning.flat_plan import (
    BoxRead,
    SpanRead,
    count_lex_below,
    flat_range_boxes,
    plan_flat_read,
)
from lightning_distckpt.planning.metadata import ShardRecord, StoredShard, TensorEntry
from lightning_distckpt.planning.validation import validate_tensor_records
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
from lightning_distckpt.reading.reads import read_tensors


# -- geometry -------------------------------------------------------------------------------
def test_flat_range_boxes_tile_the_range_in_order():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        boxes = flat_range_boxes(shape, lo, hi)
        assert len(boxes) <= 2 * len(shape) - 1
        idx = np.arange(n).reshape(shape)
        got = np.concatenate([idx[tuple(slice(o, o + s) for o, s in zip(off, sh))].reshape(-1)
                              for off, sh in boxes]) if boxes else np.array([], dtype=int)
        assert got.tolist() == list(range(lo, hi))


def test_count_lex_below_matches_brute_force():
    rng = random.Random(1)
    for _ in range(200):
        nd = rng.randint(1, 3)
        off = tuple(rng.randint(0, 3) for _ in range(nd))
        shape = tuple(rng.randint(1, 4) for _ in range(nd))
        point = tuple(rng.randint(0, 7) for _ in range(nd))
        elems = [tuple(o + i for o, i in zip(off, ix)) for ix in np.ndindex(*shape)]
        assert count_lex_below((off, shape), point) == sum(e < point for e in elems)


# -- planning against a numpy model of storage ------------------------------------------------
def _split(n, parts, rng, uneven):
    parts = min(parts, n)
    if not uneven:
        return [n * i // parts for i in range(parts + 1)]
    cuts = sorted(rng.sample(range(1, n), parts - 1)) if n >= parts else []
    return [0] + cuts + [n]


def _grid(shape, axis, parts):
    """Boxes splitting ``shape`` evenly along ``axis`` into ``parts`` (a TP split)."""
    step = shape[axis] // parts
    out = []
    for p in range(parts):
        off = [0] * len(shape)
        sh = list(shape)
        off[axis], sh[axis] = p * step, step
        out.append((tuple(off), tuple(sh)))
    return out


def _apply(plan, stored_arrays, numel, dtype=torch.float64):
    """Execute a plan with torch on in-memory arrays (what read_tensors does with tensorstore)."""
    dest = torch.full((numel,), float("nan"), dtype=dtype)
    if plan.zero_fill:
        dest.zero_()

    def strided(buf, v):
        return buf.as_strided(v.shape, v.strides, buf.storage_offset() + v.offset)

    for item in plan.items:
        arr = stored_arrays[item.writer]
        if isinstance(item, BoxRead):
            strided(dest, item.dst).copy_(arr[item.src])
        else:
            assert isinstance(item, SpanRead)
            buf = torch.cat([arr[s:s + item.length] for s in item.starts.tolist()])
            assert buf.numel() == item.read_numel
            for src, dst in item.copies:
                strided(dest, dst).copy_(strided(buf, src))
    return dest


def _stored(full, boxes, rng, flat_pieces):
    """Store each box whole (flat_pieces=0) or cut into flat pieces at random boundaries."""
    arrays, shards = [], []
    for off, shape in boxes:
        block = full[tuple(slice(o, o + s) for o, s in zip(off, shape))]
        if flat_pieces:
            cuts = _split(math.prod(shape), flat_pieces, rng, uneven=True)
            for a, b in zip(cuts, cuts[1:]):
                shards.append(StoredShard(off, shape, (a, b), len(arrays), 0))
                arrays.append(block.reshape(-1)[a:b].clone())
        else:
            shards.append(StoredShard(off, shape, None, len(arrays), 0))
            arrays.append(block.clone())
    return arrays, shards


@pytest.mark.parametrize("seed", range(6))
def test_random_reshards_match_numpy(seed):
    """Any mix of flat/non-flat on both sides, TP axis and size changes, uneven DP boundaries."""
    rng = random.Random(seed)
    for _ in range(40):
        nd = rng.randint(1, 3)
        shape = tuple(rng.choice([2, 4, 6, 12]) for _ in range(nd))
        full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
        s_axis, r_axis = rng.randrange(nd), rng.randrange(nd)
        s_parts = rng.choice([p for p in (1, 2) if shape[s_axis] % p == 0])
        r_parts = rng.choice([p for p in (1, 2, 3) if shape[r_axis] % p == 0])
        arrays, shards = _stored(full, _grid(shape, s_axis, s_parts), rng, flat_pieces=rng.choice([0, 1, 2, 3]))
        entry = TensorEntry(shape, "float64", shards)
        for off, box in _grid(shape, r_axis, r_parts):
            block = full[tuple(slice(o, o + s) for o, s in zip(off, box))].reshape(-1)
            pieces = rng.choice([0, 1, 3])
            cuts = _split(math.prod(box), pieces, rng, uneven=True) if pieces else [0, math.prod(box)]
            for a, b in zip(cuts, cuts[1:]):
                data = torch.zeros(b - a, dtype=torch.float64)
                req = (ldc.ShardedTensor.from_offsets("w", torch.zeros(box, dtype=torch.float64), shape, off)
                       if not pieces else
                       ldc.ShardedTensor(key="w", data=data, dtype=torch.float64, local_shape=box, global_shape=shape,
                                         global_offset=off, flattened_range=slice(a, b)))
                plan = plan_flat_read(req, entry, "ck", slack_elems=0)
                got = _apply(plan, arrays, b - a)
                assert torch.equal(got, block[a:b]), (shape, s_axis, s_parts, r_axis, r_parts, off, a, b)
                # Proportional reads: never more than twice what is kept (slack 0).
                assert plan.read_numel <= 2 * (b - a)


def test_tp_increase_on_last_axis_reads_rows_not_the_tensor():
    """Stored flat, unsplit (TP=1); asked for one eighth of the columns (TP=8): with no slack the
    plan reads the needed row segments only, as many spans, computed without per-element loops."""
    shape = (64, 256)
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    shards = [StoredShard((0, 0), shape, (0, 5000), 0, 0), StoredShard((0, 0), shape, (5000, 64 * 256), 1, 0)]
    arrays = [full.reshape(-1)[:5000].clone(), full.reshape(-1)[5000:].clone()]
    req = ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64, 32, dtype=torch.float64), (1, 3, 8))
    plan = plan_flat_read(req, TensorEntry(shape, "float64", shards), "ck", slack_elems=0)
    assert plan.read_numel == 64 * 32  # exactly the needed elements
    assert torch.equal(_apply(plan, arrays, 64 * 32), full[:, 96:128].reshape(-1))
    spans = sum(len(i.starts) for i in plan.items)
    assert spans == 64  # one per row, not one per element
    # With the default slack small tensors are read in a few large spans instead.
    relaxed = plan_flat_read(req, TensorEntry(shape, "float64", shards), "ck")
    assert sum(len(i.starts) for i in relaxed.items) < 10


def test_dp_reshard_is_one_span_per_overlap():
    shape = (10, 7)  # 70 elements; DP=2 cut at 33 saved, DP=4 cuts requested
    shards = [StoredShard((0, 0), shape, (0, 33), 0, 0), StoredShard((0, 0), shape, (33, 70), 1, 0)]
    entry = TensorEntry(shape, "float32", shards)
    req = ldc.ShardedTensor(key="w", data=None, dtype=torch.float32, local_shape=shape, global_shape=shape,
                            global_offset=(0, 0), flattened_range=slice(20, 41))
    plan = plan_flat_read(req, entry, "ck")
    assert [(i.writer, i.starts.tolist(), i.length, i.direct) for i in plan.items] == [
        (0, [20], 13, True), (1, [0], 8, True)]


def test_shape_mismatch_zero_fills_flat_requests_and_incomplete_index_is_reported():
    shape = (4, 3)
    full = torch.arange(12, dtype=torch.float64).reshape(shape)
    arrays, shards = _stored(full, [((0, 0), shape)], random.Random(0), flat_pieces=2)
    bigger = ldc.ShardedTensor(key="w", data=None, dtype=torch.float64, local_shape=(6, 3), global_shape=(6, 3),
                               global_offset=(0, 0), flattened_range=slice(7, 16), allow_shape_mismatch=True)
    plan = plan_flat_read(bigger, TensorEntry(shape, "float64", shards), "ck")
    assert plan.zero_fill
    want = torch.cat([full.reshape(-1), torch.zeros(6, dtype=torch.float64)])[7:16]
    assert torch.equal(_apply(plan, arrays, 9), want)
    strict = ldc.ShardedTensor(key="w", data=None, dtype=torch.float64, local_shape=(6, 3), global_shape=(6, 3),
                               global_offset=(0, 0), flattened_range=slice(7, 16))
    with pytest.raises(ldc.ShardingError, match=r"global shape \(4, 3\).*allow_shape_mismatch"):
        plan_flat_read(strict, TensorEntry(shape, "float64", shards), "ck")
    kept = shards[1].flat[1] - shards[1].flat[0]  # drop the first piece from the index
    with pytest.raises(ldc.CheckpointingError, match=f"/ck/x: 'w': stored shards cover {kept} of the 12 elements"):
        whole = ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(shape, dtype=torch.float64))
        plan_flat_read(whole, TensorEntry(shape, "float64", shards[1:]), "/ck/x")


# -- validation of flat ranges ----------------------------------------------------------------
def _rec(rank, flat, offset=(0, 0), shape=(4, 6), main=True):
    return ShardRecord("opt.w", "float32", (8, 6), offset, shape, flat, main, rank)


def test_validation_flat_ranges_cover_each_shard_exactly_once():
    ok = [_rec(0, (0, 7)), _rec(1, (7, 24)), _rec(2, (0, 24), offset=(4, 0))]
    assert validate_tensor_records(ok) == []
    gap = validate_tensor_records([_rec(0, (0, 7)), _rec(1, (9, 24)), _rec(2, (0, 24), offset=(4, 0))])
    assert any("gap at element 7" in p and "rank 1" in p for p in gap)
    overlap = validate_tensor_records([_rec(0, (0, 9)), _rec(1, (7, 24)), _rec(2, (0, 24), offset=(4, 0))])
    assert any("overlap" in p for p in overlap)
    short = validate_tensor_records([_rec(0, (0, 7)), _rec(1, (7, 20)), _rec(2, (0, 24), offset=(4, 0))])
    assert any("cover 20 of 24" in p for p in short)
    mixed = validate_tensor_records([_rec(0, (0, 7)), _rec(1, None), _rec(2, (0, 24), offset=(4, 0))])
    assert any("both flattened and whole" in p for p in mixed)
    # Replicas (replica_id != 0) of a flat piece do not count twice.
    replicas = ok + [_rec(3, (0, 7), main=False)]
    assert validate_tensor_records(replicas) == []


# -- real saves and loads: a simulated distributed optimizer on gloo groups --------------------
# model key -> (full shape, TP axis). b.weight is row-parallel: a TP change cuts its rows.
PARAMS = {"a.weight": ((6, 5), 0), "a.bias": ((6,), 0), "b.weight": ((4, 6), 1)}
STATES = ("master", "exp_avg", "exp_avg_sq")
# Uneven DP boundaries over each TP rank's flat buffer, as fractions: they split rows and params.
CUTS = {1: [0.0, 1.0], 2: [0.0, 0.37, 1.0], 4: [0.0, 0.11, 0.48, 0.71, 1.0]}


def full_value(state, name):
    """fp32 values, distinct per state and parameter, exact in bf16 for the model copy."""
    shape, _ = PARAMS[name]
    i, j = STATES.index(state) if state in STATES else 3, list(PARAMS).index(name)
    return (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 100 * j + 1000 * i) * 0.5


def local_shard(t, name, tp, tp_rank):
    return t.chunk(tp, dim=PARAMS[name][1])[tp_rank]


def dist_opt_state(rank, world, tp, fill):
    """Model (bf16, whole shards, replicated over DP) and fp32 optimizer state kept flat: each DP
    rank owns one contiguous range of its TP rank's concatenated parameters, ranges uneven."""
    tp_rank, dp_rank = rank % tp, rank // tp
    dp = world // tp
    locals_ = {n: local_shard(full_value("model", n), n, tp, tp_rank) for n in PARAMS}
    total = sum(t.numel() for t in locals_.values())
    cuts = [round(f * total) for f in CUTS[dp]]
    r0, r1 = cuts[dp_rank], cuts[dp_rank + 1]
    sd = {"model": {}, "optimizer": {}}
    for n, t in locals_.items():
        data = t.to(torch.bfloat16) if fill else torch.zeros_like(t, dtype=torch.bfloat16)
        sd["model"][n] = ldc.ShardedTensor.from_rank_offsets(
            f"model.{n}", data, (PARAMS[n][1], tp_rank, tp), replica_id=dp_rank)
    buffers, expected = {}, {}
    for s in STATES:
        flat = torch.cat([local_shard(full_value(s, n), n, tp, tp_rank).reshape(-1) for n in PARAMS])
        expected[s] = flat[r0:r1].clone()
        buffers[s] = expected[s].clone() if fill else torch.full((r1 - r0,), float("nan"))
        p0 = 0
        for n, t in locals_.items():
            lo, hi = max(r0, p0), min(r1, p0 + t.numel())
            if lo < hi:
                sd["optimizer"][f"{s}.{n}"] = ldc.ShardedTensor.from_rank_offsets_flat(
                    f"optimizer.{s}.{n}", buffers[s][lo - r0:hi - r0], t.shape, (PARAMS[n][1], tp_rank, tp),
                    flattened_range=slice(lo - p0, hi - p0))
            p0 += t.numel()
    return sd, buffers, expected


def whole_state(rank, world, tp):
    """The same state saved without flattening (TP shards, replicated over DP)."""
    tp_rank, dp_rank = rank % tp, rank // tp
    return {f"optimizer.{s}.{n}": ldc.ShardedTensor.from_rank_offsets(
        f"optimizer.{s}.{n}", local_shard(full_value(s, n), n, tp, tp_rank).clone(), (PARAMS[n][1], tp_rank, tp),
        replica_id=dp_rank) for s in STATES for n in PARAMS}


def load_and_check(rank, world, tp, path, what):
    sd, buffers, expected = dist_opt_state(rank, world, tp, fill=False)
    loaded = ldc.load(sd, path)
    for s in STATES:
        assert torch.equal(buffers[s], expected[s]), f"{what}: rank {rank}: {s} flat buffer differs"
    for n in PARAMS:
        got = loaded["model"][n]
        assert got.dtype == torch.bfloat16
        want = local_shard(full_value("model", n), n, tp, rank % tp).to(torch.bfloat16)
        assert torch.equal(got, want), f"{what}: rank {rank}: model {n} differs"
    # The flat views were filled in place: the returned tensors are the buffer slices.
    for key, t in loaded["optimizer"].items():
        assert t.data_ptr() == sd["optimizer"][key].data.data_ptr()


def _save_world2(rank, world, root):
    ldc.save(dist_opt_state(rank, world, 1, fill=True)[0], f"{root}/tp1dp2")
    ldc.save(dist_opt_state(rank, world, 2, fill=True)[0], f"{root}/tp2dp1")
    ldc.save(whole_state(rank, world, 2), f"{root}/whole_tp2")


def _world4(rank, world, root):
    load_and_check(rank, world, 1, f"{root}/tp1dp2", "DP 2->4")
    load_and_check(rank, world, 2, f"{root}/tp1dp2", "TP 1->2, DP 2->2 (ranges move)")
    load_and_check(rank, world, 1, f"{root}/tp2dp1", "TP 2->1, DP 1->4")
    ldc.save(dist_opt_state(rank, world, 1, fill=True)[0], f"{root}/tp1dp4")


def _world2_after(rank, world, root):
    load_and_check(rank, world, 1, f"{root}/tp1dp4", "DP 4->2")
    load_and_check(rank, world, 2, f"{root}/tp1dp4", "DP 4->1, TP 1->2")
    # Flat requests from whole stored shards (and another TP split).
    sd, buffers, expected = dist_opt_state(rank, world, 1, fill=False)
    ldc.load({"optimizer": sd["optimizer"]}, f"{root}/whole_tp2")
    for s in STATES:
        assert torch.equal(buffers[s], expected[s]), f"whole TP2 -> flat DP2: rank {rank}: {s}"


def test_flattened_dp_and_tp_reshards_on_gloo(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_world2, 2, root)
    # A flat checkpoint read whole, in one process: flat pieces -> whole tensors.
    plain = ldc.load_plain_tensors(f"{root}/tp1dp2")
    for s in STATES:
        for n in PARAMS:
            assert torch.equal(plain[f"optimizer.{s}.{n}"], full_value(s, n))
    assert plain["model.a.weight"].dtype == torch.bfloat16
    run_distributed(_world4, 4, root)
    run_distributed(_world2_after, 2, root)


def test_flat_reads_are_proportional_on_disk(tmp_path):
    """A TP=8 column slice of a flat-saved (TP=1, two uneven DP pieces) 256x512 fp32 tensor reads
    about its own size from the files, not the tensor."""
    rows, cols = 256, 512
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    cut = 70_001
    ldc.save({"a": ldc.ShardedTensor.from_rank_offsets_flat("w", full.reshape(-1)[:cut].clone(), (rows, cols),
                                                              flattened_range=slice(0, cut)),
              "b": ldc.ShardedTensor.from_rank_offsets_flat("w", full.reshape(-1)[cut:].clone(), (rows, cols),
                                                              flattened_range=slice(cut, rows * cols))},
             tmp_path / "ck")
    ckpt = OpenedCheckpoint.open(str(tmp_path / "ck"))
    want = ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(rows, cols // 8), (1, 5, 8))
    out, nbytes = read_tensors(ckpt, [want], set())
    assert torch.equal(out[0], full[:, 5 * 64:6 * 64])
    needed = rows * cols // 8 * 4
    assert nbytes <= 2 * needed, (nbytes, needed)  # the whole tensor would be 8x
    # A flat request under DP=3 with TP=8: a range of the column slice, cut mid-row.
    buf = torch.zeros(5000)
    flat = ldc.ShardedTensor.from_rank_offsets_flat("w", buf, (rows, cols // 8), (1, 5, 8),
                                                    flattened_range=slice(3001, 8001))
    out, nbytes = read_tensors(ckpt, [flat], set())
    assert torch.equal(buf, full[:, 5 * 64:6 * 64].reshape(-1)[3001:8001])
    assert nbytes <= 2 * 5000 * 4 + 4 * 64 * 4
