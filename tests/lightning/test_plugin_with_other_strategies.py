"""``DistCheckpointIO`` beside Lightning strategies that do not save or resume through it.

Stock Lightning 2.6, found with real runs (2 CPU ranks, gloo):

* ``ModelParallelStrategy`` (``save_distributed_checkpoint=True``, its default) writes DCP directories itself;
  the plugin is only asked to remove what ``ModelCheckpoint`` rotates away: a silent bypass (``ckpt_path=``
  resumes, from the strategy's own files).
* ``ModelParallelStrategy(save_distributed_checkpoint=False)`` saves through the plugin on rank 0, then stops at
  the second save of ``last.ckpt`` (``IsADirectoryError: The checkpoint path exists and is a directory``), and
  ``ckpt_path=`` to what the plugin wrote fails (``does not point to a valid checkpoint``).
* ``FSDPStrategy`` (the Trainer's default ``state_dict_type="full"``: saves through the plugin, resumes only a
  ``torch.save`` file; ``"sharded"``: saves itself) needs a GPU in Lightning 2.6 (and FSDP1 in this torch): no
  Trainer run here. Its own ``save_checkpoint`` / ``remove_checkpoint`` (the code a Trainer runs) are called
  directly instead.

Now the plugin names the strategy, says what happens and what to use instead, once, as a warning (the calls come
on rank 0 alone: an error there would leave the other ranks in their next collective).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

from lightning_distckpt.lightning import DistCheckpointIO
from script_ranks import run_ranks, script_env

SCRIPT = r'''
import datetime, json, logging, os, sys, torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointModelParallelStrategy

SAID = []


class Said(logging.Handler):
    def emit(self, record):
        SAID.append(record.getMessage())


logging.getLogger("lightning_distckpt").addHandler(Said(logging.WARNING))


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 12), torch.nn.Linear(12, 4)

    def configure_model(self):
        if self.device_mesh is not None:
            for layer in (self.l1, self.l2, self):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        return self.l2(torch.relu(self.l1(batch))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=4)


T = datetime.timedelta(seconds=30)  # a rank's failure ends the other's wait
STRATEGIES = {
    "mp": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=T),
    "mp_full": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=T,
                                             save_distributed_checkpoint=False),
    "ours": lambda: DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=T),
    "ddp": lambda: DDPStrategy(timeout=T),
}


def fit(strategy, root, steps, resume=None, plugin=True, last=True):
    """What the run ended with (its step or its error) and what the plugin said on this rank."""
    SAID.clear()
    cb = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_last=last)  # save_top_k=1: rotation
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, strategy=STRATEGIES[strategy](),
                         plugins=[DistCheckpointIO()] if plugin else [], callbacks=[cb], enable_progress_bar=False,
                         enable_model_summary=False)
    torch.manual_seed(0)
    try:
        trainer.fit(Model(), ckpt_path=resume)
        end = trainer.global_step
    except Exception as e:
        end = f"{type(e).__name__}: {e}"
    torch.distributed.barrier()
    return {"end": end, "said": list(SAID), "files": sorted(os.listdir(root)) if os.path.isdir(root) else []}


if __name__ == "__main__":
    out, res = sys.argv[1], {}
    res["mp"] = fit("mp", out + "/mp", 2)
    res["mp_resume"] = fit("mp", out + "/mp", 3, resume=out + "/mp/last.ckpt")
    res["mp_full"] = fit("mp_full", out + "/mp_full", 2)  # stops at the second save of last.ckpt
    full_ckpt = out + "/mp_full/epoch=0-step=2.ckpt"  # step 1 rotated away
    res["mp_full_resume"] = fit("mp_full", out + "/mp_full_again", 3, resume=full_ckpt, last=False)
    res["ours_resume_full"] = fit("ours", out + "/ours_full", 3, resume=full_ckpt, plugin=False, last=False)
    res["ours_resume_mp"] = fit("ours", out + "/ours_mp", 4, resume=out + "/mp/last.ckpt", plugin=False)
    res["ddp"] = fit("ddp", out + "/ddp", 2)
    with open(f"{out}/result{os.environ['LOCAL_RANK']}.json", "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of a group a failed run may have left broken
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The script's Trainer runs on 2 ranks; each rank's record of them."""
    root = tmp_path_factory.mktemp("plugin_with_other_strategies")
    script = root / "runs.py"
    script.write_text(SCRIPT)
    code, output = run_ranks(str(script), [str(root)], script_env(), 2, timeout=600)
    assert code == 0 and os.path.isfile(root / "result0.json"), output[-8000:]
    return [json.loads((root / f"result{r}.json").read_text()) for r in (0, 1)]


def _said(record, words):
    return [m for m in record["said"] if words in m]


