"""A run moved from a stock strategy to ours rotates past the stock run's checkpoints.

Lightning's ``ModelParallelStrategy`` writes DCP directories (``.metadata``, ``__<rank>_<n>.distcp``,
``meta.pt``). Resumed under ``DistCheckpointModelParallelStrategy``, the first ``ModelCheckpoint``
rotation removed such a directory, and a save of ``last.ckpt`` replaced the stock one: both were refused
("not a checkpoint of ours nor a torch.save file", "not a committed lightning_distckpt checkpoint") and
the fit stopped. Now a stock DCP directory is removed and replaced as the stock strategy would; one with
anything else in it (a foreign file, a link, a subdirectory, a FIFO) is still refused and left as it is.
A stock DDP run's ``.ckpt`` files rotate under ``DistCheckpointStrategy`` and ``DistCheckpointIO`` too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ArgumentError, CheckpointingError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.lightning.last_link import link_last
from lightning_distckpt.storage import local_store
from script_ranks import run_ranks, script_env

SCRIPT = r'''
import datetime, json, os, sys, torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,
                                          DistCheckpointStrategy)


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


def fit(strategy, root, max_steps, resume=None, last=True):
    top1 = ModelCheckpoint(dirpath=root + "/top1", every_n_train_steps=1, save_last=last)  # save_top_k=1
    keep = ModelCheckpoint(dirpath=root + "/keep", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, strategy=strategy,
                         callbacks=[top1, keep], enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)
    trainer.fit(Model(), ckpt_path=resume)
    return trainer.global_step


TIMEOUT = datetime.timedelta(seconds=30)  # the group's (the first run makes it): a rank's failure ends the other's wait


def mp():
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)


def ours_mp():
    return DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)


if __name__ == "__main__":
    out, res = sys.argv[1], {}
    runs = {"mp": (mp, ours_mp), "ddp": (lambda: DDPStrategy(timeout=TIMEOUT), lambda: DistCheckpointStrategy()),
            "ddp_io": (lambda: DDPStrategy(timeout=TIMEOUT),
                       lambda: DDPStrategy(checkpoint_io=DistCheckpointIO(), timeout=TIMEOUT))}
    rank0 = int(os.environ["LOCAL_RANK"]) == 0
    for name, (stock, ours) in runs.items():
        root = f"{out}/{name}"
        fit(stock(), root, 2, last=True)
        if rank0:  # what the stock run left, for the test to compare
            res[name + "_stock"] = {d: sorted(os.listdir(f"{root}/{d}")) for d in ("top1", "keep")}
        torch.distributed.barrier()
        try:
            res[name] = fit(ours(), root, 4, resume=f"{root}/top1/last.ckpt", last=True)
        except Exception as e:  # the other rank fails too (within the group's timeout): stop here
            res[name] = f"{type(e).__name__}: {e}"
            break
    if rank0:
        with open(out + "/result.json", "w") as f:
            json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of a group a failed run may have left broken
'''


def digest(path):
    """Each file under ``path`` (a directory or a file) by its name, with its SHA-256."""
    if os.path.isfile(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()
    return {n: hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest() for n in sorted(os.listdir(path))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each stock run (2 ranks, 2 steps) then resumed under ours from its ``last.ckpt`` to step 4."""
    root = tmp_path_factory.mktemp("stock_rotation")
    script = root / "runs.py"
    script.write_text(SCRIPT)
    code, output = run_ranks(str(script), [str(root)], script_env(), 2, timeout=600)
    assert code == 0 and os.path.isfile(root / "result.json"), output[-8000:]
    with open(root / "result.json") as f:
        return str(root), json.load(f)


def is_ours(path):
    return os.path.isfile(os.path.join(path, "COMMITTED")) and not os.path.lexists(os.path.join(path, ".metadata"))


