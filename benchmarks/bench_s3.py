"""Save / load throughput to an S3-protocol server on loopback: lightning_distckpt's ``s3://`` store
(tensorstore's s3 kvstore, OCDBT) against torch.distributed.checkpoint (DCP) through fsspec/s3fs,
side by side in one run, interleaved.

    pip install s3fs   # DCP's FsspecWriter / FsspecReader need it for s3://
    .venv/bin/python benchmarks/bench_s3.py --size-mib 256 --world 2 --repeats 3

The server is moto's (``moto[server]``, the one the tests use), started in this process on
127.0.0.1; ``--world`` gloo CPU processes hold a GPT-like mixed-precision Adam state
(``benchmarks/common.py``) laid out tensor-parallel. Each repeat saves with every contestant (the
order rotated every repeat) to a fresh prefix, loads it back in place into zeroed tensors and
checks every byte, then deletes it. Times are wall-clock of the slowest rank, barrier to barrier.
moto is a Python server sharing this machine's cores with the clients: these numbers compare the
two client paths against the same slow server, they are not what S3 or MinIO would give.

Contestants:

* ``ours`` - ``ldc.save`` / ``ldc.load`` to ``s3://bucket/...`` (default StorageOptions: one OCDBT
  database per writing rank over the s3 kvstore, commit by marker).
* ``dcp``  - ``torch.distributed.checkpoint.save`` / ``load`` with ``FsspecWriter`` /
  ``FsspecReader`` on the same URL (s3fs; one file per rank, DTensors on a CPU mesh).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (LocalTensor, fmt_table, free_port, local_state, machine_summary,  # noqa: E402
                               moto_s3, timed_collective, unique_bytes)

BUCKET = "bench-s3"
CONTESTANTS = ("ours", "dcp")


def _ours(state: List[LocalTensor], dest: List[torch.Tensor], url: str, rank: int, world: int):
    import lightning_distckpt as ldc

    def sharded(tensors: List[torch.Tensor]) -> Dict[str, Any]:
        return {t.key: ldc.ShardedTensor.from_rank_offsets(t.key, d, replica_id=rank) if t.tp_axis is None
                else ldc.ShardedTensor.from_rank_offsets(t.key, d, (t.tp_axis, rank, world))
                for t, d in zip(state, tensors)}

    return (lambda: ldc.save(sharded([t.data for t in state]), url)), (lambda: ldc.load(sharded(dest), url))


def _dcp(state: List[LocalTensor], dest: List[torch.Tensor], url: str, rank: int, world: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    fs_options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "key": os.environ["AWS_ACCESS_KEY_ID"],
                  "secret": os.environ["AWS_SECRET_ACCESS_KEY"]}

    def wrap(tensors: List[torch.Tensor]) -> Dict[str, Any]:
        return {t.key: DTensor.from_local(d, mesh, [Replicate() if t.tp_axis is None else Shard(t.tp_axis)],
                                          run_check=False) for t, d in zip(state, tensors)}

    def save() -> None:
        dcp.save(wrap([t.data for t in state]), storage_writer=FsspecWriter(url, **fs_options))

    def load() -> None:
        dcp.load(wrap(dest), storage_reader=FsspecReader(url, **fs_options))

    return save, load


FACTORIES: Dict[str, Callable] = {"ours": _ours, "dcp": _dcp}


def _delete_prefix(prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        state = local_state(int(args.size_mib * 2**20), rank, world, "tp", seed=1)
        dest = [torch.empty_like(t.data) for t in state]
        results = []
        for rep in range(args.repeats):
            k = rep % len(args.contestants)
            for name in args.contestants[k:] + args.contestants[:k]:  # nobody always goes first
                prefix = f"{name}-{rep}"
                save, load = FACTORIES[name](state, dest, f"s3://{BUCKET}/{prefix}", rank, world)
                save_s = timed_collective(save)
                for d in dest:
                    d.zero_()
                load_s = timed_collective(load)
                oks: List[bool] = [False] * world
                dist.all_gather_object(oks, all(torch.equal(t.data, d) for t, d in zip(state, dest)))
                if rank == 0:
                    _delete_prefix(prefix)
                    results.append({"repeat": rep, "contestant": name, "save_s": save_s, "load_s": load_s,
                                    "load_ok": all(oks)})
                    print(f"[#{rep}] {name:4s} save {save_s:6.2f}s load {load_s:6.2f}s ok {all(oks)}", flush=True)
                dist.barrier()
        if rank == 0:
            out["results"] = results
    finally:
        dist.destroy_process_group()


def summarize(results: List[Dict[str, Any]], state_bytes: int) -> Tuple[str, Dict[str, Any]]:
    med = {}
    for name in dict.fromkeys(r["contestant"] for r in results):
        runs = [r for r in results if r["contestant"] == name]
        med[name] = {"save_s": statistics.median(r["save_s"] for r in runs),
                     "load_s": statistics.median(r["load_s"] for r in runs),
                     "save_runs": [round(r["save_s"], 2) for r in runs], "load_runs": [round(r["load_s"], 2) for r in runs],
                     "ok": all(r["load_ok"] for r in runs)}
    rows = []
    for name, m in med.items():
        vs = med.get("dcp")
        rows.append([name, f"{m['save_s']:.2f}", " / ".join(map(str, m["save_runs"])),
                     f"{state_bytes / m['save_s'] / 1e6:.0f}", f"{vs['save_s'] / m['save_s']:.2f}x" if vs else "-",
                     f"{m['load_s']:.2f}", " / ".join(map(str, m["load_runs"])),
                     f"{state_bytes / m['load_s'] / 1e6:.0f}", f"{vs['load_s'] / m['load_s']:.2f}x" if vs else "-",
                     "yes" if m["ok"] else "NO"])
    table = fmt_table(["contestant", "save s", "runs", "save MB/s", "vs DCP", "load s", "runs", "load MB/s", "vs DCP",
                       "ok"], rows)
    return table, med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=256)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--contestants", default=",".join(CONTESTANTS))
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/s3_<time>.json)")
    args = p.parse_args()
    args.contestants = args.contestants.split(",")
    with moto_s3(BUCKET):  # the AWS environment points at it: seen by the spawned ranks
        load_before = os.getloadavg()
        out = mp.Manager().dict()
        mp.spawn(_worker, args=(args.world, free_port(), args, out), nprocs=args.world, join=True)
        results = list(out["results"])
    state = unique_bytes(int(args.size_mib * 2**20))
    table, med = summarize(results, state)
    header = (f"state {state / 2**20:.0f} MiB on {args.world} ranks (tp), moto server on loopback, medians of "
              f"{args.repeats}; load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(header + "\n\n" + table)
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    time.strftime("s3_%Y%m%d_%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"command": " ".join(sys.argv), "machine": machine_summary(), "state_bytes": state,
                   "world": args.world, "load_average_before": load_before, "load_average_after": os.getloadavg(),
                   "results": results, "medians": med, "table": table}, f, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
