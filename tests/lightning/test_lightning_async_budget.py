"""The YAML key ``max_staging_bytes`` reaches the AsyncSaver of a Trainer's DistCheckpointStrategy:
its background saves go in waves under the budget, the staging pool never holds more than the
budget's share left after the writer's (``WRITER_BYTES``), and the checkpoint of the last step
equals the trained module."""

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointStrategy
from lightning_distckpt.saving.async_staging import WRITER_BYTES
from lightning_distckpt.saving.stats import format_bytes
from lightning_helpers import TPMLP

SHARE = 600  # bytes for the snapshot: the module's 512-byte fc1.weight and its Adam moments do not fit together
BUDGET = WRITER_BYTES + SHARE


class RecordWaves(Callback):
    """Each background save's number of write calls, seen at the next step's start."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.waves = []

    def on_train_batch_start(self, *args):
        pending = self.strategy.checkpoint_io.pending
        if pending is not None:
            self.waves.append(pending.waves)


def test_yaml_budget_reaches_the_saver(tmp_path, isolated_process_group, caplog):
    config = tmp_path / "checkpoint.yaml"
    config.write_text(f"async_save: true\nmax_staging_bytes: {BUDGET}\nstorage:\n  pack_max_bytes: 0\n")
    strategy = DistCheckpointStrategy(checkpoint=str(config))
    waves = RecordWaves(strategy)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=6, callbacks=[ckpt, waves],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = TPMLP(total_steps=6)
    with caplog.at_level("INFO", logger="lightning_distckpt"):
        trainer.fit(model)
    saver = strategy.checkpoint_io._saver
    assert saver is not None and saver.max_staging_bytes == BUDGET and saver.writer_bytes == WRITER_BYTES
    assert 0 < saver.peak_staging_bytes <= SHARE
    assert waves.waves and all(w == 2 for w in waves.waves)  # in place before returning, then the background
    assert any(f"waves under max_staging_bytes={format_bytes(BUDGET)}" in m for m in caplog.messages), caplog.messages
    saved = ldc.lightning.DistCheckpointIO().load_checkpoint(tmp_path / "ck" / "step=6.ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(saved["state_dict"][k], v), k
