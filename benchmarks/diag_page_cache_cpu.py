"""Diagnostic (not a contestant benchmark): does it matter which CPU writes into the page cache?

    python benchmarks/diag_page_cache_cpu.py --mib 512 --repeats 6

The main thread, pinned to CPU 0, touches and frees a buffer (what ``common.prefault`` does before
every timed operation), then the same bytes are written and fsync'd either from the main thread
(CPU 0) or from a thread pinned to CPU 1. On a VM that hands freed memory back to the host, pages
freed on CPU 0 are cheap to reuse there and may not be elsewhere; writers that run in I/O thread
pools (tensorstore) then pay more per byte than a writer on the thread that freed the memory
(raw ``os.write``, DCP, ``torch.save`` in ``bench_save_load.py``). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args()
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs Linux and at least 2 CPUs")
    cpu_a, cpu_b = sorted(os.sched_getaffinity(0))[:2]
    nbytes = args.mib << 20
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    os.sched_setaffinity(0, {cpu_a})
    path = os.path.join(tempfile.mkdtemp(prefix="diag_pc_", dir=os.getcwd()), "f.bin")

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for off in range(0, nbytes, 64 << 20):
            os.write(fd, memoryview(src)[off:off + (64 << 20)])
        os.fsync(fd)
        os.close(fd)

    def other_cpu() -> None:
        os.sched_setaffinity(0, {cpu_b})
        write()

    times: dict = {"same CPU": [], "other CPU": []}
    for _ in range(args.repeats):
        for mode in times:
            buf = np.ones(nbytes, dtype=np.uint8)  # touch and free, on cpu_a
            del buf
            t0 = time.perf_counter()
            if mode == "same CPU":
                write()
            else:
                th = threading.Thread(target=other_cpu)
                th.start()
                th.join()
            times[mode].append(time.perf_counter() - t0)
            os.unlink(path)
    os.rmdir(os.path.dirname(path))
    for mode, ts in times.items():
        print(f"{mode:9s}: median {statistics.median(ts):.3f} s  ({' '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
