"""Interrupts (SIGTERM, Ctrl-C) at every step, second round: what a red-team probe found.

* **SIGTERM during ``convert --to safetensors``** left an empty directory at the output's name (signal at
  the first file's fsync), or a ``model.safetensors`` / the first shard files with no index (later
  fsyncs); into an earlier export, the earlier index was already deleted and its files overwritten one
  by one. Every file (index and config too) is now written under a temporary name and renamed into
  place only once all are written: an interrupted (or failed) export leaves no new file, no directory it
  made, and an earlier export whole (its index, moved aside before the renames, is put back).
  ``--to dcp`` / ``--to megatron`` and a ``torch.save`` output left the parent folders they made.
* **Ctrl-C while rank 0's side thread wrote ``common.pt`` / ``metadata.json``** (``save_commit._beside``,
  beside the shard writes): an interrupt that reached the main thread while it waited for that thread
  ended the wait, so ``save`` raised, and a single-process save removed its staging directory, while
  the side thread still wrote into it (a file created after the removal began kept the directory). The
  wait now goes on through Ctrl-C and re-raises it once the thread is done.
* **Ctrl-C in ``DistCheckpointIO.wait()``** (waiting for a background save: the next save, a load or
  teardown) forgot the save in flight and the removals ``ModelCheckpoint`` had deferred until it
  committed: the old top-k checkpoints stayed on disk for good, and a save failing after the interrupt
  was never reported. Both now stay for the next ``wait`` (Lightning's teardown after the interrupt):
  removals done once it commits, dropped (old checkpoints kept) when it fails.

Signals are sent at exact points: a SIGTERM by the process to itself at its n-th fsync, a Ctrl-C to
the main thread once it waits on what the test holds (``trust.test_trust_async_redteam``'s helpers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from trust.test_trust_async_redteam import CtrlC, WaitCalls, HANG_GUARD_S

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import SaveFailedError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.saving import async_request, save_commit
from lightning_distckpt.storage.local_store import LocalStore
from lightning_distckpt.storage.staging import is_staging_dir


def _tree(value: float):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((3, 4), value)),
            "b": ldc.ShardedTensor.from_rank_offsets("b", torch.full((4,), value)), "step": 1}


# Runs each convert again and again in one process, SIGTERM sent by the process to itself at its n-th
# fsync (n = 1, 2, ...) until a run ends without one; after each run the output's folder is listed
# (what is left there) and put back as it was. Prints [argv, n, exit status, entries] per run.
TERMINATED = """
import hashlib, json, os, shutil, signal, sys
from safetensors.torch import load
from lightning_distckpt.cli.main import main
real, calls, at = os.fsync, [0], [0]
def fsync(fd):
    calls[0] += 1
    if calls[0] == at[0]:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(fd)
os.fsync = fsync
def listed(root):
    out = {}
    for d, dirs, files in os.walk(root):
        out[os.path.relpath(d, root) + "/"] = ""
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                data = f.read()
            if n.endswith(".safetensors"):  # its header's order differs by run: what it holds, then
                data = repr(sorted((k, v.tolist()) for k, v in load(data).items())).encode()
            out[os.path.join(os.path.relpath(d, root), n)] = hashlib.sha1(data).hexdigest()
    return out
