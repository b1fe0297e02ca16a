"""Save a sharded checkpoint under tensor-parallel size 2, load it under 4 and under 1.

Run: python examples/reshard_demo.py [--dir DIR]
Spawns real gloo process groups on CPU; prints what each step did.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lightning_distckpt as ldc

GLOBAL = (16, 8)


def weights() -> torch.Tensor:
    return torch.arange(GLOBAL[0] * GLOBAL[1], dtype=torch.float32).reshape(GLOBAL).to(torch.bfloat16)


def sharded(rank: int, tp: int, data: torch.Tensor) -> dict:
    return {
        "layer.weight": ldc.ShardedTensor.from_rank_offsets("layer.weight", data, (0, rank, tp)),
        "rng": ldc.ShardedObject("rng", {"rank": rank}, (tp,), (rank,)),
        "step": 100,
    }


def worker(rank: int, world: int, port: int, path: str, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    rows = GLOBAL[0] // world
    if mode == "save":
        local = weights()[rank * rows:(rank + 1) * rows].clone()
        ldc.save(sharded(rank, world, local), path)
        if rank == 0:
            print(f"[TP={world}] saved {GLOBAL} bf16 weight as {world} shards of {tuple(local.shape)} -> {path}")
    else:
        template = {"layer.weight": ldc.ShardedTensor.from_rank_offsets(
            "layer.weight", torch.zeros(rows, GLOBAL[1], dtype=torch.bfloat16), (0, rank, world))}
        out = ldc.load(template, path)
        ok = torch.equal(out["layer.weight"], weights()[rank * rows:(rank + 1) * rows])
        print(f"[TP={world}] rank {rank} loaded rows {rank * rows}:{(rank + 1) * rows}, exact={ok}, step={out['step']}")
        assert ok
    dist.destroy_process_group()


def run(world: int, path: str, mode: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, port, path, mode), nprocs=world, start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    path = os.path.join(args.dir or tempfile.mkdtemp(prefix="distckpt_demo_"), "ckpt")
    run(2, path, "save")
    run(4, path, "load")
    plain = ldc.load_plain_tensors(path)["layer.weight"]
    print(f"[TP=1] single process read the whole tensor {tuple(plain.shape)}, exact={torch.equal(plain, weights())}")
    for key, st in ldc.load_tensors_metadata(path).items():
        print(f"checkpoint holds {key}: global shape {st.global_shape}, {st.dtype}")


if __name__ == "__main__":
    main()
