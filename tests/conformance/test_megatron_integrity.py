"""Megatron-Core's remaining ``dist_checkpointing`` names on our format: ``load(...,
validate_access_integrity=True)`` checks the ranks' templates as Megatron-Core's
``validate_sharding_integrity`` does (on every rank alike, naming the key and the uncovered region),
``check_is_distributed_checkpoint`` answers for our checkpoints and Megatron-Core's, and
``remove_sharded_tensors`` refuses, touching nothing (docs/interop.md's rows)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed

mdc = pytest.importorskip("megatron.core.dist_checkpointing")

GROUP_TIMEOUT_S = 30  # a hang guard only: every case below ends in the same step on both ranks


def _w(rank, mod=ldc, replica=0, chunk=None, dtype=torch.float32):
    """Rank ``rank``'s half of the 1-D tensor 'w' (8 elements, 2 chunks), chunk ``chunk`` (default: its own)."""
    chunk = rank if chunk is None else chunk
    return mod.ShardedTensor.from_rank_offsets("w", torch.zeros(4, dtype=dtype), (0, chunk, 2), replica_id=replica)


def _obj(rank, replica=0):
    return ldc.ShardedObject("o", None, (2,), (rank,), replica_id=replica)


def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as e:  # the type and words, compared across ranks by the test
        return f"{type(e).__name__}: {e}"


def _megatron_check(rank, template):
    """Megatron-Core's own validate_sharding_integrity on the same templates (it raises on rank 0 only)."""
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    _, global_metadata = determine_global_metadata(template)
    return _outcome(lambda: validate_sharding_integrity(global_metadata))


def _broken_factory(rank):
    def build(key, data, replica_id, flattened_range):
        if rank == 1:
            raise RuntimeError("this rank's factory cannot build")
        return ldc.ShardedTensor.from_rank_offsets(key, data, (0, rank, 2))
    return ldc.ShardedTensorFactory("w", torch.zeros(4), build, lambda d: d)


def _cases(rank, world, path):
    full = torch.arange(8, dtype=torch.float32)
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", full[rank * 4:rank * 4 + 4].clone(), (0, rank, 2)),
              "o": ldc.ShardedObject("o", {"r": rank}, (2,), (rank,))}, path)
    out = {}

    def load(template, **kw):
        return lambda: ldc.load(template, path, **kw)
    # Megatron-Core's own templates and answer beside ours
    from megatron.core.dist_checkpointing import mapping as mmap
    gap_theirs = {"w": _w(rank, mmap, replica=rank)}  # rank 1's chunk is no main replica: chunk 1 uncovered
    out["megatron_gap"] = _megatron_check(rank, gap_theirs)
    out["ours_on_megatron_leaves_gap"] = _outcome(load(gap_theirs, validate_access_integrity=True))
    out["megatron_ok"] = _megatron_check(rank, {"w": _w(rank, mmap)})
    out["ok"] = _outcome(load({"w": _w(rank), "o": _obj(rank)}, validate_access_integrity=True))
    got = ldc.load({"w": _w(rank), "o": _obj(rank)}, path, validate_access_integrity=True)
    out["ok_values"] = (torch.equal(got["w"], full[rank * 4:rank * 4 + 4]), got["o"])
    out["gap"] = _outcome(load({"w": _w(rank, replica=rank)}, validate_access_integrity=True))
    out["gap_default"] = _outcome(load({"w": _w(rank, replica=rank)}))  # not asked for: read as before
    out["gap_false"] = _outcome(load({"w": _w(rank, replica=rank)}, validate_access_integrity=False))
    out["duplicate"] = _outcome(load({"w": _w(rank, chunk=0)}, validate_access_integrity=True))
    dtype = torch.float32 if rank == 0 else torch.float64
    out["dtype"] = _outcome(load({"w": _w(rank, dtype=dtype)}, validate_access_integrity=True, cast="any"))
    out["objects"] = _outcome(load({"w": _w(rank), "o": _obj(rank, replica=rank)}, validate_access_integrity=True))
    out["broken_rank"] = _outcome(load({"w": _broken_factory(rank)}, validate_access_integrity=True))
    dist.barrier()  # every case above ended on both ranks: the group is still in step
    out["after"] = _outcome(load({"w": _w(rank)}, validate_access_integrity=True))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_cases, 2, str(tmp_path_factory.mktemp("integrity") / "ckpt"), timeout_s=GROUP_TIMEOUT_S)


def test_complete_templates_load_with_the_check(results):
    for rank, r in enumerate(results):
        assert r["megatron_ok"] == r["ok"] == r["after"] == "ok"
        assert r["ok_values"] == (True, {"r": rank})