for argv, folder in json.loads(sys.argv[1]):
    shutil.copytree(folder, folder + ".kept", symlinks=True)
    print(json.dumps([argv, 0, None, listed(folder)]), flush=True)  # as it was
    for n in range(1, 40):
        calls[0], at[0] = 0, n
        code = main(argv + ["-q"])
        print(json.dumps([argv, n, code, listed(folder) if os.path.exists(folder) else None]), flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(folder + ".kept", folder, symlinks=True)
        if calls[0] < n:  # this run ended before its n-th fsync: every step was interrupted once
            break
    shutil.rmtree(folder + ".kept")
"""


def test_sigterm_at_every_fsync_of_an_export_leaves_it_absent_or_whole(tmp_path):
    """Each output kind, SIGTERM at each of its fsyncs in turn: exit status 143 and the folder as it was
    (no empty directory, no partial file, no temporary, an earlier export untouched), or, when the
    signal came after the output was in place (the directory's last fsync), the whole output."""
    ck, new = str(tmp_path / "ck"), str(tmp_path / "new")
    ldc.save(_tree(1.0), ck)
    ldc.save(_tree(2.0), new)
    old = tmp_path / "old" / "out"  # an earlier sharded export, in a folder holding a user's file too
    ldc.export.to_safetensors(ck, str(old), max_shard_size=40)
    (tmp_path / "old" / "README").write_text("mine")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    runs = [[["convert", new, str(fresh / "st"), "--to", "safetensors"], str(fresh)],
            [["convert", new, str(fresh / "st"), "--to", "safetensors", "--max-shard-size", "40"], str(fresh)],
            [["convert", new, str(old), "--to", "safetensors", "--max-shard-size", "40"], str(old.parent)],
            [["convert", new, str(old), "--to", "safetensors"], str(old.parent)],
            [["convert", new, str(fresh / "a" / "b" / "dcp"), "--to", "dcp"], str(fresh)],
            [["convert", new, str(fresh / "a" / "meg"), "--to", "megatron"], str(fresh)],
            [["convert", new, str(fresh / "a" / "b" / "o.pt")], str(fresh)]]
    r = subprocess.run([sys.executable, "-c", TERMINATED, json.dumps(runs)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    assert r.returncode == 0 and results, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    before = {json.dumps(argv): entries for argv, n, code, entries in results if n == 0}
    whole = {json.dumps(argv): entries for argv, n, code, entries in results if code == 0}  # uninterrupted runs
    assert len(whole) == len(before) == len(runs), results
    interrupted = 0
    for argv, n, code, entries in results:
        if n == 0 or code == 0:
            continue
        interrupted += 1
        was, done = before[json.dumps(argv)], whole[json.dumps(argv)]
        assert code == 143, (argv, n, code, r.stderr[-3000:])
        if entries == was:
            continue
        # else the signal came once the output was in place: whole (DCP's files differ by run: by name)
        if "dcp" in argv or "megatron" in argv:
            assert entries is not None and sorted(entries) == sorted(done), (argv, n, entries, was)
        else:
            assert entries == done, (argv, n, entries, was)
    assert interrupted >= 2 * len(runs)


class HeldSideWrites:
    """Holds the blobs rank 0's side thread writes (``save_commit._beside``) until the main thread, interrupted
    while waiting for them, waits again; or until ``go`` is set (by the test, once ``save`` has raised)."""

    def __init__(self, monkeypatch):
        self.first_wait, self.go, self.wrote = threading.Event(), threading.Event(), []
        real_in_background, real_write_blob, waits = save_commit.in_background, LocalStore.write_blob, []
        held = self

        class Watched:
            def __init__(self, future):
                self.future = future

            def exception(self, timeout=None):
                waits.append(1)
                (held.first_wait if len(waits) == 1 else held.go).set()
                return self.future.exception(timeout)

        def in_background(fn):
            pending = real_in_background(fn)
            return None if pending is None else Watched(pending)

        def write_blob(store, staging_dir, name, data):
            if threading.current_thread() is not threading.main_thread():
                assert held.go.wait(HANG_GUARD_S), "the main thread never waited again"
            real_write_blob(store, staging_dir, name, data)
            held.wrote.append(name)

        monkeypatch.setattr(save_commit, "in_background", in_background)
        monkeypatch.setattr(LocalStore, "write_blob", write_blob)


def test_ctrl_c_while_rank0s_blobs_are_written_waits_for_them(tmp_path, monkeypatch):
    """Ctrl-C reaching the main thread while it waits for the side thread writing common.pt and metadata.json:
    ``save`` raises KeyboardInterrupt only once those writes ended, and leaves no staging directory."""
    held = HeldSideWrites(monkeypatch)
    ctrl_c = CtrlC(after=held.first_wait)
    try:
        with pytest.raises(KeyboardInterrupt):
            ldc.save(_tree(1.0), str(tmp_path / "ck"))
        written_before_it_raised = list(held.wrote)
    finally:
        held.go.set()
        ctrl_c.restore()
    assert written_before_it_raised == ["common.pt", "metadata.json"]  # was []: still being written
    assert not [n for n in os.listdir(tmp_path) if is_staging_dir(str(tmp_path / n)) or n == "ck"]
    ldc.save(_tree(2.0), str(tmp_path / "ck"))  # and the next save of that name is as any other
    assert ldc.load_plain_tensors(str(tmp_path / "ck"))["w"].eq(2.0).all()


def _held_save(tmp_path, monkeypatch, fail: bool):
    """A plugin with a committed checkpoint ``one``, a background save of ``two`` held in its writes (failing
    with an OSError once let go when ``fail``), and ``one`` removed by ModelCheckpoint meanwhile (deferred)."""
    io = DistCheckpointIO({"async_save": True})
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 1}, one)
    io.wait()
    go, real = threading.Event(), async_request.write_local

    def write_local(prep):
        assert go.wait(HANG_GUARD_S), "the test never let the writes go"
        if fail:
            raise OSError(28, "No space left on device")
        return real(prep)

    monkeypatch.setattr(async_request, "write_local", write_local)
    io.save_checkpoint({"state_dict": {"w": torch.full((4,), 2.0)}, "global_step": 2}, two)
    io.remove_checkpoint(one)  # ModelCheckpoint's top-k: done once two is committed
    assert os.path.isdir(one)
    return io, go, one, two


def _interrupted_wait(io, go, monkeypatch):
    waits = WaitCalls(monkeypatch)  # finalize waits for the writes through AsyncSaveRequest.wait
    ctrl_c = CtrlC(after=waits.entered(1))
    try:
        with pytest.raises(KeyboardInterrupt):
            io.wait()
    finally:
        ctrl_c.restore()
    go.set()


def test_ctrl_c_in_wait_keeps_the_save_pending_and_its_deferred_removals(tmp_path, monkeypatch):
    io, go, one, two = _held_save(tmp_path, monkeypatch, fail=False)
    _interrupted_wait(io, go, monkeypatch)
    io.teardown()  # as Lightning's teardown after the interrupt
    assert not os.path.exists(one)  # was kept for good: the removal was forgotten
    assert io.load_checkpoint(two)["state_dict"]["w"].eq(2.0).all()


def test_ctrl_c_in_wait_then_the_save_fails_reports_it_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    io, go, one, two = _held_save(tmp_path, monkeypatch, fail=True)
    _interrupted_wait(io, go, monkeypatch)
    with pytest.raises(SaveFailedError, match="No space left on device"):  # was: nothing raised
        io.teardown()
    assert io.load_checkpoint(one)["state_dict"]["w"].eq(1.0).all()  # the removal dropped: one is kept
    assert not os.path.exists(two) and io.pending is None


def test_ctrl_c_while_a_checkpoint_is_removed_leaves_nothing_that_says_committed(tmp_path, monkeypatch):
    """``remove_checkpoint`` (ModelCheckpoint's top-k) interrupted after its first file: no directory at the
    name that ``inspect`` calls committed and a load finds damaged; what is left is a staging leftover."""
    io = DistCheckpointIO({"storage": {"layout": "zarr"}})  # many files: the interrupt lands amid them
    path = str(tmp_path / "epoch=0-step=1")
    io.save_checkpoint({"state_dict": {"w": torch.ones(4), "v": torch.ones(8)}, "global_step": 1}, path)
    real, calls = os.unlink, []

    def unlink(name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as Ctrl-C between two of rmtree's unlinks
        return real(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        io.remove_checkpoint(path)
    monkeypatch.setattr(os, "unlink", real)
    left = os.listdir(tmp_path)
    assert left and all(is_staging_dir(str(tmp_path / n)) for n in left), left  # was: the name, "committed"
    assert main(["clean", str(tmp_path), "--older-than", "0", "-q"]) == 0
    assert os.listdir(tmp_path) == []
