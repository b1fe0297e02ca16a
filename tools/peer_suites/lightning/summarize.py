"""Count the peer-suite results ``ldc_harness`` wrote (one JSON-lines file per mode) and list the
failing tests, parametrizations of one test function folded into one line with their count and the
first one's reason: ``python summarize.py RESULTS_DIR/*.jsonl``."""

from __future__ import annotations

import collections
import json
import os
import sys
from typing import Dict, List


def main(paths: List[str]) -> None:
    for path in paths:
        rows: List[Dict[str, object]] = [json.loads(line) for line in open(path)]
        counts = collections.Counter(str(r["outcome"]) for r in rows)
        injected = sum(1 for r in rows if r["injected"])
        mode = os.path.basename(path).rsplit(".", 1)[0]
        print(f"{mode}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
              + f"; {injected} ran with ours injected")
        failing: Dict[str, List[Dict[str, object]]] = collections.defaultdict(list)
        for r in rows:
            if r["outcome"] in ("failed", "error"):
                failing[str(r["test"]).split("[", 1)[0]].append(r)
        for test, group in failing.items():
            print(f"    {len(group)}x {test}: {str(group[0]['reason'])[:200]}")


if __name__ == "__main__":
    main(sys.argv[1:])
