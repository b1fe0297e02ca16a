"""Where an async Lightning save's blocking goes, save by save (the first one especially).

    python benchmarks/bench_first_async_save.py --out /tmp/phases [--layers 8 --width 2048]

Runs ``bench_training_overhead``'s fit (DDP over 2 CPU ranks, ``DistCheckpointStrategy`` with
``async_save``, ``ModelCheckpoint(every_n_train_steps=10)``) with timers (wall and this thread's
CPU seconds) around the phases of each ``trainer.save_checkpoint``: Lightning's
``dump_checkpoint``, the strategy's ``sharded_checkpoint``, ``checkpoint_io.save_sharded``
(inside it ``AsyncSaver.save``), and the closing barrier. Writes ``OUT.rankN.json`` per rank:
a list of saves, each ``{phase: [wall s, cpu s]}``; prints rank 0's and rank 1's table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
#: the checkout measured (BENCH_ROOT: another one, e.g. an older commit, for an A/B)
ROOT = os.environ.get("BENCH_ROOT", os.path.dirname(HERE))
sys.path.insert(0, ROOT)

PHASES: List[Dict[str, List[float]]] = []


def _timed(owner: Any, name: str, phase: str) -> None:
    """Wrap ``owner.name`` so each call adds its wall / thread CPU seconds to the current save's ``phase``."""
    inner: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*a: Any, **k: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return inner(*a, **k)
        finally:
            if PHASES:
                w, p = PHASES[-1].setdefault(phase, [0.0, 0.0])
                PHASES[-1][phase] = [w + time.perf_counter() - t, p + time.thread_time() - c]

    setattr(owner, name, wrapper)


def _instrument() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
    from lightning_distckpt.saving.async_save import AsyncSaver

    save = Trainer.save_checkpoint

    def timed_save(self: Any, *a: Any, **k: Any) -> Any:
        PHASES.append({})
        t, c = time.perf_counter(), time.thread_time()
        try:
            return save(self, *a, **k)
        finally:
            PHASES[-1]["total"] = [time.perf_counter() - t, time.thread_time() - c]

    Trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    _timed(_CheckpointConnector, "dump_checkpoint", "dump_checkpoint")
    _timed(DistCheckpointStrategy, "sharded_checkpoint", "sharded_checkpoint")
    _timed(DistCheckpointStrategy, "barrier", "barrier")
    _timed(DistCheckpointIO, "save_sharded", "save_sharded")
    _timed(DistCheckpointIO, "wait", "io.wait")
    _timed(AsyncSaver, "save", "AsyncSaver.save")
    _timed(AsyncSaver, "_background_comm", "saver._background_comm")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every-n-steps", type=int, default=10)
    p.add_argument("--ckpt-dir", default=None)
    args = p.parse_args()
    from benchmarks import bench_training_overhead as bto

    _instrument()
    ns = argparse.Namespace(contestant="ours_async", ckpt_dir=args.ckpt_dir or args.out + "-ckpt", out=args.out,
                            layers=args.layers, width=args.width, steps=args.steps, every_n_steps=args.every_n_steps)
    import atexit

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    atexit.register(lambda: json.dump(PHASES, open(f"{args.out}.phases{rank}.json", "w")))
    bto._script(ns)
    if rank == 0:
        for r in range(2):
            path = f"{args.out}.rank{r}.json"
            saves = json.load(open(path))["saves_s"] if os.path.exists(path) else []
            print(f"rank {r}: saves_s", [round(s, 3) for s in saves])
        print("rank 0 phases (wall s / cpu s):")
        for i, ph in enumerate(PHASES):
            print(f"  save {i}: " + "  ".join(f"{k} {w:.3f}/{c:.3f}" for k, (w, c) in ph.items()))


if __name__ == "__main__":
    main()
