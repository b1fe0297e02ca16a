"""Async save on real gloo groups: the snapshot is what gets saved, staging buffers are reused,
nothing is committed before finalize, the next save finalizes the previous one, and a real
background failure on one rank (file size limit: a disk-full stand-in) raises on every rank
and leaves the previous checkpoint untouched."""

import os
import resource
import signal

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import SaveFailedError
from lightning_distckpt.storage.layout import is_committed


def state(rank, world, value):
    """Replicated weights (written by both ranks, balanced), a TP-split tensor, an object, common."""
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((64, 64), value + i), replica_id=rank)
          for i in range(4)}
    sd["tp"] = ldc.ShardedTensor.from_rank_offsets("tp", torch.full((8, 4), value + 10 * rank), (0, rank, world))
    sd["obj"] = ldc.ShardedObject("rng", {"rank": rank, "value": value}, (world,), (rank,))
    sd["step"] = int(value)
    return sd


def loaded(path, rank, world):
    tmpl = state(rank, world, 0.0)
    for v in tmpl.values():
        if isinstance(v, ldc.ShardedTensor):
            v.data.zero_()
    out = ldc.load(tmpl, path)
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def same(a, b):
    return all(torch.equal(a[k], b[k].data) if isinstance(b[k], ldc.ShardedTensor) else
               (a[k] == b[k].data if isinstance(b[k], ldc.ShardedObject) else a[k] == b[k]) for k in b)


def _async_cycle(rank, world, root):
    saver = ldc.AsyncSaver()
    sd = state(rank, world, 1.0)
    req = saver.save(sd, f"{root}/ck1")
    # the caller may change the state as soon as save returns: the snapshot is what is saved
    for v in sd.values():
        if isinstance(v, ldc.ShardedTensor):
            v.data.add_(1000.0)
    committed_early = is_committed(f"{root}/ck1")
    req.wait()
    assert req.done() and req.all_done()
    assert not is_committed(f"{root}/ck1")  # written, but not committed before finalize
    req.finalize()
    req.finalize()  # idempotent
    ptrs = {k: b.data_ptr() for k, b in saver.staging_buffers().items()}
    staged = saver.staging_bytes

    sd2 = state(rank, world, 2.0)
    req2 = saver.save(sd2, f"{root}/ck2")
    sd3 = state(rank, world, 3.0)
    req3 = saver.save(sd3, f"{root}/ck3")  # finalizes req2 first
    ck2_committed_by_next_save = req2.finalized and is_committed(f"{root}/ck2")
    ptrs3 = {k: b.data_ptr() for k, b in saver.staging_buffers().items()}
    saver.finalize()
    assert req3.finalized and saver.pending is None

    # the plain entry point: async_save=True gives a request too
    req4 = ldc.save(state(rank, world, 4.0), f"{root}/ck4", async_save=True)
    req4.finalize()
    return {
        "committed_early": committed_early,
        "ck1": same(loaded(f"{root}/ck1", rank, world), state(rank, world, 1.0)),
        "ck2": same(loaded(f"{root}/ck2", rank, world), state(rank, world, 2.0)),
        "ck3": same(loaded(f"{root}/ck3", rank, world), state(rank, world, 3.0)),
        "ck4": same(loaded(f"{root}/ck4", rank, world), state(rank, world, 4.0)),
        "ck2_by_next": ck2_committed_by_next_save,
        "reused": ptrs == ptrs3 and len(ptrs) > 0,
        "staged": staged,
        "blocking_s": req.blocking_s,
    }


def test_async_save_snapshot_reuse_and_commit_order(tmp_path):
    res = run_distributed(_async_cycle, 2, str(tmp_path))
    for r in res:
        assert not r["committed_early"]
        assert r["ck1"] and r["ck2"] and r["ck3"] and r["ck4"]
        assert r["ck2_by_next"]
        assert r["reused"]
    # each rank stages only what it writes: the replicated weights are split between the ranks
    total = 4 * 64 * 64 * 4 + 2 * 8 * 4 * 4
    assert sum(r["staged"] for r in res) == total
    assert all(r["staged"] < 0.75 * total for r in res)


def _failure(rank, world, root):
    good = f"{root}/ck"
    ldc.save(state(rank, world, 1.0), good)
    saver = ldc.AsyncSaver()
    errors = {}

    # 1. rank 1's writes hit a file size limit in the background (EFBIG, as on a full disk)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, do not kill the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        req = saver.save(state(rank, world, 2.0), good)
        req.wait()
        try:
            req.finalize()
            errors["fsize"] = None
        except SaveFailedError as e:
            errors["fsize"] = str(e)
            errors["fsize_failures"] = sorted(e.failures)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    errors["after_fsize"] = same(loaded(good, rank, world), state(rank, world, 1.0))

    # 2. something appears in the way of the target between save and finalize
    other = f"{root}/ck_other"
    req = saver.save(state(rank, world, 3.0), other)
    if rank == 0:
        with open(other, "w") as f:
            f.write("not a checkpoint")
    try:
        req.finalize()
        errors["in_the_way"] = None
    except SaveFailedError as e:
        errors["in_the_way"] = str(e)
        errors["in_the_way_failures"] = sorted(e.failures)

    # 3. the saver recovers: the next save commits
    saver.save(state(rank, world, 5.0), good).finalize()
    errors["recovered"] = same(loaded(good, rank, world), state(rank, world, 5.0))
    errors["leftovers"] = sorted(n for n in os.listdir(root) if "staging" in n)
    return errors


