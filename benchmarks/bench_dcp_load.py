"""Loading a PyTorch DCP checkpoint under a new split: ``ldc.load`` vs ``dcp.load``, side by side.

Setup: ``dcp.save`` of GPT-like float32 weights (``bench_export.full_state``) as DTensors
``Shard(0)`` on 2 gloo processes (DCP's default ``FileSystemWriter``). Each contestant then loads it
on 2 fresh gloo processes into DTensors ``Shard(1)`` (columns: every rank needs a piece of every
stored chunk):

* ``ldc``: ``ldc.load(template, dcp_dir)`` (DTensor leaves; default loader), each chunk's record
  read whole and checked against its CRC-32;
* ``ldc_unverified``: the same with ``LIGHTNING_DISTCKPT_VERIFY=0``: only the span of a chunk that
  holds the pieces is read, unchecked;
* ``dcp``: ``torch.distributed.checkpoint.load(template, checkpoint_id=dcp_dir)``.

    .venv/bin/python benchmarks/bench_dcp_load.py --size-mib 256 --repeats 3

``--saved whole --load-dim 0``: saved as plain tensors (one chunk each), loaded as row halves
(``Shard(0)``): each rank needs a contiguous half of every chunk, where reading only the span
halves the bytes read.

Runs are interleaved (each repeat runs every contestant, the order rotated). Time: the slowest rank's load call, from a barrier
to its return. Memory: the largest rank's peak RSS (``VmHWM``) growth over its RSS after the
template was allocated (and zeroed). The first run of each contestant checks its result bit-exact. The files
are in the page cache (warm).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_export import HIDDEN, full_state  # noqa: E402

METHODS = ("ldc", "ldc_unverified", "dcp")
WORLD = 2


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _writer(path: str, writer: str):
    """DCP's FileSystemWriter as ``--writer`` names it: its default format, zstd-compressed items, or
    the SAFETENSORS serialization format."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    if writer == "zstd":
        return FileSystemWriter(path, _extensions=[ZStandard()])
    if writer == "safetensors":
        return FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS)
    return FileSystemWriter(path)


def _save_rank(rank: int, port: int, size_mib: int, path: str, saved: str, writer: str = "default") -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    state = full_state(size_mib)
    if saved == "shard0":
        state = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in state.items()}
    dcp.save(state, storage_writer=_writer(path, writer))  # plain tensors: one chunk each (DCP writes a replica once)
    dist.destroy_process_group()


def _load_rank(rank: int, port: int, method: str, size_mib: int, path: str, out: str, check: bool,
               dim: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    import lightning_distckpt as ldc

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    specs = _specs(size_mib)  # shapes only: full_state here would raise this process's peak RSS
    # zeroed: its pages are resident before ``base``, so the growth is the loader's own memory
    template = {k: DTensor.from_local(torch.zeros(_local_shape(s, rank, _dim(s, dim))), mesh, [Shard(_dim(s, dim))],
                                      run_check=False, shape=torch.Size(s), stride=_stride(s))
                for k, s in specs.items()}
    base = _rss_mib("VmRSS")
    dist.barrier()
    t0 = time.perf_counter()
    if method == "ldc_unverified":
        os.environ["LIGHTNING_DISTCKPT_VERIFY"] = "0"
    if method.startswith("ldc"):
        ldc.load(template, path)
    else:
        dcp.load(template, checkpoint_id=path)
    seconds = time.perf_counter() - t0
    grown = _rss_mib("VmHWM") - base
    ok = None
    if check:
        full = full_state(size_mib)
        ok = all(torch.equal(template[k].to_local(), full[k].chunk(WORLD, _dim(full[k].shape, dim))[rank])
                 for k in full)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "grown_mib": grown, "ok": ok}, f)
    dist.destroy_process_group()


def _specs(size_mib: int) -> Dict[str, tuple]:
    """The tensor shapes of ``full_state(size_mib)``, computed without allocating it (checked
    against it in ``main``)."""
    specs = {"embed.weight": (4 * HIDDEN, HIDDEN)}
    layers = max(1, round(((size_mib << 20) - 4 * HIDDEN * HIDDEN * 4) / (12 * HIDDEN * HIDDEN * 4)))
    for i in range(layers):
        for name, shape in (("qkv", (3 * HIDDEN, HIDDEN)), ("proj", (HIDDEN, HIDDEN)), ("fc1", (4 * HIDDEN, HIDDEN)),
                            ("fc2", (HIDDEN, 4 * HIDDEN)), ("norm", (HIDDEN,))):
            specs[f"layers.{i}.{name}.weight"] = shape
    return specs