def test_model_parallel_strategy_saving_itself_is_said_once(runs):
    """Stock ModelParallelStrategy (DCP, the default) never calls the plugin to save: its checkpoints are DCP
    directories, and the plugin only removes the rotated one. Before: silent. Now rank 0 says (once, at the
    first rotation) that the strategy saves itself and names DistCheckpointModelParallelStrategy; the run and
    its resume work as stock does, and our strategy resumes the DCP checkpoint too."""
    rank0, rank1 = runs
    assert rank0["mp"]["end"] == 2 and rank0["mp"]["files"] == ["epoch=0-step=2.ckpt", "last.ckpt"]
    said = _said(rank0["mp"], "ModelParallelStrategy (save_distributed_checkpoint=True)")
    assert len(said) == 1, rank0["mp"]["said"]
    assert "writes its checkpoints itself" in said[0] and "DistCheckpointModelParallelStrategy" in said[0]
    assert rank1["mp"]["said"] == []  # Lightning removes on global rank 0 only
    assert rank0["mp_resume"]["end"] == 3 and len(_said(rank0["mp_resume"], "itself")) == 1
    assert rank0["ours_resume_mp"]["end"] == 4 and rank0["ours_resume_mp"]["said"] == []


def test_model_parallel_full_state_dict_save_says_it_cannot_resume(runs):
    """Stock ModelParallelStrategy(save_distributed_checkpoint=False) saves through the plugin, stops at the second
    save of last.ckpt (IsADirectoryError) and cannot resume what the plugin wrote ('does not point to a valid
    checkpoint'). Now the first save says so, before either failure, and names DistCheckpointModelParallelStrategy,
    which does resume that checkpoint."""
    rank0, _ = runs
    run = rank0["mp_full"]
    assert run["end"].startswith("IsADirectoryError: The checkpoint path exists and is a directory"), run["end"]
    said = _said(run, "ModelParallelStrategy(save_distributed_checkpoint=False)")
    assert len(said) == 1, run["said"]  # once, not at every save
    assert "cannot read this checkpoint" in said[0] and "IsADirectoryError" in said[0]
    assert "use DistCheckpointModelParallelStrategy" in said[0]
    assert "does not point to a valid checkpoint" in rank0["mp_full_resume"]["end"]
    assert rank0["ours_resume_full"]["end"] == 3


def test_ddp_with_the_plugin_says_nothing(runs):
    """The plugin's own case (stock DDP saving through it, rotating its checkpoints) stays quiet."""
    for rank in runs:
        assert rank["ddp"]["end"] == 2 and rank["ddp"]["said"] == [], rank["ddp"]


def test_fsdp_full_state_dict_save_through_the_plugin_says_it_cannot_resume(tmp_path, caplog):
    """FSDPStrategy(state_dict_type='full') (the Trainer's default; Fabric's is 'sharded'): its save_checkpoint
    (what a Trainer runs on each save; FSDP needs a GPU here) hands the checkpoint to the plugin on rank 0, and its
    load_checkpoint reads only a torch.save file or its own sharded directory. Before: silent. Now the save is
    written and the plugin says, once, that FSDPStrategy cannot resume it, what loads it, and what to use for FSDP."""
    strategy = FSDPStrategy(checkpoint_io=DistCheckpointIO())  # state_dict_type="full"
    with caplog.at_level(logging.WARNING, logger="lightning_distckpt"):
        for step in (1, 2):
            strategy.save_checkpoint({"state_dict": {"w": torch.full((3,), float(step))}}, str(tmp_path / f"{step}"))
    said = [r.getMessage() for r in caplog.records if "FSDPStrategy(state_dict_type='full')" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "cannot read this checkpoint" in said[0] and "DistCheckpointModelParallelStrategy (FSDP2" in said[0]
    assert "drop the plugin and keep FSDPStrategy's own sharded checkpoints" in said[0]
    loaded = DistCheckpointIO().load_checkpoint(str(tmp_path / "2"))
    assert torch.equal(loaded["state_dict"]["w"], torch.full((3,), 2.0))  # the save itself is good


def test_fsdp_sharded_saving_itself_is_said_at_its_first_rotation(tmp_path, caplog):
    """FSDPStrategy(state_dict_type='sharded') writes DCP itself and never calls the plugin to save;
    ModelCheckpoint's rotation reaches the plugin through Strategy.remove_checkpoint. Before: silent. Now the
    plugin says FSDPStrategy saves itself and what to use; the removal is done as before."""
    strategy = FSDPStrategy(state_dict_type="sharded", checkpoint_io=DistCheckpointIO())
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with caplog.at_level(logging.WARNING, logger="lightning_distckpt"):
        strategy.remove_checkpoint(str(tmp_path / "a"))
        strategy.remove_checkpoint(str(tmp_path / "b"))
    said = [r.getMessage() for r in caplog.records if "FSDPStrategy (state_dict_type='sharded')" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "writes its checkpoints itself" in said[0] and "DistCheckpointModelParallelStrategy (FSDP2" in said[0]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
