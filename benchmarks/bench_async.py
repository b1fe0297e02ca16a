"""Async save vs synchronous save of the same state: how long the caller is blocked.

For each world size (gloo processes on this machine), every rank holds its tensor-parallel share
of a GPT-like training state (see common.py). Measured, as the slowest rank's time:

* sync: ``save(...)`` end to end (plan, write, fsync, commit);
* async, first save: ``AsyncSaver.save`` returning (plan + snapshot into freshly allocated host
  staging buffers) - the caller's blocking time - then the wait left at ``finalize()``;
* with ``--snapshot background`` (or ``both``), ``background_snapshot=True``: the save's thread copies
  the state while the caller trains, and the caller's blocking is the save's return plus its
  ``wait_snapshot()`` before it changes the state;
* async, steady state: the next saves with the same saver (staging buffers reused, no
  allocation, the validated save plan reused: metadata unchanged), while the caller "trains" (matrix multiplies) for as long as a sync save takes,
  then ``finalize()``.

Sync and steady-state async saves are repeated (``--repeats``, default 3) and medians reported.

The target: blocking time at most 10% of the synchronous save time. The checkpoint written
asynchronously is loaded back and compared with the state at the time of the save.

``--budgets`` (fractions of a rank's state, ``none`` for no budget) measures host memory instead:
for each budget, fresh processes make two async saves with ``AsyncSaver(max_staging_bytes=...)``
while the caller trains; reported per rank: the peak RSS above the RSS with the state in memory
(``VmHWM`` reset before the first save), the saver's peak staging bytes, the caller's blocking
time (the budget trades it for memory) and the save to commit.

Run: ``.venv/bin/python benchmarks/bench_async.py [--mb 512] [--worlds 1 2] [--repeats 3] [--out results.json]``
or ``... --worlds 2 --budgets none 0.5 0.25 0`` (``0.5:0``: that budget with ``writer_bytes=0``)
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
from rss import peak_increase_mib, reset_peak  # noqa: E402


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


def _worker(rank: int, world: int, root: str, total_bytes: int, repeats: int, bg: bool = False) -> Dict[str, Any]:
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
        req = saver.save(sd, f"{root}/async", background_snapshot=bg)
        blocked = time.perf_counter() - t0
        expected = {t.key: t.data.clone() for t in tensors[:8]}  # with bg: as in the save (unchanged since)
        steps, waited = 0, 0.0
        if phase != "first":
            steps = _train(out["sync_s"])
            tw = time.perf_counter()
            req.wait_snapshot()  # before changing the state (a no-op unless the copy is the thread's)
            waited = time.perf_counter() - tw
            for t in tensors:  # training changes the state while the save is still being written
                t.data.add_(1)
        t1 = time.perf_counter()
        req.finalize()
        out[f"{phase}_blocked_s"] = _max(blocked + waited)  # with bg: the save's return and the wait for the copy
        out[f"{phase}_snapshot_wait_s"] = _max(waited)
        out[f"{phase}_snapshot_s"] = _max(req.snapshot_s)
        out[f"{phase}_finalize_s"] = _max(time.perf_counter() - t1)
        out[f"{phase}_total_s"] = _max(time.perf_counter() - t0)
        out[f"{phase}_steps"] = steps
        out[f"{phase}_plan_reused"] = req.plan_reused
        out["staged_bytes"] = saver.staging_bytes
    steady = [f"steady{i}" for i in range(repeats)]
    for what in ("blocked_s", "snapshot_s", "snapshot_wait_s", "finalize_s", "total_s", "steps"):
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


def _memory_worker(rank: int, world: int, root: str, total_bytes: int, spec: Any) -> Dict[str, Any]:
    """Two async saves under ``fraction`` x this rank's state of staging budget (None: no budget);
    ``spec`` is the fraction or (fraction, writer_bytes)."""
    fraction, writer = spec if isinstance(spec, tuple) else (spec, None)
    torch.set_num_threads(1)
    tensors = local_state(total_bytes, rank, world, "tp")
    sd = _sharded(tensors, rank, world)
    nbytes = state_bytes(tensors)
    budget = None if fraction is None else int(fraction * nbytes)
    ldc.save({k: v for k, v in list(sd.items())[:2]}, f"{root}/warmup")  # imports, tensorstore, out of the peak
    saver = ldc.AsyncSaver(max_staging_bytes=budget, **({} if writer is None else {"writer_bytes": writer}))
    _train(0.1)  # the training's own first-use memory (its kernels' code paged in) is not the save's
    before = reset_peak()
    blocked, total, peaks = [], [], []
    for i in range(2):
        _barrier()
        t0 = time.perf_counter()
        req = saver.save(sd, f"{root}/m{i}")
        blocked.append(_max(time.perf_counter() - t0))
        _train(0.5)
        req.finalize()
        total.append(_max(time.perf_counter() - t0))
        peaks.append(peak_increase_mib(before))
    return {"state_bytes": nbytes, "budget": budget, "peak_rss_mib": peak_increase_mib(before), "peaks_mib": peaks,
            "peak_staging": saver.peak_staging_bytes, "waves": req.waves, "blocked_s": blocked, "total_s": total}


def run_memory(world: int, total_bytes: int, fractions: List[Any]) -> List[Dict[str, Any]]:
    rows = []
    for fraction in fractions:
        root = tempfile.mkdtemp(prefix=f"bench_async_mem_{world}_", dir=os.environ.get("BENCH_DIR"))
        try:  # fresh processes for each budget: each peak is its own
            per_rank = run_distributed(_memory_worker, world, root, total_bytes, fraction, timeout_s=600)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append({"world": world, "fraction": fraction, "per_rank": per_rank})
    return rows


def _budget_spec(text: str) -> Any:
    """``none``, a fraction, or ``FRACTION:WRITER_BYTES`` (e.g. ``0.5:0``: the whole budget to the snapshot)."""
    fraction, _, writer = text.partition(":")
    value = None if fraction == "none" else float(fraction)
    return value if not writer else (value, int(writer))


def report_memory(rows: List[Dict[str, Any]]) -> str:
    out = []
    for r in rows:
        p = r["per_rank"]
        mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
        spec = r["fraction"] if isinstance(r["fraction"], (tuple, list)) else (r["fraction"], None)
        label = "none" if spec[0] is None else f"{spec[0]:g}" + ("" if spec[1] is None else f", writer_bytes={spec[1]}")
        out.append([r["world"], label,
                    mib(max(x["state_bytes"] for x in p)),
                    "-" if p[0]["budget"] is None else mib(max(x["budget"] for x in p)),
                    mib(max(x["peak_staging"] for x in p)),
                    " / ".join(f"{max(x['peaks_mib'][i] for x in p):.0f}" for i in range(2)),
                    max(x["waves"] for x in p), " / ".join(f"{b:.3f}" for b in p[0]["blocked_s"]),
                    " / ".join(f"{b:.3f}" for b in p[0]["total_s"])])
    return fmt_table(["ranks", "budget (x state)", "state MiB per rank", "budget MiB", "peak staging MiB",
                      "peak RSS above state MiB (after 1st / 2nd save)", "waves", "caller blocked s (1st / 2nd save)",
                      "save to commit s"], out)


def _steps(k: int) -> None:
    a = torch.randn(256, 256)
    for _ in range(k):
        a = torch.tanh(a @ a)


def _timed(fn: Any) -> float:
    _barrier()
    t0 = time.perf_counter()
    fn()
    return _max(time.perf_counter() - t0)


def _overhead_worker(rank: int, world: int, root: str, total_bytes: int, repeats: int, train_s: float,
                     configs: List[str]) -> Dict[str, Any]:
    """What a save costs a caller that trains for ``train_s`` after it: per config, the time of
    save + the steps (+ finalize) minus the time of the steps alone, every repeat interleaved."""
    torch.set_num_threads(1)
    tensors = local_state(total_bytes, rank, world, "tp")
    sd = _sharded(tensors, rank, world)
    ldc.save(sd, f"{root}/warmup")
    t0 = time.perf_counter()
    _steps(50)
    k = int(_max(50 * train_s / (time.perf_counter() - t0)))  # the same step count on every rank
    savers = {c: ldc.AsyncSaver(nice=int(c.split(":")[1]), io_concurrency=int(c.split(":")[2]) or None,
                                commit_in_background=c.endswith(":bg"))
              for c in configs if c.startswith("async")}
    for c, saver in savers.items():  # buffers allocated, plan cached: the steady state
        saver.save(sd, f"{root}/{c}").finalize()
    times: Dict[str, List[float]] = {c: [] for c in ["none", *configs]}
    for r in range(repeats):
        order = ["none", *configs]
        order = order[r % len(order):] + order[:r % len(order)]
        for c in order:
            if c == "none":
                times[c].append(_timed(lambda: _steps(k)))
            elif c == "sync":
                times[c].append(_timed(lambda: (ldc.save(sd, f"{root}/sync"), _steps(k))))
            else:
                def run_async(saver: Any = savers[c], path: str = f"{root}/{c}") -> None:
                    req = saver.save(sd, path)
                    _steps(k)
                    req.finalize()
                times[c].append(_timed(run_async))
    return {"steps": k, "times": times}


def run_overhead(world: int, total_bytes: int, repeats: int, train_s: float, configs: List[str]) -> str:
    root = tempfile.mkdtemp(prefix=f"bench_async_ovh_{world}_", dir=os.environ.get("BENCH_DIR"))
    try:
        res = run_distributed(_overhead_worker, world, root, total_bytes, repeats, train_s, configs, timeout_s=600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = res["times"]["none"]
    rows = [["none (steps alone)", f"{statistics.median(base):.3f}", "-", " / ".join(f"{t:.2f}" for t in base)]]
    for c in configs:
        t = res["times"][c]
        lost = statistics.median(a - b for a, b in zip(t, base))
        rows.append([c, f"{statistics.median(t):.3f}", f"{lost:.3f}", " / ".join(f"{x:.2f}" for x in t)])
    return fmt_table(["config (async:nice:io_concurrency[:bg])", "median s", "lost s (median of paired)", "all s"], rows)


def run(world: int, total_bytes: int, repeats: int, bg: bool = False) -> Dict[str, Any]:
    root = tempfile.mkdtemp(prefix=f"bench_async_{world}_", dir=os.environ.get("BENCH_DIR"))
    try:
        if world == 1:
            per_rank = [_worker(0, 1, root, total_bytes, repeats, bg)]
        else:
            per_rank = run_distributed(_worker, world, root, total_bytes, repeats, bg, timeout_s=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = dict(per_rank[0])
    res["world"] = world
    res["background_snapshot"] = bg
    res["state_bytes"] = sum(r["state_bytes"] for r in per_rank)
    res["ok"] = all(r["ok"] for r in per_rank)
    res["steady_plan_reused"] = all(r["steady_plan_reused"] for r in per_rank)
    return res


def report(results: List[Dict[str, Any]]) -> str:
    rows = []
    for r in results:
        s = r["sync_s"]
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        rows.append([r["world"], "thread" if r.get("background_snapshot") else "caller",
                     f"{r['state_bytes'] / 1e6:.0f}", f"{s:.3f} [{fmt(r['sync_all_s'])}]",
                     f"{r['first_blocked_s']:.3f} ({100 * r['first_blocked_s'] / s:.1f}%)",
                     f"{r['steady_blocked_s']:.3f} ({100 * r['steady_blocked_s'] / s:.1f}%) [{fmt(r['steady_blocked_all_s'])}]",
                     f"{r['steady_snapshot_s']:.3f}", f"{r['steady_snapshot_wait_s']:.3f}",
                     f"{r['steady_finalize_s']:.3f}", f"{r['steady_total_s']:.3f}",
                     r["steady_steps"], r["steady_plan_reused"], r["ok"]])
    return fmt_table(["ranks", "snapshot by", "state MB", "sync save s: median [all]",
                      "async blocked s, 1st save (% of sync)",
                      "async blocked s, reused buffers: median (% of sync) [all]", "of which snapshot in save s",
                      "of which wait for the thread's copy s",
                      "finalize wait s after training",
                      "async save to commit s", "training steps during save", "cached plan reused",
                      "loads back as snapshot"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="whole training state (MB), split over the ranks")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3, help="sync saves and steady-state async saves (medians)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budgets", nargs="+", default=None,
                    help="host memory mode: staging budgets as fractions of a rank's state, or 'none'")
    ap.add_argument("--overhead", nargs="+", default=None,
                    help="overhead mode: configs 'sync' and 'async:NICE:IO_CONCURRENCY[:bg]' (0: the storage "
                         "default; bg: commit in the background)")
    ap.add_argument("--train-s", type=float, default=3.0, help="overhead mode: seconds of steps after each save")
    ap.add_argument("--snapshot", choices=["caller", "background", "both"], default="caller",
                    help="who copies the state: the caller before save returns, the save's thread "
                         "(background_snapshot=True, the caller waiting for it after its training), or both in turn")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.overhead:
        for w in args.worlds:
            print(f"machine: {machine_summary()}, load average {os.getloadavg()[0]:.1f}, ranks {w}")
            print(run_overhead(w, args.mb * 10**6, args.repeats, args.train_s, args.overhead))
        print(f"load average after {os.getloadavg()[0]:.1f}")
        return
    if args.budgets:
        fractions = [_budget_spec(b) for b in args.budgets]
        rows = [r for w in args.worlds for r in run_memory(w, args.mb * 10**6, fractions)]
        print(f"machine: {machine_summary()}, load average {os.getloadavg()[0]:.1f}")
        print(report_memory(rows))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"machine": machine_summary(), "memory": rows}, f, indent=1)
        return
    modes = {"caller": [False], "background": [True], "both": [False, True]}[args.snapshot]
    load_before = os.getloadavg()
    results = [run(w, args.mb * 10**6, args.repeats, bg) for w in args.worlds for bg in modes]
    print(f"machine: {machine_summary()}")
    print(report(results))
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f}s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_summary(), "command": " ".join(["python", *sys.argv]),
                       "load_before": load_before, "load_after": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
