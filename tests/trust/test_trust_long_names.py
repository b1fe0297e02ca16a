"""Checkpoint names of 225-255 bytes: legal file names (``torch.save`` and PyTorch DCP save there), too long for
a staging name that spells them beside the room a suffix (``.old<N>``, ``.removed``) needs.

Before, a save to such a name failed with a raw ``OSError: [Errno 36] File name too long`` from deep inside
(from 233 bytes on; a removal or a replacement without ``RENAME_EXCHANGE`` from 225 on): ``ldc.save`` on one
rank or two, ``ModelCheckpoint(filename=...)`` under ``DistCheckpointIO`` and ``trainer.save_checkpoint``. Such
a name now gets a staging name holding a hash of it (``.distckpt-staging-sha-<hash>-<id>``), the name itself
recorded in every rank's owner note; ``clean`` reads it there, or finds the target beside it by its hash, and
keeps a committed copy whose name is known nowhere (notes removed, target missing) for the next save or load
of its checkpoint, which renames it into place. Real saves, loads, kills (SIGKILL at a commit step) and the
real ``clean``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from dist_utils import run_distributed

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage import staging
from lightning_distckpt.storage.commit import KILL_AT_ENV
from lightning_distckpt.storage.layout import is_committed
from lightning_distckpt.storage.swap import NO_EXCHANGE_ENV

NAME_MAX = 255
N = 64
SAVER = """
import sys, torch, lightning_distckpt as ldc
value = float(sys.argv[2])
ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((%d,), value)), "step": int(value)}, sys.argv[1])
""" % N


def long_name(nbytes: int) -> str:
    return "c" * (nbytes - 7) + "-step=1"


def save(target, value: float) -> str:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((N,), value)), "step": int(value)}, str(target))
    assert is_committed(str(target))
    return str(target)


def value_at(target) -> float:
    w = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(N))}, str(target))["w"]
    assert torch.equal(w, torch.full((N,), w[0].item()))
    assert ldc.load_common_state_dict(str(target))["step"] == int(w[0].item())
    return w[0].item()


def killed_save(target, value: float, step: str, exchange: bool = True) -> None:
    """A real save in a subprocess, SIGKILLed at the commit step ``step``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", KILL_AT_ENV: step, **({} if exchange else {NO_EXCHANGE_ENV: "1"})}
    done = subprocess.run([sys.executable, "-c", SAVER, str(target), str(value)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]


def staging_names(parent) -> list:
    return sorted(n for n in os.listdir(parent) if staging.is_staging_dir(n))


@pytest.mark.parametrize("nbytes", [225, 233, 240, 255])
def test_staging_names_of_long_targets_fit_and_name_them(tmp_path, nbytes):
    """A staging name, its ``.old7`` and a removal's aside fit in 255 bytes, are recognised as ours and name their
    target: by hash (no note needed), by the owner note's record, or by the target found beside them."""
    target = str(tmp_path / long_name(nbytes))
    made = staging.new_staging_dir(target)
    for name in (made, made + ".old7", staging.removal_aside(target)):
        assert len(os.fsencode(os.path.basename(name))) <= NAME_MAX, (nbytes, name)
        assert staging.is_staging_dir(name) and staging.names_target(name, os.path.basename(target))
        assert not staging.names_target(name, long_name(nbytes - 1)) and not staging.names_target(name, "x")
        assert staging.target_of(name) is None  # recorded nowhere, nothing beside it
    assert staging.is_removal_aside(staging.removal_aside(target)) and not staging.is_removal_aside(made)
    staging.write_owner_note(made, 0, target)
    assert staging.target_of(made) == target
    os.mkdir(target)
    assert staging.target_of(made + ".old") == target


@pytest.mark.parametrize("nbytes", [225, 255])
def test_one_process_saves_replaces_loads_and_removes(tmp_path, nbytes, monkeypatch):
    """Saved, saved again (with ``RENAME_EXCHANGE``, then without: the previous checkpoint goes aside under the
    staging name plus ``.old``), loaded, then removed by ``DistCheckpointIO``: nothing is left beside it."""
    target = save(tmp_path / long_name(nbytes), 1.0)
    save(target, 2.0)
    assert value_at(target) == 2.0
    monkeypatch.setenv(NO_EXCHANGE_ENV, "1")
    save(target, 3.0)
    assert value_at(target) == 3.0 and os.listdir(tmp_path) == [long_name(nbytes)]
    DistCheckpointIO().remove_checkpoint(target)
    assert os.listdir(tmp_path) == []


def _save_and_load_on_two_ranks(rank: int, world: int, target: str) -> list:
    w = ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0) + 4 * rank, (0, rank, world))
    ldc.save({"w": w, "step": 7}, target)
    back = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))}, target)
    return back["w"].tolist()