def test_background_failure_raises_everywhere_and_keeps_previous(tmp_path):
    res = run_distributed(_failure, 2, str(tmp_path), timeout_s=60)
    for r in res:
        assert r["fsize"] is not None and "rank 1" in r["fsize"] and "nothing was committed" in r["fsize"], r["fsize"]
        assert "rank 0:" not in r["fsize"] and r["fsize_failures"] == [1]  # only the rank that failed is blamed
        assert r["after_fsize"]  # the previous checkpoint is untouched and loads
        assert r["in_the_way"] is not None and "not a directory" in r["in_the_way"]
        assert r["in_the_way_failures"] == [0]  # the commit, on rank 0
        assert r["recovered"]
        assert r["leftovers"] == []


def test_single_process_async(tmp_path):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}
    req = ldc.save(sd, tmp_path / "ck", async_save=True)
    sd["w"].data.zero_()
    req.finalize()
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, tmp_path / "ck")
    assert torch.equal(out["w"], torch.arange(6.0))
    with pytest.raises(ldc.ValidationError):  # planning errors are raised by save itself, not later
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=1)}, tmp_path / "x",
                 async_save=True)


def _plan_cache(rank, world, root):
    """Same metadata -> the cached plan is reused; a change on one rank -> planned and validated again."""
    saver = ldc.AsyncSaver()
    out = {}
    req = saver.save(state(rank, world, 1.0), f"{root}/c1")
    req.finalize()
    out["first"] = req.plan_reused
    req = saver.save(state(rank, world, 2.0), f"{root}/c2")  # new values, same layout
    req.finalize()
    out["second"] = req.plan_reused
    out["c2"] = same(loaded(f"{root}/c2", rank, world), state(rank, world, 2.0))

    # a key only rank 1 holds: only rank 1's records changed, so both ranks plan again
    extra = state(rank, world, 3.0)
    if rank == 1:
        extra["extra"] = ldc.ShardedTensor.from_rank_offsets("extra", torch.arange(5.0))
    req = saver.save(extra, f"{root}/c3")
    req.finalize()
    out["one_rank_changed"] = req.plan_reused
    out["c3_extra"] = ldc.load_tensors_metadata(f"{root}/c3")["extra"].global_shape

    # rank 1's TP shard grows: its global shape disagrees with rank 0's -> ValidationError everywhere
    bad = state(rank, world, 4.0)
    if rank == 1:
        bad["tp"] = ldc.ShardedTensor.from_rank_offsets("tp", torch.ones(9, 4), (0, rank, world))
    try:
        saver.save(bad, f"{root}/c4")
        out["inconsistent"] = None
    except ldc.ValidationError as e:
        out["inconsistent"] = str(e)
    out["c4_exists"] = os.path.exists(f"{root}/c4")

    # back to the original layout: planned again (the failed save left no plan to reuse), then reused
    req = saver.save(state(rank, world, 5.0), f"{root}/c5")
    req.finalize()
    out["after_error"] = req.plan_reused
    req = saver.save(state(rank, world, 6.0), f"{root}/c5")  # overwrite with the reused plan
    req.finalize()
    out["again"] = req.plan_reused
    out["c5"] = same(loaded(f"{root}/c5", rank, world), state(rank, world, 6.0))
    out["hits_misses"] = (saver.plan_cache.hits, saver.plan_cache.misses)
    return out


def test_plan_cache_reuse_and_revalidation(tmp_path):
    res = run_distributed(_plan_cache, 2, str(tmp_path), timeout_s=90)
    for r in res:
        assert r["first"] is False and r["second"] is True
        assert r["c2"]
        assert r["one_rank_changed"] is False
        assert tuple(r["c3_extra"]) == (5,)
        assert r["inconsistent"] is not None and "tp" in r["inconsistent"], r["inconsistent"]
        assert not r["c4_exists"]
        assert r["after_error"] is False and r["again"] is True
        assert r["c5"]
        assert r["hits_misses"] == (2, 3)


def test_plan_cache_single_process_logs_reuse(tmp_path, caplog):
    saver = ldc.AsyncSaver()
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0)), "step": 1}
    with caplog.at_level("DEBUG", logger="lightning_distckpt"):
        saver.save(sd, tmp_path / "a").finalize()
        sd["w"].data.mul_(2)
        sd["step"] = 2
        req = saver.save(sd, tmp_path / "b")
        req.finalize()
    assert req.plan_reused
    assert sum("cached plan reused" in m for m in caplog.messages) == 1
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(6)), "step": 0}, tmp_path / "b")
    assert torch.equal(out["w"], 2 * torch.arange(6.0)) and out["step"] == 2
    # a different dtype is a different layout: planned again
    sd["w"] = ldc.ShardedTensor.from_rank_offsets("w", torch.arange(6, dtype=torch.float64))
    assert not saver.save(sd, tmp_path / "c").plan_reused
    saver.finalize()
