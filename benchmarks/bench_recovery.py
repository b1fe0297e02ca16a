"""Recovery from a failure: a Lightning fit of the benchmark GPT on 4 CPU processes (2 simulated
nodes of 2), a failure at a fixed step, a restart with ``ckpt_path="last"``.

    python benchmarks/bench_recovery.py --size-mib 64 --fail-at 27 --durable-every 20 --local-every 5 \\
        --json benchmarks/results/recovery_<tag>.json

The model: the parameters of ``common.gpt_params`` (the GPT of ``bench_save_load.py``) as fp32
``nn.Parameter`` s of one LightningModule, data parallel (every rank holds the whole model), Adam.

Contestants:

* ``none``    - no checkpoints: the run time the others' overhead is measured against (no restart).
* ``stock``   - Lightning's ``DDPStrategy`` and ``ModelCheckpoint(every_n_train_steps=N, save_last=True)``:
  rank 0 ``torch.save`` s ``last.ckpt`` every N steps.
* ``durable`` - ``DistCheckpointStrategy`` and ``DistModelCheckpoint`` with the same arguments: our
  sharded ``last.ckpt`` every N steps (every rank writes its part).
* ``tiers``   - ``DistCheckpointStrategy`` with ``tiers: {local_every_n_steps: n, durable_every_n_steps: N}``:
  a node-local checkpoint (``/dev/shm``) with a partner copy on the other node every n steps, plus
  the durable ``last.ckpt`` every N.

The failure: when step ``--fail-at`` is done every rank exits at once (``os._exit``, no teardown, no
save at the end), after the local tier's save in flight has finished (so the outcome does not depend on
timing). Then node 1's local directory is deleted (``--keep-node`` keeps it) and the durable folder's
files are dropped from the page cache (fsync, then ``posix_fadvise(DONTNEED)``, as ``bench_save_load``
does): a real restart reads durable storage cold (another node, or the cache gone), while the local
tier (``/dev/shm``) stays in memory as it would on a surviving node. The restart is a fresh launch
with ``ckpt_path="last"``; its clock starts just before the launch and stops on each rank when its
first batch starts.

``--durable-store s3`` puts ``durable``'s ``DistModelCheckpoint`` folder and ``tiers``' ``TierCheckpoint``
folder at ``s3://bench-recovery/...`` on moto's S3 server, started by the orchestrator on 127.0.0.1
(``common.moto_s3``). No page-cache drop there: moto keeps the objects in its own memory, so an S3
restore measures the S3 protocol path (HTTP, a Python server sharing these cores), not a disk. ``stock``
stays on the local directory: Lightning's ``ModelCheckpoint`` writes ``s3://`` through s3fs, but its
``ckpt_path="last"`` does not find it there (``_find_last_checkpoints`` drops the protocol from the
listed paths; Lightning-AI/pytorch-lightning#18261), so its restart would start from step 0.

Reported per contestant (slowest rank): steps redone (fail step - step resumed from), recovery s
(launch to first step), restore s (inside the strategy's load hooks: agreeing on the point, fetching,
reading), restore CPU s (the same hooks' process CPU seconds, summed over the ranks: steadier than wall
seconds on a shared machine), start s (recovery s - restore s on each rank: starting the processes, the same work for
every contestant), run s (first step to the
failure), run CPU s (the same span's process CPU seconds, summed over the ranks: the checkpointing's background
work included), checkpointing overhead s (run s - ``none``'s run s), blocked s (the training thread inside
saves), and lost s = recovery s + steps redone x ``none``'s mean step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CONTESTANTS = ("none", "stock", "durable", "tiers")
BUCKET = "bench-recovery"
WORLD, RANKS_PER_NODE = 4, 2


def _durable_dir(args: argparse.Namespace, contestant: str) -> str:
    """The contestant's durable folder: under the durable root (a directory or an s3:// URL); stock's
    always in the work directory (Lightning's "last" does not resolve on s3://: the module docstring)."""
    root = args.work if contestant == "stock" else args.durable_root
    return os.path.join(root, contestant, "checkpoints")


# -- the training script (run by the orchestrator below, re-run by Lightning for ranks 1..3) -------
def _parts(args: argparse.Namespace) -> Tuple[Any, ...]:
    """The script's classes, imported here (the orchestrator does not need Lightning)."""
    import torch
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common import gpt_params
    from lightning_distckpt.lightning import DistCheckpointStrategy
    from lightning_distckpt.lightning.tiers import TierCheckpoint

    class GPTState(LightningModule):
        """The benchmark GPT's parameters; the loss touches every one (DDP wants a gradient for each)."""

        def __init__(self, size_bytes: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.params = torch.nn.ParameterDict({
                p.name.replace(".", "_"): torch.nn.Parameter(torch.randn(p.shape, generator=g) * 0.02)
                for p in gpt_params(size_bytes)})

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return batch[0].mean() * sum(p.sum() for p in self.params.values())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:  # long enough that no epoch ends (no epoch-end saves)
            return DataLoader(TensorDataset(torch.randn(8 * (args.fail_at + 100), 4)), batch_size=2)

    class Timed:
        """Seconds in the strategy's save and load hooks (the load hooks: wall and this process's CPU
        seconds; with ``BENCH_RECOVERY_PROFILE=<dir>`` set, a cProfile of them per rank is written there)."""

        save_s = 0.0
        restore_s = 0.0
        restore_cpu_s = 0.0
        profile: Any = None

        def _timed(self, field: str, name: str, *a: Any, **k: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            loading = field == "restore_s"
            if loading and os.environ.get("BENCH_RECOVERY_PROFILE"):
                import cProfile
                self.profile = self.profile or cProfile.Profile()
                self.profile.enable()
            try:
                return getattr(super(), name)(*a, **k)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
                if loading:
                    self.restore_cpu_s += time.process_time() - c0
                    if self.profile is not None:
                        self.profile.disable()
                        self.profile.dump_stats(os.path.join(os.environ["BENCH_RECOVERY_PROFILE"],
                                                             f"rank{self.global_rank}.prof"))

        def save_checkpoint(self, *a: Any, **k: Any) -> Any:
            return self._timed("save_s", "save_checkpoint", *a, **k)

        def load_checkpoint(self, *a: Any, **k: Any) -> Any:
            return self._timed("restore_s", "load_checkpoint", *a, **k)

        def load_model_state_dict(self, *a: Any, **k: Any) -> Any:
            return self._timed("restore_s", "load_model_state_dict", *a, **k)

        def load_optimizer_state_dict(self, *a: Any, **k: Any) -> Any:
            return self._timed("restore_s", "load_optimizer_state_dict", *a, **k)

    class TimedDDP(Timed, DDPStrategy):
        pass

    class TimedDist(Timed, DistCheckpointStrategy):
        pass

    class TimedTierCheckpoint(TierCheckpoint):
        """Seconds in local saves: in all, waiting for the previous local save's background work (write,
        commit, partner copy), and building the checkpoint dict (the rest is LocalTier.save's snapshot)."""

        local_s = 0.0
        local_cpu_s = 0.0  # the training thread's CPU seconds in local saves
        local_wait_s = 0.0
        local_tree_s = 0.0

        def save_local(self, trainer: Any, step: int) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            self.local_tier.wait()  # what LocalTier.save would wait for first, timed apart
            self.local_wait_s += time.perf_counter() - t0
            super().save_local(trainer, step)
            self.local_s += time.perf_counter() - t0
            self.local_cpu_s += time.thread_time() - c0

        def local_tree(self, trainer: Any, step: int) -> Any:
            t0 = time.perf_counter()
            try:
                return super().local_tree(trainer, step)
            finally:
                self.local_tree_s += time.perf_counter() - t0

    class Clock(Callback):
        """Records the first step (time since launch, step resumed from) and, at the failure step,
        the run's time; then every rank exits at once (the failure), or after the first step of a restart."""

        def __init__(self) -> None:
            self.record: Dict[str, Any] = {}
            self.marks: Dict[str, Any] = {}

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            # where "start s" goes: launch, imports and the process group before this; then setup and restore
            self.marks = {"setup_s": time.time() - args.t0, "setup_cpu_s": time.process_time()}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            now = time.time()
            if not self.record:
                self.record = {"to_first_step_s": now - args.t0, "first_step": trainer.global_step,
                               "cpu_first": time.process_time(), "restore_s": trainer.strategy.restore_s,
                               "restore_cpu_s": getattr(trainer.strategy, "restore_cpu_s", 0.0), "t_first": now,
                               **self.marks}
                if args.phase == "restart":
                    self._exit(trainer)
            if trainer.global_step == args.fail_at:
                for cb in trainer.callbacks:  # the local save in flight finishes: a deterministic outcome
                    if isinstance(cb, TierCheckpoint) and cb.local_tier is not None:
                        cb.local_tier.wait()
                tier = [cb for cb in trainer.callbacks if isinstance(cb, TimedTierCheckpoint)]
                self.record.update(run_s=now - self.record["t_first"],
                                   run_cpu_s=time.process_time() - self.record["cpu_first"],
                                   local_cpu_s=sum(cb.local_cpu_s for cb in tier),
                                   steps=trainer.global_step - self.record["first_step"],
                                   blocked_s=trainer.strategy.save_s + sum(cb.local_s for cb in tier),
                                   durable_s=trainer.strategy.save_s, local_s=sum(cb.local_s for cb in tier),
                                   local_wait_s=sum(cb.local_wait_s for cb in tier),
                                   local_tree_s=sum(cb.local_tree_s for cb in tier))
                self._exit(trainer)

        def _exit(self, trainer: Any) -> None:
            with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
                json.dump(self.record, f)
            trainer.strategy.barrier()
            os._exit(0)  # the failure: no teardown, no save at the end

    return GPTState, TimedDDP, TimedDist, TimedTierCheckpoint, Clock


def _script(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_distckpt.lightning import DistModelCheckpoint
    from lightning_distckpt.tiers import TierOptions

    torch.set_num_threads(1)
    GPTState, TimedDDP, TimedDist, TimedTierCheckpoint, Clock = _parts(args)
    durable_dir = _durable_dir(args, args.contestant)  # a folder or an s3:// URL
    every = dict(dirpath=durable_dir, every_n_train_steps=args.durable_every, save_top_k=0, save_last=True)
    callbacks: List[Any] = [Clock()]
    if args.contestant == "none":
        strategy = TimedDDP(process_group_backend="gloo")
    elif args.contestant == "stock":
        strategy = TimedDDP(process_group_backend="gloo")
        callbacks.append(ModelCheckpoint(**every))
    elif args.contestant == "durable":
        strategy = TimedDist(process_group_backend="gloo")
        callbacks.append(DistModelCheckpoint(**every))
    else:
        tiers = dict(local_dir=os.path.join(args.local_root, "{node}"), local_every_n_steps=args.local_every,
                     durable_every_n_steps=args.durable_every, ranks_per_node=RANKS_PER_NODE, replicas=1, keep_local=2)
        strategy = TimedDist(process_group_backend="gloo", checkpoint={"tiers": tiers})
        callbacks.append(TimedTierCheckpoint(TierOptions(**tiers), dirpath=durable_dir))
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=args.fail_at + 50, logger=False,
                      enable_checkpointing=args.contestant != "none", enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
                      default_root_dir=os.path.join(args.work, args.contestant))
    model = GPTState(int(args.size_mib * 2**20))
    trainer.fit(model, ckpt_path="last" if args.phase == "restart" else None)
    raise RuntimeError("the run ended before the failure step")  # Clock exits the process first


# -- the orchestrator ---------------------------------------------------------------------------
def _launch(args: argparse.Namespace, phase: str, name: str, out: str) -> List[Dict[str, Any]]:
    """Launch the script (rank 0; Lightning starts ranks 1..3); every rank's record."""
    import subprocess

    from benchmarks.common import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--contestant", name, "--work", args.work,
           "--local-root", args.local_root, "--durable-root", args.durable_root,
           "--size-mib", str(args.size_mib), "--fail-at", str(args.fail_at),
           "--durable-every", str(args.durable_every), "--local-every", str(args.local_every),
           "--t0", repr(time.time()), "--out", out]
    subprocess.run(cmd, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL,
                   stderr=None if args.verbose else subprocess.DEVNULL)
    ranks = []
    for r in range(WORLD):
        with open(f"{out}.rank{r}.json") as f:
            ranks.append(json.load(f))
    return ranks


def _contestant(args: argparse.Namespace, name: str) -> Dict[str, Any]:
    from benchmarks.common import drop_page_cache

    run = _launch(args, "run", name, os.path.join(args.work, f"{name}-run"))
    res: Dict[str, Any] = {"contestant": name, "run": run, "run_s": max(r["run_s"] for r in run),
                           "run_cpu_s": sum(r["run_cpu_s"] for r in run),
                           "steps": run[0]["steps"], "blocked_s": max(r["blocked_s"] for r in run)}
    if name == "none":
        return res
    if name == "tiers" and not args.keep_node:
        shutil.rmtree(os.path.join(args.local_root, "node1"))  # node 1 is lost with its local tier
    durable = _durable_dir(args, name)
    if os.path.isdir(durable):  # an s3:// one is no directory: moto keeps its objects in memory
        drop_page_cache(durable)
    if name == "tiers" and args.local_cold:
        drop_page_cache(args.local_root)
    restart = _launch(args, "restart", name, os.path.join(args.work, f"{name}-restart"))
    res.update(restart=restart, recovery_s=max(r["to_first_step_s"] for r in restart),
               restore_s=max(r["restore_s"] for r in restart), resumed_step=restart[0]["first_step"],
               restore_cpu_s=sum(r.get("restore_cpu_s", 0.0) for r in restart),
               start_s=max(r["to_first_step_s"] - r["restore_s"] for r in restart),
               steps_redone=args.fail_at - restart[0]["first_step"])
    return res


def _table(results: List[Dict[str, Any]]) -> str:
    from benchmarks.common import fmt_table

    base = next((r for r in results if r["contestant"] == "none"), None)
    step_s = base["run_s"] / base["steps"] if base else None
    rows = []
    for r in results:
        over = f"{r['run_s'] - base['run_s']:.2f}" if base and r is not base else "-"
        if r["contestant"] == "none":
            rows.append(["none", "-", "-", "-", "-", "-", "-", f"{r['run_s']:.2f}", f"{r['run_cpu_s']:.2f}", "-", "-",
                         "-"])
            continue
        lost = f"{r['recovery_s'] + r['steps_redone'] * step_s:.2f}" if step_s else "-"
        rows.append([r["contestant"], str(r["resumed_step"]), str(r["steps_redone"]), f"{r['recovery_s']:.2f}",
                     f"{r['restore_s']:.2f}", f"{r['restore_cpu_s']:.2f}", f"{r['start_s']:.2f}",
                     f"{r['run_s']:.2f}", f"{r['run_cpu_s']:.2f}", over,
                     f"{r['blocked_s']:.2f}", lost])
    return fmt_table(["contestant", "resumed at", "steps redone", "recovery s", "restore s", "restore CPU s",
                      "start s", "run s", "run CPU s",
                      "ckpt overhead s", "blocked s", "lost s"], rows)


def _args(argv: List[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=64, help="size of the GPT's training state (default 64)")
    p.add_argument("--fail-at", type=int, default=27, help="the step the failure happens after (default 27)")
    p.add_argument("--durable-every", type=int, default=20, help="N: durable saves every N steps (default 20)")
    p.add_argument("--local-every", type=int, default=5, help="n: local saves every n steps (default 5)")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"comma-separated subset of {CONTESTANTS}")
    p.add_argument("--keep-node", action="store_true", help="keep node 1's local tier (default: it is lost)")
    p.add_argument("--local-base", default=None,
                   help="where the simulated nodes' local tiers go (default /dev/shm, else the work folder)")
    p.add_argument("--local-cold", action="store_true",
                   help="drop the local tiers' files from the page cache before the restart too (a disk local tier "
                        "whose node's cache is gone; /dev/shm cannot be dropped)")
    p.add_argument("--durable-store", choices=("dir", "s3"), default="dir",
                   help="where durable checkpoints go: a directory (default) or s3:// on moto's server on loopback")
    p.add_argument("--dir", default=None, help="where durable checkpoints go (default: a temp dir in the cwd)")
    p.add_argument("--json", default=None, help="write raw results and the table here")
    p.add_argument("--timeout", type=float, default=600, help="seconds one launch may take")
    p.add_argument("--verbose", action="store_true", help="show the runs' stderr")
    # the script's, set by the orchestrator
    for flag in ("--phase", "--contestant", "--work", "--local-root", "--durable-root", "--out"):
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase is None and not 0 < args.local_every <= args.durable_every < args.fail_at:
        p.error("need 0 < --local-every <= --durable-every < --fail-at")
    return args


def main(argv: List[str] | None = None) -> int:
    args = _args(argv)
    if args.phase is not None:
        _script(args)
        return 0
    from benchmarks.common import moto_s3, run_header

    names = [x for x in args.contestants.split(",") if x]
    unknown = sorted(set(names) - set(CONTESTANTS))
    if unknown:
        raise SystemExit(f"unknown contestant(s) {unknown}; choose from {CONTESTANTS}")
    own = args.dir is None
    args.work = tempfile.mkdtemp(prefix="bench_recovery_", dir=os.getcwd()) if own else args.dir
    base = args.local_base or ("/dev/shm" if os.path.isdir("/dev/shm") else args.work)
    args.local_root = tempfile.mkdtemp(prefix="bench_recovery_local_", dir=base)
    started, load_before = time.time(), os.getloadavg()
    results = []
    s3 = args.durable_store == "s3"
    args.durable_root = f"s3://{BUCKET}/{os.path.basename(args.work)}" if s3 else args.work
    try:
        with moto_s3(BUCKET) if s3 else contextlib.nullcontext():
            for name in names:
                res = _contestant(args, name)
                resumed = (f" resumed at {res['resumed_step']} recovery {res['recovery_s']:5.2f}s"
                           if "recovery_s" in res else "")
                print(f"{name:8s} run {res['run_s']:6.2f}s ({res['run_cpu_s']:6.2f} CPU s) "
                      f"blocked {res['blocked_s']:5.2f}s" + resumed, flush=True)
                results.append(res)
    finally:
        shutil.rmtree(args.local_root, ignore_errors=True)
        if own:
            shutil.rmtree(args.work, ignore_errors=True)
    load_after = os.getloadavg()
    table = _table(results)
    if s3:  # what "durable" means in this table
        table += (f"\n\ndurable store: s3://{BUCKET}/ on moto's server on 127.0.0.1 (objects in its memory, no "
                  "page-cache drop); stock's in a local directory (its \"last\" is not found on s3://); "
                  f"local tiers in {base}")
    print(table)
    print(f"\nload average (1, 5, 15 min) before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_header(args, started, load_before, load_after), "results": results, "table": table},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