def test_uncovered_region_raises_on_every_rank_as_megatron_core_refuses(results):
    assert results[0]["megatron_gap"].startswith("CheckpointingException: Invalid access pattern")
    assert results[1]["megatron_gap"] == "ok"  # Megatron-Core checks on rank 0 only; ours on every rank alike
    for case in ("gap", "ours_on_megatron_leaves_gap"):
        assert results[0][case] == results[1][case], case
        msg = results[0][case]
        assert msg.startswith("ValidationError: load from ") and "validate_access_integrity=True" in msg
        assert "'w': region at offset (4,) shape (4,) of global shape (8,) (chunk (1,) of grid (2,))" in msg
        assert "nothing was read" in msg


def test_without_the_flag_nothing_is_checked(results):
    assert all(r["gap_default"] == r["gap_false"] == "ok" for r in results)


def test_duplicate_main_replica_named_with_its_ranks(results):
    msg = results[0]["duplicate"]
    assert msg == results[1]["duplicate"]
    assert "'w': chunk (0,) (offset (0,) shape (4,)) is accessed as a main replica by ranks [0, 1]" in msg
    assert "region at offset (4,) shape (4,)" in msg  # and chunk 1 by nobody


def test_disagreeing_dtype_and_missing_object_element(results):
    assert results[0]["dtype"] == results[1]["dtype"]
    assert "'w': ranks disagree on dtype: float32 on ranks [0]; float64 on ranks [1]" in results[0]["dtype"]
    assert results[0]["objects"] == results[1]["objects"]
    assert "'o': ShardedObject array of shape (2,) has main replicas for only 1 elements" in results[0]["objects"]


def test_one_rank_failing_to_describe_its_template_fails_every_rank(results):
    first = [r["broken_rank"].splitlines()[0] for r in results]  # rank 1 also shows its own traceback
    assert first[0] == first[1] and first[0].startswith("CheckpointingError: load from ")
    assert "rank 1" in first[0] and "cannot build" in first[0]


def test_single_process_check(tmp_path):
    path = str(tmp_path / "ckpt")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))}, path)
    half = ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(1, 3), (0, 0, 2))
    with pytest.raises(ldc.ValidationError, match=r"'w': region at offset \(1, 0\) shape \(1, 3\)"):
        ldc.load({"w": half}, path, validate_access_integrity=True)
    assert torch.equal(ldc.load({"w": half}, path)["w"], torch.ones(1, 3))  # the default reads a part


def _tree_digest(path):
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_check_is_distributed_checkpoint(tmp_path):
    ours = str(tmp_path / "ours")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))}, ours)
    assert ldc.check_is_distributed_checkpoint(ours) is True
    megatron = tmp_path / "megatron"
    megatron.mkdir()
    (megatron / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    assert ldc.check_is_distributed_checkpoint(megatron) is mdc.check_is_distributed_checkpoint(str(megatron)) is True
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ldc.check_is_distributed_checkpoint(empty) is mdc.check_is_distributed_checkpoint(str(empty)) is False
    assert ldc.check_is_distributed_checkpoint(tmp_path / "absent") is False
    uncommitted = tmp_path / "uncommitted"
    uncommitted.mkdir()
    (uncommitted / "metadata.json").write_text(json.dumps({"format": "lightning_distckpt"}))
    assert ldc.check_is_distributed_checkpoint(uncommitted) is False
    with pytest.raises(ldc.ArgumentError):
        ldc.check_is_distributed_checkpoint("gs://bucket/ckpt")


def test_remove_sharded_tensors_refuses_and_touches_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    ldc.save({"a.w": ldc.ShardedTensor.from_rank_offsets("a.w", torch.ones(3)),
              "b.w": ldc.ShardedTensor.from_rank_offsets("b.w", torch.zeros(3))}, path)
    before = _tree_digest(path)
    with pytest.raises(ldc.ArgumentError, match=r"remove_sharded_tensors\(.*'a\.'\): not supported.*nothing was "
                                                r"changed.*save them as a new checkpoint"):
        ldc.remove_sharded_tensors(path, "a.")
    assert _tree_digest(path) == before
    assert set(ldc.load_plain_tensors(path)) == {"a.w", "b.w"}
    with pytest.raises(ldc.ArgumentTypeError, match="key_prefix"):
        ldc.remove_sharded_tensors(path, 3)


def test_a_huge_grid_is_checked_by_counting_not_by_listing_every_chunk():
    """A wrong axis_fragmentations (10^10 chunks, one accessed) is said with its count; only the first
    chunks of the grid are listed (listing all of them was a hang)."""
    from lightning_distckpt.planning.metadata import ShardRecord
    from lightning_distckpt.reading.access_integrity import Access, _grid_problems

    st = ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(1, 1), (0, 0, 100000), (1, 0, 100000))
    problems = _grid_problems("w", (100000, 100000), [Access(ShardRecord.of(st, 0), (100000, 100000), (0, 0))])
    assert len(problems) == 21 and "chunk (0, 1) of grid (100000, 100000)" in problems[0]
    assert problems[-1] == "'w': ... and 9999999979 more chunks accessed by no rank"
