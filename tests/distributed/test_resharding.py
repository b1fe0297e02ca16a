"""Checkpoints written under one split load under another (real gloo groups of 1, 2 and 4)."""

import math

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint

GLOBAL = (8, 12)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64}


def full_tensor(name):
    t = torch.arange(math.prod(GLOBAL), dtype=torch.float64).reshape(GLOBAL) * 0.37 - 11.0
    return t.to(DTYPES[name])


def even(axis, parts, idx):
    size = GLOBAL[axis] // parts
    off = [0, 0]
    shape = list(GLOBAL)
    off[axis], shape[axis] = idx * size, size
    return tuple(off), tuple(shape)


# layout name -> (world size, fn(rank) -> (offset, local shape, replica id))
LAYOUTS = {
    "whole": (1, lambda r: ((0, 0), GLOBAL, 0)),
    "rows2": (2, lambda r: (*even(0, 2, r), 0)),
    "cols2": (2, lambda r: (*even(1, 2, r), 0)),
    "rows4": (4, lambda r: (*even(0, 4, r), 0)),
    "cols4": (4, lambda r: (*even(1, 4, r), 0)),
    "grid2x2": (4, lambda r: ((r // 2 * 4, r % 2 * 6), (4, 6), 0)),
    "dp2": (2, lambda r: ((0, 0), GLOBAL, r)),
    "uneven2": (2, lambda r: ((0, 0), (3, 12), 0) if r == 0 else ((3, 0), (5, 12), 0)),
    "tp2dp2": (4, lambda r: (*even(0, 2, r % 2), r // 2)),
}


def state_for(layout, rank, zeros):
    _, fn = LAYOUTS[layout]
    off, shape, replica = fn(rank)
    sd = {}
    for name in DTYPES:
        sl = tuple(slice(o, o + s) for o, s in zip(off, shape))
        data = torch.zeros(shape, dtype=DTYPES[name]) if zeros else full_tensor(name)[sl].clone()
        sd[name] = ldc.ShardedTensor.from_offsets(name, data, GLOBAL, off, replica_id=replica)
    return sd, off, shape


# Every layout is saved twice: with the default packing (these shards are small, so each is a range
# of its writer's pack array, read through an index-array view) and with every shard its own array.
STORAGE = {"packed": ldc.StorageOptions(), "arrays": ldc.StorageOptions(pack_max_bytes=0)}


def _save(rank, world, root, layouts):
    for layout in layouts:
        sd, _, _ = state_for(layout, rank, zeros=False)
        for kind, storage in STORAGE.items():
            ldc.save(sd, f"{root}/{kind}/{layout}", storage=storage)


def _load_check(rank, world, root, pairs):
    for saved, wanted in pairs:
        for kind in STORAGE:
            template, off, shape = state_for(wanted, rank, zeros=True)
            data_ptrs = {k: v.data.data_ptr() for k, v in template.items()}
            path = f"{root}/{kind}/{saved}"
            packed = [sh.packed for e in OpenedCheckpoint.open(path).index.tensors.values() for sh in e.shards]
            assert all(p is not None for p in packed) if kind == "packed" else all(p is None for p in packed)
            out = ldc.load(template, path)
            sl = tuple(slice(o, o + s) for o, s in zip(off, shape))
            for name in DTYPES:
                expected = full_tensor(name)[sl]
                assert out[name].dtype == DTYPES[name]
                assert torch.equal(out[name], expected), f"{kind} {saved}->{wanted} {name} rank {rank}"
                assert out[name].data_ptr() == data_ptrs[name], "load must read into the given tensor"
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    by_world = {}
    for name, (world, _) in LAYOUTS.items():
        by_world.setdefault(world, []).append(name)
    for world, layouts in by_world.items():
        if world == 1:
            _save(0, 1, root, layouts)
        else:
            run_distributed(_save, world, root, layouts)
    return root


def test_load_single_process(saved):
    pairs = [(s, "whole") for s in LAYOUTS]
    _load_check(0, 1, saved, pairs)


def test_load_two_processes(saved):
    # TP 1->2 and 2->2 across axes, grid -> rows, DP -> sharded, sharded -> DP, uneven.
    pairs = [("whole", "rows2"), ("whole", "cols2"), ("rows2", "cols2"), ("cols2", "rows2"), ("grid2x2", "uneven2"),
             ("dp2", "rows2"), ("rows2", "dp2"), ("uneven2", "cols2"), ("tp2dp2", "dp2")]
    run_distributed(_load_check, 2, saved, pairs)


def test_load_four_processes(saved):
    pairs = [("rows2", "rows4"), ("cols2", "cols4"), ("rows2", "cols4"), ("grid2x2", "rows4"), ("dp2", "grid2x2"),
             ("uneven2", "tp2dp2"), ("whole", "grid2x2")]
    run_distributed(_load_check, 4, saved, pairs)


def test_prepend_axis_and_shape_mismatch(tmp_path):
    layers = [torch.full((4, 6), float(i)) for i in range(3)]
    sd = {f"l{i}": ldc.ShardedTensor.from_rank_offsets("layers.w", layers[i], (0, i, 3), prepend_axis_num=1)
          for i in range(3)}
    ldc.save(sd, tmp_path / "ck")
    plain = ldc.load_plain_tensors(tmp_path / "ck")["layers.w"]
    assert plain.shape == (3, 4, 6) and torch.equal(plain[2], layers[2])
    # The stacked tensor read back as one prepended-axis shard per layer, half the columns each.
    t = {"x": ldc.ShardedTensor.from_rank_offsets("layers.w", torch.zeros(4, 3), (0, 1, 3), (2, 1, 2),
                                                  prepend_axis_num=1)}
    assert torch.equal(ldc.load(t, tmp_path / "ck")["x"], torch.ones(4, 3))
    # A vocabulary padded to a larger multiple: zero-filled; a smaller one: truncated.
    vocab = torch.arange(40.0).reshape(10, 4)
    ldc.save({"emb": ldc.ShardedTensor.from_rank_offsets("emb", vocab)}, tmp_path / "v")
    big = ldc.load({"emb": ldc.ShardedTensor.from_rank_offsets("emb", torch.full((16, 4), 7.0),
                                                               allow_shape_mismatch=True)}, tmp_path / "v")["emb"]
    assert torch.equal(big[:10], vocab) and torch.equal(big[10:], torch.zeros(6, 4))
    small = ldc.load({"emb": ldc.ShardedTensor.from_rank_offsets("emb", torch.zeros(4, 4), (0, 1, 2),
                                                                 allow_shape_mismatch=True)}, tmp_path / "v")["emb"]
    assert torch.equal(small, vocab[4:8])
