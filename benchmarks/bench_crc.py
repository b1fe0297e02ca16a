"""CRC-32C throughput of the implementations our chunk checksums can use, interleaved, in the three
places a checkpoint computes it: over data in cache, over data in memory (a save's tensors), and over
each piece just read from a file (a load).

    .venv/bin/python benchmarks/bench_crc.py --repeats 9 [--json out.json]

Implementations: the ``crc32c`` package (the CRC32 instruction, three streams) and ``crc32c-rs``
(carry-less-multiply folding where the CPU has it), whichever are installed. "after read" reads a
``--file-mib`` file in the page cache with ``os.preadv`` 1 MiB at a time into a tensor-sized buffer
and checksums each piece right after it is read, as ``storage/direct_read.py`` does; the figure is
the checksum's share only (the reads are timed apart). Prints GB/s, medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import numpy as np

PIECE = 1 << 20


def implementations() -> Dict[str, Callable[..., int]]:
    out: Dict[str, Callable[..., int]] = {}
    try:
        import crc32c

        out["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import crc32c_rs

        out["crc32c-rs"] = crc32c_rs.crc32c
    except ImportError:
        pass
    return out


def in_memory(fn: Callable[..., int], data: np.ndarray, passes: int) -> float:
    t0 = time.perf_counter()
    for _ in range(passes):
        fn(data)
    return passes * data.nbytes / (time.perf_counter() - t0) / 1e9


def after_read(fn: Callable[..., int], fd: int, dest: np.ndarray) -> float:
    crc_s, crc = 0.0, 0
    for start in range(0, dest.nbytes, PIECE):
        piece = dest[start:start + PIECE]
        os.preadv(fd, [piece], start)
        t0 = time.perf_counter()
        crc = fn(piece, crc)
        crc_s += time.perf_counter() - t0
    return dest.nbytes / crc_s / 1e9


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--memory-mib", type=int, default=256, help="buffer for the 'in memory' case (beyond the caches)")
    ap.add_argument("--file-mib", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    impls = implementations()
    rng = np.random.default_rng(0)
    hot = rng.integers(0, 256, PIECE, dtype=np.uint8)
    cold = rng.integers(0, 256, args.memory_mib << 20, dtype=np.uint8)
    dest = np.empty(args.file_mib << 20, dtype=np.uint8)
    results: Dict[str, Dict[str, List[float]]] = {n: {"in cache": [], "in memory": [], "after read": []} for n in impls}
    with tempfile.NamedTemporaryFile(dir=os.getcwd(), prefix=".bench_crc_") as f:
        rng.integers(0, 256, args.file_mib << 20, dtype=np.uint8).tofile(f.name)
        fd = os.open(f.name, os.O_RDONLY)
        try:
            after_read(next(iter(impls.values())), fd, dest)  # the file into the page cache, dest faulted in
            for rep in range(args.repeats):
                names = list(impls)
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    fn = impls[name]
                    results[name]["in cache"].append(in_memory(fn, hot, 512))
                    results[name]["in memory"].append(in_memory(fn, cold, 2))
                    results[name]["after read"].append(after_read(fn, fd, dest))
        finally:
            os.close(fd)
    print(f"CRC-32C GB/s, medians of {args.repeats} interleaved repeats")
    print("| implementation | in cache (1 MiB) | in memory | after a 1 MiB read |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(v):.1f}" for v in r.values()) + " |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "results": results}, out,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
