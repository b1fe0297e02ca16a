"""What checking other formats' bytes costs a load: zip records' headers and CRC-32s, and DCP's
``.metadata`` unpickled by Python's unpickler (docs/safety.md).

    .venv/bin/python benchmarks/bench_foreign_checks.py --size-mib 1024 --repeats 5 \\
        --json benchmarks/results/foreign_checks_run1.json

* ``torch``: ``ldc.load`` of a ``torch.save`` file of the fp32 weights of the GPT whose training
  state is ``--size-mib`` (``common.gpt_params``; the table gives the weights' size) into a template
  of the same tensors, one process;
* ``dcp``: ``ldc.load`` of a ``dcp.save`` of the same weights at the same split (each chunk read
  whole, so its record's CRC-32 is checked), one process.

Each load runs in a fresh process with ``LIGHTNING_DISTCKPT_VERIFY=1`` (checked) and ``=0`` (the
CRC-32s skipped; the headers are checked either way), interleaved (the order alternates), cold (the
files dropped from the page cache) and warm (read once before). Medians and the ratio checked /
unchecked.

``--metadata-chunks N`` also times unpickling a DCP ``Metadata`` of ``N`` chunks (2,000 tensors of
``N / 2000`` chunks each) with the C unpickler (``pickle.loads``) and Python's (what the reader uses),
interleaved, in this process.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from common import drop_page_cache, fmt_table, gpt_params, run_header  # noqa: E402

_CHILD = r"""
import sys, time, json, torch
sys.path.insert(0, sys.argv[3])
import lightning_distckpt as ldc
from common import gpt_params
specs = gpt_params(int(float(sys.argv[2]) * 2**20))
template = {s.name: ldc.ShardedTensor.from_rank_offsets(s.name, torch.empty(s.shape, dtype=torch.float32))
            for s in specs}
t0 = time.perf_counter()
out = ldc.load(template, sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def _weights(size_mib: float) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for s in gpt_params(int(size_mib * 2**20))}


def _load(path: str, size_mib: float, verify: bool) -> float:
    env = dict(os.environ, LIGHTNING_DISTCKPT_VERIFY="1" if verify else "0")
    res = subprocess.run([sys.executable, "-c", _CHILD, path, str(size_mib), HERE], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["seconds"]


def _metadata(chunks: int) -> bytes:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    per = max(1, chunks // 2000)
    sd, storage = {}, {}
    for t in range(2000):
        parts = [ChunkStorageMetadata(offsets=torch.Size([r * 64, 0]), sizes=torch.Size([64, 1024])) for r in range(per)]
        sd[f"layers.{t}.weight"] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                                         size=torch.Size([64 * per, 1024]), chunks=parts)
        for r, c in enumerate(parts):
            storage[MetadataIndex(f"layers.{t}.weight", c.offsets)] = _StorageInfo(f"__{r}_0.distcp", t * 4096, 262144)
    return pickle.dumps(Metadata(state_dict_metadata=sd, storage_data=storage))


def _median_row(name: str, runs: Dict[bool, List[float]]) -> List[object]:
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    return [name, f"{on:.3f}", f"{off:.3f}", f"{on / off:.2f}"]


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=float, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--metadata-chunks", type=int, default=128000)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    started, load_before = time.time(), os.getloadavg()
    work = tempfile.mkdtemp(prefix="bench_foreign_", dir=args.dir or os.getcwd())
    results: Dict[str, Dict[bool, List[float]]] = {}
    try:
        weights = _weights(args.size_mib)
        weight_mib = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
        paths = {"torch": os.path.join(work, "model.pt"), "dcp": os.path.join(work, "dcp")}
        torch.save(weights, paths["torch"])
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(weights, checkpoint_id=paths["dcp"], no_dist=True)
        del weights
        for r in range(args.repeats):
            for fmt, path in paths.items():
                for cold in (True, False):
                    for verify in ((True, False) if r % 2 == 0 else (False, True)):
                        if cold:
                            drop_page_cache(path)
                        else:
                            _load(path, args.size_mib, verify)  # read once: warm
                        seconds = _load(path, args.size_mib, verify)
                        results.setdefault(f"{fmt} {'cold' if cold else 'warm'}", {True: [], False: []})[verify].append(seconds)
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
        unpickle: Dict[bool, List[float]] = {True: [], False: []}  # True: Python's, False: C
        if args.metadata_chunks:
            data = _metadata(args.metadata_chunks)
            for r in range(args.repeats):
                for python in ((True, False) if r % 2 == 0 else (False, True)):
                    t0 = time.perf_counter()
                    pickle._Unpickler(io.BytesIO(data)).load() if python else pickle.loads(data)  # type: ignore[attr-defined]
                    unpickle[python].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [_median_row(f"ldc.load, {name}, {weight_mib:.0f} MiB", runs) for name, runs in results.items()]
    table = fmt_table(["case", "checked s", "CRC-32s off s", "ratio"], rows)
    if unpickle[True]:
        table += "\n\n" + fmt_table(["DCP .metadata", "Python unpickler s", "C unpickler s", "ratio"],
                                    [_median_row(f"{args.metadata_chunks} chunks, {len(data) / 1e6:.1f} MB", unpickle)])
    print(table)
    out = dict(run_header(args, started, load_before, os.getloadavg()),
               results={k: {"checked": v[True], "unchecked": v[False]} for k, v in results.items()},
               unpickle={"python": unpickle[True], "c": unpickle[False]}, table=table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
