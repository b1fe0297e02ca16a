"""Staging directories are never taken for checkpoints by Lightning's own folder scans: the SLURM
requeue resume (``ckpt_path="hpc"``: every name holding ``hpc_ckpt_``, its non-digits stripped),
``ckpt_path="last"`` (``last*.ckpt``) and the next HPC save's number (names holding ``ckpt_``).
Staging directories are made by the naming function a save uses, as a save killed before its commit
leaves them; older-form leftovers are still recognised and recovered."""

from __future__ import annotations

import os

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage.commit import recover_interrupted_commit
from lightning_distckpt.storage.staging import find_leftovers, is_staging_dir, new_staging_dir, target_of
from lightning_helpers import TPMLP, quiet_trainer


def leftover(target: str) -> str:
    """What a save to ``target`` killed before its commit leaves beside it."""
    staging = new_staging_dir(target)
    os.makedirs(os.path.join(staging, "data"))
    return staging


def test_requeue_resume_skips_staging_directories(tmp_path):
    root = str(tmp_path)
    trainer = quiet_trainer(max_steps=2, plugins=[DistCheckpointIO()], default_root_dir=root,
                            enable_checkpointing=False)
    trainer.fit(TPMLP(total_steps=2))
    trainer.save_checkpoint(os.path.join(root, "hpc_ckpt_3.ckpt"))  # what the SLURM signal handler saves
    stranded = [leftover(os.path.join(root, f"hpc_ckpt_{n}.ckpt")) for n in (3, 4)]
    assert all("ckpt_" not in os.path.basename(s) for s in stranded)  # nothing for Lightning's name scans
    resumed = quiet_trainer(max_steps=3, plugins=[DistCheckpointIO()], default_root_dir=root,
                            enable_checkpointing=False)
    model = TPMLP(total_steps=3)
    resumed.fit(model, ckpt_path="hpc")
    assert resumed.ckpt_path == os.path.join(root, "hpc_ckpt_3.ckpt")
    assert sorted(model.losses) == [2]  # steps 0, 1 restored; one more step
    # The next HPC save is numbered from the committed checkpoints alone.
    assert resumed._checkpoint_connector.hpc_save_path(root) == os.path.join(root, "hpc_ckpt_4.ckpt")


def test_last_resume_skips_a_staging_directory_of_last(tmp_path):
    ckdir = str(tmp_path)
    trainer = quiet_trainer(max_steps=2, plugins=[DistCheckpointIO()],
                            callbacks=[ModelCheckpoint(dirpath=ckdir, save_last=True, every_n_train_steps=1)])
    trainer.fit(TPMLP(total_steps=2))
    leftover(os.path.join(ckdir, "last.ckpt"))
    leftover(os.path.join(ckdir, "last-v1.ckpt"))
    resumed = quiet_trainer(max_steps=3, plugins=[DistCheckpointIO()],
                            callbacks=[ModelCheckpoint(dirpath=ckdir, save_last=True)])
    resumed.fit(TPMLP(total_steps=3), ckpt_path="last")
    assert resumed.ckpt_path == os.path.join(ckdir, "last.ckpt")


def test_new_and_older_staging_names_are_both_found_and_recovered(tmp_path):
    """A committed copy stranded under either form (a commit killed before its rename) is found by
    ``clean``'s scan and renamed into place; the new form spells no name out."""
    for name, older in (("hpc_ckpt_7.ckpt", False), ("last.ckpt", True)):
        target = str(tmp_path / name)
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(3.0))}, target)
        staging = (os.path.join(str(tmp_path), f".{name}.distckpt-staging-0123456789ab") if older
                   else new_staging_dir(target))
        os.rename(target, staging)
        assert is_staging_dir(staging) and target_of(staging) == target
        assert (name in os.path.basename(staging)) is older
        found = find_leftovers(str(tmp_path), name)
        assert [lo.path for lo in found] == [staging] and found[0].recoverable
        assert recover_interrupted_commit(target).placed == staging
        assert ldc.load_plain_tensors(target)["w"].tolist() == [0.0, 1.0, 2.0]

