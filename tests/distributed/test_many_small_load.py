"""Many tiny tensors (the per-key paths of a load: packs read as runs, pieces copied out by numpy,
buckets of chunks gathered and scattered by numpy, whole-shard read plans): exact values on 2 gloo
ranks under another split with every loader, mixed dtypes, non-contiguous destinations; a flipped
byte in a pack holding thousands of them is an error on every rank, never wrong values."""

import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed

N = 2000
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16)


def _full(i):
    """Tensor i, the same on every rank: 8 rows of 2 (a few of them 3-D), its dtype by i."""
    dtype = DTYPES[i % len(DTYPES)]
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 2, generator=g) * 50
    x = x > 0 if dtype == torch.bool else x.to(dtype)
    return x.view(8, 2, 1) if i % 7 == 0 else x


def _state(rank, world, resplit, fill):
    """Even-numbered tensors split over the ranks along dim 0 and odd ones replicated; ``resplit``
    swaps the two (a load under another split). Every 11th loads into a non-contiguous view."""
    sd = {}
    for i in range(N):
        full = _full(i)
        split = (i % 2 == 0) != resplit
        data = full.chunk(world)[rank] if split else full
        if not fill:
            data = torch.zeros_like(data)
            if i % 11 == 0:  # a column of a wider tensor: read through a buffer, copied in
                data = torch.zeros(data.shape[:1] + (data.shape[1] + 1,) + data.shape[2:], dtype=data.dtype)[:, :-1]
        key = f"blocks.{i // 100:02d}.t{i:04d}"
        sd[key] = (ldc.ShardedTensor.from_rank_offsets(key, data.clone() if fill else data, (0, rank, world))
                   if split else ldc.ShardedTensor.from_rank_offsets(key, data, replica_id=rank))
    return sd


def _save(rank, world, path):
    ldc.save(_state(rank, world, False, True), path)
    return True


def _load(rank, world, path, loader):
    out = ldc.load(_state(rank, world, True, False), path, loader=loader)
    want = _state(rank, world, True, True)
    return [k for k, st in want.items() if not torch.equal(out[k], st.data)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("many") / "ck")
    run_distributed(_save, 2, path)
    return path


@pytest.mark.parametrize("loader", ["every_rank", "parallel", "two_stage"])
def test_thousands_of_tiny_tensors_load_exactly_under_another_split(saved, loader):
    assert run_distributed(_load, 2, saved, loader) == [[], []]


def _load_damaged(rank, world, path, loader):
    try:
        ldc.load(_state(rank, world, True, False), path, loader=loader)
    except ldc.CheckpointingError as e:
        return type(e).__name__, str(e)
    return None


def _flip_in_pack(path):
    """Flip a byte of tensor 10's first chunk as stored (in rank 0's float32 pack, among hundreds of others)."""
    needle = _full(10)[:4].contiguous().view(-1).numpy().tobytes()  # chunk 0 of split tensor 10 (rank 0's)
    found = []
    for d, _, files in os.walk(os.path.join(path, "data")):
        for f in files:
            blob = open(os.path.join(d, f), "rb").read()
            if needle in blob:
                found.append((os.path.join(d, f), blob.index(needle)))
    assert len(found) == 1, found
    victim, at = found[0]
    data = bytearray(open(victim, "rb").read())
    data[at + 5] ^= 0x01
    with open(victim, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize("loader", ["every_rank", "two_stage"])
def test_a_flipped_byte_in_a_pack_of_many_tiny_tensors_fails_every_rank(tmp_path, loader):
    path = str(tmp_path / "ck")
    run_distributed(_save, 2, path)
    _flip_in_pack(path)
    results = run_distributed(_load_damaged, 2, path, loader)
    assert all(r is not None for r in results), results  # no rank returned wrong values, none hung
    assert all("Digest mismatch" in r[1] or "checksum" in r[1].lower() for r in results), results
