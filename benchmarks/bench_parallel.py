"""Fully parallel save / load vs the naive alternatives, replicated (data-parallel) layout.

Every rank holds the whole training state (a GPT-like mix of large and small tensors, see
common.py), as data-parallel replicas do. For 2 and 4 gloo processes on this machine:

* save: fully parallel (each unique shard written once, writes balanced over the replicas)
  vs rank 0 writing everything (``balance_writes=False``: the main replica writes) vs every
  replica writing its own copy (each rank saves its state under its own keys: what a naive
  per-replica checkpoint costs);
* load, with a cold page cache (posix_fadvise DONTNEED on every file before each load):
  every rank reads what it needs (``loader="every_rank"``) vs fully parallel load vs the
  two-stage data-parallel loader (default 256 MiB in-flight bound, and a 32 MiB bound). "storage bytes" are the bytes the library asked storage for
  (summed over ranks: what a shared file system serves); "device bytes" are what the kernel
  read from the disk (/proc/self/io read_bytes) - on one machine the page cache is shared by
  the ranks, so a second reader of the same file often hits the cache: on a multi-node shared
  file system it would not.

Run: ``.venv/bin/python benchmarks/bench_parallel.py [--mb 128] [--worlds 2 4] [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import lightning_distckpt as ldc  # noqa: E402
from common import (dir_bytes, drop_page_cache, fmt_table, local_state, machine_summary,  # noqa: E402
                    state_bytes, timed_collective)
from dist_utils import run_distributed  # noqa: E402

SAVES = ("fully_parallel", "every_replica_writes", "rank0_writes_all")
LOADS = ("every_rank", "fully_parallel", "two_stage", "two_stage_32MB")


def device_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def _quiesce(path: str, rank: int) -> None:
    """Flush dirty pages and drop the checkpoint from the page cache (cold reads)."""
    dist.barrier()
    if rank == 0:
        os.sync()
        drop_page_cache(path)
    dist.barrier()


def _worker(rank: int, world: int, root: str, total_bytes: int) -> Dict[str, Any]:
    torch.set_num_threads(1)
    tensors = local_state(total_bytes, rank, world, "dp")
    state = {t.key: ldc.ShardedTensor.from_rank_offsets(t.key, t.data, replica_id=rank) for t in tensors}
    out: Dict[str, Any] = {"state_bytes": state_bytes(tensors), "save": {}, "load": {}}

    for name in SAVES:
        path = f"{root}/save_{name}"
        if name == "every_replica_writes":
            sd = {f"r{rank}/{t.key}": ldc.ShardedTensor.from_rank_offsets(f"r{rank}/{t.key}", t.data) for t in tensors}
        else:
            sd = state
        _quiesce(root, rank)
        balance = name != "rank0_writes_all"
        seconds = timed_collective(lambda sd=sd, path=path, balance=balance: ldc.save(sd, path, balance_writes=balance))
        out["save"][name] = {"s": seconds, "bytes_on_disk": dir_bytes(path) if rank == 0 else 0}

    path = f"{root}/save_fully_parallel"
    template = {t.key: ldc.ShardedTensor.from_rank_offsets(t.key, torch.empty_like(t.data), replica_id=rank)
                for t in tensors}
    for name in LOADS:
        # loader objects, not names: each keeps every rank's stats of its last load (last_stats)
        loader: Any = {"every_rank": ldc.EveryRankLoader(), "fully_parallel": ldc.FullyParallelLoader(),
                       "two_stage": ldc.TwoStageDataParallelLoader(),
                       "two_stage_32MB": ldc.TwoStageDataParallelLoader(max_inflight_bytes=32 << 20)}[name]
        for st in template.values():
            st.data.zero_()
        _quiesce(path, rank)
        io0 = device_read_bytes()
        seconds = timed_collective(lambda loader=loader: ldc.load(template, path, loader=loader))
        device = device_read_bytes() - io0
        ok = all(torch.equal(template[t.key].data, t.data) for t in tensors)
        me = loader.last_stats[rank]
        lib_bytes, extra, inflight = me.bytes_read, me.peak_extra_bytes, me.peak_inflight_bytes
        out["load"][name] = {"s": seconds, "storage_bytes": lib_bytes, "device_bytes": device, "ok": ok,
                             "peak_extra_bytes": extra, "peak_inflight_bytes": inflight}
        if name == "two_stage" and rank == 0:
            out["two_stage_times"] = loader.summarize_load_times()
    return out


def run(world: int, total_bytes: int) -> Dict[str, Any]:
    root = tempfile.mkdtemp(prefix=f"bench_parallel_{world}_", dir=os.environ.get("BENCH_DIR"))
    try:
        per_rank = run_distributed(_worker, world, root, total_bytes, timeout_s=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res: Dict[str, Any] = {"world": world, "state_bytes": per_rank[0]["state_bytes"], "save": {}, "load": {}}
    for name in SAVES:
        res["save"][name] = {"s": per_rank[0]["save"][name]["s"],
                             "bytes_on_disk": per_rank[0]["save"][name]["bytes_on_disk"]}
    for name in LOADS:
        rows = [r["load"][name] for r in per_rank]
        res["load"][name] = {"s": rows[0]["s"], "storage_bytes": sum(r["storage_bytes"] for r in rows),
                             "device_bytes": sum(r["device_bytes"] for r in rows), "ok": all(r["ok"] for r in rows),
                             "peak_extra_bytes": max(r["peak_extra_bytes"] for r in rows),
                             "peak_inflight_bytes": max(r["peak_inflight_bytes"] for r in rows)}
    res["two_stage_times"] = per_rank[0].get("two_stage_times", "")
    return res


def report(results: List[Dict[str, Any]]) -> str:
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    lines = []
    for res in results:
        w, sb = res["world"], res["state_bytes"]
        base = res["save"]["fully_parallel"]["s"]
        lines.append(f"\n### {w} processes, replicated state of {mb(sb)} MB per rank\n")
        lines.append(fmt_table(
            ["save", "seconds", "x fully parallel", "MB on disk", "GB/s (state)"],
            [[n, f"{res['save'][n]['s']:.2f}", f"{res['save'][n]['s'] / base:.2f}",
              mb(res["save"][n]["bytes_on_disk"]), f"{sb / res['save'][n]['s'] / 1e9:.2f}"] for n in SAVES]))
        base = res["load"]["every_rank"]["s"]
        lines.append("")
        lines.append(fmt_table(
            ["load (cold cache)", "seconds", "x every_rank", "storage MB (all ranks)", "device MB read",
             "peak in-flight MB/rank", "peak extra MB/rank", "bit-identical"],
            [[n, f"{res['load'][n]['s']:.2f}", f"{res['load'][n]['s'] / base:.2f}", mb(res["load"][n]["storage_bytes"]),
              mb(res["load"][n]["device_bytes"]), mb(res["load"][n]["peak_inflight_bytes"]),
              mb(res["load"][n]["peak_extra_bytes"]), res["load"][n]["ok"]]
             for n in LOADS]))
        lines.append("\ntwo-stage per-rank stage times (rank 0's view of all ranks):\n```\n"
                     + res["two_stage_times"] + "\n```")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="training state per rank (MB, replicated)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = [run(w, args.mb * 10**6) for w in args.worlds]
    print(f"machine: {machine_summary()}")
    print(report(results))
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f}s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_summary(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
