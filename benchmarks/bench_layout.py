"""Which on-disk layout: OCDBT (one database per rank) vs plain zarr v3 vs zarr v3 with the
``sharding_indexed`` codec, for a GPT-like state of a few hundred tensors, most of them small.

    .venv/bin/python benchmarks/bench_layout.py --size-gib 0.5 --layers 12 --repeats 3

Measures the storage layer alone (``TensorStoreIO.write`` / ``read_into``, one process, everything
fsync'd, page cache dropped before each load): files per checkpoint, save and load seconds.
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
from typing import Any, Dict, List, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    dir_bytes, drop_page_cache, fmt_table, local_state, machine_summary, prefault, state_bytes,
)
from lightning_distckpt.storage.tensorstore_io import StorageOptions, TensorStoreIO  # noqa: E402


class ShardedZarrIO(TensorStoreIO):
    """Plain zarr v3 files, but each stored shard is one zarr *shard* (``sharding_indexed`` codec):
    one data file per array holding all its chunks plus an index, instead of one file per chunk."""

    def create_spec(self, writer: int, path: str, dtype: torch.dtype, shape: Sequence[int]) -> Dict[str, Any]:
        spec = super().create_spec(writer, path, dtype, shape)
        meta = spec["metadata"]
        inner = meta["chunk_grid"]["configuration"]["chunk_shape"]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [max(1, int(s)) for s in shape]  # one shard per array
        meta["codecs"] = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": inner,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end",
        }}]
        return spec


VARIANTS = {
    "ocdbt": lambda d: TensorStoreIO(d, StorageOptions(layout="ocdbt")),
    "zarr": lambda d: TensorStoreIO(d, StorageOptions(layout="zarr")),
    "zarr+sharding": lambda d: ShardedZarrIO(d, StorageOptions(layout="zarr")),
}


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    state = local_state(int(args.size_gib * 2**30), 0, 1, "dp", seed=2, layers=args.layers)
    nbytes = state_bytes(state)
    dest = [torch.empty_like(t.data) for t in state]
    results = []
    for rep in range(args.repeats):
        for name in args.variants:
            path = os.path.join(args.dir, f"{name}-{rep}")
            io = VARIANTS[name](path)
            prefault(nbytes)
            t0 = time.perf_counter()
            io.write(0, [(t.key, 0, t.data) for t in state])
            save_s = time.perf_counter() - t0
            nfiles = drop_page_cache(path)
            for d in dest:
                d.zero_()
            prefault(nbytes)
            reader = VARIANTS[name](path)
            t0 = time.perf_counter()
            reader.read_into([(t.key, 0, 0, tuple(slice(None) for _ in t.data.shape), d) for t, d in zip(state, dest)])
            load_s = time.perf_counter() - t0
            ok = all(torch.equal(t.data, d) for t, d in zip(state, dest))
            results.append({"variant": name, "repeat": rep, "save_s": save_s, "load_s": load_s, "files": nfiles,
                            "dirs": sum(1 for _ in os.walk(path)), "bytes_on_disk": dir_bytes(path),
                            "state_bytes": nbytes, "tensors": len(state), "ok": ok})
            print(f"[#{rep}] {name:14s} save {save_s:6.2f}s load {load_s:6.2f}s files {nfiles:5d} ok {ok}", flush=True)
            shutil.rmtree(path, ignore_errors=True)
    return results


def summarize(results: List[Dict[str, Any]]) -> str:
    rows = []
    for name in VARIANTS:
        runs = [r for r in results if r["variant"] == name]
        if not runs:
            continue
        save = statistics.median(r["save_s"] for r in runs)
        load = statistics.median(r["load_s"] for r in runs)
        r0 = runs[0]
        rows.append([name, r0["files"], r0["dirs"], f"{save:.2f}", " / ".join(f"{r['save_s']:.2f}" for r in runs),
                     f"{r0['state_bytes'] / save / 1e9:.2f}", f"{load:.2f}",
                     " / ".join(f"{r['load_s']:.2f}" for r in runs), f"{r0['state_bytes'] / load / 1e9:.2f}",
                     "yes" if all(r["ok"] for r in runs) else "NO"])
    r0 = results[0]
    head = (f"{r0['tensors']} tensors, {r0['state_bytes'] / 2**30:.2f} GiB, one process; medians of "
            f"{len({r['repeat'] for r in results})} run(s), every run after the median\n\n")
    return head + fmt_table(["layout", "files", "dirs", "save s", "runs", "save GB/s", "load s", "runs", "load GB/s",
                             "ok"], rows)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--layers", type=int, default=12, help="transformer blocks: 4 x (12 x layers + 3) tensors")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir in the cwd)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    own = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="bench_layout_", dir=os.getcwd()) if own else args.dir
    os.makedirs(args.dir, exist_ok=True)
    try:
        results = run(args)
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)
    table = summarize(results)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_summary(),
                       "results": results, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
