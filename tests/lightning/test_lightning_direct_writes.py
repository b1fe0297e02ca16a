"""A Lightning fit saving in the zarr layout, synchronously and in the background: the large
parameters' and moments' chunk files are written with O_DIRECT (storage/direct_write.py), the
checkpoints hold exactly the trained state, and a resume from one continues bit-exactly."""

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
from lightning_distckpt.storage import direct_write
from lightning_helpers import TPMLP

BIG = dict(d_in=512, d_hidden=1024, d_out=4, total_steps=4)  # fc1: 2 MiB, its moments too


def _fit(tmp_path, name, async_save, steps, ckpt_path=None):
    strategy = DistCheckpointStrategy(checkpoint={"async_save": async_save, "storage": {"layout": "zarr"}})
    cb = ModelCheckpoint(dirpath=tmp_path / name, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    model = TPMLP(**BIG)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, callbacks=[cb],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("async_save", [False, True])
def test_fit_in_zarr_layout_saves_exactly_and_resumes(tmp_path, isolated_process_group, async_save):
    if not direct_write.supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")  # CI's /tmp takes it (ext4, xfs)
    model, trainer = _fit(tmp_path, "a", async_save, 4)
    path = tmp_path / "a" / "step=4.ckpt"
    chunk_files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if "/c/" in os.path.join(d, f)]
    assert any(os.path.getsize(f) >= direct_write.MIN_DIRECT_BYTES for f in chunk_files)  # the zarr layout's chunks
    stored = DistCheckpointIO().load_checkpoint(str(path))
    for name, value in model.state_dict().items():
        assert torch.equal(stored["state_dict"][name], value), name
    opt = trainer.optimizers[0]
    for j, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(stored["optimizer_states"][0]["state"][j][k]).to(v.dtype), v), k
    # Resume from step 2's checkpoint and train to step 4: the same state as the uninterrupted fit
    resumed, _ = _fit(tmp_path, "b", async_save, 4, ckpt_path=str(tmp_path / "a" / "step=2.ckpt"))
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
