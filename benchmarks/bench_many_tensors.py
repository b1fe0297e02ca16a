"""Load (and save) of many tiny tensors: the per-key cost of a load, with each loader, cold and warm.

    python benchmarks/bench_many_tensors.py --tensors 10000 --repeats 3 --tag run1

State: ``--tensors`` fp32 tensors of ``--numel`` elements each on ``--world`` gloo CPU processes;
even-numbered ones split along dim 0 over the ranks (ShardedTensors, rank r holds chunk r), odd ones
replicated (every rank the same data, rank 0's replica the main one). Saved with
``lightning_distckpt.save``, then saved again over itself (``save_over_s``, the median of
``--saves-over``: as a save of ``last`` does);
then, per repeat (the order of the contestants rotates), each contestant loads cold (the page cache of
every file of the checkpoint dropped first, as ``common.drop_page_cache`` does) and then warm:

* ``every_rank`` / ``parallel`` / ``two_stage``: ``lightning_distckpt.load`` with that loader,
  in place into a zeroed template;
* ``torch``: the reference, ``torch.load(weights_only=True)`` on every rank of one ``torch.save``
  file of the whole (global) state written by rank 0, each rank copying its slices into place.

Times (the template's ShardedTensors built before the clock starts) are wall-clock from a barrier before to a barrier after (the slowest rank); medians over
the repeats. Every load is checked for exact values. ``--tree`` imports the library from another
checkout (an A/B of two versions, run interleaved by the caller).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from benchmarks.common import drop_page_cache, fmt_table, free_port, machine_summary  # noqa: E402

LOADERS = ("every_rank", "parallel", "two_stage")


def _state(n: int, numel: int, rank: int, world: int) -> Dict[str, torch.Tensor]:
    """The global tensors, deterministic by key: the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    full = torch.randn(n, numel, generator=g)
    return {f"layer{i // 100:03d}.t{i:05d}": full[i].clone() for i in range(n)}


def _sharded(full: Dict[str, torch.Tensor], data: Dict[str, torch.Tensor], rank: int, world: int) -> Dict[str, Any]:
    import lightning_distckpt as ldc

    out = {}
    for i, key in enumerate(full):
        if i % 2 == 0:
            out[key] = ldc.ShardedTensor.from_rank_offsets(key, data[key], (0, rank, world))
        else:
            out[key] = ldc.ShardedTensor.from_rank_offsets(key, data[key], replica_id=rank)
    return out


def _local(full: Dict[str, torch.Tensor], rank: int, world: int) -> Dict[str, torch.Tensor]:
    """This rank's data: chunk ``rank`` of the split tensors, the whole of the replicated ones."""
    return {k: (t.chunk(world)[rank].clone() if i % 2 == 0 else t.clone()) for i, (k, t) in enumerate(full.items())}


def _timed(fn: Callable[[], None]) -> float:
    # common.timed_collective's twin: bench_many_tensors_ab.py runs a copy of this file inside older
    # checkouts, whose benchmarks/common.py may not have it.
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    import lightning_distckpt as ldc

    try:
        full = _state(args.tensors, args.numel, rank, world)
        mine = _local(full, rank, world)
        dest = {k: torch.zeros_like(t) for k, t in mine.items()}
        ckpt, ref = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "ref.pt")
        save_s = _timed(lambda: ldc.save(_sharded(full, mine, rank, world), ckpt))
        # again over it, as a save of `last` does: the target is checked before writing and at the swap
        save_over_s = statistics.median(_timed(lambda: ldc.save(_sharded(full, mine, rank, world), ckpt))
                                        for _ in range(args.saves_over))
        if rank == 0:
            with open(ref, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()

        def ours(loader: str) -> Callable[[], Callable[[], None]]:
            def prepare() -> Callable[[], None]:  # the template, built before the clock starts
                template = _sharded(full, dest, rank, world)
                return lambda: ldc.load(template, ckpt, loader=loader)
            return prepare

        def load_reference() -> None:
            loaded = torch.load(ref, weights_only=True, map_location="cpu")
            for i, (k, d) in enumerate(dest.items()):
                d.copy_(loaded[k].chunk(world)[rank] if i % 2 == 0 else loaded[k])

        contestants = {name: ours(name) for name in args.loaders}
        contestants["torch"] = lambda: load_reference
        names = list(contestants)
        times: Dict[str, Dict[str, List[float]]] = {n: {"cold": [], "warm": []} for n in names}
        for rep in range(args.repeats):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                for how in ("cold", "warm"):
                    for d in dest.values():
                        d.zero_()
                    if how == "cold" and rank == 0:
                        drop_page_cache(ref if name == "torch" else ckpt)
                    times[name][how].append(_timed(contestants[name]()))
                    ok = all(torch.equal(mine[k2], d) for k2, d in dest.items())
                    oks: List[bool] = [False] * world
                    dist.all_gather_object(oks, ok)
                    if not all(oks):
                        raise AssertionError(f"{name} ({how}) loaded wrong values")
        if rank == 0:
            out["save_s"] = save_s
            out["save_over_s"] = save_over_s
            out["times"] = times
    finally:
        dist.destroy_process_group()


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=10_000)
    p.add_argument("--numel", type=int, default=16, help="fp32 elements per tensor (default 16)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--saves-over", type=int, default=3, help="saves over the first one (median: save_over_s)")
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--tree", default=None, help="import lightning_distckpt from this checkout (an A/B)")
    p.add_argument("--tag", default=None, help="write benchmarks/results/many_tensors_<tag>.json")
    p.add_argument("--json", default=None, help="write the results here instead")
    args = p.parse_args(argv)
    args.loaders = [x for x in args.loaders.split(",") if x]
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    import lightning_distckpt

    code = os.path.dirname(os.path.dirname(os.path.abspath(lightning_distckpt.__file__)))
    started, load_before = time.time(), os.getloadavg()
    args.dir = tempfile.mkdtemp(prefix="bench_many_", dir=os.getcwd())
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.start_processes(_worker, args=(args.world, free_port(), args, out), nprocs=args.world,
                               join=True, start_method="spawn")
            save_s, save_over_s, times = out["save_s"], out["save_over_s"], dict(out["times"])
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    load_after = os.getloadavg()
    med = {n: {h: statistics.median(v) for h, v in t.items()} for n, t in times.items()}
    rows = [[n, f"{m['cold']:.3f}", f"{m['warm']:.3f}", f"{m['cold'] / med['torch']['cold']:.2f}x"]
            for n, m in med.items()]
    table = fmt_table(["loader", "cold load s", "warm load s", "cold / torch.load cold"], rows)
    print(f"{args.tensors} tensors of {args.numel} fp32 on {args.world} ranks (code: {code}); save {save_s:.3f} s, "
          f"again over it {save_over_s:.3f} s")
    print(table)
    print(f"load average (1, 5, 15 min) before: {' '.join(f'{x:.1f}' for x in load_before)}, after: "
          f"{' '.join(f'{x:.1f}' for x in load_after)} on {os.cpu_count()} CPUs")
    target = args.json or (os.path.join(HERE, "benchmarks", "results", f"many_tensors_{args.tag}.json")
                           if args.tag else None)
    if target:
        with open(target, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "code": code,
                       "machine": machine_summary(), "loadavg_before": load_before, "loadavg_after": load_after,
                       "seconds": round(time.time() - started, 1), "args": {k: v for k, v in vars(args).items()},
                       "save_s": save_s, "save_over_s": save_over_s, "times": times, "medians": med, "table": table},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
