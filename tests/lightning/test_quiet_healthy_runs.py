"""Healthy runs are quiet: no WARNING from our loggers and no Python warning raised from our modules.

A user who sees warnings in a healthy run learns to ignore them, then misses the real one. A 2-process
Trainer fit with our strategy (async saves, the local tier on one host with its default ``replicas: 1``,
a monitored top-k ``ModelCheckpoint`` and ``save_last=True``), then its ``ckpt_path="last"`` resume, must
say nothing at WARNING; so must ``fabric.load`` of a directory ``ldc.save`` wrote. The warnings kept
still fire when their condition holds. This file is also the fit's rank script (``__main__``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (script_ranks, dist_utils)

import pytest  # noqa: E402
import torch  # noqa: E402

import lightning_distckpt  # noqa: E402

OURS = "lightning_distckpt"
PACKAGE_DIR = os.path.dirname(os.path.abspath(lightning_distckpt.__file__))
RUN_TIMEOUT_S = 240  # a hang bound only


class Records(logging.Handler):
    """Every record at WARNING or above of our loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def ours_raised(caught: List[warnings.WarningMessage]) -> List[str]:
    """The Python warnings raised from our package's files."""
    return [f"{w.category.__name__} {w.filename}:{w.lineno}: {w.message}" for w in caught
            if os.path.abspath(w.filename).startswith(PACKAGE_DIR + os.sep)]


def _fit(root: str, steps: int) -> Dict[str, Any]:
    """One Trainer fit on this rank (launched externally), resumed from "last"; what it said."""
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distckpt.lightning import DistCheckpointStrategy

    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"], sync_dist=True)  # the same on every rank: a healthy monitor
            return out

    seed_everything(0)
    tiers = {"local_dir": os.path.join(root, "local", "{node}"), "local_every_n_steps": 1}  # one host: one node
    strategy = DistCheckpointStrategy(checkpoint={"async_save": True, "tiers": tiers}, timeout=timedelta(seconds=60))
    checkpoints = ModelCheckpoint(os.path.join(root, "ckpt"), monitor="train_loss", save_top_k=2,
                                  every_n_train_steps=2, save_last=True)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      callbacks=[checkpoints], enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root)
    records = Records()
    logging.getLogger(OURS).addHandler(records)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Model(), ckpt_path="last")
    logging.getLogger(OURS).removeHandler(records)
    return {"step": trainer.global_step, "logged": records.lines, "raised": ours_raised(caught)}


def _run_fit(tmp_path: Any, steps: int) -> List[Dict[str, Any]]:
    from script_ranks import run_ranks, script_env

    out = tmp_path / f"fit{steps}"
    code, output = run_ranks(__file__, [str(tmp_path), str(steps), str(out)], script_env(), 2, RUN_TIMEOUT_S,
                             cwd=str(tmp_path))
    assert code == 0, output[-6000:]
    return [json.loads((tmp_path / f"fit{steps}.rank{r}.json").read_text()) for r in range(2)]


def test_trainer_fit_and_resume_with_async_tiers_and_top_k_say_no_warning(tmp_path):
    """Before: rank 0 logged "local tier: replicas=1 asked, but only 0 other node(s)" at every fit on
    one host with the default config, though a single node has no other node to copy to."""
    for steps in (4, 6):  # a fresh fit, then its resume from "last"
        ranks = _run_fit(tmp_path, steps)
        assert [r["step"] for r in ranks] == [steps, steps]
        for rank, said in enumerate(ranks):
            assert said["logged"] == [] and said["raised"] == [], f"rank {rank}, fit to step {steps}: {said}"


def _gather_nodes(rank: int, world: int, root: str, ranks_per_node: Any, replicas: int) -> List[str]:
    from lightning_distckpt.comm import get_comm
    from lightning_distckpt.tiers.nodes import gather_nodes
    from lightning_distckpt.tiers.options import TierOptions

    records = Records()
    logging.getLogger(OURS).addHandler(records)
    try:
        gather_nodes(TierOptions(local_dir=os.path.join(root, "{node}"), ranks_per_node=ranks_per_node,
                                 replicas=replicas), get_comm())
    finally:
        logging.getLogger(OURS).removeHandler(records)
    return records.lines


def test_replicas_warning_only_when_other_nodes_hold_fewer_copies_than_asked(tmp_path):
    from dist_utils import run_distributed

    one_node = run_distributed(_gather_nodes, 2, str(tmp_path), None, 1)  # one host, the default replicas
    assert one_node == [[], []]
    two_nodes = run_distributed(_gather_nodes, 2, str(tmp_path), 1, 2)  # 2 nodes: only one partner copy
    assert len(two_nodes[0]) == 1 and "replicas=2 asked, but only 1 other node(s)" in two_nodes[0][0]
    assert two_nodes[1] == []  # said once, by rank 0


def test_fabric_load_of_an_ldc_save_directory_is_quiet(tmp_path, caplog, isolated_process_group):
    """Before: WARNING "checkpoint ... was not saved by lightning_distckpt (no manifest)", for a
    directory lightning_distckpt's own ``save`` wrote, loaded as documented."""
    from lightning.fabric import Fabric

    import lightning_distckpt as ldc
    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    weight = torch.arange(8.0).reshape(2, 4)
    ldc.save({"model": {"weight": ldc.ShardedTensor.from_rank_offsets("model.weight", weight),
                        "bias": ldc.ShardedTensor.from_rank_offsets("model.bias", torch.ones(2))}, "step": 3},
             str(tmp_path / "core"))
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    model = fabric.setup(torch.nn.Linear(4, 2))
    state = {"model": model, "step": 0}
    with caplog.at_level(logging.WARNING, logger=OURS), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(str(tmp_path / "core"), state)
    assert state["step"] == 3 and torch.equal(model.module.weight.detach(), weight)
    assert [r for r in caplog.records if r.name.startswith(OURS) and r.levelno >= logging.WARNING] == []
    assert ours_raised(caught) == []


@pytest.mark.parametrize("save_last,warned", [("link", True), (True, False)])
def test_async_link_last_warning_fires_only_for_link(save_last, warned, caplog):
    """The kept warning: an async save with save_last="link" can leave last.ckpt dangling."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_distckpt.lightning.strategy import warn_async_link_last

    trainer = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(save_last=save_last)], is_global_zero=True)
    with caplog.at_level(logging.WARNING, logger=OURS):
        warn_async_link_last(trainer)
    assert any('save_last="link"' in r.getMessage() for r in caplog.records) is warned


if __name__ == "__main__":  # one rank of the fit (run_ranks): argv ROOT STEPS OUT
    root_, steps_, out_ = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    said_ = _fit(root_, steps_)
    with open(f"{out_}.rank{os.environ['LOCAL_RANK']}.json", "w") as f:
        json.dump(said_, f)
