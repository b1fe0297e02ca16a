"""Lightning's SLURM auto-requeue with background saves: on SLURM's signal Lightning saves
``hpc_ckpt_<N>.ckpt`` and requeues the job at once, which then ends. With ``async_save`` that save was
still being written when the job ended, leaving the requeued job a placeholder to resume from; it is
now written before ``save_checkpoint`` returns, while other saves stay in the background. Lightning's
own handler runs here (``scontrol`` is absent: its requeue call fails and is only logged)."""

from __future__ import annotations

import signal

import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_distckpt.storage.layout import is_committed
from lightning_helpers import quiet_trainer

ASYNC = {"async_save": True}


def _trainer(how: str, root, **kwargs):
    setup = {"plugins": [DistCheckpointIO(ASYNC)]} if how == "plugin" else \
        {"strategy": DistCheckpointStrategy(checkpoint=ASYNC)}
    return quiet_trainer(default_root_dir=root, limit_val_batches=0, enable_checkpointing=False, **setup, **kwargs)


class Requeue(Callback):
    """At step 2, in the middle of the fit: an ordinary save, then what SLURM's signal runs."""

    def __init__(self, root) -> None:
        self.root, self.seen = root, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 2:
            return
        io = trainer.strategy.checkpoint_io
        trainer.save_checkpoint(self.root / "ordinary.ckpt")
        self.seen["ordinary_in_background"] = io._pending is not None
        io.wait()
        trainer._signal_connector._slurm_sigusr_handler_fn(signal.SIGUSR1, None)
        self.seen["requeue_committed"] = is_committed(str(self.root / "hpc_ckpt_1.ckpt"))
        self.seen["requeue_in_background"] = io._pending is not None


@pytest.mark.parametrize("how", ["plugin", "strategy"])
def test_the_requeue_checkpoint_is_written_before_the_job_is_requeued(tmp_path, monkeypatch, isolated_process_group,
                                                                       how):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", str(tmp_path / "no-scontrol"))  # the requeue command is not found: logged
    requeue = Requeue(tmp_path)
    _trainer(how, tmp_path, max_steps=3, callbacks=[requeue]).fit(BoringModel())
    # an ordinary save still writes in the background; the requeue checkpoint is whole when the requeue begins
    assert requeue.seen == {"ordinary_in_background": True, "requeue_committed": True, "requeue_in_background": False}

    resumed = _trainer(how, tmp_path, max_steps=4)
    resumed.fit(BoringModel(), ckpt_path="hpc")  # what the requeued job resumes from
    assert resumed.global_step == 4
