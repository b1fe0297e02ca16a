"""What checkpointing costs a training run: how much longer a Lightning ``trainer.fit`` takes
because it checkpoints, ours against Lightning's own checkpointing, 2 CPU processes (gloo).

    python benchmarks/bench_training_overhead.py --sizes small,large --rounds 3 --tag run1

The fit: an MLP (``--layers`` Linear(width, width) + ReLU, fp32, Adam; ``small``: 8 x 128, about
1.6 MB of state, for the fixed cost of a checkpoint; ``large``: 8 x 2048, about 400 MB, for the
bandwidth), ``--steps`` training steps (default 40) with ``ModelCheckpoint(every_n_train_steps=N,
save_top_k=-1)`` (``--every-n-steps``, default 10: 4 checkpoints, all kept), DDP over 2 CPU
processes.

Contestants (each run is a fresh pair of processes, Lightning's launcher starting rank 1):

* ``none``          - DDP, no checkpoints (the baseline of the DDP contestants);
* ``stock``         - DDP and Lightning's ``TorchCheckpointIO``: rank 0 ``torch.save`` s one file;
* ``stock_async``   - DDP and Lightning's ``AsyncCheckpointIO`` (``torch.save`` in a thread);
* ``mp_none``       - Lightning's ``ModelParallelStrategy`` (FSDP2 over the 2 ranks), no
  checkpoints (the baseline of the two contestants below);
* ``stock_dcp``     - ``ModelParallelStrategy`` with its ``torch.distributed.checkpoint`` saves;
* ``ours_mp``       - ``DistCheckpointModelParallelStrategy`` (not run unless named);
* ``ours_io`` / ``ours_io_async`` - DDP and our ``DistCheckpointIO`` plugin (rank 0 saves alone),
  synchronous / ``async_save``;
* ``ours`` / ``ours_async`` - ``DistCheckpointStrategy`` (every rank saves its part), sync / async.
* ``ours_async_bg`` - ``ours_async`` with ``background_snapshot: true``: the parameters and Adam moments
  are copied by the save's thread while the next step's forward and backward run (not run unless named).
* ``ours_zarr`` / ``ours_zarr_async`` / ``ours_zarr_async_bg`` - the same with ``storage: {layout: zarr}``
  (chunk files of 128 KiB+ written with ``O_DIRECT``, not through the page cache; not run unless named).
* ``ours_buffered`` / ``ours_buffered_async`` - ``ours`` / ``ours_async`` with ``storage: {direct_writes:
  false}``: each rank's OCDBT store in one commit through the page cache, the write before the page
  cache was kept out (``storage/page_cache.py``; not run unless named).

Measured on each rank: ``fit s``, from ``on_train_start`` (after setup, DDP's broadcast) until
``fit`` returns (an async save still in flight at the end is waited for there: a user pays for
it too); the slowest rank counts. ``blocked s`` is the time inside ``trainer.save_checkpoint``
per checkpoint (what the training loop waits for; for async saves the planning and snapshot), plus,
with ``background_snapshot``, the strategy's waits for the copy (before optimizer steps and at the
fence; ``snapshot_wait_s`` apart in the JSON).
``peak RSS`` is the largest ``ru_maxrss`` of the ranks. ``CPU s`` are the CPU seconds, from the
start of training until ``fit`` returns, of the training thread and of the whole process (the
background save threads and tensorstore's included), slowest rank: on a machine other jobs load,
wall times stretch with the load, CPU seconds much less. Rounds are interleaved (every round runs
every size and contestant once, the order rotated each round); medians over rounds with a 90%
bootstrap interval (rounds resampled, fixed seed); ``s lost per ckpt`` = (fit s - its baseline's
fit s) / checkpoints, the interval from resampling rounds in pairs. ``--py-spy DIR`` records each
run's ranks (collapsed stacks, thread ids, idle frames, GIL held marked) for profiling;
``BENCH_PROFILE_SAVES=DIR`` writes a cProfile of each rank's ``trainer.save_checkpoint`` calls there
(``saves_rank<N>.prof``, all of a fit's saves together).

``training thread page faults`` are the training thread's minor faults over the fit (slowest rank),
``state copy s`` the time one rank takes to copy its parameters and optimizer state once into
memory already touched (the reference of issue 29's async target). On this VM a page fault costs
about 3 CPU-s per GB, and glibc's allocator, with its defaults, hands a step's large buffers back
and faults them in again the next step, more or less often as its thresholds move with each large
free (a save's included): 1 to 2.7 million faults in a 40-step fit of the large size. ``--malloc
steady`` runs every contestant with those thresholds fixed high (:data:`STEADY_MALLOC`): about
150,000 faults, the state's first touch, and a baseline that no longer moves by seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import fmt_table, free_port, run_header  # noqa: E402
from benchmarks.rss import status_kib  # noqa: E402

#: contestant -> the contestant whose fit time is its no-checkpoint baseline
BASELINE = {"none": "none", "stock": "none", "stock_async": "none", "mp_none": "mp_none", "stock_dcp": "mp_none",
            "ours_mp": "mp_none", "ours_io": "none", "ours_io_async": "none", "ours": "none", "ours_async": "none",
            "ours_async_bg": "none",
            "ours_zarr": "none", "ours_zarr_async": "none", "ours_zarr_async_bg": "none", "ours_buffered": "none", "ours_buffered_async": "none"}
DEFAULT = ("none", "stock", "stock_async", "mp_none", "stock_dcp", "ours_io", "ours_io_async", "ours", "ours_async")
#: size -> (layers, width)
SIZES = {"small": (8, 128), "large": (8, 2048)}
#: ``--malloc steady``: glibc's allocator keeps what a step freed (no mmap per large tensor, no trim),
#: so no run's steps fault their buffers in afresh; with its defaults the thresholds move with every
#: large free (a save's included), and the fit's own page faults vary by more than a checkpoint costs.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


# -- the training script (run by the orchestrator below, re-run by Lightning for rank 1) ----------
def _mlp_class() -> Any:
    import torch
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader

    class MLP(LightningModule):
        """``layers`` Linear(width, width) + ReLU; FSDP2-sharded under ModelParallelStrategy."""

        def __init__(self, layers: int, width: int, batches: int) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
            self.width, self.batches = width, batches

        def configure_model(self) -> None:
            if self.device_mesh is not None:  # ModelParallelStrategy: shard each layer over the ranks
                from torch.distributed.fsdp import fully_shard

                for layer in [*self.layers, self]:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            x = batch
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            data = torch.randn(8 * self.batches, self.width, generator=torch.Generator().manual_seed(0))
            return DataLoader(data, batch_size=8)

    return MLP


def _strategy(name: str) -> Tuple[Any, List[Any]]:
    """The contestant's strategy and plugins."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,
                                              DistCheckpointStrategy)

    async_cfg = {"async_save": True}
    zarr_cfg = {"storage": {"layout": "zarr"}}  # plain zarr arrays: large chunks written with O_DIRECT
    buffered_cfg = {"storage": {"direct_writes": False}}  # OCDBT in one commit through the page cache
    return {
        "none": lambda: (DDPStrategy(process_group_backend="gloo"), []),
        "stock": lambda: (DDPStrategy(process_group_backend="gloo"), []),
        "stock_async": lambda: (DDPStrategy(process_group_backend="gloo"), [AsyncCheckpointIO()]),
        "mp_none": lambda: (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), []),
        "stock_dcp": lambda: (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), []),
        "ours_mp": lambda: (DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), []),
        "ours_io": lambda: (DDPStrategy(process_group_backend="gloo"), [DistCheckpointIO()]),
        "ours_io_async": lambda: (DDPStrategy(process_group_backend="gloo"), [DistCheckpointIO(async_cfg)]),
        "ours": lambda: (DistCheckpointStrategy(process_group_backend="gloo"), []),
        "ours_async": lambda: (DistCheckpointStrategy(process_group_backend="gloo", checkpoint=async_cfg), []),
        "ours_async_bg": lambda: (DistCheckpointStrategy(process_group_backend="gloo",
                                                         checkpoint={**async_cfg, "background_snapshot": True}), []),
        "ours_zarr": lambda: (DistCheckpointStrategy(process_group_backend="gloo", checkpoint=zarr_cfg), []),
        "ours_zarr_async": lambda: (DistCheckpointStrategy(process_group_backend="gloo",
                                                           checkpoint={**zarr_cfg, **async_cfg}), []),
        "ours_zarr_async_bg": lambda: (DistCheckpointStrategy(
            process_group_backend="gloo", checkpoint={**zarr_cfg, **async_cfg, "background_snapshot": True}), []),
        "ours_buffered": lambda: (DistCheckpointStrategy(process_group_backend="gloo", checkpoint=buffered_cfg), []),
        "ours_buffered_async": lambda: (DistCheckpointStrategy(process_group_backend="gloo",
                                                               checkpoint={**buffered_cfg, **async_cfg}), []),
    }[name]()


