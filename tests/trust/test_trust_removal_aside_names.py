"""A removal's ``.removed`` aside: it fits in a file name for every name we save, and ``clean`` removes only
what is ours there.

1. A checkpoint name of 217-224 bytes is too long to encode and keeps the older staging form
   (``.NAME.distckpt-staging-<id>``). The suffixes appended to it (``.removed`` by a removal, ``.old<N>`` by a
   commit without ``RENAME_EXCHANGE``) made the name longer than 255 bytes: removing such a checkpoint
   (``ModelCheckpoint``'s ``save_top_k`` rotation, ``remove_checkpoint``) failed with ENAMETOOLONG, and so did
   replacing one on NFS or Lustre. The id in that form is now shortened so that the suffixes fit.
2. A user's directory that a removal found at a checkpoint's name and could not put back (the name was taken
   again) stays at the ``.removed`` aside name. ``clean`` took it for "left by an interrupted removal" and
   deleted it. A removal now notes in the aside that it deletes what is there (after checking it is ours) and
   deletes that note last; ``clean`` removes an aside only when it is empty, holds that note, or is a
   checkpoint directory of ours, and keeps anything else, saying why.
Real saves, real files, the real command line in a subprocess and a real kill of a removal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage import staging
from lightning_distckpt.storage.commit import KILL_AT_ENV
from lightning_distckpt.storage.layout import COMMIT_MARKER, is_committed
from lightning_distckpt.storage.local_store import LocalStore
from lightning_distckpt.storage.store import LeftoverChanged
from lightning_distckpt.storage.swap import NO_EXCHANGE_ENV
from user_files import tree_digest, users_dir

NAME_MAX = 255
REFUSED = "refused: not a checkpoint of ours but what a removal of step=1 found at that name"


def save_ours(path, step: int = 1) -> str:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0) + step), "step": step}, str(path))
    assert is_committed(str(path))
    return str(path)


def long_name(nbytes: int) -> str:
    return "c" * (nbytes - 7) + "-step=1"


def cli_clean(directory, *extra: str) -> subprocess.CompletedProcess:
    """``python -m lightning_distckpt clean DIR --older-than 0`` in a subprocess (this test's package on its path)."""
    return subprocess.run([sys.executable, "-m", "lightning_distckpt", "clean", str(directory), "--older-than", "0",
                           *extra], capture_output=True, text=True, cwd=str(directory), timeout=300)


@pytest.mark.parametrize("nbytes", [1, 135, 136, 216, 217, 220, 224])
def test_every_suffix_fits_beside_every_name_we_save(tmp_path, nbytes):
    """For names up to 224 bytes (the longest whose staging directory fits), the staging name plus the longest
    suffix appended to it (``.removed``; ``.old7`` is shorter) is at most 255 bytes, and still names its target
    and, for a removal's, says so."""
    target = str(tmp_path / long_name(nbytes))
    for name in (staging.new_staging_dir(target) + ".old7", staging.removal_aside(target)):
        assert len(os.fsencode(os.path.basename(name))) <= NAME_MAX, (nbytes, name)
        assert staging.is_staging_dir(name) and staging.target_of(name) == target
    assert staging.is_removal_aside(staging.removal_aside(target))


@pytest.mark.parametrize("nbytes", [216, 217, 220, 224])
def test_a_long_named_checkpoint_is_removed(tmp_path, nbytes):
    """``remove_checkpoint`` removes a checkpoint of ours named with 216-224 bytes, leaving nothing aside, and
    the checkpoint beside it stays. Before: ENAMETOOLONG from 217 bytes on (the aside name was 256-263 bytes)."""
    target = save_ours(tmp_path / long_name(nbytes))
    other = save_ours(tmp_path / "other")
    DistCheckpointIO().remove_checkpoint(target)
    assert os.listdir(tmp_path) == ["other"] and is_committed(other)


def test_save_top_k_rotates_long_named_checkpoints(tmp_path):
    """A real Trainer fit with ``ModelCheckpoint(save_top_k=1)`` and 220-byte checkpoint names under
    ``DistCheckpointIO``: every step's rotation removes the previous checkpoint and the last one stays,
    loadable. Before: the first rotation failed with ENAMETOOLONG and stopped the fit."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_helpers import quiet_trainer

    stem = "c" * (220 - len("-step=3.ckpt"))
    top1 = ModelCheckpoint(dirpath=str(tmp_path), filename=stem + "-{step}", every_n_train_steps=1, save_top_k=1)
    trainer = quiet_trainer(max_steps=3, callbacks=[top1], plugins=[DistCheckpointIO()], limit_val_batches=0)
    trainer.fit(BoringModel())
    (left,) = os.listdir(tmp_path)
    assert left == stem + "-step=3.ckpt" and len(left) == 220
    assert is_committed(str(tmp_path / left)) and ldc.load_tensors_metadata(str(tmp_path / left))


def test_a_long_named_checkpoint_is_replaced_without_rename_exchange(tmp_path, monkeypatch):
    """Saved again where ``RENAME_EXCHANGE`` is missing (NFS, Lustre: the previous checkpoint goes aside under
    the staging name plus ``.old``), a 224-byte-named checkpoint is replaced and nothing is left aside.
    Before: ENAMETOOLONG from 221 bytes on, the save failed."""
    monkeypatch.setenv(NO_EXCHANGE_ENV, "1")
    target = save_ours(tmp_path / long_name(224), step=1)
    save_ours(target, step=2)
    assert os.listdir(tmp_path) == [long_name(224)]
    assert torch.equal(ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, target)["w"],
                       torch.arange(6.0) + 2)


def test_clean_keeps_a_users_directory_left_at_a_removal_aside(tmp_path):
    """A user's directory at a ``.removed`` aside name (where a removal leaves what it could not put back): the
    real ``clean`` command, dry run or not, keeps it byte for byte and says why, exit status 0; the checkpoint
    beside it stays. Before: "removed ... left by an interrupted removal of step=1", and the directory was gone."""
    aside = users_dir(staging.removal_aside(str(tmp_path / "step=1")))
    kept = tree_digest(aside)
    other = save_ours(tmp_path / "step=2")
    for extra in (("--dry-run",), ()):
        done = cli_clean(tmp_path, *extra)
        assert done.returncode == 0, done.stderr
        line = next(x for x in done.stdout.splitlines() if os.path.basename(aside) in x)
        assert line.startswith("kept") and REFUSED in line and "could not put back" in line, done.stdout
        assert tree_digest(aside) == kept and is_committed(other)
    (found,) = staging.find_leftovers(str(tmp_path))
    assert found.foreign and found.verdict(0) == "not-ours"


def test_clean_rechecks_an_aside_before_removing_it(tmp_path):
    """An empty aside (ours to remove) listed by ``clean``, then given a user's files before the removal: the
    removal's second look under the folder's lock refuses it (LeftoverChanged), and the files stay."""
    aside = staging.removal_aside(str(tmp_path / "step=1"))
    os.mkdir(aside)
    store = LocalStore(str(tmp_path))
    (found,) = store.find_leftovers()
    assert not found.foreign and found.verdict(0) == "remove"
    os.rmdir(aside)
    users_dir(aside)
    kept = tree_digest(aside)
    with pytest.raises(LeftoverChanged, match="not a removal's leftover of ours"):
        store.remove_leftover(found)
    assert tree_digest(aside) == kept


REMOVE_SCRIPT = "import sys; from lightning_distckpt.lightning import DistCheckpointIO; " \
                "DistCheckpointIO().remove_checkpoint(sys.argv[1])"


def test_a_removal_killed_mid_way_is_cleaned(tmp_path):
    """A removal killed (SIGKILL) right after it deleted the commit marker leaves a partly deleted checkpoint at
    its aside name, holding the removal's note: no checkpoint of ours by its markers any more, yet ``clean``
    (the real command) removes it, and an empty aside too; the checkpoint beside it stays."""
    target = save_ours(tmp_path / "step=1")
    other = save_ours(tmp_path / "step=2")
    env = {**os.environ, KILL_AT_ENV: "removal_after_marker"}
    done = subprocess.run([sys.executable, "-c", REMOVE_SCRIPT, target], env=env, cwd=str(tmp_path), timeout=300)
    assert done.returncode == -signal.SIGKILL
    (aside,) = [str(tmp_path / n) for n in os.listdir(tmp_path) if staging.is_removal_aside(n)]
    assert not os.path.lexists(os.path.join(aside, COMMIT_MARKER)) and os.listdir(aside)
    empty = staging.removal_aside(str(tmp_path / "step=3"))
    os.mkdir(empty)
    out = cli_clean(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("left by an interrupted removal") == 2, out.stdout
    assert sorted(os.listdir(tmp_path)) == ["step=2"] and is_committed(other)


def test_clean_in_process_removes_ours_and_keeps_the_users(tmp_path):
    """In one folder, ``clean`` (the library call) removes a removal's aside holding our whole checkpoint (a
    removal stopped before its note) and keeps a user's directory at another aside, reporting it kept."""
    ours_aside = staging.removal_aside(str(tmp_path / "step=1"))
    os.rename(save_ours(tmp_path / "step=1"), ours_aside)
    users_aside = users_dir(staging.removal_aside(str(tmp_path / "step=1")))
    done = {a.leftover.path: (a.action, a.reason) for a in clean(str(tmp_path), 0, dry_run=False)}
    assert done[ours_aside][0] == "removed" and done[users_aside][0] == "kept"
    assert done[users_aside][1].startswith(REFUSED)
    assert os.listdir(tmp_path) == [os.path.basename(users_aside)]
