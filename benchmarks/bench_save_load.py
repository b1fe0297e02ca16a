"""Save / load throughput of lightning_distckpt against torch.save, torch.distributed.checkpoint
(DCP) and a raw-write ceiling, side by side in one run.

    .venv/bin/python benchmarks/bench_save_load.py --size-gib 1 --layouts tp,dp --repeats 2

State: a GPT-like mixed-precision Adam state (bf16 weights, fp32 master weights, two fp32 Adam
moments; a few hundred tensors, see ``common.py``) of ``--size-gib`` in all, on ``--world`` gloo
CPU processes, laid out tensor-parallel (``tp``: big matrices split, norms replicated) or
data-parallel (``dp``: every rank holds everything).

Contestants (every one durable: data fsync'd before the timer stops):

* ``ours``  - ``lightning_distckpt.save`` / ``load`` (default StorageOptions), template tensors
  loaded in place.
* ``torch`` - ``torch.save`` + fsync. tp: each rank saves its own local state to its own file and
  loads it back; dp: rank 0 saves the full state, every rank loads that file. Loads include the
  copy into the model's tensors (what ``load_state_dict`` does).
* ``dcp``   - ``torch.distributed.checkpoint.save`` / ``load`` with its default FileSystemWriter
  (one file per rank, one thread, ``sync_files=True``); tp state as DTensors on a CPU device mesh,
  dp state as plain (replicated) tensors, which DCP deduplicates over ranks. Loads are in place.
* ``raw``   - ceiling: each rank ``os.write``s exactly the bytes our save plan gives it into one
  file and fsyncs it; loads ``preadv`` each rank's tensors straight into place.

``load +RSS MiB``: the largest increase of a rank's peak RSS during a load over its RSS just before
(peak reset through ``/proc/self/clear_refs``, after the prefault): the memory the load needed
beyond the destination tensors, which exist (touched) before it starts.

Before every load the page cache is dropped for each file of the checkpoint
(``posix_fadvise(POSIX_FADV_DONTNEED)`` after fsync), so loads read from the device. Times are
wall-clock from a barrier before to a barrier after (the slowest rank). GB/s for saves = bytes of
the global state (stored once) / s; for loads = bytes delivered into all ranks' tensors / s.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rss as rss_peak  # noqa: E402
from benchmarks.save_load_report import summarize  # noqa: E402
from benchmarks.common import (  # noqa: E402
    free_port,
    LocalTensor, chunk_checksums_off, codec_checksums, dir_bytes, drop_page_cache, local_state, machine_summary, prefault, state_bytes,
    unique_bytes,
)

CONTESTANTS = ("ours", "torch", "dcp", "raw")


# -- contestants -----------------------------------------------------------------------------
def _ours(state: List[LocalTensor], dest: List[torch.Tensor], path: str, rank: int, world: int,
          loader: Optional[str] = None, checksums: str = "on", layout: str = "ocdbt", direct_writes: bool = True):
    import lightning_distckpt as ldc

    def sharded(tensors: List[torch.Tensor]) -> Dict[str, Any]:
        out = {}
        for t, data in zip(state, tensors):
            if t.tp_axis is None:
                out[t.key] = ldc.ShardedTensor.from_rank_offsets(t.key, data, replica_id=rank)
            else:
                out[t.key] = ldc.ShardedTensor.from_rank_offsets(t.key, data, (t.tp_axis, rank, world))
        return out

    mode = {"on": contextlib.nullcontext, "off": chunk_checksums_off, "codec": codec_checksums}[checksums]

    def save() -> None:
        with mode():
            ldc.save(sharded([t.data for t in state]), path,
                     storage=ldc.StorageOptions(layout=layout, direct_writes=direct_writes))

    def load() -> None:
        with mode():
            ldc.load(sharded(dest), path, **({"loader": loader} if loader else {}))

    return save, load


def _torch(state: List[LocalTensor], dest: List[torch.Tensor], path: str, rank: int, world: int):
    dp = all(t.replicated for t in state)
    mine = os.path.join(path, "full.pt" if dp else f"rank_{rank}.pt")

    def save() -> None:
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        if dp and rank != 0:
            return
        with open(mine, "wb") as f:
            torch.save({t.key: t.data for t in state}, f)
            f.flush()
            os.fsync(f.fileno())

    def load() -> None:
        loaded = torch.load(mine, weights_only=True, map_location="cpu")
        for t, d in zip(state, dest):
            d.copy_(loaded[t.key])

    return save, load


def _dcp(state: List[LocalTensor], dest: List[torch.Tensor], path: str, rank: int, world: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))

    def wrap(tensors: List[torch.Tensor]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for t, data in zip(state, tensors):
            if all(s.replicated for s in state):
                out[t.key] = data  # plain tensors: replicated, deduplicated by DCP
            else:
                placement = Replicate() if t.tp_axis is None else Shard(t.tp_axis)
                out[t.key] = DTensor.from_local(data, mesh, [placement], run_check=False)
        return out

    def save() -> None:
        dcp.save(wrap([t.data for t in state]), checkpoint_id=path)

    def load() -> None:
        dcp.load(wrap(dest), checkpoint_id=path)

    return save, load


def _raw(state: List[LocalTensor], dest: List[torch.Tensor], path: str, rank: int, world: int):
    from lightning_distckpt.comm import get_comm
    from lightning_distckpt.planning.metadata import ShardRecord
    from lightning_distckpt.planning.save_plan import make_save_plan
    from lightning_distckpt.storage.tensorstore_io import to_numpy

    import lightning_distckpt as ldc

    # The same assignment of shards to writers as our save.
    sts = [ldc.ShardedTensor.from_rank_offsets(t.key, t.data, replica_id=rank) if t.tp_axis is None
           else ldc.ShardedTensor.from_rank_offsets(t.key, t.data, (t.tp_axis, rank, world)) for t in state]
    comm = get_comm()
    records = comm.all_gather_object([ShardRecord.of(st, rank) for st in sts])
    plan = make_save_plan([r for recs in records for r in recs], [], world)
    writes = [sts[item.source] for item in plan.writes.get(rank, [])]
    # Where each shard lands: (key, shard id) -> (writer, file offset), known to every rank.
    offsets, pos = {}, 0
    for st in writes:
        offsets[(st.key, ShardRecord.of(st, rank).shard_id)] = (rank, pos)
        pos += st.data.numel() * st.data.element_size()
    where = {k: v for part in comm.all_gather_object(offsets) for k, v in part.items()}
    fname = lambda r: os.path.join(path, f"rank_{r}.bin")  # noqa: E731

    def save() -> None:
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        fd = os.open(fname(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for st in writes:
                os.write(fd, memoryview(to_numpy(st.data).reshape(-1).view("uint8")))
            os.fsync(fd)
        finally:
            os.close(fd)

    def load() -> None:
        fds = {}
        try:
            for st, d in zip(sts, dest):
                writer, off = where[(st.key, ShardRecord.of(st, rank).shard_id)]
                if writer not in fds:
                    fds[writer] = os.open(fname(writer), os.O_RDONLY)
                os.preadv(fds[writer], [memoryview(to_numpy(d).reshape(-1).view("uint8"))], off)
        finally:
            for fd in fds.values():
                os.close(fd)

    return save, load


FACTORIES: Dict[str, Callable] = {"ours": _ours, "torch": _torch, "dcp": _dcp, "raw": _raw}


def factory(name: str) -> Callable:
    """``ours`` (the library's default loader), ``ours:<loader>`` (e.g. ``ours:every_rank``),
    ``ours:nocrc`` (saved without chunk checksums: the off side of the checksum A/B),
    ``ours:codec`` (chunk checksums by the zarr ``crc32c`` codec, as formats 3-4 saved),
    ``ours:zarr`` (the zarr layout: chunk files of 128 KiB+ written with ``O_DIRECT``),
    ``ours:buffered`` (``direct_writes=False``: each rank's OCDBT store in one commit through the page
    cache, as before ``storage/page_cache.py``), or one of the other contestants."""
    if name == "ours:zarr":  # plain zarr arrays, chunks of 128 KiB+ written with O_DIRECT
        return lambda *a: _ours(*a, layout="zarr")
    if name == "ours:buffered":
        return lambda *a: _ours(*a, direct_writes=False)
    if name in ("ours:nocrc", "ours:codec"):
        return lambda *a: _ours(*a, checksums="off" if name == "ours:nocrc" else "codec")
    if name.startswith("ours:"):
        loader = name.split(":", 1)[1]
        return lambda *a: _ours(*a, loader=loader)
    return FACTORIES[name]


# -- the run ---------------------------------------------------------------------------------
def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return r.ru_utime + r.ru_stime


def _timed_collective(fn: Callable[[], None], warm_bytes: int = 0,
                      ready: Callable[[], None] = lambda: None) -> Tuple[float, float]:
    """(wall seconds of the slowest rank, CPU seconds summed over ranks) of ``fn``; ``ready`` runs
    after the prefault, just before the clock starts."""
    prefault(warm_bytes)
    ready()
    dist.barrier()
    c0 = _cpu_seconds()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([_cpu_seconds() - c0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(elapsed.item()), float(cpu.item())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        results = []
        size = int(args.size_gib * 2**30)
        for layout in args.layouts:
            state = local_state(size, rank, world, layout, seed=1)
            dest = [torch.empty_like(t.data) for t in state]
            local = torch.tensor([state_bytes(state)], dtype=torch.int64)
            dist.all_reduce(local)
            delivered = int(local.item())
            for rep in range(args.repeats):
                # Rotate the order every repeat: nobody always goes first (or right after another).
                k = rep % len(args.contestants)
                for name in args.contestants[k:] + args.contestants[:k]:
                    path = os.path.join(args.dir, f"{layout}-{name.replace(':', '-')}-{rep}")
                    save, load = factory(name)(state, dest, path, rank, world)
                    warm = state_bytes(state) if args.prefault else 0
                    save_s, save_cpu = _timed_collective(save, warm)
                    nfiles = nbytes = 0
                    if rank == 0:
                        nfiles = drop_page_cache(path)
                        nbytes = dir_bytes(path)
                    load_s: Optional[float] = None
                    load_cpu: Optional[float] = None
                    load_peak_extra_mib: Optional[float] = None
                    oks: List[Optional[bool]] = [None] * world
                    if not args.save_only:
                        for d in dest:
                            d.zero_()
                        dist.barrier()
                        rss: List[Optional[int]] = []
                        load_s, load_cpu = _timed_collective(load, warm, lambda: rss.append(rss_peak.reset_peak()))
                        # Peak RSS above the RSS before the load (destinations allocated and touched
                        # already): what the load itself needed, on the rank that needed most.
                        peak = rss_peak.peak_increase_mib(rss[0])
                        extra = torch.tensor([-1.0 if peak is None else peak], dtype=torch.float64)
                        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
                        load_peak_extra_mib = None if extra.item() < 0 else round(float(extra.item()), 1)
                        ok = all(torch.equal(t.data, d) for t, d in zip(state, dest))
                        dist.all_gather_object(oks, ok)
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                        results.append({
                            "layout": layout, "repeat": rep, "contestant": name, "save_s": save_s,
                            "load_s": load_s, "save_cpu_s": save_cpu, "load_cpu_s": load_cpu, "files": nfiles,
                            "bytes_on_disk": nbytes,
                            "state_bytes": unique_bytes(size), "delivered_bytes": delivered,
                            "load_ok": None if args.save_only else all(oks),
                            "load_peak_rss_extra_mib": load_peak_extra_mib,
                        })
                        loaded = "" if load_s is None else f" load {load_s:6.2f}s ok {all(oks)}"
                        print(f"[{layout} #{rep}] {name:5s} save {save_s:6.2f}s{loaded} files {nfiles:4d}", flush=True)
                    dist.barrier()
            del state, dest
        if rank == 0:
            out["results"] = results
    finally:
        dist.destroy_process_group()


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="size of the whole training state (default 1 GiB)")
    p.add_argument("--world", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--layouts", default="tp,dp", help="comma-separated: tp, dp")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"comma-separated subset of {CONTESTANTS}")
    p.add_argument("--repeats", type=int, default=1, help="runs of every contestant (interleaved)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir in the cwd)")
    p.add_argument("--json", default=None, help="write raw results and the summary here")
    p.add_argument("--no-prefault", dest="prefault", action="store_false",
                   help="do not touch and free a buffer of the rank's state size before each timed operation "
                        "(see common.prefault: evens out hypervisor page-fault costs between contestants)")
    p.add_argument("--save-only", action="store_true",
                   help="time saves only (no loads in between): more repeats in the same time, for save-path changes")
    args = p.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.contestants = [x for x in args.contestants.split(",") if x]
    for c in args.contestants:
        if c not in CONTESTANTS and not c.startswith("ours:"):
            p.error(f"unknown contestant {c!r}")
    own_dir = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="bench_save_load_", dir=os.getcwd()) if own_dir else args.dir
    os.makedirs(args.dir, exist_ok=True)
    started = time.time()
    load_before = os.getloadavg()
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.start_processes(_worker, args=(args.world, free_port(), args, out), nprocs=args.world,
                               join=True, start_method="spawn")
            results = list(out.get("results", []))
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    table, verdict = summarize(results)
    load_after = os.getloadavg()
    print(table)
    print(f"\nload average (1, 5, 15 min) before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f} on {os.cpu_count()} CPUs")
    print("\ntargets (ours save >= 0.9x raw and >= 1.3x DCP, ours load >= 0.8x raw and >= 2x DCP):")
    for k, v in verdict.items():
        load = ("not measured (--save-only)" if v["load_vs_dcp"] is None
                else f"{v['load_vs_raw']:.2f}x raw, {v['load_vs_dcp']:.2f}x DCP")
        print(f"  {k}: save {v['save_vs_raw']:.2f}x raw, {v['save_vs_dcp']:.2f}x DCP; load {load}"
              f" -> {'met' if v['targets_met'] else 'MISSED'}" + (" (saves only)" if v["load_vs_dcp"] is None else ""))
    if args.json:
        with open(args.json, "w") as f:
            from lightning_distckpt.reading.loaders import DEFAULT_LOADER

            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_summary(),
                       "default_loader": DEFAULT_LOADER, "loadavg_before": load_before, "loadavg_after": load_after,
                       "args": {k: v for k, v in vars(args).items()}, "seconds": round(time.time() - started, 1),
                       "results": results, "verdict": verdict, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
