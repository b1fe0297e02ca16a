"""Planning on a coordinator with real processes: 8 gloo ranks (oversubscribed), TP 2 x DP 4, so
ranks share layouts and only one rank per layout sends its records. Saves, a save reusing its
plan, a refused inconsistent save, and loads resharded to 8 ranks and to one process."""

import json
import os

import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli import main
from lightning_distckpt.comm import get_comm
from lightning_distckpt.planning.metadata import CheckpointIndex
from lightning_distckpt.storage.layout import METADATA_FILE
from lightning_distckpt.saving.save import SavePlanCache, finalize_save, prepare_save, write_local
from dist_utils import run_distributed

TP, DP = 2, 4
ROWS, COLS = 16, 8


def _full(key):
    base = {"w": 0.0, "b": 1000.0, "norm": 2000.0}[key]
    return base + torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)


def _state(rank):
    """TP splits ``w`` by rows and ``b`` by columns; ``norm`` is whole on every rank. The first
    DP replica holds the main replicas: two layouts per TP rank (8 ranks, 4 layouts)."""
    tp, dp = rank % TP, rank // TP
    return {
        "w": ldc.ShardedTensor.from_rank_offsets("w", _full("w").chunk(TP, 0)[tp].clone(), (0, tp, TP),
                                                 replica_id=dp),
        "b": ldc.ShardedTensor.from_rank_offsets("b", _full("b").chunk(TP, 1)[tp].clone(), (1, tp, TP),
                                                 replica_id=dp),
        "norm": ldc.ShardedTensor.from_rank_offsets("norm", _full("norm").clone(), replica_id=rank),
        "step": 7,
    }


FSDP_ROWS = {"f0": 32, "f1": 22}  # over 8 ranks: chunks of 4, and of 3 (rank 7: 1 row)


def _fsdp_full(key):
    return torch.arange(FSDP_ROWS[key] * 3, dtype=torch.float32).view(-1, 3) + (0.5 if key == "f1" else 0.0)


def _fsdp_state(rank, world, shift=0):
    """Every tensor split evenly along dim 0 over all ranks (FSDP-like): one layout for all
    ranks; ``shift`` moves rank 5's chunk of f0 by that many rows (an overlap and a gap)."""
    out = {}
    for key, rows in FSDP_ROWS.items():
        chunk = -(-rows // world)
        lo = rank * chunk + (shift if rank == 5 and key == "f0" else 0)
        out[key] = ldc.ShardedTensor.from_offsets(key, _fsdp_full(key)[lo:lo + chunk].clone(), (rows, 3), (lo, 0))
    return out


def _fsdp(rank, world, root):
    """FSDP-like save planned from one rank's records, a refused shifted layout, a resharded load."""
    out = {}
    prep = prepare_save(_fsdp_state(rank, world), f"{root}/fsdp", get_comm())
    out["fsdp_writes"] = [(w.key, w.index) for w in prep.plan.writes.get(rank, [])]
    finalize_save(prep, write_local(prep))
    try:
        ldc.save(_fsdp_state(rank, world, shift=1), f"{root}/fsdp_bad")
        out["fsdp_bad"] = None
    except ldc.CheckpointingError as e:
        out["fsdp_bad"] = (type(e).__name__, str(e))
    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(rows, 1), (1, rank % 3, 3), replica_id=rank // 3)
                for k, rows in FSDP_ROWS.items()}
    loaded = ldc.load(template, f"{root}/fsdp")
    out["fsdp_loaded_ok"] = all(torch.equal(loaded[k], _fsdp_full(k)[:, rank % 3:rank % 3 + 1]) for k in FSDP_ROWS)
    return out


def _save_and_reshard(rank, world, root):
    comm = get_comm()
    out = _fsdp(rank, world, root)
    prep = prepare_save(_state(rank), f"{root}/a", comm)
    out["a_plan_index_keys"] = sorted(prep.plan.index.tensors)  # rank 0 only: the whole index
    out["a_bytes"] = prep.plan.bytes_per_rank.get(rank, 0)
    finalize_save(prep, write_local(prep))
    cache = SavePlanCache()
    ldc.save(_state(rank), f"{root}/b", plan_cache=cache)
    ldc.save(_state(rank), f"{root}/c", plan_cache=cache)
    out["cache"] = (cache.hits, cache.misses)
    bad = _state(rank)
    if rank == 5:  # claims a different global shape
        bad["w"] = ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(8, COLS + 1), (0, 1, TP), replica_id=2)
    try:
        ldc.save(bad, f"{root}/bad")
        out["bad"] = None
    except ldc.CheckpointingError as e:
        out["bad"] = (type(e).__name__, str(e))
    # load every tensor split by columns over all 8 ranks (another split than the save's)
    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(ROWS, 1), (1, rank, world))
                for k in ("w", "b", "norm")}
    loaded = ldc.load(template, f"{root}/c")
    out["loaded_ok"] = all(torch.equal(loaded[k], _full(k)[:, rank:rank + 1]) for k in template)
    out["step"] = loaded.get("step")
    out["keys"] = _key_matching(rank, f"{root}/c")
    return out


