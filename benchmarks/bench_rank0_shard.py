"""Rank 0 reads an ordinary ``torch.save`` file, every rank ends with its tensor-parallel shards:
lightning_distckpt.ingest against DCP's broadcast_from_rank0, every rank loading the whole file,
and a hand-written per-tensor broadcast, side by side in one run.

    .venv/bin/python benchmarks/bench_rank0_shard.py --size-gib 1 --worlds 2,4 --repeats 3

Weights: the fp32 weights of the GPT of ``common.gpt_params`` (a few hundred tensors: big matrices
split over the ranks along Megatron's axes, norms and row-parallel biases replicated), one file
written by ``torch.save``, ``--size-gib`` in all. Before every contestant the file is dropped
from the page cache (cold reads).

Contestants (every rank ends with its own contiguous shards):

* ``ours``      - ``sharding.load_state_dict`` (memory-mapped) + ``broadcast_and_shard_state_dict``
  on rank 0, ``shard_broadcasted_state_dict`` elsewhere (default options).
* ``dcp``       - ``set_model_state_dict(model, full, StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True))`` on a model of DTensor parameters (``Shard(axis)`` / ``Replicate()``
  on a CPU device mesh); rank 0 gives the file memory-mapped.
* ``torch_load`` - every rank ``torch.load`` s the whole file (not memory-mapped) and copies its slices.
* ``broadcast`` - hand-written: rank 0 memory-maps the file; per tensor, ``dist.broadcast`` of the
  whole tensor, every rank ``narrow`` s and copies its slice.

Reported per contestant: wall seconds (barrier to barrier, the slowest rank), and per rank the
peak resident memory above what it held before (``VmHWM`` after resetting it, which counts the
file's pages mapped in, and the sampled peak of anonymous memory, which does not), minus nothing:
the rank's own shards are part of it (``shard_mib`` says how much).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    BYTES_PER_PARAM, ParamSpec, drop_page_cache, fmt_table, free_port, gpt_params, machine_summary)

CONTESTANTS = ("ours", "direct", "dcp", "torch_load", "broadcast")


def specs_for(size_bytes: int) -> List[ParamSpec]:
    return gpt_params(int(size_bytes * BYTES_PER_PARAM / 4))  # fp32 weights only: 4 bytes a parameter


def write_file(path: str, specs: List[ParamSpec]) -> int:
    g = torch.Generator().manual_seed(0)
    state = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    torch.save(state, path)
    return sum(t.numel() * 4 for t in state.values())


def local_slice(t: torch.Tensor, spec: ParamSpec, rank: int, world: int) -> torch.Tensor:
    return t if spec.tp_axis is None else t.chunk(world, spec.tp_axis)[rank]


def local_shape(spec: ParamSpec, world: int) -> tuple:
    shape = list(spec.shape)
    if spec.tp_axis is not None:
        shape[spec.tp_axis] //= world
    return tuple(shape)


# -- contestants: each returns {name: this rank's shard} -------------------------------------------
def _ours(path: str, specs: List[ParamSpec], rank: int, world: int) -> Dict[str, torch.Tensor]:
    from lightning_distckpt import ShardedTensor
    from lightning_distckpt.ingest import broadcast_and_shard_state_dict, load_state_dict, shard_broadcasted_state_dict

    meta = {}
    for s in specs:
        data = torch.empty(local_shape(s, world), device="meta")
        meta[s.name] = (ShardedTensor.from_rank_offsets(s.name, data, replica_id=rank) if s.tp_axis is None
                        else ShardedTensor.from_rank_offsets(s.name, data, (s.tp_axis, rank, world)))
    sd = load_state_dict(path)
    out: Dict[str, torch.Tensor] = {}
    if rank == 0:
        broadcast_and_shard_state_dict(sd, meta, out)
    else:
        shard_broadcasted_state_dict(meta, out)
    return out


def _direct(path: str, specs: List[ParamSpec], rank: int, world: int) -> Dict[str, torch.Tensor]:
    """(b) every rank reads its own slices straight from the file with ldc.load (no broadcast)."""
    import lightning_distckpt as ldc

    template = {}
    for s in specs:
        data = torch.empty(local_shape(s, world))
        template[s.name] = (ldc.ShardedTensor.from_rank_offsets(s.name, data, replica_id=rank) if s.tp_axis is None
                            else ldc.ShardedTensor.from_rank_offsets(s.name, data, (s.tp_axis, rank, world)))
    return ldc.load(template, path, loader="every_rank")


def _read_bytes() -> int:
    """Bytes this process has made the kernel read from storage (page-cache misses included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _dcp(path: str, specs: List[ParamSpec], rank: int, world: int) -> Dict[str, torch.Tensor]:
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = _MESH.setdefault(world, init_device_mesh("cpu", (world,)))  # a one-time setup, not timed twice
    model = nn.Module()
    for s in specs:
        owner = model
        *parents, leaf = s.name.split(".")
        for p in parents:
            if not hasattr(owner, p):
                owner.add_module(p, nn.Module())
            owner = getattr(owner, p)
        placement = Replicate() if s.tp_axis is None else Shard(s.tp_axis)
        local = torch.empty(local_shape(s, world))
        owner.register_parameter(leaf, nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False)))
    full = torch.load(path, map_location="cpu", weights_only=True, mmap=True) if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return {name: p.to_local() for name, p in model.named_parameters()}


