"""Red team: what counts as "ours" before a removal. A directory was taken for a checkpoint of ours (and
removed whole by ``ModelCheckpoint``'s rotation, ``remove_checkpoint``, ``link_last``) when it merely held a
regular file named ``COMMITTED`` (empty, text, any JSON) or a ``data/rank_00000/`` folder of anyone's files;
and ``clean`` took a user's directory holding files named ``COMMITTED`` and ``metadata.json`` for the committed
checkpoint superseding our only committed copy of it, and removed that copy. Now a marker counts only as our
marker (a JSON object with the fields every version wrote), an uncommitted directory only as our entries
around rank stores holding a store's own files. Every format witness (1-8) and every torn state of a save
stays removable and cleanable."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.lightning.last_link import link_last
from lightning_distckpt.storage import staging
from lightning_distckpt.storage.layout import is_checkpoint_dir
from lightning_distckpt.storage.local_store import LocalStore

WITNESSES = os.path.join(os.path.dirname(__file__), "..", "data", "formats")
WITNESS_NAMES = sorted(n for n in os.listdir(WITNESSES) if os.path.isdir(os.path.join(WITNESSES, n)))


def digest(path):
    return {os.path.relpath(os.path.join(d, n), path): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, names in os.walk(path) for n in names}


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# A user's directory, as files (relative path -> content); each is at a name a checkpoint would have.
USER_DIRS = {
    "empty_marker": {"COMMITTED": "", "notes.txt": "mine"},
    "text_marker": {"COMMITTED": "done\n", "results.csv": "1,2"},
    "json_marker_other_keys": {"COMMITTED": json.dumps({"status": "done", "when": "today"}), "model.bin": "x"},
    "json_marker_wrong_types": {"COMMITTED": json.dumps({"bytes": "many", "world_size": 2, "committed_unix": 1.0})},
    "marker_and_foreign_metadata": {"COMMITTED": "{}", "metadata.json": json.dumps({"format": "mine"})},
    "rank_folder_of_user_files": {"data/rank_00000/images.npy": "pixels", "data/rank_00000/labels.txt": "cat"},
    "rank_folder_beside_other_data": {"data/rank_00000/d/x": "ok", "data/train.csv": "1,2"},
    "our_names_beside_user_files": {"data/rank_00000/manifest.ocdbt": "m", "thesis.tex": "years of work"},
}


def user_dir(path, kind):
    for rel, text in USER_DIRS[kind].items():
        _write(os.path.join(path, rel), text)
    return str(path)


def save_ours(path, value=0.0):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((3,), value))}, str(path))
    return str(path)


@pytest.mark.parametrize("kind", sorted(USER_DIRS))
def test_a_users_directory_is_not_removed(tmp_path, kind):
    """Before: removed whole by remove_checkpoint (LocalStore.remove) and replaced by link_last, every kind
    but the last two of the data/ ones."""
    path = user_dir(tmp_path / "epoch=0-step=1.ckpt", kind)
    before = digest(path)
    with pytest.raises(ArgumentError, match="not a checkpoint of ours") as e:
        LocalStore(path).remove()
    assert path in str(e.value)
    with pytest.raises(ArgumentError, match="not a checkpoint of ours"):
        DistCheckpointIO().remove_checkpoint(path)
    ours = save_ours(tmp_path / "epoch=1-step=2.ckpt")
    with pytest.raises(ArgumentError, match="is not a checkpoint"):
        link_last(ours, path)
    assert clean(str(tmp_path), 0.0, dry_run=False) == []
    assert digest(path) == before and not is_checkpoint_dir(path)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt"]


def test_the_refusal_says_what_is_there(tmp_path):
    path = user_dir(tmp_path / "ck", "text_marker")
    with pytest.raises(ArgumentError, match="its COMMITTED is not a commit marker of ours.*results.csv"):
        LocalStore(path).remove()


def test_clean_keeps_our_copy_that_a_users_directory_does_not_supersede(tmp_path):
    """Our commit to ``ck`` stranded in its staging directory; a user's directory at ``ck`` holding files
    named COMMITTED (JSON without our fields: its time was the file's mtime) and metadata.json. Before: the
    copy was "superseded by the committed checkpoint at its target" and removed, our only copy."""
    copy = staging.new_staging_dir(str(tmp_path / "ck"))
    save_ours(tmp_path / "made")
    os.rename(tmp_path / "made", copy)
    target = user_dir(tmp_path / "ck", "marker_and_foreign_metadata")
    before = digest(target)
    mine = json.load(open(os.path.join(copy, "COMMITTED")))["committed_unix"]
    os.utime(os.path.join(target, "COMMITTED"), (mine + 10, mine + 10))  # written after our commit
    actions = clean(str(tmp_path), 0.0, dry_run=False)
    assert [a.action for a in actions] == ["kept"], [(a.action, a.reason) for a in actions]
    assert os.path.isfile(os.path.join(copy, "COMMITTED")) and digest(target) == before
    assert ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))}, copy)["w"].sum() == 0


def test_the_rotation_leaves_a_users_directory_at_a_tracked_name(tmp_path):
    """ModelCheckpoint's top-1 rotation removes the previous best; a user's directory put at its name
    meanwhile (a COMMITTED file of their own in it) fails the fit, and stays. Before: removed whole."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    folder = tmp_path / "ckpts"
    before = {}

    class Swap(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:  # before ModelCheckpoint's save of step 2 (and removal of step 1)
                first = os.path.join(folder, "step=1.ckpt")
                shutil.rmtree(first)
                user_dir(first, "json_marker_other_keys")
                before.update(digest(first))

    mc = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_top_k=1,
                         monitor="step", mode="max")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[DistCheckpointIO()], callbacks=[Swap(), mc])
    with pytest.raises(ArgumentError, match="step=1.ckpt: not a checkpoint of ours"):
        trainer.fit(BoringModel())
    assert before and digest(os.path.join(folder, "step=1.ckpt")) == before


