"""CPU-seconds of one async save, by phase, against the raw ceilings (issue 29).

Where training uses every core, each CPU-second the background writer spends is taken from the
training: what an async save costs is its CPU, not its wall time. Per rank (gloo processes on this
machine, a tensor-parallel GPT-like state, ``--mb`` in all), after a warm-up save with the same
saver (staging pool allocated, plan cached: the steady state), each of ``--repeats`` saves is split
into, as CPU-seconds of the whole process (``time.process_time``: every thread, exited ones too):

* ``blocked``: ``AsyncSaver.save`` until it returns (plan, snapshot copy, collectives); of
  which, on the caller's thread, ``plan`` and ``snapshot`` (the request's ``blocking_cpu_s``);
* ``background``: from its return until the background writes end (the caller waits in a join);
* ``commit``: ``finalize()`` (agreement, rank 0's commit, fsyncs);

and, on the same bytes, the raw ceilings: ``memcpy`` (a copy of the state into a preallocated,
touched buffer), ``crc32c`` (the chunk checksums' CRC-32C over the state), ``write`` (the state
written with ``os.write`` from its numpy buffers into a new file, then ``fsync``) and ``rewrite``
(the same over that file again). On a VM that hands freed guest memory back to its host (free page
reporting, as this machine's), a new file's page-cache pages each cost a host fault: ``write``
there is up to ~10x ``rewrite`` (when no recently freed memory is at hand), and so is the page-cache
copy of every save, ours and stock alike. ``BENCH_POOL_PROBE=1`` adds ``write_pool`` (the staged
bytes written from the staging pool into a new file, as the background writer does) and
``read_pool`` (a memcpy out of the pool). Medians over the
repeats; CPU-seconds summed over ranks are printed beside each rank's. The first save of the saver
(``first_*``: the staging pool allocated, the plan made) is reported apart. ``BENCH_LAYOUT=zarr``
saves in the zarr layout (chunk files of 128 KiB+ written with ``O_DIRECT``).

Run: ``python benchmarks/bench_async_cpu.py [--mb 400] [--worlds 2] [--repeats 3] [--budget none]``;
an older checkout: ``PYTHONPATH=/path/to/checkout python benchmarks/bench_async_cpu.py``.
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
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import lightning_distckpt as ldc  # noqa: E402
from bench_async import _barrier, _sharded  # noqa: E402
from common import fmt_table, local_state, machine_summary, state_bytes  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

PHASES = ("blocked", "background", "commit", "memcpy", "crc32c", "write", "rewrite")


def _cpu(fn: Callable[[], Any]) -> float:
    """CPU-seconds of the whole process while ``fn`` runs."""
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _ceilings(tensors: List[Any], dst: torch.Tensor, root: str, n: int) -> Dict[str, float]:
    """The raw ceilings on this rank's bytes: copy (into ``dst``, allocated once like a staging
    pool), checksum, and write + fsync, into a new file (what a save does: every page of the page
    cache fresh) and over the same file again (its pages freed and at once reused)."""
    from lightning_distckpt.storage.chunk_checksums import crc32c

    flat = [t.data.reshape(-1).view(torch.uint8) for t in tensors]

    def copy() -> None:
        off = 0
        for f in flat:
            dst[off:off + f.numel()].copy_(f)
            off += f.numel()

    def crc() -> None:
        for f in flat:
            crc32c(memoryview(f.numpy()))

    def write(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for f in flat:
                view = memoryview(f.numpy())
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    path = os.path.join(root, f"raw_{os.getpid()}_{n}")
    return {"memcpy": _cpu(copy), "crc32c": _cpu(crc), "write": _cpu(lambda: write(path)),
            "rewrite": _cpu(lambda: write(path))}  # (kept: a save's files stay too, until they are replaced)


def _write_new(buf: torch.Tensor, path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(buf.numpy())
    while view:
        view = view[os.write(fd, view[:64 << 20]):]
    os.fsync(fd)
    os.close(fd)


def _wait_for_profiler(rank: int) -> None:
    """With ``BENCH_PROFILE_DIR`` set: say this rank is ready (``ready.<rank>``, holding its pid) and
    wait for ``go`` there, so a profiler attached meanwhile sees only the measured saves."""
    where = os.environ.get("BENCH_PROFILE_DIR")
    if not where:
        return
    with open(os.path.join(where, f"ready.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 120  # a bound for a forgotten profiler, not a timing
    while not os.path.exists(os.path.join(where, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    _barrier()


def _worker(rank: int, world: int, root: str, total_bytes: int, repeats: int,
            budget: Optional[float], saver_args: Dict[str, Any]) -> Dict[str, Any]:
    torch.set_num_threads(1)
    tensors = local_state(total_bytes, rank, world, "tp")
    sd = _sharded(tensors, rank, world)
    nbytes = state_bytes(tensors)
    saver = ldc.AsyncSaver(max_staging_bytes=None if budget is None else int(budget * nbytes), **saver_args)
    ldc.save({k: v for k, v in list(sd.items())[:2]}, f"{root}/imports")  # imports, tensorstore started
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # the memcpy ceiling's destination, resident like a staging pool
    _barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    storage = ldc.StorageOptions(layout=os.environ.get("BENCH_LAYOUT", "ocdbt"))
    first = saver.save(sd, f"{root}/warm", storage=storage)  # the staging pool allocated, the plan made and cached
    c1, w1 = time.process_time(), time.perf_counter()
    first.finalize()
    rows: Dict[str, List[float]] = {p: [] for p in (*PHASES, "blocked_wall")}
    _wait_for_profiler(rank)
    rows.update(first_blocked=[c1 - c0], first_blocked_wall=[w1 - w0], plan=[], snapshot=[])
    if hasattr(first, "snapshot_cpu_s"):  # (older checkouts do not say)
        rows.update(first_plan=[first.blocking_cpu_s - first.snapshot_cpu_s], first_snapshot=[first.snapshot_cpu_s])
    for i in range(repeats):
        os.sync()
        _barrier()
        c0 = time.process_time()
        req = saver.save(sd, f"{root}/s{i}", storage=storage)  # a new checkpoint each time, as ModelCheckpoint's
        c1 = time.process_time()
        req.wait()
        c2 = time.process_time()
        req.finalize()
        c3 = time.process_time()
        rows["blocked"].append(c1 - c0)
        rows["background"].append(c2 - c1)
        rows["commit"].append(c3 - c2)
        if hasattr(req, "snapshot_cpu_s"):
            rows["plan"].append(req.blocking_cpu_s - req.snapshot_cpu_s)
            rows["snapshot"].append(req.snapshot_cpu_s)
        rows["blocked_wall"].append(req.blocking_s)
        _barrier()
        for k, v in _ceilings(tensors, dst, root, i).items():
            rows[k].append(v)
        if os.environ.get("BENCH_POOL_PROBE"):
            pool = saver._pool._pool
            where = os.path.join(root, f"pool_{rank}_{i}")
            rows.setdefault("write_pool", []).append(_cpu(lambda: _write_new(pool, where)))
            m = min(dst.numel(), pool.numel())
            rows.setdefault("read_pool", []).append(_cpu(lambda: dst[:m].copy_(pool[:m])))
    return {"state_bytes": nbytes, "cpu_s": {p: statistics.median(v) for p, v in rows.items() if v},
            "all": rows, "blocked_wall_s": req.blocking_s, "snapshot_wall_s": req.snapshot_s}


def report(per_rank: List[Dict[str, Any]]) -> str:
    rows = []
    for p in ("first_blocked_wall", "first_blocked", "first_plan", "first_snapshot", "blocked_wall", "plan", "snapshot",
              *PHASES, "write_pool", "read_pool"):
        each = [r["cpu_s"][p] for r in per_rank if p in r["cpu_s"]]
        if not each:
            continue
        rows.append([p, f"{sum(each):.3f}", " / ".join(f"{x:.3f}" for x in each)])
    save = sum(r["cpu_s"][p] for r in per_rank for p in PHASES[:3])
    rows.append(["async save (blocked + background + commit)", f"{save:.3f}", ""])
    return fmt_table(["phase", "CPU-s, ranks summed (median)", "per rank"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=400, help="whole training state (MB), split over the ranks")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", default="none", help="max_staging_bytes as a fraction of a rank's state, or none")
    ap.add_argument("--io-concurrency", type=int, default=None, help="AsyncSaver(io_concurrency=...)")
    ap.add_argument("--nice", type=int, default=None, help="AsyncSaver(nice=...)")
    ap.add_argument("--bg-commit", action="store_true", help="AsyncSaver(commit_in_background=True)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budget = None if args.budget == "none" else float(args.budget)
    saver_args: Dict[str, Any] = {"io_concurrency": args.io_concurrency}
    saver_args.update({"nice": args.nice} if args.nice is not None else {})
    saver_args.update({"commit_in_background": True} if args.bg_commit else {})
    results = []
    for w in args.worlds:
        load = os.getloadavg()[0]
        root = tempfile.mkdtemp(prefix=f"bench_async_cpu_{w}_", dir=os.environ.get("BENCH_DIR"))
        try:
            per_rank = run_distributed(_worker, w, root, args.mb * 10**6, args.repeats, budget, saver_args,
                                       timeout_s=900)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"{ldc.__file__}: ranks {w}, {sum(r['state_bytes'] for r in per_rank) / 1e6:.0f} MB, "
              f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; {machine_summary()}")
        print(report(per_rank))
        results.append({"world": w, "load_before": load, "per_rank": per_rank})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_summary(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
