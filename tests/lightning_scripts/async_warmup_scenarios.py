"""Trainer runs of ``DistCheckpointModelParallelStrategy`` with async saves, for
tests/lightning/test_lightning_async_warmup_mp.py: ``python async_warmup_scenarios.py SCENARIO... --dir D --out O``.

Each fit records, at the end of its second step (before the first save, at step 3), the saver's
staging pool and commit group, then checks after the fit that both saves staged into that very pool
and that the last checkpoint, read whole, equals the trained state. Every rank writes ``OUT.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (lightning_helpers)

from scenario_runner import scenario_main  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_distckpt.lightning import DistCheckpointIO  # noqa: E402
from model_parallel_scenarios import MPModel, full_state, trainer  # noqa: E402


class BeforeFirstSave(Callback):
    """The saver as it is after the second step, before the first save (every_n_train_steps=3)."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.seen: Dict[str, Any] = {}

    def on_train_batch_end(self, trainer_: Trainer, *args: Any) -> None:  # checkpoint callbacks run after this one
        if trainer_.global_step != 2:
            return
        io = trainer_.strategy.checkpoint_io
        saver = io._saver
        self.pool = None if saver is None else saver._pool._pool
        self.seen = {"saver": saver is not None, "pending": io.pending is not None,
                     "commit_group": saver is not None and saver._commit_group is not None,
                     "pool_bytes": 0 if self.pool is None else self.pool.numel()}


def _stored_equals(path: str, model: MPModel, t: Trainer) -> Dict[str, bool]:
    """The checkpoint read whole (torch's layout: optimizer state by index) against the trained state."""
    stored = DistCheckpointIO().load_checkpoint(path)
    got = full_state(model, t)
    opt = stored["optimizer_states"][0]["state"]
    out = {}
    for j, (name, _) in enumerate(model.named_parameters()):
        out[name] = torch.equal(stored["state_dict"][name], got[name])
        for k, v in opt[j].items():
            out[f"{name}.{k}"] = torch.equal(torch.as_tensor(v).to(got[f"{name}.{k}"].dtype), got[f"{name}.{k}"])
    return out


def _fit(args: argparse.Namespace, res: Dict[str, Any], tag: str, tp: int, **strategy_kw: Any) -> None:
    ck = os.path.join(args.dir, tag)
    seen = BeforeFirstSave()
    cb = ModelCheckpoint(dirpath=ck, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    model = MPModel()
    t = trainer(args, 6, [cb, seen], tp=tp, **strategy_kw)
    t.fit(model)
    saver = t.strategy.checkpoint_io._saver
    res[tag] = {**seen.seen, "files": sorted(os.listdir(ck)), "exact": _stored_equals(os.path.join(ck, "step=6.ckpt"),
                                                                                       model, t)}
    if saver is not None:
        res[tag].update(same_pool=saver._pool._pool is seen.pool and seen.pool is not None,
                        peak=saver.peak_staging_bytes)


def async_dp2(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """FSDP2 over 2 ranks, async saves every 3 steps."""
    _fit(args, res, "async_dp2", 1, checkpoint={"async_save": True})


def async_tp2(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """Tensor parallel over 2 ranks (fc2's bias replicated on both), async saves every 3 steps."""
    _fit(args, res, "async_tp2", 2, checkpoint={"async_save": True})


def sync_dp2(args: argparse.Namespace, res: Dict[str, Any]) -> None:
    """The same fit saving synchronously: no saver, nothing reserved."""
    _fit(args, res, "sync_dp2", 1)


SCENARIOS = {"async_dp2": async_dp2, "async_tp2": async_tp2, "sync_dp2": sync_dp2}

if __name__ == "__main__":
    scenario_main(SCENARIOS)