def test_two_ranks_save_and_load(tmp_path):
    """Two ranks (gloo) save a tensor sharded across them to a 255-byte name and load their shards back."""
    target = str(tmp_path / long_name(NAME_MAX))
    assert run_distributed(_save_and_load_on_two_ranks, 2, target, timeout_s=120) == [[0., 1., 2., 3.],
                                                                                      [4., 5., 6., 7.]]
    assert os.listdir(tmp_path) == [long_name(NAME_MAX)] and ldc.load_common_state_dict(target)["step"] == 7


def test_killed_before_the_marker_clean_names_and_removes_it(tmp_path):
    """A save killed before its marker: uncommitted, its notes recording the target. ``clean`` names that target
    and removes the staging directory."""
    target = str(tmp_path / long_name(240))
    killed_save(target, 1.0, "after_metadata")
    (left,) = staging.find_leftovers(str(tmp_path))
    assert left.target == target and not left.committed and left.verdict(0) == "remove"
    (done,) = clean(str(tmp_path), 0, dry_run=False)
    assert done.action == "removed" and os.listdir(tmp_path) == []


def test_killed_with_its_notes_clean_recovers_it_by_name(tmp_path):
    """A first save killed right after its marker, before removing its notes: ``clean`` reads the name in the
    notes and renames the committed copy into place."""
    target = str(tmp_path / long_name(NAME_MAX))
    killed_save(target, 2.0, "after_marker")
    (done,) = clean(str(tmp_path), 0, dry_run=False)
    assert done.action == "recovered" and done.leftover.target == target, done
    assert os.listdir(tmp_path) == [long_name(NAME_MAX)] and value_at(target) == 2.0


def test_killed_after_its_notes_went_clean_keeps_it_and_a_load_recovers_it(tmp_path):
    """A first save killed after removing its notes, before its rename: its name is recorded nowhere and nothing
    is beside it. ``clean`` (dry run, then for real) keeps the committed copy, saying why; a load of the
    checkpoint (which knows the name) renames it into place."""
    target = str(tmp_path / long_name(230))
    killed_save(target, 2.0, "after_notes_removed")
    for dry_run in (True, False):
        (done,) = clean(str(tmp_path), 0, dry_run=dry_run)
        assert done.action == ("would recover" if dry_run else "kept") and done.leftover.target is None, done
        assert "was not recorded" in done.reason and "next save or load" in done.reason
    assert value_at(target) == 2.0 and os.listdir(tmp_path) == [long_name(230)]


def test_replacement_killed_between_its_renames_is_recovered(tmp_path):
    """Without ``RENAME_EXCHANGE``, a second save killed between moving the previous checkpoint aside (``.old``)
    and renaming its own into place: ``clean`` keeps both copies (the name is nowhere), and the next save of
    that name recovers the newer, removes the older and commits."""
    target = save(tmp_path / long_name(250), 1.0)
    killed_save(target, 2.0, "after_first_rename", exchange=False)
    assert not os.path.lexists(target) and len(staging_names(tmp_path)) == 2
    assert [a.action for a in clean(str(tmp_path), 0, dry_run=False)] == ["kept", "kept"]
    assert value_at(target) == 2.0 and staging_names(tmp_path) == []
    save(target, 3.0)
    assert value_at(target) == 3.0 and os.listdir(tmp_path) == [long_name(250)]


def test_lightning_model_checkpoint_and_save_checkpoint(tmp_path):
    """A real Trainer fit under ``DistCheckpointIO`` with ``ModelCheckpoint(save_top_k=1)`` naming 255-byte
    checkpoints (every rotation removes the previous one), then ``trainer.save_checkpoint`` to a 250-byte path,
    then a fit resumed from it. Before: ENAMETOOLONG at the first save."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_helpers import quiet_trainer

    stem = "c" * (NAME_MAX - len("-step=3.ckpt"))
    ckpts = tmp_path / "ckpts"
    top1 = ModelCheckpoint(dirpath=str(ckpts), filename=stem + "-{step}", every_n_train_steps=1, save_top_k=1)
    trainer = quiet_trainer(max_steps=3, callbacks=[top1], plugins=[DistCheckpointIO()], limit_val_batches=0)
    trainer.fit(BoringModel())
    (left,) = os.listdir(ckpts)
    assert left == stem + "-step=3.ckpt" and len(left) == NAME_MAX and is_committed(str(ckpts / left))
    manual = str(tmp_path / ("m" * 245 + ".ckpt"))
    trainer.save_checkpoint(manual)
    assert is_committed(manual) and staging_names(tmp_path) == []
    resumed = quiet_trainer(max_steps=4, plugins=[DistCheckpointIO()], limit_val_batches=0,
                            enable_checkpointing=False)
    resumed.fit(BoringModel(), ckpt_path=manual)
    assert resumed.global_step == 4
