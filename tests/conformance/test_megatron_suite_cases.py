"""Behaviours Megatron-LM's own dist_checkpointing unit tests check (tools/peer_suites/megatron runs
them against us), written as our tests: uneven 1-D splits where some ranks hold no elements.

Megatron-Core accepts an empty shard on any number of ranks, each its main replica (replica_id 0)
at the same offset: it covers nothing, so it cannot overlap another shard or fill a gap.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.planning.metadata import ShardRecord
from lightning_distckpt.planning.validation import validate_tensor_records

WORLD = 4


def _piece(split: List[int], rank: int, key: str, fill: torch.Tensor, mod: object) -> object:
    """Rank ``rank``'s piece of a 1-D tensor cut as ``split`` (elements per rank), a main replica."""
    start = sum(split[:rank])
    data = fill[start:start + split[rank]].clone()
    return mod.ShardedTensor(key, data, data.dtype, tuple(data.shape), (sum(split),), (start,), None)


def _save_then_load(rank: int, world: int, path: str, src: List[int], dst: List[int], use_megatron: bool) -> list:
    if use_megatron:
        from megatron.core.dist_checkpointing import mapping as mod
    else:
        mod = ldc
    values = torch.arange(sum(src), dtype=torch.float32) * 10
    ldc.save({"a": _piece(src, rank, "a", values, mod)}, path)
    out = ldc.load({"a": _piece(dst, rank, "a", torch.full((sum(dst),), -1.0), mod)}, path)
    start = sum(dst[:rank])
    return [torch.equal(out["a"], values[start:start + dst[rank]]), tuple(out["a"].shape)]


@pytest.mark.parametrize(("src", "dst", "use_megatron"), [
    ([3, 0, 0, 5], [0, 4, 4, 0], False),  # ranks 1 and 2 empty at one offset; empty pieces asked for too
    ([8, 0, 0, 0], [2, 2, 2, 2], True),  # Megatron-Core's ShardedTensors, three empty ones at offset 8
], ids=["ours", "megatron_leaves"])
def test_empty_main_shards_on_several_ranks_save_and_reshard(tmp_path, src, dst, use_megatron):
    if use_megatron:
        pytest.importorskip("megatron.core.dist_checkpointing")
    results = run_distributed(_save_then_load, WORLD, str(tmp_path / "ckpt"), src, dst, use_megatron)
    assert results == [[True, (n,)] for n in dst]


def _record(rank: int, offset: int, length: int) -> ShardRecord:
    return ShardRecord(key="a", dtype="float32", global_shape=(8,), offset=(offset,), shape=(length,),
                       flat=None, main=True, rank=rank)


def test_validation_ignores_empty_main_shards_but_not_duplicated_data():
    empty_twice = [_record(0, 0, 8), _record(1, 8, 0), _record(2, 8, 0), _record(3, 3, 0)]
    assert validate_tensor_records(empty_twice) == []
    full_twice = [_record(0, 0, 8), _record(1, 0, 8)]
    (problem,) = validate_tensor_records(full_twice)
    assert "main replica on ranks 0 and 1" in problem
    gap = [_record(0, 0, 4), _record(1, 4, 0)]
    assert "cover 4 of 8 elements" in " ".join(validate_tensor_records(gap))
