"""``fit(ckpt_path="last")`` with tiers when the TierCheckpoint's folder is ``s3://`` (moto's server on
loopback, this folder's fixtures): the marker is an object in that folder, and "last" asks the tiers: the
newest local step when the local tier holds it, the durable ``last.ckpt`` on S3 when it does not.
One process (DistCheckpointStrategy on one CPU device: one node, no partner copies)."""

import shutil

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from lightning_distckpt.lightning import DistCheckpointStrategy  # noqa: E402
from lightning_distckpt.lightning.tiers import MARKER_NAME, TierCheckpoint  # noqa: E402
from lightning_distckpt.tiers import TierOptions  # noqa: E402
from s3_helpers import keys  # noqa: E402


class _FirstStep(Callback):
    def on_train_start(self, trainer, module):
        self.step = trainer.global_step


def _fit(dirpath, local_dir, steps, ckpt_path=None):
    options = TierOptions(local_dir=local_dir, local_every_n_steps=2, durable_every_n_steps=4, replicas=0)
    first = _FirstStep()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DistCheckpointStrategy(), max_steps=steps,
                      callbacks=[TierCheckpoint(options, dirpath=dirpath), first], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer, first.step


def test_last_asks_the_tiers_with_an_s3_folder(bucket, endpoint, tmp_path):
    dirpath, local = f"s3://{bucket}/run", str(tmp_path / "local")
    _fit(dirpath, local, 7)  # local saves at 2, 4, 6; durable last.ckpt at 4
    assert f"run/{MARKER_NAME}" in keys(endpoint, bucket)
    trainer, first = _fit(dirpath, local, 7, ckpt_path="last")
    assert trainer.ckpt_path == f"{dirpath}/{MARKER_NAME}" and first == 6  # the local step, newer than durable
    shutil.rmtree(local)  # the local tier lost: the durable last.ckpt of step 4 on S3, through the tiers
    trainer, first = _fit(dirpath, local, 7, ckpt_path="last")
    assert trainer.ckpt_path == f"{dirpath}/{MARKER_NAME}" and first == 4
