"""What Lightning's resume and restore tests (``models/test_restore.py``, the checkpoint connector's,
the callbacks' that save and resume; run against us by ``tools/peer_suites/lightning`` with
``SUITE=resume``) expect of a resume, asserted here stock, with ``DistCheckpointIO`` and with
``DistCheckpointStrategy`` side by side (one process, CPU):

* a ``ckpt_path`` with nothing at it is a ``FileNotFoundError`` in Lightning's words, the path as
  given first (``Checkpoint file not found: <path>``), as ``TorchCheckpointIO`` says it; ours follow;
* a checkpoint that exists resumes as before (the words are added to a missing path's error only);
* a callback replacing ``checkpoint["state_dict"]`` in ``on_save_checkpoint`` (Lightning's
  ``WeightAveraging`` / ``EMAWeightAveraging`` puts the average there, ``ModelPruning`` the pruned
  weights) has its dict saved, as stock saves it: ``DistCheckpointStrategy`` saved the module's
  ``sharded_state_dict()`` instead, so an EMA resume restored the live weights as the average
  (Lightning's ``test_ema_resume`` and ``test_permanent_when_model_is_saved_multiple_times``).
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from lightning.pytorch import callbacks as pl_callbacks
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_distckpt.core.errors import CheckpointNotFoundError
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_helpers import quiet_trainer

HOWS = ["stock", "plugin", "strategy"]


def trainer_args(how: str) -> dict:
    if how == "plugin":
        return {"plugins": [DistCheckpointIO()]}
    return {"strategy": DistCheckpointStrategy()} if how == "strategy" else {}


@pytest.mark.parametrize("how", HOWS)
def test_a_missing_ckpt_path_says_lightnings_words_with_the_path_as_given(tmp_path, monkeypatch,
                                                                         isolated_process_group, how):
    monkeypatch.chdir(tmp_path)  # a relative path, shown as the user wrote it, not made absolute
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, enable_checkpointing=False, **trainer_args(how))
    with pytest.raises(FileNotFoundError, match=r"^Checkpoint file not found: no such\.ckpt") as err:
        trainer.fit(BoringModel(), ckpt_path="no such.ckpt")
    if how != "stock":  # ours: still our error (where a committed checkpoint is), Megatron-Core's words too
        assert isinstance(err.value, CheckpointNotFoundError)
        assert "does not exist" in str(err.value)


def test_the_plugin_says_lightnings_words_when_called_directly(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"^Checkpoint file not found: .*gone\.ckpt; checkpoint "):
        DistCheckpointIO().load_checkpoint(tmp_path / "gone.ckpt")


@pytest.mark.parametrize("how", HOWS)
def test_an_existing_checkpoint_still_resumes(tmp_path, isolated_process_group, how):
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False, **trainer_args(how))
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    resumed = quiet_trainer(max_steps=3, limit_val_batches=0, enable_checkpointing=False, **trainer_args(how))
    resumed.fit(BoringModel(), ckpt_path=tmp_path / "two.ckpt")
    assert resumed.global_step == 3


# Lightning's EMA callback came with 2.6; at the declared floor (2.5) the case it checks does not exist.
EMAWeightAveraging = getattr(pl_callbacks, "EMAWeightAveraging", object)


class RecordingEMA(EMAWeightAveraging):  # type: ignore[misc, valid-type]
    """Lightning's EMA callback, keeping a copy of the ``state_dict`` it hands over for each save."""

    def __init__(self) -> None:
        super().__init__(decay=0.5)
        self.handed: Dict[str, torch.Tensor] = {}

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self.handed = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}


@pytest.mark.skipif(EMAWeightAveraging is object, reason="Lightning before 2.6 has no EMAWeightAveraging")
@pytest.mark.parametrize("how", HOWS)
def test_a_state_dict_a_callback_put_in_the_checkpoint_is_the_one_saved(tmp_path, isolated_process_group, how):
    ema = RecordingEMA()
    mc = ModelCheckpoint(dirpath=tmp_path, filename="step3", every_n_train_steps=3, save_top_k=1)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[ema, mc], **trainer_args(how))
    trainer.fit(BoringModel())
    saved = DistCheckpointIO().load_checkpoint(tmp_path / "step3.ckpt")
    assert set(saved["state_dict"]) == set(ema.handed)
    assert not torch.equal(ema.handed["layer.weight"], saved["current_model_state"]["layer.weight"])  # the average
    for key, value in ema.handed.items():
        assert torch.equal(saved["state_dict"][key], value), key
