"""Async saves under a host staging budget (``AsyncSaver(max_staging_bytes=...)``): a budget smaller
than a rank's state saves in waves (the largest shards that fit staged for the background, the
rest written before ``save`` returns), the checkpoint holds the state as it was when ``save``
was called, and the staging pool never holds more than the budget less the writer's share. Real
gloo group of 2."""

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.saving.async_staging import WRITER_BYTES, plan_staging
from lightning_distckpt.storage.base import ShardWrite


def state(rank, world, value):
    """Per rank about 1.3 MB: two replicated 360 KB weights written by each rank (balanced), a
    512 KB TP split, packed small tensors of three dtypes, an object and common state."""
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((300, 300), value + i), replica_id=rank)
          for i in range(4)}
    sd["tp"] = ldc.ShardedTensor.from_rank_offsets(
        "tp", torch.arange(1024 * 128, dtype=torch.float32).reshape(1024, 128) + value + 100 * rank, (0, rank, world))
    sd["norm"] = ldc.ShardedTensor.from_rank_offsets("norm", torch.full((16,), value, dtype=torch.bfloat16),
                                                     replica_id=rank)
    sd["ids"] = ldc.ShardedTensor.from_rank_offsets("ids", torch.arange(8) + int(value) + rank, (0, rank, world))
    sd["obj"] = ldc.ShardedObject("rng", {"rank": rank, "value": value}, (world,), (rank,))
    sd["step"] = int(value)
    return sd


def _template(rank, world):
    tmpl = state(rank, world, 0.0)
    for v in tmpl.values():
        if isinstance(v, ldc.ShardedTensor):
            v.data.zero_()
    return tmpl


def _exact(got, want):
    for k, v in want.items():
        if isinstance(v, ldc.ShardedTensor):
            if not torch.equal(got[k], v.data):
                return f"{k} differs"
        elif isinstance(v, ldc.ShardedObject):
            if got[k] != v.data:
                return f"{k} differs"
        elif got[k] != v:
            return f"{k} differs"
    return None


def _budgets(rank, world, root):
    out = {}
    for budget in (None, 400_000, 100_000, 0):
        saver = ldc.AsyncSaver(max_staging_bytes=budget, writer_bytes=0)
        for n, value in enumerate((1.0, 2.0)):  # the second save reuses the pool
            sd = state(rank, world, value)
            path = f"{root}/b{budget}_{n}"
            req = saver.save(sd, path)
            for v in sd.values():  # the training step changes the state right after save returns
                if isinstance(v, ldc.ShardedTensor):
                    v.data.add_(1000)
            req.finalize()
            got = ldc.load(_template(rank, world), path)
            out[(budget, n)] = {"mismatch": _exact(got, state(rank, world, value)), "waves": req.waves,
                                "staged": req.staged_bytes, "peak": saver.peak_staging_bytes,
                                "held": saver.staging_bytes}
    return out


def test_waves_under_a_budget_save_the_snapshot_exactly(tmp_path):
    results = run_distributed(_budgets, 2, str(tmp_path), timeout_s=120)
    for rank, res in enumerate(results):
        for (budget, n), r in res.items():
            assert r["mismatch"] is None, (rank, budget, n, r)
            if budget is None:
                assert r["waves"] == 1 and r["peak"] >= 1_000_000, r  # everything staged
            else:
                assert r["peak"] <= budget and r["held"] <= budget, (rank, budget, r)
                assert r["waves"] == 2, r  # CPU shards that do not fit are written in place, in one call
        assert 300_000 < res[(400_000, 0)]["staged"] <= 400_000  # a 360 KB weight and the packed ones
        assert res[(0, 0)]["staged"] == 0 and res[(0, 0)]["peak"] == 0


