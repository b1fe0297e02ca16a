"""``EveryRankLoader.last_stats``: every rank's read statistics of the last load, as the exchange
loaders keep them (benchmarks/bench_parallel.py reads the storage bytes from it)."""

import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed


def _state(rank: int, world: int, fill: bool):
    make = torch.full if fill else (lambda shape, _v: torch.zeros(shape))
    return {
        "rep": ldc.ShardedTensor.from_rank_offsets("rep", make((64, 8), 3.0), replica_id=rank),  # replicated
        "part": ldc.ShardedTensor.from_rank_offsets("part", make((4, 8), float(rank)), (0, rank, world)),
    }


def _every_rank_load(rank: int, world: int, path: str):
    ldc.save(_state(rank, world, True), path)
    loader = ldc.EveryRankLoader()
    assert loader.last_stats == []
    out = ldc.load(_state(rank, world, False), path, loader=loader)
    ok = torch.equal(out["rep"], torch.full((64, 8), 3.0)) and torch.equal(out["part"], torch.full((4, 8), float(rank)))
    return {"ok": ok, "stats": loader.last_stats}


def test_every_rank_loader_keeps_every_ranks_stats(tmp_path):
    res = run_distributed(_every_rank_load, 2, str(tmp_path / "ck"))
    assert all(r["ok"] for r in res)
    for r in res:
        stats = r["stats"]
        assert [s.rank for s in stats] == [0, 1]
        # each rank reads the whole replicated tensor and its own part: no deduplication
        assert [s.bytes_read for s in stats] == [64 * 8 * 4 + 4 * 8 * 4] * 2
        assert all(s.total_s > 0 for s in stats)