def test_model_parallel_run_rotates_past_stock_dcp_checkpoints(runs):
    root, res = runs
    assert res.get("mp_stock") == {"top1": ["epoch=0-step=2.ckpt", "last.ckpt"], "keep": ["epoch=0-step=2.ckpt"]}
    assert res["mp"] == 4, res["mp"]  # before: ArgumentError at the first rotation (step 3)
    top1, keep = os.path.join(root, "mp", "top1"), os.path.join(root, "mp", "keep")
    assert sorted(os.listdir(top1)) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # the stock ones removed, no leftover
    assert is_ours(os.path.join(top1, "epoch=0-step=4.ckpt")) and is_ours(os.path.join(top1, "last.ckpt"))
    assert sorted(os.listdir(keep)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    kept = os.path.join(keep, "epoch=0-step=2.ckpt")  # the stock one kept: still DCP, still readable
    assert sorted(os.listdir(kept)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    meta = ldc.load_tensors_metadata(kept)
    assert "state_dict.l1.weight" in meta


@pytest.mark.parametrize("run", ["ddp", "ddp_io"])
def test_ddp_runs_rotate_past_stock_ckpt_files(runs, run):
    root, res = runs
    assert res.get(run + "_stock") == {"top1": ["epoch=0-step=2.ckpt", "last.ckpt"], "keep": ["epoch=0-step=2.ckpt"]}
    assert res.get(run) == 4, res.get(run)  # before: the first save of last.ckpt over the stock file was refused
    top1, keep = os.path.join(root, run, "top1"), os.path.join(root, run, "keep")
    # the stock step-2 file rotated away; the stock last.ckpt (a Lightning checkpoint file) replaced by ours
    assert sorted(os.listdir(top1)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert is_ours(os.path.join(top1, "epoch=0-step=4.ckpt")) and is_ours(os.path.join(top1, "last.ckpt"))
    assert sorted(os.listdir(keep)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert os.path.isfile(os.path.join(keep, "epoch=0-step=2.ckpt"))  # the stock file kept


# ---------------------------------------------------------------- what is refused still

@pytest.fixture
def stock_dir(runs, tmp_path):
    """A copy of the stock run's kept DCP checkpoint (``.metadata``, two ``.distcp``, ``meta.pt``)."""
    path = tmp_path / "epoch=0-step=2.ckpt"
    shutil.copytree(os.path.join(runs[0], "mp", "keep", "epoch=0-step=2.ckpt"), path)
    return str(path)


def _add_foreign_file(p):
    with open(os.path.join(p, "notes.txt"), "w") as f:
        f.write("mine")


def _add_link(p):
    os.symlink("/etc/hostname", os.path.join(p, "__2_0.distcp"))  # a DCP name, but a link


def _add_subdir(p):
    os.mkdir(os.path.join(p, "data"))


def _add_fifo(p):
    os.mkfifo(os.path.join(p, "__3_0.distcp"))


def _garble_metadata(p):
    with open(os.path.join(p, ".metadata"), "wb") as f:
        f.write(b"not a DCP metadata pickle")


def _meta_pt_not_torch(p):
    with open(os.path.join(p, "meta.pt"), "w") as f:
        f.write("a user's text under Lightning's name")


SPOILERS = [_add_foreign_file, _add_link, _add_subdir, _add_fifo, _garble_metadata, _meta_pt_not_torch]


@pytest.mark.parametrize("spoil", SPOILERS, ids=lambda f: f.__name__.lstrip("_"))
def test_a_dcp_looking_directory_with_anything_else_is_refused_and_kept(stock_dir, spoil, tmp_path):
    spoil(stock_dir)
    before = sorted(os.listdir(stock_dir))
    with pytest.raises(ArgumentError, match="not a checkpoint of ours"):
        DistCheckpointIO().remove_checkpoint(stock_dir)
    with pytest.raises(ArgumentError, match="is not a checkpoint"):
        link_last(str(tmp_path / "elsewhere"), stock_dir)
    with pytest.raises(CheckpointingError, match="refusing to replace it"):
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))}, stock_dir)
    assert sorted(os.listdir(stock_dir)) == before
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # nothing renamed aside and left


def test_a_stock_dcp_directory_is_removed_replaced_and_relinked(stock_dir, tmp_path):
    """Removed by ``remove_checkpoint`` (no staging leftover), replaced by a save of ours, and by a link
    (``save_last="link"``); a link to one is removed, never its target."""
    link = tmp_path / "last.ckpt"
    os.symlink(stock_dir, link)
    kept = digest(stock_dir)
    DistCheckpointIO().remove_checkpoint(str(link))
    assert not os.path.lexists(link) and digest(stock_dir) == kept
    copy = str(tmp_path / "copy")
    shutil.copytree(stock_dir, copy)
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))}, copy)
    assert is_ours(copy)
    link_last(copy, stock_dir)  # save_last="link" over a stock last.ckpt directory
    assert os.path.islink(stock_dir) and os.path.realpath(stock_dir) == os.path.realpath(copy)
    assert sorted(os.listdir(tmp_path)) == ["copy", "epoch=0-step=2.ckpt"]  # the stock directory gone, nothing aside


def test_a_plain_dcp_directory_without_meta_pt_is_removed(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=path, no_dist=True)
    assert ".metadata" in os.listdir(path) and "meta.pt" not in os.listdir(path)
    DistCheckpointIO().remove_checkpoint(path)
    assert os.listdir(tmp_path) == []


def test_a_file_put_in_while_it_is_removed_keeps_it(stock_dir):
    """What is removed is what was checked: a stock directory is checked again once renamed aside, and a
    file put into it between the check and the rename (here: before the removal's own steps) keeps it,
    back at its name."""
    _add_foreign_file(stock_dir)
    before = digest(stock_dir)
    with pytest.raises(ArgumentError, match="appeared in it while it was being removed"):
        local_store._remove_dir(stock_dir, stock=True)
    assert digest(stock_dir) == before
    assert os.listdir(os.path.dirname(stock_dir)) == [os.path.basename(stock_dir)]



def test_a_save_replaces_a_lightning_checkpoint_file_but_no_other_torch_file(tmp_path):
    """What TorchCheckpointIO wrote (its pickle holds ``pytorch-lightning_version``) is replaced, at once and
    whole; a torch.save file of anything else at a checkpoint's name stays the user's, refused and untouched."""
    stock = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "pytorch-lightning_version": "2.6.0", "global_step": 2}, stock)
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(stock))
    assert is_ours(str(stock)) and sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # nothing left aside
    mine = tmp_path / "mine.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "note": "pytorch-lightning is mentioned, not the key"}, mine)
    before = digest(str(mine))
    with pytest.raises(CheckpointingError, match="exists and is not a directory"):
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(mine))
    assert digest(str(mine)) == before
