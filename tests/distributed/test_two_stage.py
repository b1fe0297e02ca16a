"""Two-stage data-parallel loader on real gloo groups: bit-identical to every-rank reads, storage
reads equal the unique bytes, the in-flight bound holds, DP groups that are not the world work,
and failures surface on every rank without hanging."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.comm import get_comm
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
from lightning_distckpt.reading.reads import read_tensors
from lightning_distckpt.reading.request import make_request
from lightning_distckpt.reading import TwoStageDataParallelLoader

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def _value(key_i, shape, dtype):
    g = torch.Generator().manual_seed(1000 + key_i)
    x = torch.randn(shape, generator=g) * 100
    return x > 0 if dtype == torch.bool else x.to(dtype)


def replicated_state(rank, fill=True):
    """A data-parallel replica of a mixed state: every rank holds everything (replica_id = rank)."""
    sd = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate([(40, 16), (7,), (3, 5, 2)]):
            n = i * 3 + j
            data = _value(n, shape, dtype) if fill else torch.zeros(shape, dtype=dtype)
            sd[f"t{n}"] = ldc.ShardedTensor.from_rank_offsets(f"layer.{n}", data, replica_id=rank)
    # prepended axis (a stacked layer), and a shard of a tensor split along axis 0
    stacked = _value(99, (4, 6), torch.float32) if fill else torch.zeros(4, 6)
    sd["stacked"] = ldc.ShardedTensor.from_rank_offsets("stacked", stacked, (0, 0, 1), prepend_axis_num=1,
                                                        replica_id=rank)
    sd["common"] = {"step": 7}
    return sd


def _filled(sd):
    return {k: v.data for k, v in sd.items() if isinstance(v, ldc.ShardedTensor)}


def _two_ranks(rank, world, path):
    saved = replicated_state(rank)
    ldc.save(saved, path)
    expected = _filled(replicated_state(rank))

    # every-rank reads, as the reference (bytes counted by the same read path the loader uses)
    ref = ldc.load(replicated_state(rank, fill=False), path, loader="every_rank")
    req = make_request(replicated_state(rank, fill=False))
    every_rank_bytes = read_tensors(OpenedCheckpoint.open(path), req.tensors, set())[1]

    # template variants: a non-contiguous destination, a metadata-only entry, a duplicate request
    tmpl = replicated_state(rank, fill=False)
    tmpl["t0"].data = torch.zeros(16, 40).t()  # same shape, not contiguous
    tmpl["t1"].data = None
    tmpl["dup"] = ldc.ShardedTensor.from_rank_offsets("layer.3", torch.zeros(40, 16, dtype=torch.bfloat16),
                                                      replica_id=rank)
    tmpl["dup0"] = ldc.ShardedTensor.from_rank_offsets("layer.0", torch.zeros(40, 16), replica_id=rank)
    # flattened (distributed-optimizer) requests: one the ranks share, one each of their own
    tmpl["flat_shared"] = ldc.ShardedTensor.from_rank_offsets_flat(
        "layer.0", torch.zeros(100), (40, 16), flattened_range=slice(50, 150), replica_id=rank)
    tmpl["flat_own"] = ldc.ShardedTensor.from_rank_offsets_flat(
        "layer.0", torch.zeros(320), (40, 16), flattened_range=slice(320 * rank, 320 * (rank + 1)), replica_id=rank)
    loader = TwoStageDataParallelLoader(max_inflight_bytes=6000, bucket_bytes=512)
    out = ldc.load(tmpl, path, loader=loader)
    identical = all(torch.equal(out[k], ref[k]) and torch.equal(out[k], v) for k, v in expected.items())
    identical &= torch.equal(out["dup"], expected["t3"]) and out["common"] == {"step": 7}
    identical &= torch.equal(out["dup0"], expected["t0"])  # copied from a non-contiguous first request
    identical &= out["t0"] is tmpl["t0"].data and out["t0"].stride() == (1, 40)
    flat = expected["t0"].reshape(-1)
    identical &= torch.equal(out["flat_shared"], flat[50:150])
    identical &= torch.equal(out["flat_own"], flat[320 * rank:320 * (rank + 1)])

    # resharding on the way: save split over 2 ranks (TP), load whole tensors on both ranks
    full = _value(5, (8, 6), torch.float32)
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", full.chunk(2)[rank].clone(), (0, rank, 2))}, path + "_tp")
    resh_loader = TwoStageDataParallelLoader()
    resh = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6), replica_id=rank)},
                    path + "_tp", loader=resh_loader)
    return {
        "identical": bool(identical),
        "resharded": torch.equal(resh["w"], full),
        "every_rank_bytes": every_rank_bytes,
        "stats": loader.last_stats,
        "summary": loader.summarize_load_times(),
        "resh_read": [s.bytes_read for s in resh_loader.last_stats],
    }


def test_two_ranks_bit_identical_and_unique_reads(tmp_path):
    path = str(tmp_path / "ck")
    res = run_distributed(_two_ranks, 2, path)
    assert all(r["identical"] for r in res)
    assert all(r["resharded"] for r in res)
    unique = sum(t.numel() * t.element_size() for t in _filled(replicated_state(0)).values())
    unique += (100 + 2 * 320) * 4  # the flattened requests: one shared range, one range per rank
    stats = res[0]["stats"]
    assert [s.rank for s in stats] == [0, 1]
    # storage reads: each unique byte once over the group, against once per rank for every-rank reads
    assert sum(s.bytes_read for s in stats) == unique
    assert [r["every_rank_bytes"] for r in res] == [unique - (100 + 2 * 320) * 4] * 2
    # reads spread over both ranks, roughly evenly (balanced by bytes, largest first)
    assert all(s.bytes_read > 0.3 * unique for s in stats)
    # each rank receives what the other sent: all it read but its own flattened range
    assert stats[0].bytes_received == stats[1].bytes_sent and stats[1].bytes_received == stats[0].bytes_sent
    assert all(s.bytes_read - s.bytes_sent == 320 * 4 for s in stats)
    # memory bound: admitted bytes and the loader's own buffers never exceed max_inflight_bytes
    assert all(0 < s.peak_extra_bytes <= s.peak_inflight_bytes <= 6000 for s in stats)
    assert all(s.inflight_limit == 6000 for s in stats)
    # the read of a whole tensor made of two stored shards happens once (on one rank)
    assert sorted(res[0]["resh_read"]) == [0, 8 * 6 * 4]
    summary = res[0]["summary"]
    for col in ("read_s", "copy_s", "comm_s", "read_MB"):
        assert col in summary
    assert len(summary.splitlines()) == 3


def _bound(rank, world, path, bound):
    """Large chunks, a bound smaller than one of them and a bound fitting several."""
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((256, 64), float(i)), replica_id=rank)
          for i in range(8)}
    ldc.save(sd, path)
    out = {}
    for b in bound:
        loader = TwoStageDataParallelLoader(max_inflight_bytes=b, bucket_bytes=1024)
        tmpl = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(256, 64), replica_id=rank) for k in sd}
        got = ldc.load(tmpl, path, loader=loader)
        assert all(torch.equal(got[k], sd[k].data) for k in sd)
        out[b] = loader.last_stats[rank]
    return out


def test_inflight_bound_and_read_ahead(tmp_path):
    chunk = 256 * 64 * 4
    res = run_distributed(_bound, 2, str(tmp_path / "ck"), [chunk // 2, 3 * chunk])
    for r in res:
        small, big = r[chunk // 2], r[3 * chunk]
        # a chunk bigger than the bound goes alone: never more than one chunk admitted
        assert small.peak_inflight_bytes == chunk
        # a bound fitting three chunks: reads run ahead of the broadcasts, up to the bound
        assert 2 * chunk <= big.peak_inflight_bytes <= 3 * chunk
        # receiving straight into contiguous CPU destinations needs no buffers
        assert big.peak_extra_bytes == 0
        assert big.bytes_read == 4 * chunk  # 8 equal chunks over 2 readers


def _tp_dp(rank, world, path):
    """4 ranks as TP=2 x DP=2: tensors split over TP (ranks r, r^1), replicated over DP (r, r+2)."""
    tp, dp = rank % 2, rank // 2
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    dp_group = groups[tp]

    def state(fill):
        sd = {}
        for i in range(6):
            full = _value(i, (12, 8), torch.float32)
            data = full.chunk(2)[tp].clone() if fill else torch.zeros(6, 8)
            sd[f"w{i}"] = ldc.ShardedTensor.from_rank_offsets(f"w{i}", data, (0, tp, 2), replica_id=dp)
        bias = torch.arange(8, dtype=torch.bfloat16) if fill else torch.zeros(8, dtype=torch.bfloat16)
        sd["bias"] = ldc.ShardedTensor.from_rank_offsets("bias", bias, replica_id=rank)  # replicated on all 4
        return sd

    ldc.save(state(True), path)
    expected = _filled(state(True))
    loader = TwoStageDataParallelLoader(dp_group, bucket_bytes=256)
    out = ldc.load(state(False), path, loader=loader)
    ok = all(torch.equal(out[k], v) for k, v in expected.items())
    # the same layout with the fully parallel loader over the whole world (point-to-point sends)
    par = ldc.load(state(False), path, loader="parallel")
    ok_par = all(torch.equal(par[k], v) for k, v in expected.items())
    # and the default loader (two-stage over the whole world: point-to-point within the pairs)
    whole = ldc.load(state(False), path)
    ok_par &= all(torch.equal(whole[k], v) for k, v in expected.items())
    return {"ok": ok, "ok_par": ok_par, "dp_ranks": dist.get_process_group_ranks(dp_group),
            "stats": loader.last_stats, "group_rank": get_comm(dp_group).rank}


def test_tp2_dp2_groups_from_new_group(tmp_path):
    res = run_distributed(_tp_dp, 4, str(tmp_path / "ck"))
    assert all(r["ok"] and r["ok_par"] for r in res)
    assert [r["dp_ranks"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    stats = res[0]["stats"]  # per global rank
    shard_bytes = 6 * 6 * 8 * 4 + 8 * 2  # a TP half of each weight, and the replicated bias
    # within each DP group the two ranks share the reads of their TP half: read once per group
    for group in ([0, 2], [1, 3]):
        assert sum(stats[r].bytes_read for r in group) == shard_bytes
        assert all(stats[r].bytes_read > 0 for r in group)
        assert stats[group[0]].bytes_received == stats[group[1]].bytes_read


def _read_failure(rank, world, path):
    sd = {f"w{i}": ldc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((64, 8), float(i)), replica_id=rank)
          for i in range(4)}
    ldc.save(sd, path)
    errors = {}
    # a bad template on one rank only: every rank fails alike
    bad = {"w0": ldc.ShardedTensor.from_rank_offsets("w0", torch.zeros(64, 9 if rank == 1 else 8), replica_id=rank)}
    try:
        ldc.load(bad, path, loader="two_stage")
        errors["shape"] = None
    except CheckpointingError as e:
        errors["shape"] = str(e)
    dist.barrier()
    if rank == 0:  # lose one rank's stored data: whoever reads its chunks fails
        shutil.rmtree(os.path.join(path, "data", "rank_00001"))
    dist.barrier()
    for name, loader in (("two_stage", TwoStageDataParallelLoader(max_inflight_bytes=4096)), ("parallel", "parallel")):
        tmpl = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(64, 8), replica_id=rank) for k in sd}
        try:
            ldc.load(tmpl, path, loader=loader)
            errors[name] = None
        except CheckpointingError as e:
            errors[name] = str(e)
    return errors


def test_failures_raise_on_every_rank(tmp_path):
    res = run_distributed(_read_failure, 2, str(tmp_path / "ck"), timeout_s=60)
    for errors in res:
        for name in ("two_stage", "parallel"):
            assert errors[name] is not None and "written by rank 1" in errors[name], errors[name]
        assert errors["shape"] is not None and "'w0'" in errors["shape"] and "rank 1" in errors["shape"]


def test_single_process_and_bad_loader(tmp_path):
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4))}
    ldc.save(sd, tmp_path / "ck")
    for loader in ("two_stage", "parallel", TwoStageDataParallelLoader(max_inflight_bytes=8)):
        out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, tmp_path / "ck",
                       loader=loader)
        assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))
    with pytest.raises(ValueError, match="unknown loader 'fast'"):
        ldc.load(sd, tmp_path / "ck", loader="fast")
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        TwoStageDataParallelLoader(max_inflight_bytes=0)


def test_loads_pause_the_garbage_collector(tmp_path):
    """Every loader runs with Python's cyclic collector off (a full collection cost up to 0.35 s of
    a cold load, docs/benchmarks.md) and leaves it as it found it, on failure too."""
    import gc

    from lightning_distckpt.core.strict import StrictHandling
    from lightning_distckpt.reading.checkpoint import open_checkpoint
    from lightning_distckpt.reading.loaders import resolve_loader

    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, tmp_path / "ck")
    seen = []

    def opener():
        seen.append(gc.isenabled())
        return open_checkpoint(str(tmp_path / "ck"))

    def failing():
        seen.append(gc.isenabled())
        raise FileNotFoundError("no checkpoint here")

    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            for name in ("every_rank", "parallel", "two_stage"):
                template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(6))}
                out = resolve_loader(name).load(template, opener, get_comm(), StrictHandling.ASSUME_OK_UNEXPECTED)
                assert torch.equal(out[0]["w"], torch.arange(6.0))
                assert gc.isenabled() is enabled
                with pytest.raises(CheckpointingError):
                    resolve_loader(name).load(template, failing, get_comm(), StrictHandling.ASSUME_OK_UNEXPECTED)
                assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False] * 12
