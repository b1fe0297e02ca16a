"""Time to resume: a Lightning Trainer restart of the benchmark GPT from a checkpoint, ours vs stock
Lightning DDP with its ``torch.save`` checkpoint, 2 CPU processes, cold page cache.

    .venv/bin/python benchmarks/bench_resume.py --size-gib 0.5 --repeats 3 --json resume.json

The model: the parameters of ``common.gpt_params`` (the GPT of ``bench_save_load.py``) as fp32
``nn.Parameter`` s of one LightningModule, trained with Adam: the checkpoint holds the weights and
two Adam moments, 12 bytes per parameter. Every rank holds the whole model (data parallelism).

Contestants (each saves its checkpoint once, from a 1-step run, then restarts ``--repeats`` times):

* ``stock``   - Lightning's ``DDPStrategy`` and its default ``TorchCheckpointIO``: rank 0
  ``torch.save`` s one file; on resume every rank ``torch.load`` s the whole file.
* ``ours_io`` - ``DDPStrategy`` + ``DistCheckpointIO()``: the same checkpoint dict in our format
  (saved by rank 0); on resume every rank reads it all, no collectives.
* ``ours``    - ``DistCheckpointStrategy()``: every rank saves and loads its part of the sharded
  checkpoint (replicated tensors written once, spread over the ranks), read straight into the
  model's parameters and optimizer state by the default loader.

A restart is a fresh ``python`` process (Lightning's launcher starts rank 1): the clock starts just
before it is launched, after the checkpoint's pages were dropped from the page cache
(``posix_fadvise(DONTNEED)``, as ``bench_save_load.py`` does), and stops on each rank when its
first training batch starts (``on_train_batch_start``); reported: the slowest rank. "restore s" is
the time inside the strategy's ``load_checkpoint``, ``load_model_state_dict`` and
``load_optimizer_state_dict`` (reading the checkpoint and putting it into the model and
optimizer), slowest rank. "peak RSS" is the largest ``ru_maxrss`` of the ranks at the first step.
Contestants are interleaved, their order rotated every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CONTESTANTS = ("stock", "ours_io", "ours")


# -- the training script (run by the orchestrator below, re-run by Lightning for rank 1) ----------
def _parts(args: argparse.Namespace) -> Tuple[Any, Any, Any, Any]:
    """The script's classes (imported here: the orchestrator does not need Lightning):
    (module class, timed DDP strategy, timed DistCheckpointStrategy, first-step callback)."""
    import resource

    import torch
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common import gpt_params
    from lightning_distckpt.lightning import DistCheckpointStrategy

    class GPTState(LightningModule):
        """The benchmark GPT's parameters; the loss touches every one (DDP wants a gradient for each)."""

        def __init__(self, size_bytes: int, init: bool) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.params = torch.nn.ParameterDict({
                p.name.replace(".", "_"): torch.nn.Parameter(
                    torch.randn(p.shape, generator=g) * 0.02 if init else torch.empty(p.shape))
                for p in gpt_params(size_bytes)})

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return batch[0].mean() * sum(p.sum() for p in self.params.values())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2)

    class Timed:
        """Seconds spent restoring the checkpoint (read + into the model and optimizer)."""

        restore_s = 0.0

        def _timed(self, name: str, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return getattr(super(), name)(*a, **k)
            finally:
                self.restore_s += time.perf_counter() - t0

        def load_checkpoint(self, *a: Any, **k: Any) -> Any:
            return self._timed("load_checkpoint", *a, **k)

        def load_model_state_dict(self, *a: Any, **k: Any) -> Any:
            return self._timed("load_model_state_dict", *a, **k)

        def load_optimizer_state_dict(self, *a: Any, **k: Any) -> Any:
            return self._timed("load_optimizer_state_dict", *a, **k)

    class TimedDDP(Timed, DDPStrategy):
        pass

    class TimedDist(Timed, DistCheckpointStrategy):
        pass

    class FirstStep(Callback):
        def __init__(self) -> None:
            self.record: Dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if not self.record:
                self.record = {"to_first_step_s": time.time() - args.t0, "restore_s": trainer.strategy.restore_s,
                               "global_step": trainer.global_step,
                               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    return GPTState, TimedDDP, TimedDist, FirstStep


def _script(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Trainer

    from lightning_distckpt.lightning import DistCheckpointIO

    torch.set_num_threads(1)
    GPTState, TimedDDP, TimedDist, FirstStep = _parts(args)
    strategy = (TimedDist if args.contestant == "ours" else TimedDDP)(process_group_backend="gloo")
    plugins = [DistCheckpointIO()] if args.contestant == "ours_io" else []
    first = FirstStep()
    restart = args.phase == "restart"
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=plugins, max_steps=2 if restart else 1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[first])
    model = GPTState(int(args.size_gib * 2**30), init=not restart)
    trainer.fit(model, ckpt_path=args.ckpt if restart else None)
    if not restart:
        trainer.save_checkpoint(args.ckpt)
    rank = trainer.global_rank
    if restart:
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(first.record, f)
    if dist.is_initialized():
        dist.barrier()  # leave together, then destroy the group (an abort at exit otherwise)
        dist.destroy_process_group()


# -- the orchestrator ---------------------------------------------------------------------------
def _run(args: argparse.Namespace, phase: str, contestant: str, ckpt: str, out: str = "") -> float:
    """Launch the script (rank 0; Lightning starts rank 1); returns the launch time."""
    from benchmarks.common import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    t0 = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--contestant", contestant, "--ckpt", ckpt,
           "--size-gib", str(args.size_gib), "--t0", repr(t0), "--out", out]
    subprocess.run(cmd, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL,
                   stderr=None if args.verbose else subprocess.DEVNULL)
    return t0


def _restart(args: argparse.Namespace, name: str, ckpt: str, work: str, rep: int) -> Dict[str, Any]:
    from benchmarks.common import drop_page_cache

    drop_page_cache(ckpt)
    out = os.path.join(work, f"{name}-{rep}")
    _run(args, "restart", name, ckpt, out)
    ranks = []
    for r in range(2):
        with open(f"{out}.rank{r}.json") as f:
            ranks.append(json.load(f))
    return {"contestant": name, "repeat": rep, "ranks": ranks,
            "to_first_step_s": max(r["to_first_step_s"] for r in ranks),
            "restore_s": max(r["restore_s"] for r in ranks),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "resumed_step": ranks[0]["global_step"]}


def _table(results: List[Dict[str, Any]], ckpt_bytes: Dict[str, int]) -> str:
    from benchmarks.common import fmt_table

    names = list(dict.fromkeys(r["contestant"] for r in results))
    med = {n: {k: statistics.median(r[k] for r in results if r["contestant"] == n)
               for k in ("to_first_step_s", "restore_s", "peak_rss_mib")} for n in names}
    rows = []
    for n in names:
        runs = [r for r in results if r["contestant"] == n]
        base = med.get("stock")
        rows.append([n, f"{med[n]['to_first_step_s']:.2f}", " / ".join(f"{r['to_first_step_s']:.2f}" for r in runs),
                     f"{base['to_first_step_s'] / med[n]['to_first_step_s']:.2f}x" if base else "-",
                     f"{med[n]['restore_s']:.2f}", " / ".join(f"{r['restore_s']:.2f}" for r in runs),
                     f"{base['restore_s'] / med[n]['restore_s']:.2f}x" if base else "-",
                     f"{med[n]['peak_rss_mib']:.0f}", f"{ckpt_bytes[n] / 2**20:.0f}",
                     "yes" if all(r["resumed_step"] == 1 for r in runs) else "NO"])
    return fmt_table(["contestant", "start -> 1st step s", "runs", "vs stock", "restore s", "runs", "vs stock",
                      "peak RSS MiB", "ckpt MiB", "resumed at step 1"], rows)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=0.5, help="size of the GPT's training state (default 0.5)")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"comma-separated subset of {CONTESTANTS}")
    p.add_argument("--repeats", type=int, default=3, help="restarts of every contestant (interleaved)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir in the cwd)")
    p.add_argument("--json", default=None, help="write raw results and the table here")
    p.add_argument("--timeout", type=float, default=600, help="seconds one launch may take")
    p.add_argument("--verbose", action="store_true", help="show the runs' stderr")
    # the training script's own arguments (set by the orchestrator)
    p.add_argument("--phase", choices=("save", "restart"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--contestant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase is not None:
        _script(args)
        return 0
    from benchmarks.common import dir_bytes, machine_summary

    names = [x for x in args.contestants.split(",") if x]
    for n in names:
        if n not in CONTESTANTS:
            p.error(f"unknown contestant {n!r}")
    own = args.dir is None
    work = tempfile.mkdtemp(prefix="bench_resume_", dir=os.getcwd()) if own else args.dir
    os.makedirs(work, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()
    try:
        ckpts = {n: os.path.join(work, f"{n}.ckpt") for n in names}
        for n in names:
            _run(args, "save", n, ckpts[n])
        sizes = {n: dir_bytes(c) if os.path.isdir(c) else os.path.getsize(c) for n, c in ckpts.items()}
        results = []
        for rep in range(args.repeats):
            k = rep % len(names)
            for n in names[k:] + names[:k]:
                res = _restart(args, n, ckpts[n], work, rep)
                print(f"[#{rep}] {n:8s} start -> first step {res['to_first_step_s']:6.2f}s restore "
                      f"{res['restore_s']:6.2f}s peak RSS {res['peak_rss_mib']:6.0f} MiB", flush=True)
                results.append(res)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    table = _table(results, sizes)
    print(table)
    print(f"\nload average (1, 5, 15 min) before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_summary(),
                       "loadavg_before": load_before, "loadavg_after": load_after, "args": vars(args),
                       "seconds": round(time.time() - started, 1), "checkpoint_bytes": sizes, "results": results,
                       "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