def _key_matching(rank, path):
    """Missing and unexpected keys when every rank asks the same keys (digests agree), and when
    ranks ask different ones (pipeline-like: only one rank per distinct key set sends its keys)."""
    def ask(keys):
        tmpl = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(ROWS, COLS)) for k in keys}
        _, missing, unexpected = ldc.load(tmpl, path, strict=ldc.StrictHandling.RETURN_ALL)
        return sorted(missing), sorted(unexpected)

    same = ask(["w", "b"])
    split = ask(["w"] if rank % 2 == 0 else ["b", "zzz"] if rank == 3 else ["b"])
    covered = ask(["w", "norm"] if rank == 6 else ["b"])
    return same, split, covered


def _fsdp_tools(tmp_path):
    """validate, inspect and convert read the compact FSDP-like index; the copy loads whole."""
    assert main(["validate", str(tmp_path / "fsdp")]) == 0
    assert main(["inspect", str(tmp_path / "fsdp"), "--json"]) == 0
    assert main(["convert", str(tmp_path / "fsdp"), str(tmp_path / "fsdp_zarr"), "--to", "distckpt",
                 "--layout", "zarr"]) == 0
    whole = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(rows, 3)) for k, rows in FSDP_ROWS.items()},
                     tmp_path / "fsdp_zarr")
    assert all(torch.equal(whole[k], _fsdp_full(k)) for k in FSDP_ROWS)


def test_eight_ranks_save_reuse_refuse_and_reshard(tmp_path):
    root = str(tmp_path)
    results = run_distributed(_save_and_reshard, TP * DP, root, timeout_s=300)
    assert results[0]["a_plan_index_keys"] == ["b", "norm", "w"]
    assert all(r["a_plan_index_keys"] == [] for r in results[1:])  # other ranks hold their writes only
    # every byte written once, spread over the replicas (balance_writes)
    unique = 3 * ROWS * COLS * 4
    assert sum(r["a_bytes"] for r in results) == unique
    assert sum(1 for r in results if r["a_bytes"]) > TP
    assert all(r["cache"] == (1, 1) for r in results)
    kinds = {r["bad"][0] for r in results}
    messages = {r["bad"][1] for r in results}
    assert kinds == {"ValidationError"} and len(messages) == 1
    (message,) = messages
    assert "disagree on global shape" in message and "ranks [5]" in message
    assert not os.path.exists(tmp_path / "bad")
    assert all(r["loaded_ok"] and r["step"] == 7 for r in results)
    # (missing: saved, asked for by no rank; unexpected: this rank's keys the checkpoint lacks)
    assert all(r["keys"] == ((["norm"], []), (["norm"], ["zzz"] if rank == 3 else []), ([], []))
               for rank, r in enumerate(results))
    meta = json.loads((tmp_path / "a" / METADATA_FILE).read_text())
    assert meta["world_size"] == TP * DP and sorted(meta["tensors"]) == ["b", "norm", "w"]
    # FSDP-like: each rank writes its own chunks; the shifted layout fails alike on every rank
    assert all(r["fsdp_writes"] == [("f0", rank), ("f1", rank)] for rank, r in enumerate(results))
    fsdp_meta = json.loads((tmp_path / "fsdp" / METADATA_FILE).read_text())
    # one entry per tensor, not one per chunk (format 4); chunks of 3 rows (small: packed)
    assert fsdp_meta["tensors"]["f1"] == {"global_shape": [22, 3], "dtype": "float32",
                                          "even": {"over": 8, "packed_from": 0}}
    index = CheckpointIndex.from_json(fsdp_meta, "fsdp")
    assert [s.offset[0] for s in index.tensors["f1"].shards] == [0, 3, 6, 9, 12, 15, 18, 21]
    _fsdp_tools(tmp_path)
    assert {r["fsdp_bad"] for r in results} == {results[0]["fsdp_bad"]}
    kind, message = results[0]["fsdp_bad"]
    assert kind == "ValidationError" and "'f1'" not in message
    assert "'f0': main replicas overlap: offset (21, 0) shape (4, 3) (ranks [5]) and offset (24, 0) shape (4, 3) " \
           "(ranks [6])" in message
    assert not os.path.exists(tmp_path / "fsdp_bad")
    assert all(r["fsdp_loaded_ok"] for r in results)
    # one process reads the whole of every tensor (8 -> 1)
    whole = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(ROWS, COLS)) for k in ("w", "b", "norm")},
                     tmp_path / "a")
    assert all(torch.equal(whole[k], _full(k)) for k in ("w", "b", "norm"))
