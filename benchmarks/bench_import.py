"""What importing this library costs a process: every rank of a job pays it at each (re)start.

    python benchmarks/bench_import.py --repeats 8 --json benchmarks/results/import_<tag>.json
    python benchmarks/bench_import.py --repeats 8 --ab /tmp/ml_dtypes_070   # a directory first on sys.path

Each repeat starts fresh interpreters (interleaved, rotated order) and times, in each:

* ``ml_dtypes``: ``import ml_dtypes`` after numpy (tensorstore imports it; it registers its dtypes'
  ufunc loops with numpy at import),
* ``library``: ``import lightning_distckpt.lightning`` after torch and lightning are imported (what
  a Lightning job adds by using us),

as wall and process CPU seconds. ``--ab DIR`` runs each probe a second time with ``DIR`` first on
``PYTHONPATH`` (for example ``pip install --no-deps --target DIR ml_dtypes==0.7.0``), labelled ``ab``.
Prints medians and writes them, every sample and the command line to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
PROBES = {
    "ml_dtypes": ("import numpy", "import ml_dtypes"),
    "library": ("import torch, lightning", "import lightning_distckpt.lightning"),
}
_TIMER = """
import time
{before}
t, c = time.perf_counter(), time.process_time()
{what}
import json, ml_dtypes
print(json.dumps({{"wall": time.perf_counter() - t, "cpu": time.process_time() - c,
                  "ml_dtypes": ml_dtypes.__version__}}))
"""


def probe(name: str, path: Optional[str]) -> Dict[str, float]:
    """One fresh interpreter timing one import."""
    before, what = PROBES[name]
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _TIMER.format(before=before, what=what)], env=env,
                         cwd=os.path.dirname(HERE), check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--ab", default=None, help="a directory put first on PYTHONPATH for the 'ab' runs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    variants = {"this": None, **({"ab": args.ab} if args.ab else {})}
    runs = [(name, v) for name in PROBES for v in variants]
    samples: Dict[str, List[Dict[str, float]]] = {f"{n} {v}": [] for n, v in runs}
    for r in range(args.repeats):
        for name, v in runs[r % len(runs):] + runs[:r % len(runs)]:  # rotated: each meets each load
            samples[f"{name} {v}"].append(probe(name, variants[v]))
    summary = {}
    for label, xs in samples.items():
        summary[label] = {k: statistics.median(x[k] for x in xs) for k in ("wall", "cpu")}
        summary[label]["ml_dtypes"] = xs[0]["ml_dtypes"]
        print(f"{label:16s} ml_dtypes {xs[0]['ml_dtypes']:8s} wall {summary[label]['wall']:.3f} s  "
              f"cpu {summary[label]['cpu']:.3f} s  (median of {len(xs)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "load": os.getloadavg(), "summary": summary,
                       "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