def _torch_load(path: str, specs: List[ParamSpec], rank: int, world: int) -> Dict[str, torch.Tensor]:
    full = torch.load(path, map_location="cpu", weights_only=True)
    return {s.name: local_slice(full[s.name], s, rank, world).clone() for s in specs}


def _broadcast(path: str, specs: List[ParamSpec], rank: int, world: int) -> Dict[str, torch.Tensor]:
    full = torch.load(path, map_location="cpu", weights_only=True, mmap=True) if rank == 0 else None
    out = {}
    for s in specs:
        t = full[s.name] if full is not None else torch.empty(s.shape)
        dist.broadcast(t, src=0)
        out[s.name] = local_slice(t, s, rank, world).clone()
        del t
    return out


_MESH: Dict[int, Any] = {}
FACTORIES: Dict[str, Callable[..., Dict[str, torch.Tensor]]] = {
    "ours": _ours, "direct": _direct, "dcp": _dcp, "torch_load": _torch_load, "broadcast": _broadcast}


# -- memory ---------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak resident memory of this process during a block: ``VmHWM`` (reset through
    ``/proc/self/clear_refs``; counts mapped file pages) and anonymous memory sampled every 2 ms."""

    def __enter__(self) -> "PeakMemory":
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier contestants freed goes back to the OS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.rss0, self.anon0 = _status_kib("VmRSS"), _status_kib("RssAnon")
        self.anon_peak, self._stop = self.anon0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.anon_peak = max(self.anon_peak, _status_kib("RssAnon"))

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.hwm_mib = (_status_kib("VmHWM") - self.rss0) / 1024
        self.anon_mib = (self.anon_peak - self.anon0) / 1024


# -- the run --------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import lightning_distckpt.ingest  # noqa: F401  imports out of the timings
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        specs = specs_for(int(args.size_gib * 2**30))
        shard_mib = sum(torch.Size(local_shape(s, world)).numel() * 4 for s in specs) / 2**20
        results, sums = [], {}
        for name in args.contestants:  # warm-up, untimed: first-call costs (gloo pairs, lazy imports)
            FACTORIES[name](args.warmup_file, specs[:16], rank, world)
        for rep in range(args.repeats):
            k = rep % len(args.contestants)
            for name in args.contestants[k:] + args.contestants[:k]:
                if rank == 0:
                    drop_page_cache(args.file)
                gc.collect()
                dist.barrier()
                read0 = _read_bytes()
                with PeakMemory() as mem:
                    t0 = time.perf_counter()
                    shards = FACTORIES[name](args.file, specs, rank, world)
                    dist.barrier()
                    seconds = time.perf_counter() - t0
                # Same shards from every contestant: per-tensor float64 sums, compared below.
                sums[name] = [float(shards[s.name].detach().double().sum()) for s in specs]
                del shards
                row = {"world": world, "repeat": rep, "contestant": name, "rank": rank, "seconds": seconds,
                       "peak_hwm_mib": round(mem.hwm_mib, 1), "peak_anon_mib": round(mem.anon_mib, 1),
                       "shard_mib": round(shard_mib, 1), "read_mib": round((_read_bytes() - read0) / 2**20, 1)}
                gathered: List[Any] = [None] * world
                dist.all_gather_object(gathered, row)
                results.extend(gathered)
                if rank == 0:
                    print(f"[world {world} #{rep}] {name:10s} {max(r['seconds'] for r in gathered):6.2f} s, peak anon "
                          f"MiB per rank {[r['peak_anon_mib'] for r in gathered]}", flush=True)
        agree = all(v == sums[args.contestants[0]] for v in sums.values())
        all_agree: List[Any] = [None] * world
        dist.all_gather_object(all_agree, agree)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"results": results, "same_shards": all(all_agree)}, f)
    finally:
        dist.destroy_process_group()


def summarize(results: List[Dict[str, Any]]) -> str:
    """A table per world size: median seconds over repeats (slowest rank), ratio to ``ours``,
    and per rank the largest peak memory over repeats."""
    lines = []
    for world in sorted({r["world"] for r in results}):
        rows, med = [], {}
        names = list(dict.fromkeys(r["contestant"] for r in results if r["world"] == world))
        for name in names:
            mine = [r for r in results if r["world"] == world and r["contestant"] == name]
            per_rep = {}
            for r in mine:
                per_rep[r["repeat"]] = max(per_rep.get(r["repeat"], 0.0), r["seconds"])
            med[name] = statistics.median(per_rep.values())
            anon = [max(r["peak_anon_mib"] for r in mine if r["rank"] == k) for k in range(world)]
            hwm = [max(r["peak_hwm_mib"] for r in mine if r["rank"] == k) for k in range(world)]
            read = [statistics.median(r.get("read_mib", 0.0) for r in mine if r["rank"] == k) for k in range(world)]
            rows.append([name, f"{med[name]:.2f}", " / ".join(f"{per_rep[k]:.2f}" for k in sorted(per_rep)),
                         f"{med[name] / med['ours']:.2f}x" if "ours" in med else "-",
                         " / ".join(f"{a:.0f}" for a in anon), " / ".join(f"{h:.0f}" for h in hwm), mine[0]["shard_mib"],
                         " / ".join(f"{b:.0f}" for b in read)])
        lines.append(f"\n**{world} ranks** (medians of the slowest rank; memory: MiB per rank 0 / 1 / ...)\n")
        lines.append(fmt_table(["contestant", "s", "runs", "vs ours", "peak anon MiB", "peak RSS MiB (file pages incl.)",
                                "own shards MiB", "read from storage MiB"], rows))
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="size of the weights file (default 1 GiB)")
    p.add_argument("--worlds", default="2,4", help="comma-separated numbers of gloo processes")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"comma-separated subset of {CONTESTANTS}")
    p.add_argument("--repeats", type=int, default=3, help="runs of every contestant (interleaved)")
    p.add_argument("--dir", default=None, help="where the file is written (default: a temp dir in the cwd)")
    p.add_argument("--json", default=None, help="write raw results and the summary here")
    args = p.parse_args(argv)
    args.contestants = [c for c in args.contestants.split(",") if c]
    for c in args.contestants:
        if c not in CONTESTANTS:
            p.error(f"unknown contestant {c!r}")
    own_dir = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="bench_rank0_shard_", dir=os.getcwd()) if own_dir else args.dir
    started = time.time()
    results: List[Dict[str, Any]] = []
    same = True
    try:
        args.file = os.path.join(args.dir, "weights.pt")
        nbytes = write_file(args.file, specs_for(int(args.size_gib * 2**30)))
        args.warmup_file = os.path.join(args.dir, "warmup.pt")
        write_file(args.warmup_file, specs_for(int(args.size_gib * 2**30))[:16])
        print(f"{args.file}: {nbytes / 2**30:.2f} GiB, {len(specs_for(int(args.size_gib * 2**30)))} tensors", flush=True)
        # A fixed mmap threshold: glibc returns every large buffer to the OS when it is freed, so one
        # contestant's freed memory does not hide the next one's peak (its threshold grows otherwise).
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        for world in [int(w) for w in args.worlds.split(",") if w]:
            out_path = os.path.join(args.dir, f"results_{world}.json")
            mp.start_processes(_worker, args=(world, free_port(), args, out_path), nprocs=world, join=True,
                               start_method="spawn")
            with open(out_path) as f:
                got = json.load(f)
            results += got["results"]
            same = same and got["same_shards"]
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    table = summarize(results)
    print(table)
    print(f"\nevery contestant gave the same shards: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_summary(),
                       "loadavg": os.getloadavg(), "seconds": round(time.time() - started, 1),
                       "args": {k: v for k, v in vars(args).items()}, "results": results, "same_shards": same,
                       "table": table}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
