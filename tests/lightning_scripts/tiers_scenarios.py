"""Trainer runs with checkpoint tiers for tests/tiers/test_lightning_tiers.py, launched as
``python tiers_scenarios.py SCENARIO --dir D --out O --devices N --tp T --ranks-per-node R``.

The ranks are simulated nodes of ``R`` ranks, each node's local tier its own directory
(``D/<run>/local/node<i>``). A "failure" ends a run and deletes one node's local directory (or all
of them); the next Trainer in the same processes (a new module, strategy, callback and tier) resumes
with ``fit(ckpt_path="last")``. Every rank writes what it saw to ``OUT.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from datetime import timedelta
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (lightning_helpers)

from scenario_runner import scenario_main  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402

from lightning_distckpt import CheckpointingError  # noqa: E402
from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy, DistCheckpointStrategy  # noqa: E402
from lightning_distckpt.lightning.tiers import MARKER_NAME, TierCheckpoint  # noqa: E402
from lightning_helpers import TPMLP, full_weights  # noqa: E402
from model_parallel_scenarios import MPModel, full_state  # noqa: E402
from trainer_scenarios import same, snapshot  # noqa: E402

TIMEOUT = timedelta(seconds=90)  # a hang fails the test instead of blocking it
TOTAL, FAIL_AT = 10, 9  # steps of a whole run; the step the interrupted run ends at
LOCAL_EVERY, DURABLE_EVERY = 2, 6


class FirstStep(Callback):
    """Records the global step training starts from (the step a resume restored)."""

    def __init__(self) -> None:
        self.step: Optional[int] = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def fit(args: argparse.Namespace, root: str, max_steps: int, ckpt_path: Optional[str] = None,
        model_parallel: bool = False, model_cls: Any = None) -> Dict[str, Any]:
    """One Trainer run under ``root`` with tiers (local every 2 steps, durable every 6); its snapshot.
    ``model_parallel``: DistCheckpointModelParallelStrategy (FSDP2 x TP, DP = world / tp) and MPModel."""
    tiers = {"local_dir": os.path.join(root, "local", "{node}"), "local_every_n_steps": LOCAL_EVERY,
             "durable_every_n_steps": DURABLE_EVERY, "ranks_per_node": args.ranks_per_node, "replicas": 1,
             "keep_local": 2}
    if model_parallel:
        strategy: Any = DistCheckpointModelParallelStrategy(
            data_parallel_size=args.devices // args.tp, tensor_parallel_size=args.tp, timeout=TIMEOUT,
            checkpoint={"tiers": tiers})
        model: Any = MPModel(total_steps=TOTAL)
    else:
        strategy = DistCheckpointStrategy(tensor_parallel_size=args.tp, timeout=TIMEOUT, checkpoint={"tiers": tiers})
        model = (model_cls or TPMLP)(total_steps=TOTAL)
    first = FirstStep()
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=max_steps, max_epochs=-1,
                      callbacks=[first], logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=root)
    trainer.fit(model, ckpt_path=ckpt_path)
    if model_parallel:
        snap = {"state": full_state(model, trainer), "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "global_step": trainer.global_step, "losses": dict(model.losses)}
    else:
        snap = snapshot(model, trainer)
    snap["first_step"] = first.step
    snap["tier_callbacks"] = sum(isinstance(cb, TierCheckpoint) for cb in trainer.callbacks)
    return snap


def test_losses(args: argparse.Namespace, root: str, model: Any, ckpt_path: Optional[str]) -> List[float]:
    """``trainer.test`` of ``model`` under the tiers' strategy (``ckpt_path="last"``: the newest
    recoverable step, weights only); the test losses."""
    tiers = {"local_dir": os.path.join(root, "local", "{node}"), "local_every_n_steps": LOCAL_EVERY,
             "ranks_per_node": args.ranks_per_node}
    strategy = DistCheckpointStrategy(tensor_parallel_size=args.tp, timeout=TIMEOUT, checkpoint={"tiers": tiers})
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=root)
    trainer.test(model, ckpt_path=ckpt_path, verbose=False)
    return model.test_losses


def listing(root: str) -> Dict[str, List[str]]:
    """What each node's local tier and the durable folder hold (names only)."""
    out = {}
    for sub in ("local/node0", "local/node1", "checkpoints"):
        path = os.path.join(root, sub)
        # the lock file a live tier holds in its root (tiers/root_lock.py) is no step
        out[sub] = sorted(n for n in os.listdir(path) if n != ".ldc-tier-root.lock") if os.path.isdir(path) else []
    return out


