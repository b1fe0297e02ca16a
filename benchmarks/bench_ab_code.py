"""Save / load speed of two versions of the code, interleaved: before and after a change.

    python benchmarks/bench_ab_code.py --before /path/to/old/checkout --after . --rounds 8 \\
        --size-gib 0.5 --json benchmarks/results/ab_code_RUN.json

Each round runs ``bench_save_load.py --contestants ours --repeats 1`` once from each checkout (the
order alternates between rounds), so both versions meet the same machine load. Each run imports the
library from its own checkout (``bench_save_load.py`` puts its checkout first on ``sys.path``).
Prints, per layout, the median save and load seconds of each version, their ratio (after / before,
below 1 is faster) and the paired median ratio of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List


def _run(tree: str, size_gib: float, layouts: str) -> List[Dict]:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "bench_save_load.py"), "--contestants",
                        "ours", "--repeats", "1", "--size-gib", str(size_gib), "--layouts", layouts, "--json", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["results"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="checkout of the old code")
    p.add_argument("--after", default=".", help="checkout of the new code (default: this one)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--layouts", default="tp,dp")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    rows = []
    for r in range(args.rounds):
        for version in (("before", "after") if r % 2 == 0 else ("after", "before")):
            for row in _run(trees[version], args.size_gib, args.layouts):
                rows.append({**row, "version": version, "round": r})
            print(f"round {r} {version} done", file=sys.stderr)
    summary = {}
    for layout in args.layouts.split(","):
        for what in ("save_s", "load_s"):
            got = {v: {x["round"]: x[what] for x in rows if x["layout"] == layout and x["version"] == v}
                   for v in trees}
            med = {v: statistics.median(got[v].values()) for v in trees}
            paired = statistics.median(got["after"][r] / got["before"][r] for r in got["before"])
            summary[f"{layout} {what}"] = {**med, "ratio": med["after"] / med["before"], "paired": paired}
            print(f"{layout:3s} {what:6s} before {med['before']:.3f} s  after {med['after']:.3f} s  "
                  f"after/before {med['after'] / med['before']:.3f} (paired median {paired:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "args": vars(args), "rows": rows, "summary": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
