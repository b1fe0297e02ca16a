"""Loads of many tiny tensors by two versions of the code, interleaved: before and after a change.

    python benchmarks/bench_many_tensors_ab.py --before /path/to/old/checkout --rounds 3 \\
        --json benchmarks/results/many_tensors_ab_RUN.json

Each round runs ``bench_many_tensors.py --repeats 1`` once from each checkout (the order alternates
between rounds, so both versions meet the same machine load; each run imports the library from its
own checkout). Prints, per loader, the median cold and warm load seconds of each version and their
ratio (after / before, below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List


def _run(tree: str, tensors: int) -> Dict:
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "bench_many_tensors.py"), "--repeats", "1",
                        "--tensors", str(tensors), "--json", out], check=True, cwd=tree, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="checkout of the old code (bench_many_tensors.py copied in)")
    p.add_argument("--after", default=".", help="checkout of the new code (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tensors", type=int, default=10_000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    started, load_before = time.time(), os.getloadavg()
    rows: List[Dict] = []
    for r in range(args.rounds):
        for version in (("before", "after") if r % 2 == 0 else ("after", "before")):
            d = _run(trees[version], args.tensors)
            assert d["code"] == trees[version], f"{version} imported the library from {d['code']}"
            rows.append({"version": version, "round": r, "save_s": d["save_s"], "medians": d["medians"],
                         "loadavg": d["loadavg_before"]})
            print(f"round {r} {version} done (load average {d['loadavg_before'][0]:.1f})", file=sys.stderr)
    summary = {}
    for name in rows[0]["medians"]:
        for how in ("cold", "warm"):
            med = {v: statistics.median(x["medians"][name][how] for x in rows if x["version"] == v) for v in trees}
            summary[f"{name} {how}"] = {**med, "after/before": med["after"] / med["before"]}
            print(f"{name:10s} {how}: before {med['before']:.3f} s  after {med['after']:.3f} s  "
                  f"after/before {med['after'] / med['before']:.2f}")
    load_after = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.1f}' for x in load_before)}, after: "
          f"{' '.join(f'{x:.1f}' for x in load_after)} on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "trees": trees,
                       "loadavg_before": load_before, "loadavg_after": load_after,
                       "seconds": round(time.time() - started), "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