def test_single_process_budget_logs_waves(tmp_path, caplog):
    saver = ldc.AsyncSaver(max_staging_bytes=5_000, writer_bytes=0)
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((1000,), float(i))) for i in range(3)}
    with caplog.at_level("INFO", logger="lightning_distckpt"):
        req = saver.save(sd, tmp_path / "a", storage=ldc.StorageOptions(pack_max_bytes=0))
    for v in sd.values():
        v.data.zero_()
    req.finalize()
    assert req.waves == 2 and req.staged_bytes == 4_000 and saver.peak_staging_bytes <= 5_000
    assert any("2 waves under max_staging_bytes=5.0 KB" in m and "8.0 KB written before returning" in m
               for m in caplog.messages), caplog.messages
    out = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, torch.empty(1000)) for k in sd}, tmp_path / "a")
    assert all(torch.equal(out[f"w{i}"], torch.full((1000,), float(i))) for i in range(3))


@pytest.mark.parametrize("bad", [-1, 1.5, "1GB", True])
def test_budget_must_be_bytes(bad):
    with pytest.raises(ArgumentError, match="max_staging_bytes"):
        ldc.AsyncSaver(max_staging_bytes=bad)
    with pytest.raises(ArgumentError, match="writer_bytes"):
        ldc.AsyncSaver(max_staging_bytes=1 << 30, writer_bytes=bad)


def test_the_writer_share_of_a_budget_is_not_staged(tmp_path):
    """By default WRITER_BYTES of the budget are left to the writer: a budget of WRITER_BYTES + 5 KB
    stages what 5 KB with no writer share does, and a budget below WRITER_BYTES stages nothing
    (everything is written before save returns, as a synchronous save)."""
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((1000,), float(i))) for i in range(3)}
    shards = [ShardWrite(k, 0, v.data) for k, v in sd.items()]
    with_share, without = plan_staging(shards, WRITER_BYTES + 5_000, WRITER_BYTES), plan_staging(shards, 5_000)
    assert [w.key for w in with_share.staged] == [w.key for w in without.staged] and len(without.staged) == 1
    for budget, staged in ((WRITER_BYTES + 5_000, 4_000), (WRITER_BYTES, 0)):
        saver = ldc.AsyncSaver(max_staging_bytes=budget)
        req = saver.save(sd, tmp_path / str(budget), storage=ldc.StorageOptions(pack_max_bytes=0))
        for v in sd.values():
            v.data.add_(100.0)  # after save returned: not in the checkpoint
        req.finalize()
        assert req.staged_bytes == staged and saver.peak_staging_bytes <= budget - WRITER_BYTES
        out = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, torch.empty(1000)) for k in sd}, tmp_path / str(budget))
        assert all(torch.equal(out[k], v.data - 100.0) for k, v in sd.items())
        for v in sd.values():
            v.data.sub_(100.0)
    with pytest.raises(ArgumentError, match=rf"left to the writer.*at least {4032 + WRITER_BYTES}"):  # aligned
        plan_staging([ShardWrite("big", 0, torch.empty(1000, device="meta"))], WRITER_BYTES + 1000, WRITER_BYTES)


def test_accelerator_shard_larger_than_budget_is_refused_by_name():
    # "meta" tensors stand for accelerator memory here: planning looks at the device and the size only
    shards = [ShardWrite("big", 0, torch.empty(1000, device="meta")), ShardWrite("small", 0, torch.empty(10))]
    with pytest.raises(ArgumentError, match=r"shard 'big' \(stored index 0\) on meta is 4000 bytes.*at least 4032"):
        plan_staging(shards, 1000)
    # on the CPU the same shard is written in place before save returns: no staging needed
    plan = plan_staging([ShardWrite("big", 0, torch.empty(1000)), ShardWrite("small", 0, torch.empty(10))], 1000)
    assert [w.key for w in plan.in_place] == ["big"] and [w.key for w in plan.staged] == ["small"]
    # accelerator shards that do not fit go through the pool in budget-sized waves
    dev = [ShardWrite(f"d{i}", 0, torch.empty(200, device="meta")) for i in range(5)]
    plan = plan_staging(dev, 1700)
    assert len(plan.staged) == 2 and [len(w) for w in plan.device_waves] == [2, 1]
    assert plan.pool_bytes <= 1700