def _recorder() -> Any:
    """A callback timing the training (from its start) and every ``trainer.save_checkpoint`` call."""
    from lightning.pytorch import Callback

    class Record(Callback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.loop_s = 0.0
            self.saves: List[float] = []
            self.rss_start_mib = 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.faults0 = _thread_faults()
            save = trainer.save_checkpoint

            profile_dir = os.environ.get("BENCH_PROFILE_SAVES")  # a cProfile of the saves per rank, there
            prof = None
            if profile_dir:
                import cProfile

                prof = cProfile.Profile()

            def timed(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                if prof is not None:
                    prof.enable()
                try:
                    return save(*a, **k)
                finally:
                    if prof is not None:
                        prof.disable()
                        prof.dump_stats(os.path.join(profile_dir, f"saves_rank{trainer.global_rank}.prof"))
                    self.saves.append(time.perf_counter() - t)

            trainer.save_checkpoint = timed  # what ModelCheckpoint calls
            self.rss_start_mib = (status_kib("VmRSS") or 0) / 1024
            self.cpu0 = (time.thread_time(), time.process_time())  # CPU time: robust on a busy machine
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.loop_s = time.perf_counter() - self.t0  # before the strategy waits for an async save
            self.faults = _thread_faults() - self.faults0

    return Record()


def _thread_faults() -> int:
    """Minor page faults of the calling thread so far (Linux; 0 elsewhere): the training thread's
    faults show how often the allocator hands memory back and takes it again."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return 0


def _copy_seconds(trainer: Any) -> float:
    """Seconds to copy this rank's parameters and optimizer state once into memory already touched
    (the second of two copies): the reference of the async target."""
    import torch

    tensors = [p.detach() for p in trainer.lightning_module.parameters()]
    for opt in trainer.optimizers:
        tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    dest = [torch.empty_like(t) for t in tensors]
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        for d, s in zip(dest, tensors):
            d.copy_(s)
        best = min(best, time.perf_counter() - t)
    return best


def _script(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.set_num_threads(1)
    strategy, plugins = _strategy(args.contestant)
    record = _recorder()
    callbacks = [record]
    if BASELINE[args.contestant] != args.contestant:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every_n_steps,
                                         save_top_k=-1))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=plugins, max_steps=args.steps,
                      logger=False, enable_checkpointing=len(callbacks) > 1, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(_mlp_class()(args.layers, args.width, args.steps * 2))
    fit_s = time.perf_counter() - record.t0
    train_cpu_s, proc_cpu_s = time.thread_time() - record.cpu0[0], time.process_time() - record.cpu0[1]
    rank = trainer.global_rank
    out = {"fit_s": fit_s, "loop_s": record.loop_s, "train_cpu_s": train_cpu_s, "proc_cpu_s": proc_cpu_s, "saves_s": record.saves, "rss_start_mib": record.rss_start_mib,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "global_step": trainer.global_step, "snapshot_wait_s": getattr(trainer.strategy, "snapshot_wait_s", 0.0),
           "train_faults": record.faults, "copy_s": _copy_seconds(trainer),
           "checkpoints": len(os.listdir(args.ckpt_dir)) if rank == 0 and os.path.isdir(args.ckpt_dir) else None}
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    if dist.is_initialized():
        dist.barrier()  # leave together, then destroy the group (an abort at exit otherwise)
        dist.destroy_process_group()


# -- the orchestrator ---------------------------------------------------------------------------
def _launch(args: argparse.Namespace, name: str, size: str, work: str, rnd: int) -> Dict[str, Any]:
    """One fit of ``name`` in fresh processes; returns its record (slowest rank's times)."""
    layers, width = SIZES[size] if size in SIZES else (args.layers, args.width)
    run_id = f"{size}-{name}-{rnd}"
    ckpt_dir, out = os.path.join(work, run_id), os.path.join(work, run_id + "-out")
    cmd = [sys.executable, os.path.abspath(__file__), "--contestant", name, "--ckpt-dir", ckpt_dir, "--out", out,
           "--layers", str(layers), "--width", str(width), "--steps", str(args.steps),
           "--every-n-steps", str(args.every_n_steps)]
    if args.py_spy:  # all threads of both ranks, idle ones too, GIL holder marked
        os.makedirs(args.py_spy, exist_ok=True)
        gil = ["--gil"] if args.py_spy_gil else []
        cmd = ["py-spy", "record", "--subprocesses", "--idle", "--threads", *gil, "-r", "50", "-f", "raw",
               "-o", os.path.join(args.py_spy, run_id + ".txt"), "--", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               **(STEADY_MALLOC if args.malloc == "steady" else {}))
    try:
        subprocess.run(cmd, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL,
                       stderr=None if args.verbose else subprocess.DEVNULL)
        ranks = []
        for r in range(2):
            with open(f"{out}.rank{r}.json") as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return {"size": size, "contestant": name, "round": rnd, "ranks": ranks, "layers": layers, "width": width,
            "fit_s": max(r["fit_s"] for r in ranks), "loop_s": max(r["loop_s"] for r in ranks),
            "blocked_s": max(sum(r["saves_s"]) + r.get("snapshot_wait_s", 0.0) for r in ranks),
            "snapshot_wait_s": max(r.get("snapshot_wait_s", 0.0) for r in ranks), "checkpoints": ranks[0]["checkpoints"],
            "train_cpu_s": max(r.get("train_cpu_s", 0.0) for r in ranks),
            "proc_cpu_s": max(r.get("proc_cpu_s", 0.0) for r in ranks),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks), "steps": ranks[0]["global_step"],
            "train_faults": max(r.get("train_faults", 0) for r in ranks), "copy_s": max(r.get("copy_s", 0.0) for r in ranks)}


def bootstrap(samples: Sequence[Any], stat: Callable[[Sequence[Any]], float], resamples: int = 2000,
              seed: int = 0) -> Tuple[float, float]:
    """A 90% interval of ``stat`` over ``samples`` resampled with replacement (fixed seed)."""
    rng = random.Random(seed)
    boots = sorted(stat(rng.choices(samples, k=len(samples))) for _ in range(resamples))
    return boots[int(0.05 * resamples)], boots[int(0.95 * resamples) - 1]


def summarize(results: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per size and contestant: medians, intervals and seconds lost per checkpoint."""
    out: Dict[str, Dict[str, Any]] = {}
    for size in dict.fromkeys(r["size"] for r in results):
        by = {(r["contestant"], r["round"]): r for r in results if r["size"] == size}
        for name in dict.fromkeys(c for c, _ in by):
            runs = [r for (c, _), r in by.items() if c == name]
            fits = [r["fit_s"] for r in runs]
            s: Dict[str, Any] = {"fit_s": statistics.median(fits), "fit_ci": bootstrap(fits, statistics.median),
                                 "runs": fits, "checkpoints": runs[0]["checkpoints"] or 0,
                                 "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
                                 "blocked_s": statistics.median(r["blocked_s"] for r in runs),
                                 "train_cpu_s": statistics.median(r.get("train_cpu_s", 0.0) for r in runs),
                                 "proc_cpu_s": statistics.median(r.get("proc_cpu_s", 0.0) for r in runs),
                                 "train_faults": statistics.median(r.get("train_faults", 0) for r in runs),
                                 "copy_s": statistics.median(r.get("copy_s", 0.0) for r in runs)}
            base = BASELINE[name]
            pairs = [(r["fit_s"], by[(base, r["round"])]["fit_s"]) for r in runs if (base, r["round"]) in by]
            n = s["checkpoints"]
            if base != name and pairs and n:
                def lost(p: Sequence[Tuple[float, float]]) -> float:
                    return (statistics.median(a for a, _ in p) - statistics.median(b for _, b in p)) / n

                s.update(lost_s=lost(pairs), lost_ci=bootstrap(pairs, lost),
                         overhead=statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs) - 1,
                         base_rss_mib=statistics.median(by[(base, r["round"])]["peak_rss_mib"] for r in runs
                                                        if (base, r["round"]) in by))
            out[f"{size}/{name}"] = s
    return out


def table(summary: Dict[str, Dict[str, Any]]) -> str:
    rows = []
    for key, s in summary.items():
        size, name = key.split("/")
        lost = (f"{s['lost_s']:.3f} [{s['lost_ci'][0]:.3f}, {s['lost_ci'][1]:.3f}]" if "lost_s" in s else "-")
        rows.append([size, name, f"{s['fit_s']:.2f} [{s['fit_ci'][0]:.2f}, {s['fit_ci'][1]:.2f}]",
                     " / ".join(f"{x:.2f}" for x in s["runs"]),
                     f"{100 * s['overhead']:+.0f}%" if "overhead" in s else "-",
                     s["checkpoints"], lost, f"{s['blocked_s'] / s['checkpoints']:.3f}" if s["checkpoints"] else "-",
                     f"{s['peak_rss_mib']:.0f}" + (f" ({s['peak_rss_mib'] - s['base_rss_mib']:+.0f})"
                                                   if "base_rss_mib" in s else ""),
                     f"{s['train_cpu_s']:.2f} / {s['proc_cpu_s']:.2f}",
                     f"{s.get('train_faults', 0) / 1000:.0f}k", f"{s.get('copy_s', 0.0):.3f}"])
    return fmt_table(["size", "contestant", "fit s [90%]", "runs", "vs no ckpt", "ckpts", "s lost per ckpt [90%]",
                      "blocked s per ckpt", "peak RSS MiB (vs no ckpt)",
                      "CPU s: training thread / process (slowest rank)", "training thread page faults",
                      "state copy s"], rows)


def _args(argv: List[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,large", help="comma-separated: small, large, custom (--layers/--width)")
    p.add_argument("--contestants", default=",".join(DEFAULT), help=f"comma-separated subset of {list(BASELINE)}")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every size and contestant once each)")
    p.add_argument("--steps", type=int, default=40, help="training steps per fit (default 40)")
    p.add_argument("--every-n-steps", type=int, default=10, help="ModelCheckpoint(every_n_train_steps=) (default 10)")
    p.add_argument("--layers", type=int, default=8, help="layers of the custom size")
    p.add_argument("--width", type=int, default=512, help="width of the custom size")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir in the cwd)")
    p.add_argument("--tag", default=None, help="write benchmarks/results/training_overhead_<tag>.json")
    p.add_argument("--py-spy", default=None, help="record every run with py-spy into this folder")
    p.add_argument("--py-spy-gil", action="store_true", help="with --py-spy: only samples holding the GIL")
    p.add_argument("--timeout", type=float, default=900, help="seconds one fit may take")
    p.add_argument("--verbose", action="store_true", help="show the runs' stderr")
    p.add_argument("--malloc", choices=("default", "steady"), default="default",
                   help="steady: every run with glibc's mmap and trim thresholds fixed high (STEADY_MALLOC), so "
                        "the training's own buffers are reused, not handed back and faulted in again each step")
    # the training script's own arguments (set by the orchestrator)
    p.add_argument("--contestant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for n in args.contestants.split(","):
        if n not in BASELINE:
            p.error(f"unknown contestant {n!r}")
    return args


def main(argv: List[str] | None = None) -> int:
    args = _args(argv)
    if args.contestant is not None:
        _script(args)
        return 0
    names, sizes = args.contestants.split(","), args.sizes.split(",")
    names += [b for b in dict.fromkeys(BASELINE[n] for n in names) if b not in names]  # every baseline runs
    work = tempfile.mkdtemp(prefix="bench_overhead_", dir=args.dir or os.getcwd())
    started, load_before = time.time(), os.getloadavg()
    results = []
    try:
        for rnd in range(args.rounds):
            for size in sizes:
                k = rnd % len(names)
                for name in names[k:] + names[:k]:
                    res = _launch(args, name, size, work, rnd)
                    print(f"[#{rnd}] {size:5s} {name:13s} fit {res['fit_s']:6.2f}s blocked {res['blocked_s']:6.2f}s "
                          f"CPU {res['train_cpu_s']:6.2f}s / {res['proc_cpu_s']:6.2f}s "
                          f"ckpts {res['checkpoints']} peak RSS {res['peak_rss_mib']:6.0f} MiB", flush=True)
                    results.append(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    summary = summarize(results)
    text = table(summary)
    print(text)
    print(f"\nload average (1, 5, 15 min) before: {' '.join(f'{x:.1f}' for x in load_before)}, "
          f"after: {' '.join(f'{x:.1f}' for x in load_after)} on {os.cpu_count()} CPUs")
    if args.tag:
        path = os.path.join(HERE, "results", f"training_overhead_{args.tag}.json")
        with open(path, "w") as f:
            json.dump({**run_header(args, started, load_before, load_after), "results": results,
                       "summary": summary, "table": text}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
