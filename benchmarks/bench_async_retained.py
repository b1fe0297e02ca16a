"""Memory a process keeps after its async saves have finished: one process, ``async_save=True`` saves
of one float32 tensor in a row, each waited for, finalized and dropped; prints the process's anonymous
resident memory (``RssAnon``) before and after each.

    python benchmarks/bench_async_retained.py --mb 200 --saves 5
    python benchmarks/bench_async_retained.py --mb 200 --saves 5 --tree /path/to/older/checkout

What it shows: whether a finished save's staged copy stays referenced (it stayed, held by an idle
kept helper thread, until storage/workers.py let go of finished tasks). ``--tree`` imports the
library from another checkout. Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile


def rss_anon_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=200, help="the tensor's size in MB")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--tree", default=None, help="a checkout to import the library from")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.path.insert(0, args.tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    import lightning_distckpt as ldc

    state = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.randn(args.mb * 250_000)), "step": 1}
    after = []
    before = rss_anon_mib()
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as root:
        for i in range(args.saves):
            request = ldc.save(state, os.path.join(root, f"ck{i}"), async_save=True)
            request.wait()
            request.finalize()
            del request
            gc.collect()
            after.append(rss_anon_mib())
    print(f"{os.path.dirname(ldc.__file__)}: RssAnon MiB with the state {before}, after each save {after}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "library": os.path.dirname(ldc.__file__), "mb": args.mb,
                       "rss_anon_mib_before": before, "rss_anon_mib_after_each": after}, f, indent=1)


if __name__ == "__main__":
    main()
