"""``load_sharded_metadata``: Megatron-Core's function of that name, side by side with megatron-core's
own on the checkpoints each of its releases wrote, and on ours (tensors under their keys, each
ShardedObject element under Megatron's unique key; loading with it reads the whole checkpoint)."""

from __future__ import annotations

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.serialization import load_sharded_metadata

from .megatron_side import FIXTURES, cpu_only_megatron, versions


def _described(metadata):
    """key -> the fields both libraries' ShardedTensor / ShardedObject have, comparable."""
    out = {}
    for name, m in metadata.items():
        if hasattr(m, "dtype"):
            out[name] = ("tensor", m.key, tuple(m.global_shape), tuple(m.global_offset), m.dtype)
        else:
            out[name] = ("object", m.key, tuple(m.global_shape), tuple(m.global_offset))
    return out


def _megatron_metadata(rank, world, paths):
    # In a worker: importing megatron-core changes torch's process-wide allow-list.
    cpu_only_megatron()
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata as megatron_lsm

    return {path: _described(megatron_lsm(path)) for path in paths}


def test_same_entries_as_megatron_core_on_the_checkpoints_of_each_release():
    paths = [f"{FIXTURES}/{version}" for version in versions()]
    (theirs,) = run_distributed(_megatron_metadata, 1, paths)  # one worker for every release
    for path in paths:
        assert _described(load_sharded_metadata(path)) == theirs[path], path


def test_loading_with_it_reads_the_whole_checkpoint(tmp_path):
    sd = {
        "a": ldc.ShardedTensor.from_rank_offsets("TenA", torch.arange(6).reshape(2, 3)),
        "o": ldc.ShardedObject("ObjA", list(range(10)), (1,), (0,)),
        "p": [ldc.ShardedObject("ObjB", {i + 7}, (1, 8), (0, i)) for i in range(8)],
    }
    ldc.save(sd, str(tmp_path / "ck"))
    metadata = load_sharded_metadata(str(tmp_path / "ck"))
    assert set(metadata) == {"TenA", "ObjA/shard_0_1", *(f"ObjB/shard_0.{i}_1.8" for i in range(8))}
    assert {m.key for m in metadata.values()} == {"TenA", "ObjA", "ObjB"}
    loaded = ldc.load(metadata, str(tmp_path / "ck"))
    assert torch.equal(loaded["TenA"], torch.arange(6).reshape(2, 3))
    assert loaded["ObjA/shard_0_1"] == list(range(10))
    assert all(loaded[f"ObjB/shard_0.{i}_1.8"] == {i + 7} for i in range(8))


def test_a_missing_checkpoint_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sharded_metadata(str(tmp_path / "nothing"))
