"""Fully parallel save and load: exchange planning (pure), bytes written per rank for a
replicated layout (counted on disk), and the fully parallel loader on real gloo groups."""

import json
import os

import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.planning.exchange_plan import BROADCAST, LOCAL, P2P, ChunkRequest, plan_exchange
from lightning_distckpt.storage.layout import METADATA_FILE
from lightning_distckpt.reading import FullyParallelLoader


def req(key, nbytes, offset=(0,)):
    return ChunkRequest((key, offset, (nbytes // 4,), None, "float32"), nbytes)


# -- planning ------------------------------------------------------------------------------
def test_plan_dedups_and_balances_reads():
    chunks = [req(f"w{i}", 4000 + 400 * i) for i in range(9)]
    plan = plan_exchange([chunks, list(reversed(chunks)), chunks], bucket_bytes=0)
    unique = sum(c.nbytes for c in chunks)
    assert plan.unique_bytes == unique and plan.requested_bytes == 3 * unique
    loads = sorted(plan.read_bytes.values())
    assert loads[-1] - loads[0] <= max(c.nbytes for c in chunks)  # greedy by bytes: within one chunk
    assert all(op.transport == BROADCAST and op.needers == (0, 1, 2) for op in plan.ops)
    assert sorted(c for op in plan.ops for c in op.chunks) == sorted(c.chunk for c in chunks)
    # the first ops come from different readers: all ranks start reading at once
    assert len({op.src for op in plan.ops[:3]}) == 3
    # deterministic whatever the request order
    again = plan_exchange([list(reversed(chunks)), chunks, chunks[::2] + chunks[1::2]], bucket_bytes=0)
    assert again.ops == plan.ops


def test_plan_spreads_equal_chunks_not_lowest_rank():
    chunks = [req(f"w{i}", 1024) for i in range(16)]
    plan = plan_exchange([chunks, chunks], bucket_bytes=0)
    assert plan.read_bytes == {0: 8 * 1024, 1: 8 * 1024}
    # ties are broken per chunk, not always toward rank 0
    assert {op.src for op in plan.ops} == {0, 1}


def test_plan_buckets_and_transports():
    small = [req(f"s{i}", 100) for i in range(10)]
    big = req("big", 10_000)
    only0 = req("mine", 2000)
    pair = req("pair", 3000)
    plan = plan_exchange([small + [big, only0, pair], small + [big, pair], small + [big]], bucket_bytes=450)
    by_chunk = {c[0]: op for op in plan.ops for c in op.chunks}
    assert by_chunk["mine"].transport == LOCAL and by_chunk["mine"].src == 0
    assert by_chunk["pair"].transport == P2P and by_chunk["pair"].needers == (0, 1)
    assert by_chunk["pair"].src in (0, 1)
    assert by_chunk["big"].transport == BROADCAST and len(by_chunk["big"].chunks) == 1
    buckets = {id(op): op for op in plan.ops if op.chunks[0][0].startswith("s")}.values()
    assert all(op.nbytes <= 450 and len(op.chunks) >= 1 for op in buckets)
    assert sum(len(op.chunks) for op in buckets) == 10 and len(buckets) < 10
    assert plan.ops_for(2) == [op for op in plan.ops if 2 in op.needers]
    assert all(2 not in by_chunk[k].needers for k in ("mine", "pair"))


# -- fully parallel save: bytes written per rank ---------------------------------------------
def _rank_dir_bytes(path, rank):
    d = os.path.join(path, "data", f"rank_{rank:05d}")
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def _save_replicated(rank, world, path, balance):
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((100 + 20 * i, 256), float(i)),
                                                       replica_id=rank) for i in range(6)}
    ldc.save(sd, path, balance_writes=balance)
    return True


def test_replicated_save_writes_each_shard_once_balanced(tmp_path):
    sizes = [(100 + 20 * i) * 256 * 4 for i in range(6)]
    total = sum(sizes)
    out = {}
    for balance in (True, False):
        path = str(tmp_path / f"ck_{balance}")
        run_distributed(_save_replicated, 2, path, balance)
        with open(os.path.join(path, METADATA_FILE)) as f:
            shards = [s for e in json.load(f)["tensors"].values() for s in e["shards"]]
        per_writer = {rk: sum(sizes[int(k)] for k, s in enumerate(shards) if s["writer"] == rk) for rk in (0, 1)}
        on_disk = [_rank_dir_bytes(path, rk) for rk in (0, 1)]
        out[balance] = (per_writer, on_disk)
        assert len(shards) == 6  # one stored shard per tensor, not one per replica
        assert sum(on_disk) < total + 64 * 1024  # data once, plus a little OCDBT/zarr metadata
    (planned, disk) = out[True]
    assert abs(planned[0] - planned[1]) <= max(sizes)  # balanced within one shard
    for rk in (0, 1):
        assert planned[rk] <= disk[rk] < planned[rk] + 32 * 1024  # the files hold what the plan says
        assert disk[rk] > 0.35 * total
    planned, disk = out[False]
    assert planned == {0: total, 1: 0}  # the main replicas (rank 0) write everything
    assert disk[0] >= total and disk[1] < 32 * 1024


# -- fully parallel load -------------------------------------------------------------------
def _parallel_load(rank, world, path):
    def state(fill):
        sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(
            f"w{i}", torch.full((30 + i, 16), float(i + 1)) if fill else torch.zeros(30 + i, 16), replica_id=rank)
            for i in range(5)}
        sd["half"] = ldc.ShardedTensor.from_rank_offsets(  # the one non-replicated tensor
            "half", torch.full((4, 4), float(rank)) if fill else torch.zeros(4, 4), (0, rank, world))
        sd["obj"] = ldc.ShardedObject("rng", {"seed": rank}, (world,), (rank,))
        return sd

    ldc.save(state(True), path)
    loader = FullyParallelLoader(bucket_bytes=1024)
    out = ldc.load(state(False), path, loader=loader)
    ref = state(True)
    ok = all(torch.equal(out[k], ref[k].data) for k in ref if k != "obj") and out["obj"] == {"seed": rank}
    return {"ok": ok, "stats": loader.last_stats, "summary": loader.summarize_load_times()}


def test_fully_parallel_load_reads_unique_bytes(tmp_path):
    res = run_distributed(_parallel_load, 2, str(tmp_path / "ck"))
    assert all(r["ok"] for r in res)
    stats = res[0]["stats"]
    unique = sum((30 + i) * 16 * 4 for i in range(5)) + 2 * 4 * 4 * 4
    assert sum(s.bytes_read for s in stats) == unique  # every-rank reads would read 2x the replicated part
    assert all(s.bytes_read > 0.3 * unique for s in stats)
    # the local (non-replicated) shard is read, never sent
    assert stats[0].bytes_sent + stats[1].bytes_sent == unique - 2 * 4 * 4 * 4
    assert stats[0].inflight_limit is None and "read_MB" in res[0]["summary"]