# -- what we wrote stays ours ------------------------------------------------------------------------------

def _copy_witness(name, dest):
    shutil.copytree(os.path.join(WITNESSES, name), dest)
    return str(dest)


TORN = {  # a save's or a removal's states at the checkpoint's own name, and what makes them
    "committed": lambda p: None,
    "marker_removed": lambda p: os.remove(os.path.join(p, "COMMITTED")),  # _remove_dir stopped before its rename
    "metadata_damaged": lambda p: _write(os.path.join(p, "metadata.json"), "{trunc"),
    "marker_and_metadata_gone": lambda p: [os.remove(os.path.join(p, n)) for n in ("COMMITTED", "metadata.json")],
    "only_data": lambda p: [os.remove(os.path.join(p, n)) for n in ("COMMITTED", "metadata.json", "common.pt")],
    "a_rank_store_emptied": lambda p: [shutil.rmtree(os.path.join(p, "data", "rank_00001")),
                                       os.makedirs(os.path.join(p, "data", "rank_00001"))],
}


@pytest.mark.parametrize("name", WITNESS_NAMES)
def test_every_witness_is_ours_and_removable(tmp_path, name):
    path = _copy_witness(name, tmp_path / "ck")
    assert is_checkpoint_dir(path)
    link = tmp_path / "last.ckpt"
    link_last(path, str(link))  # a link to ours: fine
    assert os.path.islink(link)
    assert LocalStore(str(link)).remove() and os.path.isdir(path)  # the link only
    assert LocalStore(path).remove() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("state", sorted(TORN))
@pytest.mark.parametrize("name", ["v1", "v8-zarr"])
def test_torn_states_of_ours_stay_removable(tmp_path, name, state):
    path = _copy_witness(name, tmp_path / "ck")
    TORN[state](path)
    assert is_checkpoint_dir(path), sorted(os.listdir(path))
    DistCheckpointIO().remove_checkpoint(path)
    assert os.listdir(tmp_path) == []


def test_a_killed_writes_lock_file_and_an_empty_store_are_ours(tmp_path):
    """tensorstore writes each file through ``<name>.__lock``; a rank killed before writing left its store empty."""
    path = _copy_witness("v8", tmp_path / "ck")
    TORN["only_data"](path)
    _write(os.path.join(path, "data", "rank_00000", "manifest.ocdbt.__lock"), "")
    os.makedirs(os.path.join(path, "data", "rank_00002"))
    assert is_checkpoint_dir(path)
    LocalStore(path).remove()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("committed", [True, False], ids=["committed_copy", "uncommitted"])
def test_clean_still_handles_our_staging_directories(tmp_path, committed):
    """A staging directory superseded by a newer checkpoint at its target (committed) or a killed save's
    (uncommitted, its marker never written): removed."""
    copy = staging.new_staging_dir(str(tmp_path / "ck"))
    save_ours(tmp_path / "made")
    save_ours(tmp_path / "ck", 1.0)  # committed after the copy
    os.rename(tmp_path / "made", copy)
    if not committed:
        os.remove(os.path.join(copy, "COMMITTED"))
    actions = clean(str(tmp_path), 0.0, dry_run=False)
    assert [a.action for a in actions] == ["removed"], [(a.action, a.reason) for a in actions]
    assert os.listdir(tmp_path) == ["ck"]
