"""Peak host memory of the local tier against the issue's target (issue 30): 4 CPU processes as 2 simulated
nodes of 2, the benchmark GPT split tensor-parallel over the 4 ranks, ``--saves`` local saves to
``/dev/shm`` (``keep_local``, ``replicas``, the staging budget as given).

    python benchmarks/bench_tier_memory.py --size-mib 256 --saves 5 --json benchmarks/results/tier_memory_256.json
    python benchmarks/bench_tier_memory.py --size-mib 256 --saves 5 --max-staging-mib 16 ...

Measured per node: the peak bytes under its ``/dev/shm`` root (its lead samples them every 5 ms while the
saves run, and reads them at every save's start and end), plus each of its ranks' peak RSS increase over
the RSS before the tier existed (``VmHWM`` after resetting it; the state itself was resident before).
Target per node, summed over its ranks: ``keep_local`` x (the rank's own store bytes + the partner copies it
holds) + the staging budget (``--max-staging-mib``, else the rank's state bytes: AsyncSaver stages all
of it without a budget). The bytes a store takes are measured on disk (the newest step's ``data/rank_r``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

WORLD, RANKS_PER_NODE = 4, 2


class _Sampler:
    """The peak of ``measure()``, sampled on a thread every ``period_s`` and at :meth:`sample`."""

    def __init__(self, measure: Callable[[], int], period_s: float = 0.005) -> None:
        self.measure, self.period_s, self.peak = measure, period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        try:
            self.peak = max(self.peak, self.measure())
        except OSError:  # a file removed while listed: the next sample counts
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak


def _anon_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``): its heap, not the mapped ``/dev/shm``
    pages (``RssShmem``, counted once as the tier's bytes there)."""
    from rss import status_kib

    return (status_kib("RssAnon") or 0) * 1024


def _rank(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    import gc

    import torch.distributed as dist

    import lightning_distckpt as ldc
    from common import dir_bytes, local_state, state_bytes
    from rss import peak_increase_mib, reset_peak
    from lightning_distckpt.tiers import LocalTier, TierOptions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    tensors = local_state(args.size_mib << 20, rank, WORLD, "tp")
    sd = {t.key: ldc.ShardedTensor.from_rank_offsets(t.key, t.data, replica_id=rank) if t.tp_axis is None
          else ldc.ShardedTensor.from_rank_offsets(t.key, t.data, (t.tp_axis, rank, WORLD)) for t in tensors}
    budget = args.max_staging_mib << 20 if args.max_staging_mib else None
    options = TierOptions(local_dir=os.path.join(args.local_dir, "{node}"), keep_local=args.keep_local,
                          replicas=args.replicas, ranks_per_node=RANKS_PER_NODE, max_staging_bytes=budget)
    gc.collect()
    dist.barrier()
    rss0 = reset_peak()
    anon0 = _anon_bytes()
    anon = _Sampler(_anon_bytes)
    tier = LocalTier(options)
    sampler = _Sampler(lambda: dir_bytes(tier.root)) if rank % RANKS_PER_NODE == 0 else None
    started = time.perf_counter()
    for i in range(args.saves):
        for t in tensors:  # the training changes the state between saves
            t.data.add_(1) if t.data.is_floating_point() else None
        if sampler:
            sampler.sample()
        tier.save(sd, (i + 1) * 10)
        if sampler:
            sampler.sample()
    tier.wait()
    seconds = time.perf_counter() - started
    rss_mib = peak_increase_mib(rss0)
    anon_mib = (anon.stop() - anon0) / 2**20
    shm_peak = sampler.stop() if sampler else None
    newest = os.path.join(tier.root, f"step_{args.saves * 10:09d}", "data")
    own = dir_bytes(os.path.join(newest, f"rank_{rank:05d}"))
    sources = tier._ctx.nodes.sources(rank, args.replicas)
    held = sum(dir_bytes(os.path.join(newest, f"rank_{s:05d}")) for s in sources)
    result = {"rank": rank, "node": tier.node, "state_bytes": state_bytes(tensors), "own_store_bytes": own,
              "copies_held_bytes": held, "copies_of": sources, "rss_peak_increase_mib": rss_mib,
              "anon_peak_increase_mib": anon_mib,
              "peak_staging_mib": tier._saver.peak_staging_bytes / 2**20, "node_shm_peak_bytes": shm_peak,
              "node_shm_end_bytes": dir_bytes(tier.root) if sampler else None, "seconds": seconds}
    tier.close()
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _summary(args: argparse.Namespace, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per node: measured (shm peak + its ranks' RSS peak increases) against the target."""
    nodes: Dict[str, Any] = {}
    for r in ranks:
        n = nodes.setdefault(r["node"], {"ranks": [], "target_bytes": 0, "rss_peak_increase_mib": 0.0,
                                         "anon_peak_increase_mib": 0.0})
        n["ranks"].append(r["rank"])
        staging = (args.max_staging_mib << 20) if args.max_staging_mib else r["state_bytes"]
        n["target_bytes"] += args.keep_local * (r["own_store_bytes"] + r["copies_held_bytes"]) + staging
        n["rss_peak_increase_mib"] += r["rss_peak_increase_mib"] or 0.0
        n["anon_peak_increase_mib"] += r["anon_peak_increase_mib"]
        if r["node_shm_peak_bytes"] is not None:
            n["shm_peak_mib"] = r["node_shm_peak_bytes"] / 2**20
    for n in nodes.values():
        n["target_mib"] = n.pop("target_bytes") / 2**20
        n["measured_mib"] = n["shm_peak_mib"] + n["anon_peak_increase_mib"]
        n["within_target"] = n["measured_mib"] <= n["target_mib"]
    return nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="the whole training state (all ranks), MiB")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--keep-local", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--max-staging-mib", type=int, default=0, help="the staging budget per rank (0: none)")
    ap.add_argument("--local-dir", default="", help="default: a fresh directory under /dev/shm")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from common import free_port, machine_summary

    own_dir = not args.local_dir
    args.local_dir = args.local_dir or tempfile.mkdtemp(prefix="ldc_tier_mem_", dir="/dev/shm")
    load_before = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(_rank, args=(args, free_port(), out_dir), nprocs=WORLD, start_method="spawn")
            ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]
    finally:
        if own_dir:
            shutil.rmtree(args.local_dir, ignore_errors=True)
    nodes = _summary(args, ranks)
    report = {"args": vars(args), "machine": machine_summary(), "load_before": load_before,
              "load_after": os.getloadavg(), "ranks": ranks, "nodes": nodes}
    for name, n in sorted(nodes.items()):
        print(f"{name}: shm peak {n['shm_peak_mib']:.1f} MiB + anonymous memory peak increase "
              f"{n['anon_peak_increase_mib']:.1f} MiB = {n['measured_mib']:.1f} MiB; target {n['target_mib']:.1f} MiB "
              f"({'within' if n['within_target'] else 'ABOVE'}); RSS peak increase (mapped shm pages counted "
              f"again) {n['rss_peak_increase_mib']:.1f} MiB")
    for r in ranks:
        print(f"  rank {r['rank']}: own store {r['own_store_bytes'] / 2**20:.1f} MiB, copies "
              f"{r['copies_held_bytes'] / 2**20:.1f} MiB, anon +{r['anon_peak_increase_mib']:.1f} MiB, "
              f"RSS +{r['rss_peak_increase_mib']:.1f} MiB, staging peak {r['peak_staging_mib']:.1f} MiB, "
              f"{r['seconds']:.2f} s")
    print(f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
