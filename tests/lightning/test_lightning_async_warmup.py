"""An async-saving fit under DistCheckpointStrategy prepares its saver before the first save: the
staging pool is allocated (and its pages faulted in on a thread of its own) once the optimizer
holds state, and the first save copies into that very pool instead of allocating one; the
checkpoints are still exact."""

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointStrategy
from lightning_distckpt.saving.async_staging import StagingPool, plan_staging
from lightning_distckpt.storage.base import ShardWrite
from lightning_helpers import TPMLP


class PoolBeforeFirstSave(Callback):
    """The saver's staging pool as it is at the end of the first step (before any save)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.pool = None
        self.pending_before = None

    def on_train_batch_end(self, *args):  # checkpoint callbacks run after this one
        saver = self.strategy.checkpoint_io._saver
        if self.pool is None and saver is not None:
            self.pool = saver._pool._pool
            self.pending_before = self.strategy.checkpoint_io.pending


def test_first_async_save_uses_the_pool_reserved_ahead(tmp_path, isolated_process_group):
    strategy = DistCheckpointStrategy(checkpoint={"async_save": True})
    seen = PoolBeforeFirstSave(strategy)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=6, callbacks=[ckpt, seen],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = TPMLP(total_steps=6)
    trainer.fit(model)
    saver = strategy.checkpoint_io._saver
    assert seen.pool is not None and seen.pending_before is None  # reserved before the first save
    assert saver._pool._pool is seen.pool  # both saves staged into it: never reallocated
    assert saver.peak_staging_bytes == seen.pool.numel()
    for step in (3, 6):
        assert (tmp_path / "ck" / f"step={step}.ckpt").is_dir()
    saved = ldc.lightning.DistCheckpointIO().load_checkpoint(tmp_path / "ck" / "step=6.ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(saved["state_dict"][k], v), k


def test_a_sync_fit_reserves_nothing(tmp_path, isolated_process_group):
    strategy = DistCheckpointStrategy()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, callbacks=[ckpt],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TPMLP(total_steps=2))
    assert strategy.checkpoint_io._saver is None


def test_a_reserved_pool_is_kept_when_the_plan_fits_and_replaced_when_not():
    shards = [ShardWrite("w", 0, torch.randn(256)), ShardWrite("b", 0, torch.randn(100))]  # 1024 + 400 bytes
    plan = plan_staging(shards, None)
    pool = StagingPool(pin_memory=False)
    pool.reserve(plan.pool_bytes + 512, pin=False)
    reserved = pool._pool
    pool.prepare(plan)  # waits for the touch, keeps the pool
    staged = pool.stage(plan.staged)
    assert pool._pool is reserved
    for w, s in zip(shards, staged):
        assert torch.equal(s.data, w.data)
    small = StagingPool(pin_memory=False)
    small.reserve(plan.pool_bytes // 2, pin=False)  # too small for the save: replaced
    small.prepare(plan)
    assert small.nbytes == plan.pool_bytes
