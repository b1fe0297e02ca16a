"""Saves that meet failures and races the other suites do not reach, with real processes.

* ``clean --older-than 0`` while a save on this host is making its staging directory (the directory
  exists, its owner note not yet): the save's directory is kept and the save commits. Before, clean
  saw no note and removed the running save's directory (a save thread at ``nice`` 10 on a busy host
  sits in that window for long: 49 of 200 async saves failed against a clean loop).
* A first save (nothing at its target) whose commit is finished by someone else's recovery (clean, a
  loading rank) between the removal of its owner notes and its rename: the save succeeds. Before, it
  raised ``commit failed, nothing was committed`` (FileNotFoundError on its staging directory) while
  its checkpoint was in place.
* An async save into a folder that does not exist yet, under ``ModelCheckpoint(save_last="link")``:
  ``last.ckpt`` is linked as the save returns, which needs the folder. Before, the fit failed at its
  first checkpoint with FileNotFoundError (the folder was made by the background thread, later).
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.storage.staging import OWNERS_DIR, is_staging_dir

N = 4096
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A save of ``w`` = VALUE to TARGET that stops itself (SIGSTOP) at HOOK:
#   "before_note": in its staging directory's making, after the directory, before its owner note;
#   "notes_removed": in its commit, once its owner notes are removed, before its rename.
SAVER = """
import os, signal, sys, torch, lightning_distckpt as ldc
from lightning_distckpt.storage import commit, staging
target, value, hook = sys.argv[1], float(sys.argv[2]), sys.argv[3]
stop = lambda: os.kill(os.getpid(), signal.SIGSTOP)
if hook == "before_note":
    real_note = staging.write_owner_note
    staging.write_owner_note = lambda *a: (stop(), real_note(*a))[1]
else:
    real_remove = commit.remove_owner_notes
    commit.remove_owner_notes = lambda *a: (real_remove(*a), stop())[0]
w = ldc.ShardedTensor.from_rank_offsets("w", torch.full((%d,), value))
ldc.save({"w": w, "step": int(value)}, target)
print("saved", flush=True)
""" % N


def _start(target, value: float, hook: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SAVER, str(target), str(value), hook],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_stopped(proc: subprocess.Popen) -> None:
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the save exited before its hook ({status})"


def _finish(proc: subprocess.Popen) -> None:
    """Resume ``proc`` and reap it; it must have saved."""
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "saved", err[-3000:]


def _value(target) -> float:
    w = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(N))}, target)["w"]
    assert torch.equal(w, torch.full((N,), w[0].item()))
    assert ldc.load_common_state_dict(target)["step"] == int(w[0].item())
    return w[0].item()


def _staging(parent):
    return sorted(os.path.join(parent, n) for n in os.listdir(parent) if is_staging_dir(n))


def _lock_waiter_on(path: str) -> bool:
    """Some process waits for a lock on ``path`` (/proc/locks: ``-> FLOCK ... dev:inode``)."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any("->" in line and line.split()[-3].endswith(f":{inode}") for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs /proc/locks (Linux)")
def test_clean_keeps_a_staging_directory_a_save_is_making(tmp_path):
    target = tmp_path / "ck"
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((N,), 1.0)), "step": 1}, target)
    saver = _start(target, 2.0, "before_note")
    cleaner = None
    try:
        _wait_stopped(saver)  # its staging directory exists, with no owner note yet
        running = _staging(tmp_path)
        assert len(running) == 1 and not os.path.exists(os.path.join(running[0], OWNERS_DIR))
        cleaner = subprocess.Popen([sys.executable, "-m", "lightning_distckpt", "clean", str(tmp_path),
                                    "--older-than", "0", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        # clean either finishes (it removed the directory: the bug) or waits for the save to make it
        while cleaner.poll() is None and not _lock_waiter_on(str(tmp_path)):
            os.sched_yield()
        _finish(saver)
        out, err = cleaner.communicate(timeout=60)
    finally:
        for proc in (saver, cleaner):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=60)
    assert cleaner.returncode == 0, err[-3000:]
    removed = [a["path"] for a in json.loads(out) if a["action"] == "removed"]
    assert running[0] not in removed, out
    assert _value(target) == 2.0
    assert _staging(tmp_path) == []


def test_a_first_save_whose_commit_clean_finished_succeeds(tmp_path):
    target = tmp_path / "ck"
    saver = _start(target, 2.0, "notes_removed")
    try:
        _wait_stopped(saver)  # marker durable, notes gone, not renamed: a stranded copy to any other process
        actions = clean(str(tmp_path), 0.0, False)
        assert [a.action for a in actions] == ["recovered"], actions
        assert _value(target) == 2.0
        _finish(saver)
    finally:
        if saver.poll() is None:
            os.kill(saver.pid, signal.SIGCONT)
            saver.kill()
            saver.wait(timeout=60)
    assert _value(target) == 2.0
    assert _staging(tmp_path) == [] and OWNERS_DIR not in os.listdir(target)


@pytest.mark.parametrize("plugin", [True, False], ids=["DistCheckpointIO", "DistCheckpointStrategy"])
def test_async_save_last_link_into_a_new_folder(tmp_path, isolated_process_group, plugin):
    sys.path.insert(0, TESTS)
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy
    from lightning_helpers import TPMLP

    folder = tmp_path / "runs" / "ck"  # made by the first save
    ckpt = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=1, save_last="link")
    kwargs = dict(accelerator="cpu", devices=1, max_steps=2, callbacks=[ckpt], logger=False,
                  enable_progress_bar=False, enable_model_summary=False)
    if plugin:
        kwargs["plugins"] = [DistCheckpointIO({"async_save": True})]
    else:
        kwargs["strategy"] = DistCheckpointStrategy(checkpoint={"async_save": True})
    Trainer(**kwargs).fit(TPMLP(total_steps=2))
    assert os.path.islink(folder / "last.ckpt") and os.readlink(folder / "last.ckpt") == "step=2.ckpt"
    assert ldc.load_tensors_metadata(folder / "last.ckpt")
    assert not [n for n in os.listdir(folder) if is_staging_dir(n)]
