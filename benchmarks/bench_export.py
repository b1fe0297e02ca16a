"""Exporting a tensor-parallel checkpoint to Hugging Face safetensors, three ways, side by side:

* ``ldc``: ``ldc.export.to_safetensors(ckpt, out, max_shard_size)`` from our checkpoint saved under TP 2
  (streams one shard file at a time);
* ``whole``: ``ldc.load_plain_tensors(ckpt)`` (the whole model in memory) then one
  ``safetensors.torch.save_file``;
* ``dcp``: torch's ``consolidate_safetensors_files`` from the same state saved under TP 2 by
  ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True)`` (DCP's own route to a
  Hugging Face layout), into the same files as ``ldc``;
* ``ldc-dcp``: ``ldc.export.to_dcp(ckpt, out)`` (our checkpoint to a DCP directory), for its cost.

    .venv/bin/python benchmarks/bench_export.py --size-mib 256 --repeats 3

Each run is its own process, so its peak RSS (``VmHWM``) is its own; "peak - base" subtracts
the RSS the process had after its imports, before it started. The files are in the page cache
(warm), as right after a training job wrote them. Prints the median time and the largest peak of
each method.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN = 1024
METHODS = ("ldc", "whole", "dcp", "ldc-dcp")


def full_state(size_mib: int) -> Dict[str, torch.Tensor]:
    """float32 GPT-like weights of about ``size_mib``: blocks of qkv / proj / fc1 / fc2 and norms."""
    g = torch.Generator().manual_seed(0)
    state: Dict[str, torch.Tensor] = {"embed.weight": torch.randn(4 * HIDDEN, HIDDEN, generator=g)}
    layer_bytes = 12 * HIDDEN * HIDDEN * 4
    for i in range(max(1, round(((size_mib << 20) - state["embed.weight"].nbytes) / layer_bytes))):
        for name, shape in (("qkv", (3 * HIDDEN, HIDDEN)), ("proj", (HIDDEN, HIDDEN)), ("fc1", (4 * HIDDEN, HIDDEN)),
                            ("fc2", (HIDDEN, 4 * HIDDEN)), ("norm", (HIDDEN,))):
            state[f"layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g)
    return state


def _setup_rank(rank: int, world: int, port: int, size_mib: int, ckpt: str, dcp_dir: str) -> None:
    """Save the state under TP ``world`` (axis 0 split) with ldc.save and with DCP's HF writer."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import lightning_distckpt as ldc

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    state = full_state(size_mib)
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, t.chunk(world)[rank].clone(), (0, rank, world))
              for k, t in state.items()}, ckpt)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in state.items()},
             storage_writer=HuggingFaceStorageWriter(dcp_dir, save_distributed=True))
    dist.destroy_process_group()


def _peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would carry the parent's peak across fork + exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def run_method(method: str, root: str, max_shard: int) -> Dict[str, float]:
    """In this process: one export by ``method``; returns seconds and RSS (MiB)."""
    import lightning_distckpt as ldc
    from lightning_distckpt.export.safetensors_out import plan_files
    from lightning_distckpt.export.tensors import export_tensors, open_source

    ckpt, out = os.path.join(root, "ckpt"), os.path.join(root, f"out-{method}")
    shutil.rmtree(out, ignore_errors=True)
    base = _peak_rss_mib()
    t0 = time.perf_counter()
    if method == "ldc":
        ldc.export.to_safetensors(ckpt, out, max_shard_size=max_shard)
    elif method == "whole":
        from safetensors.torch import save_file

        os.makedirs(out)
        save_file(ldc.load_plain_tensors(ckpt), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    elif method == "dcp":
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        files = plan_files(export_tensors(open_source(ckpt, out)), max_shard)  # the same files as ldc writes
        mapping = {t.name: i + 1 for i, f in enumerate(files) for t in f.tensors}
        os.makedirs(out)
        consolidate_safetensors_files(os.path.join(root, "dcp"), out, mapping)
    else:
        ldc.export.to_dcp(ckpt, out)
    seconds = time.perf_counter() - t0
    peak = _peak_rss_mib()
    return {"seconds": seconds, "base_mib": base, "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-shard-mib", type=int, default=64)
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    max_shard = args.max_shard_mib << 20
    if args.child:
        print(json.dumps(run_method(args.child, args.dir, max_shard)))
        return
    root = args.dir or tempfile.mkdtemp(prefix="bench_export_")
    try:
        results = _run_all(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _spawn_setup(size_mib: int, root: str) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_setup_rank, args=(2, port, size_mib, os.path.join(root, "ckpt"), os.path.join(root, "dcp")),
                       nprocs=2, join=True, start_method="spawn")


def _run_all(args: argparse.Namespace, root: str) -> Dict[str, object]:
    t0 = time.perf_counter()
    _spawn_setup(args.size_mib, root)
    nbytes = sum(t.numel() * 4 for t in full_state(args.size_mib).values())
    print(f"state: {nbytes / 2**20:.0f} MiB float32, saved under TP 2 (setup {time.perf_counter() - t0:.1f} s); "
          f"max shard {args.max_shard_mib} MiB", flush=True)
    runs: Dict[str, List[Dict[str, float]]] = {m: [] for m in METHODS}
    for _ in range(args.repeats):  # interleaved: each repeat runs every method once
        for m in METHODS:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", m, "--dir", root,
                   "--max-shard-mib", str(args.max_shard_mib)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{m} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            runs[m].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| method | median s | GB/s | peak RSS MiB | peak - base MiB |\n|---|---|---|---|---|")
    summary = {}
    for m in METHODS:
        secs = statistics.median(r["seconds"] for r in runs[m])
        peak = max(r["peak_mib"] for r in runs[m])
        grown = max(r["peak_mib"] - r["base_mib"] for r in runs[m])
        summary[m] = {"median_s": secs, "peak_mib": peak, "peak_minus_base_mib": grown, "runs": runs[m]}
        print(f"| {m} | {secs:.2f} | {nbytes / secs / 1e9:.2f} | {peak:.0f} | {grown:.0f} |")
    return {"bytes": nbytes, "max_shard_mib": args.max_shard_mib,
            "repeats": args.repeats, "results": summary}


if __name__ == "__main__":
    main()