def _dim(shape: tuple, dim: int) -> int:
    """The axis a rank's piece splits: ``dim``, or the last one (1 of a 1-D norm: 0)."""
    return min(dim, len(shape) - 1)


def _local_shape(shape: tuple, rank: int, dim: int) -> tuple:
    n = shape[dim]
    size = (n + WORLD - 1) // WORLD
    return (*shape[:dim], max(0, min(size, n - rank * size)), *shape[dim + 1:])


def _stride(shape: tuple) -> tuple:
    return tuple(int(torch.tensor(shape[i + 1:]).prod()) if i + 1 < len(shape) else 1 for i in range(len(shape)))


def _spawn(fn, *args) -> None:
    """``fn`` on WORLD fresh processes; again on a new port when another program took the free port
    between its choice and the rendezvous (the machine is shared)."""
    import torch.multiprocessing as mp

    for attempt in range(3):
        try:
            mp.start_processes(fn, args=(_port(), *args), nprocs=WORLD, join=True, start_method="spawn")
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def run_once(method: str, size_mib: int, path: str, check: bool, dim: int) -> Dict[str, float]:
    out = tempfile.mkdtemp(prefix="bench_dcp_load_")
    try:
        _spawn(_load_rank, method, size_mib, path, out, check, dim)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if check and not all(r["ok"] for r in ranks):
        raise SystemExit(f"{method}: loaded values differ from the saved ones")
    return {"seconds": max(r["seconds"] for r in ranks), "grown_mib": max(r["grown_mib"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--saved", choices=["shard0", "whole"], default="shard0",
                        help="how the checkpoint is saved: DTensors Shard(0), or plain tensors (one chunk each)")
    parser.add_argument("--load-dim", type=int, choices=[0, 1], default=1, help="the axis each rank's piece splits")
    parser.add_argument("--writer", choices=["default", "zstd", "safetensors"], default="default",
                        help="DCP's writer: its default format, _extensions=[ZStandard()], or serialization_format="
                             "SAFETENSORS (which torch's own reader cannot load: no dcp contestant)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    methods = tuple(m for m in METHODS if not (args.writer == "safetensors" and m == "dcp"))
    root = tempfile.mkdtemp(prefix="bench_dcp_load_")
    try:
        path = os.path.join(root, "dcp")
        _spawn(_save_rank, args.size_mib, path, args.saved, args.writer)
        full = full_state(args.size_mib)
        assert {k: tuple(t.shape) for k, t in full.items()} == _specs(args.size_mib)
        nbytes = sum(t.numel() * 4 for t in full.values())
        del full
        print(f"state: {nbytes / 2**20:.0f} MiB float32, DCP {args.saved} on {WORLD} ranks -> Shard({args.load_dim}); "
              f"load average {os.getloadavg()}", flush=True)
        runs: Dict[str, List[Dict[str, float]]] = {m: [] for m in methods}
        for i in range(args.repeats):
            for m in methods[i % len(methods):] + methods[:i % len(methods)]:  # the order rotated
                runs[m].append(run_once(m, args.size_mib, path, check=i == 0, dim=args.load_dim))
                print(f"repeat {i} {m}: {runs[m][-1]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {m: {"median_s": statistics.median(r["seconds"] for r in runs[m]),
                   "max_grown_mib": max(r["grown_mib"] for r in runs[m]), "runs": runs[m]} for m in methods}
    print("| method | median s | GB/s | peak RSS growth MiB (max rank) |\n|---|---|---|---|")
    for m in methods:
        s = summary[m]
        print(f"| {m} | {s['median_s']:.2f} | {nbytes / s['median_s'] / 1e9:.2f} | {s['max_grown_mib']:.0f} |")
    result = {"command": "python " + " ".join(sys.argv), "saved": args.saved, "load_dim": args.load_dim,
              "writer": args.writer,
              "bytes": nbytes, "world": WORLD, "repeats": args.repeats, "load_average_end": os.getloadavg(),
              "results": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
