"""An async save's blocked time, before and after a change: two checkouts, interleaved rounds.

    python benchmarks/bench_async_blocked_ab.py --before /path/to/old/checkout --after . --rounds 4 \\
        --json benchmarks/results/async_blocked_ab_RUN.json

Each round runs one child per checkout (the order alternates between rounds); a child imports the library from
its checkout (``PYTHONPATH``, spawned ranks) and, on 2 gloo ranks holding the benchmark GPT's state
(``common.local_state``, tensor parallel), makes ``--saves`` async saves with one ``AsyncSaver``, each followed
by ``--train-s`` of stand-in training (matrix multiplies) and then the request's ``wait_snapshot()``. Reported
per save (slowest rank, the first two left out: allocation and the plan): blocked = ``save`` returning plus the
wait for the snapshot, and the part of ``save`` after planning (``req.snapshot_s``: staging, the copy unless
``--snapshot background``). Prints the median of each version and the paired median ratio (after / before).
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
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


def _rank(rank: int, world: int, root: str, mb: int, saves: int, train_s: float, bg: bool) -> List[List[float]]:
    import torch
    import torch.distributed as dist

    import lightning_distckpt as ldc
    from bench_async import _sharded, _train
    from common import local_state

    torch.set_num_threads(1)
    tensors = local_state(mb << 20, rank, world, "tp")
    sd = _sharded(tensors, rank, world)
    saver = ldc.AsyncSaver()
    out = []
    for i in range(saves):
        dist.barrier()
        t0 = time.perf_counter()
        req = saver.save(sd, os.path.join(root, "async"), background_snapshot=bg)
        blocked = time.perf_counter() - t0
        _train(train_s)
        t1 = time.perf_counter()
        req.wait_snapshot()
        blocked += time.perf_counter() - t1
        req.finalize()
        t = torch.tensor([blocked, req.snapshot_s])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 2:
            out.append(t.tolist())
    return out


def _child(args: argparse.Namespace) -> None:
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    import lightning_distckpt
    from dist_utils import run_distributed

    assert os.path.dirname(os.path.dirname(lightning_distckpt.__file__)) == os.path.abspath(args.child), \
        f"imported {lightning_distckpt.__file__}, not from {args.child}"
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        res = run_distributed(_rank, 2, root, args.mb, args.saves, args.train_s, args.snapshot == "background",
                              timeout_s=600)[0]
    print(json.dumps({"blocked_s": [r[0] for r in res], "after_plan_s": [r[1] for r in res]}))


def _run(tree: str, args: argparse.Namespace) -> Dict[str, Any]:
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=tree, LDC_TEST_START_METHOD="spawn", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, "--mb", str(args.mb), "--saves",
           str(args.saves), "--train-s", str(args.train_s), "--snapshot", args.snapshot, "--dir", args.dir]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="checkout of the old code")
    p.add_argument("--after", default=".", help="checkout of the new code (default: this one)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--mb", type=int, default=256, help="the whole training state (MiB), split over 2 ranks")
    p.add_argument("--saves", type=int, default=14)
    p.add_argument("--train-s", type=float, default=0.25)
    p.add_argument("--snapshot", choices=["caller", "background"], default="background")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args)
    if not args.before:
        p.error("--before is required")
    rounds = []
    for i in range(args.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        rounds.append({v: _run(getattr(args, v), args) for v in order})
    med = {v: {m: statistics.median(x for r in rounds for x in r[v][m]) for m in ("blocked_s", "after_plan_s")}
           for v in ("before", "after")}
    paired = statistics.median(statistics.median(r["after"]["blocked_s"]) / statistics.median(r["before"]["blocked_s"])
                               for r in rounds)
    for v in ("before", "after"):
        print(f"{v:6s}: blocked {med[v]['blocked_s'] * 1e3:.1f} ms, of which after planning "
              f"{med[v]['after_plan_s'] * 1e3:.1f} ms")
    print(f"blocked after / before, paired median over {args.rounds} rounds: {paired:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"}, "rounds": rounds,
                       "medians": med, "paired_ratio": paired}, f, indent=1)


if __name__ == "__main__":
    main()
