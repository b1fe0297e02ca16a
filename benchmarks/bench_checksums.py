"""Save / load throughput with chunk checksums (format 3, the zarr ``crc32c`` codec) against the
same save without them (format 2's codec chain), interleaved A/B in one process.

    .venv/bin/python benchmarks/bench_checksums.py --size-mib 256 --repeats 5

State: ``--size-mib`` of float32 in 8 big tensors plus 64 small (packed) ones, saved with
``lightning_distckpt.save`` and loaded with ``lightning_distckpt.load`` into preallocated tensors
(page cache dropped before every load). "off" saves with the crc32c codec left out of each array's
codec chain: the arrays are then what format 2 wrote. Objects, common.pt and metadata.json are
checksummed in both (they are small). Prints the median of each and the on/off ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_distckpt as ldc  # noqa: E402
from benchmarks.common import chunk_checksums_off, drop_page_cache  # noqa: E402


def _state(size_mib: int) -> Dict[str, torch.Tensor]:
    big = size_mib * (1 << 20) // 8 // 4
    out = {f"big{i}": torch.randn(big // 1024, 1024) for i in range(8)}
    out.update({f"small{i}": torch.randn(512) for i in range(64)})
    return out


def _sharded(tensors: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    return {k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layout", default="ocdbt", choices=["ocdbt", "zarr"])
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--validate", action="store_true",
                    help="also time `validate` of the checksummed checkpoint against `cat` of its files (cold cache)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    state = _state(args.size_mib)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    times: Dict[str, Dict[str, List[float]]] = {m: {"save": [], "load": []} for m in ("on", "off")}
    opts = ldc.StorageOptions(layout=args.layout)
    try:
        for rep in range(args.repeats):
            for mode in (("on", "off") if rep % 2 == 0 else ("off", "on")):  # interleaved, order alternating
                path = os.path.join(root, mode)
                with chunk_checksums_off() if mode == "off" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    ldc.save(_sharded(state), path, storage=opts)
                    times[mode]["save"].append(time.perf_counter() - t0)
                drop_page_cache(path)
                with chunk_checksums_off() if mode == "off" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    ldc.load(_sharded(dest), path)
                    times[mode]["load"].append(time.perf_counter() - t0)
                assert all(torch.equal(dest[k], state[k]) for k in state)
                if args.validate and mode == "on":
                    times["on"].setdefault("validate", []).append(_timed_cold(path, lambda: _validate(path)))
                    times["on"].setdefault("cat", []).append(_timed_cold(path, lambda: _cat(path)))
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{nbytes / 2**20:.0f} MiB, layout {args.layout}, {args.repeats} interleaved repeats (median GB/s)")
    if args.validate:
        v, c = statistics.median(times["on"]["validate"]), statistics.median(times["on"]["cat"])
        print(f"  validate: {nbytes / v / 1e9:.2f} GB/s ({v:.3f} s); cat of its files: {nbytes / c / 1e9:.2f} GB/s "
              f"({c:.3f} s): validate/cat throughput {c / v:.3f}x")
    for op in ("save", "load"):
        on, off = statistics.median(times["on"][op]), statistics.median(times["off"][op])
        print(f"  {op}: checksums on {nbytes / on / 1e9:.2f} GB/s ({on:.3f} s), off {nbytes / off / 1e9:.2f} GB/s "
              f"({off:.3f} s): on/off throughput {off / on:.3f}x")


def _timed_cold(path: str, fn: Any) -> float:
    drop_page_cache(path)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _validate(path: str) -> None:
    from lightning_distckpt import validate

    report = validate(path)
    assert report.ok, report.problems


def _cat(path: str) -> None:
    """Every file read through once, as `cat` would (1 MiB reads)."""
    for d, _, fs in os.walk(path):
        for f in fs:
            with open(os.path.join(d, f), "rb", buffering=0) as fh:
                while fh.read(1 << 20):
                    pass


if __name__ == "__main__":
    main()