def lose(trainer_strategy_barrier: Any, root: str, nodes: List[str], rank: int) -> None:
    """Delete the local directories of ``nodes`` (rank 0), with every rank waiting for it; and every
    rank done with what came before (e.g. listing those directories) before they go."""
    trainer_strategy_barrier()
    if rank == 0:
        for node in nodes:
            shutil.rmtree(os.path.join(root, "local", node), ignore_errors=True)
    trainer_strategy_barrier()


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def recovery(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """A: 10 steps straight. B: the same job ends at step 9 (a first run: ckpt_path="last" finds
    nothing). Node 0's local tier is lost; C resumes with "last" (from step 8: node 1's partner copies)
    to 10. Every local copy is lost; D resumes from the durable step 6 to 10. C and D must end where A
    did, exactly. Then the durable checkpoint is removed too: "last" refuses on every rank."""
    a = fit(args, os.path.join(args.dir, "A"), TOTAL)
    rank = dist.get_rank()  # the process group exists from the first fit on
    root = os.path.join(args.dir, "B")
    b = fit(args, root, FAIL_AT, ckpt_path="last")
    res["b_first_step"], res["b_global_step"] = b["first_step"], b["global_step"]
    res["b_tier_callbacks"] = b["tier_callbacks"]
    res["after_b"] = listing(root)

    lose(dist.barrier, root, ["node0"], rank)
    c = fit(args, root, TOTAL, ckpt_path="last")
    res["c_first_step"], res["c_exact"] = c["first_step"], same(a, c)
    res["c_losses_match"] = {k: v for k, v in a["losses"].items() if k >= c["first_step"]} == c["losses"]
    res["after_c"] = listing(root)
    # Trainer.test with "last": the newest recoverable step (local step 10), weights only: the
    # uninterrupted run's final weights.
    restored = TPMLP(total_steps=TOTAL)
    res["test_last"] = test_losses(args, root, restored, "last")
    weights = full_weights(restored)
    res["test_last_weights"] = set(weights) == set(a["weights"]) and all(
        torch.equal(weights[k], a["weights"][k]) for k in weights)

    lose(dist.barrier, root, ["node0", "node1"], rank)
    d = fit(args, root, TOTAL, ckpt_path="last")
    res["d_first_step"], res["d_exact"] = d["first_step"], same(a, d)

    lose(dist.barrier, root, ["node0", "node1"], rank)
    if rank == 0:
        shutil.rmtree(os.path.join(root, "checkpoints", "last.ckpt"))
    dist.barrier()
    try:
        fit(args, root, TOTAL, ckpt_path="last")
        res["nothing_left"] = "no error"
    except CheckpointingError as e:
        res["nothing_left"] = f"{type(e).__name__}: {e}"
    res["marker"] = os.path.isfile(os.path.join(root, "checkpoints", MARKER_NAME))


def damage(root: str, step: int) -> None:
    """Flip a byte every 4 KiB of every data file of ``step`` on every node: no copy of it is intact."""
    for node in ("node0", "node1"):
        data = os.path.join(root, "local", node, f"step_{step:09d}", "data")
        for d, _, files in os.walk(data):
            for name in files:
                path = os.path.join(d, name)
                with open(path, "r+b") as f:
                    raw = bytearray(f.read())
                    for i in range(len(raw) // 2, len(raw), 4096):
                        raw[i] ^= 0x5A
                    f.seek(0)
                    f.write(bytes(raw))


def recovery_damaged(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Every local copy of step 8 damaged (found as the restore reads it, not by the listing): the restore
    falls back, agreed by every rank, to local step 6 (module and optimizer alike), exact against a
    straight run."""
    a = fit(args, os.path.join(args.dir, "dmgA"), TOTAL)
    rank = dist.get_rank()
    root = os.path.join(args.dir, "dmgB")
    fit(args, root, FAIL_AT)
    if rank == 0:
        damage(root, 8)
    dist.barrier()
    e = fit(args, root, TOTAL, ckpt_path="last")
    res["damaged_first_step"], res["damaged_exact"] = e["first_step"], same(a, e)


def recovery_model_parallel(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """As :func:`recovery` under DistCheckpointModelParallelStrategy (FSDP2 x TP, restored after
    setup): node 0's local tier lost, then every local copy; exact against a straight run."""
    def exact(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
        sa, sb = a["state"], b["state"]
        return (set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
                and a["sched"] == b["sched"] and a["global_step"] == b["global_step"])

    a = fit(args, os.path.join(args.dir, "mpA"), TOTAL, model_parallel=True)
    rank = dist.get_rank()
    root = os.path.join(args.dir, "mpB")
    fit(args, root, FAIL_AT, model_parallel=True)
    lose(dist.barrier, root, ["node0"], rank)
    c = fit(args, root, TOTAL, ckpt_path="last", model_parallel=True)
    res["mp_c"] = [c["first_step"], exact(a, c)]
    lose(dist.barrier, root, ["node0", "node1"], rank)
    d = fit(args, root, TOTAL, ckpt_path="last", model_parallel=True)
    res["mp_d"] = [d["first_step"], exact(a, d)]


class FailsAtStep4(TPMLP):
    """Rank 1 cannot describe its module's shards at step 4 (a local save's, not a durable one's)."""

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, Any]:
        if self.trainer.global_step == 4 and dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot describe its shards at step 4")
        return super().sharded_state_dict(prefix)


def local_tree_fails(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """One rank fails building the local save's tree (agreed in the save's handshake, not before it):
    every rank raises, naming rank 1 and its error; nothing of step 4 is kept."""
    root = os.path.join(args.dir, "treefail")
    try:
        fit(args, root, TOTAL, model_cls=FailsAtStep4)
        res["tree_fails"] = "no error"
    except CheckpointingError as e:
        res["tree_fails"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    res["tree_fails_listing"] = listing(root)


if __name__ == "__main__":
    scenario_main({"recovery": recovery, "recovery_model_parallel": recovery_model_parallel,
                   "recovery_damaged": recovery_damaged, "local_tree_fails": local_tree_fails},
                  **{"--ranks-per-node": dict(type=int, default=2)})
