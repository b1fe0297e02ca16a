"""Async save vs synchronous save of the same state: how long the caller is blocked.

For each world size (gloo processes on this machine), every rank holds its tensor-parallel share
of a GPT-like training state (see common.py). Measured, as the slowest rank's time:

* sync: ``save(...)`` end to end (plan, write, fsync, commit);
* async, first save: ``AsyncSaver.save`` returning (plan + snapshot into freshly allocated host
  staging buffers) - the caller's blocking time - then the wait left at ``finalize()``;
* async, steady state: the next saves with the same saver (staging buffers reused, no
  allocation, the validated save plan reused: metadata unchanged), while the caller "trains" (matrix multiplies) for as long as a sync save takes,
  then ``finalize()``.

Sync and steady-state async saves are repeated (``--repeats``, default 3) and medians reported.

The target: blocking time at most 10% of the synchronous save time. The checkpoint written
asynchronously is loaded back and compared with the state at the time of the save.

Run: ``.venv/bin/python benchmarks/bench_async.py [--mb 512] [--worlds 1 2] [--repeats 3] [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import lightning_distckpt as ldc  # noqa: E402
from common import fmt_table, local_state, machine_summary, state_bytes  # noqa: E402
from dist_utils import run_distributed  # noqa: E402


def _sharded(tensors, rank: int, world: int) -> Dict[str, Any]:
    sd: Dict[str, Any] = {}
    for t in tensors:
        if t.tp_axis is None:
            sd[t.key] = ldc.ShardedTensor.from_rank_offsets(t.key, t.data, replica_id=rank)
        else:
            sd[t.key] = ldc.ShardedTensor.from_rank_offsets(t.key, t.data, (t.tp_axis, rank, world))
    return sd


def _max(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _train(seconds: float) -> int:
    """Stand-in for training steps: matrix multiplies for ``seconds``; returns the step count."""
    a = torch.randn(256, 256)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)
        steps += 1
    return steps


def _worker(rank: int, world: int, root: str, total_bytes: int, repeats: int) -> Dict[str, Any]:
    torch.set_num_threads(1)
    tensors = local_state(total_bytes, rank, world, "tp")
    sd = _sharded(tensors, rank, world)
    out: Dict[str, Any] = {"state_bytes": state_bytes(tensors)}

    ldc.save(sd, f"{root}/warmup")  # first-use costs (imports, tensorstore) out of the numbers
    sync = []
    for _ in range(repeats):
        os.sync()
        _barrier()
        t0 = time.perf_counter()
        ldc.save(sd, f"{root}/sync")  # overwrites: the same work each time, atomic swap included
        sync.append(_max(time.perf_counter() - t0))
    out["sync_s"] = statistics.median(sync)
    out["sync_all_s"] = sync

    saver = ldc.AsyncSaver()
    phases = ["first"] + [f"steady{i}" for i in range(repeats)]
    for phase in phases:
        os.sync()
        _barrier()
        t0 = time.perf_counter()
        req = saver.save(sd, f"{root}/async")
        blocked = time.perf_counter() - t0
        expected = {t.key: t.data.clone() for t in tensors[:8]}
        steps = 0
        if phase != "first":
            steps = _train(out["sync_s"])
            for t in tensors:  # training changes the state while the save is still being written
                t.data.add_(1)
        t1 = time.perf_counter()
        req.finalize()
        out[f"{phase}_blocked_s"] = _max(blocked)
        out[f"{phase}_snapshot_s"] = _max(req.snapshot_s)
        out[f"{phase}_finalize_s"] = _max(time.perf_counter() - t1)
        out[f"{phase}_total_s"] = _max(time.perf_counter() - t0)
        out[f"{phase}_steps"] = steps
        out[f"{phase}_plan_reused"] = req.plan_reused
        out["staged_bytes"] = saver.staging_bytes
    steady = [f"steady{i}" for i in range(repeats)]
    for what in ("blocked_s", "snapshot_s", "finalize_s", "total_s", "steps"):
        out[f"steady_{what}"] = statistics.median(out[f"{p}_{what}"] for p in steady)
    out["steady_blocked_all_s"] = [out[f"{p}_blocked_s"] for p in steady]
    out["steady_plan_reused"] = all(out[f"{p}_plan_reused"] for p in steady)
    # the steady-state checkpoint holds the state as it was when save returned
    assert expected is not None
    tmpl = _sharded([type(t)(t.key, torch.empty_like(t.data), t.global_shape, t.tp_axis, t.replicated)
                     for t in tensors], rank, world)
    got = ldc.load(tmpl, f"{root}/async")
    out["ok"] = all(torch.equal(got[k], v) for k, v in expected.items())
    return out


def run(world: int, total_bytes: int, repeats: int) -> Dict[str, Any]:
    root = tempfile.mkdtemp(prefix=f"bench_async_{world}_", dir=os.environ.get("BENCH_DIR"))
    try:
        if world == 1:
            per_rank = [_worker(0, 1, root, total_bytes, repeats)]
        else:
            per_rank = run_distributed(_worker, world, root, total_bytes, repeats, timeout_s=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = dict(per_rank[0])
    res["world"] = world
    res["state_bytes"] = sum(r["state_bytes"] for r in per_rank)
    res["ok"] = all(r["ok"] for r in per_rank)
    res["steady_plan_reused"] = all(r["steady_plan_reused"] for r in per_rank)
    return res


def report(results: List[Dict[str, Any]]) -> str:
    rows = []
    for r in results:
        s = r["sync_s"]
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        rows.append([r["world"], f"{r['state_bytes'] / 1e6:.0f}", f"{s:.3f} [{fmt(r['sync_all_s'])}]",
                     f"{r['first_blocked_s']:.3f} ({100 * r['first_blocked_s'] / s:.1f}%)",
                     f"{r['steady_blocked_s']:.3f} ({100 * r['steady_blocked_s'] / s:.1f}%) [{fmt(r['steady_blocked_all_s'])}]",
                     f"{r['steady_snapshot_s']:.3f}", f"{r['steady_finalize_s']:.3f}", f"{r['steady_total_s']:.3f}",
                     r["steady_steps"], r["steady_plan_reused"], r["ok"]])
    return fmt_table(["ranks", "state MB", "sync save s: median [all]", "async blocked s, 1st save (% of sync)",
                      "async blocked s, reused buffers: median (% of sync) [all]", "of which snapshot s",
                      "finalize wait s after training",
                      "async save to commit s", "training steps during save", "cached plan reused",
                      "loads back as snapshot"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="whole training state (MB), split over the ranks")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3, help="sync saves and steady-state async saves (medians)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = [run(w, args.mb * 10**6, args.repeats) for w in args.worlds]
    print(f"machine: {machine_summary()}")
    print(report(results))
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f}s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_summary(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
