"""Interrupts (SIGTERM, Ctrl-C) at every step, third round: what a red-team probe found.

* **A save into folders that do not exist yet, stopped** (``convert --to distckpt`` of a checkpoint or of a
  ``torch.save`` file under SIGTERM, ``ldc.save`` / ``DistCheckpointIO.save_checkpoint`` under Ctrl-C, at any
  of its fsyncs before the rename into place): the staging directory went, the folders the save had made
  for it stayed, empty. Rank 0 now notes which folders were missing when it named the staging directory;
  a save that commits nothing (interrupted, failed, an async save's placeholder released) takes them back
  while empty (``storage/local_store.py``), as an export does.
* **Ctrl-C / SIGTERM in a single-process save's commit** (after the marker was written, before the rename):
  the staging directory was left holding the marker, a committed copy that ``clean`` keeps (newer than the
  target) and that a load of a missing target renames into place, though the save said it was interrupted.
  The interrupted commit now removes it as an interrupted write does (``saving/save_commit.write_and_commit``).
* **Ctrl-C in ``convert --to distckpt`` to ``s3://`` while its commit deleted the previous version** (the
  marker already naming the new one): the convert discarded its version, so the marker named a version
  with no ``metadata.json`` and the checkpoint was lost. Discarding a version now keeps one the marker
  names (``storage/s3.discard``); at every other request an interrupted save leaves the earlier checkpoint
  (or the new one) whole, and ``clean`` removes the rest.

Found sound here: a Lightning Trainer (``DistCheckpointIO``, sync and ``async_save``) sent SIGTERM at any
fsync of a ``ModelCheckpoint`` save (Lightning's handler only flags it: the save commits whole, the fit
stops at the next step) or Ctrl-C there (the checkpoint being written is not committed, the earlier ones
and ``last`` are whole, the teardown waits for a background save); ``ckpt_path="last"`` then resumes.
An interrupted load (``ldc.load``, ``DistCheckpointIO.load_checkpoint``) opens nothing for writing and
leaves every file of the checkpoint as it was.

Signals are sent at exact points: by the process to itself at its n-th fsync (SIGTERM, or SIGINT for
Ctrl-C), or as a KeyboardInterrupt at the n-th read of a checkpoint file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import SaveFailedError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.saving import async_request

HERE = os.path.dirname(os.path.abspath(__file__))


def _tree(value: float):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((3, 4), value)),
            "b": ldc.ShardedTensor.from_rank_offsets("b", torch.full((4,), value)), "step": int(value)}


def _run_script(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [HERE, os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


# Runs each save again and again in one process, a signal sent by the process to itself at its n-th fsync
# (n = 1, 2, ...) until a run ends without one; after each run the folder is listed and put back as it was.
# A run: ["convert", argv] (the command line, SIGTERM), or ["save" | "io", output, value] (Ctrl-C: SIGINT).
# Prints [run, n, outcome, entries] per run (entries: relative paths of every file and folder).
INTERRUPTED_SAVES = """
import json, os, re, shutil, signal, sys
import torch
import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.lightning import DistCheckpointIO
from test_trust_interrupts_round3_redteam import _tree
real, calls, at, sig = os.fsync, [0], [0], [signal.SIGTERM]
def fsync(fd):
    calls[0] += 1
    if calls[0] == at[0]:
        os.kill(os.getpid(), sig[0])
    return real(fd)
os.fsync = fsync
# Ctrl-C as in a terminal: a process started in the background (`cmd &`, as CI may be) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
def listed(root):  # a rank store's files by kind only (an OCDBT store's file names differ by run)
    entries = (os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)
    return sorted({re.sub(r"(/data/rank_[0-9]+/[^/]+)/.*", r"\\1/...", e) for e in entries})
def run(what):
    if what[0] == "convert":
        return main(what[1] + ["-q"])
    try:
        if what[0] == "save":
            ldc.save(_tree(what[2]), what[1])
        else:
            DistCheckpointIO().save_checkpoint({"state_dict": {"w": torch.full((4,), float(what[2]))}}, what[1])
    except KeyboardInterrupt:
        return "interrupted"
    return 0
folder = sys.argv[2]
for what in json.loads(sys.argv[1]):
    sig[0] = signal.SIGTERM if what[0] == "convert" else signal.SIGINT
    shutil.copytree(folder, folder + ".kept", symlinks=True)
    print(json.dumps([what, 0, None, listed(folder)]), flush=True)  # as it was
    for n in range(1, 60):
        calls[0], at[0] = 0, n
        outcome = run(what)
        print(json.dumps([what, n, outcome, listed(folder)]), flush=True)
        shutil.rmtree(folder)
        shutil.copytree(folder + ".kept", folder, symlinks=True)
        if calls[0] < n:  # this run ended before its n-th fsync: every step was interrupted once
            break
    shutil.rmtree(folder + ".kept")
"""


def test_an_interrupted_save_into_new_folders_takes_them_back(tmp_path):
    """Each save, stopped at each of its fsyncs in turn: the folder as it was (no empty folders on the way, no
    staging directory, committed or not; an earlier checkpoint untouched), or, when the signal came once the
    output was in place (the parent's last fsync), the whole output."""
    folder = tmp_path / "work"
    folder.mkdir()
    ldc.save(_tree(1.0), str(folder / "ck"))
    torch.save({"tensors": {"w": torch.ones(3)}, "objects": {}, "common": {"step": 1}}, str(folder / "f.pt"))
    out = str(folder / "a" / "b" / "out")
    runs = [["convert", ["convert", str(folder / "ck"), out, "--to", "distckpt", "--layout", "zarr"]],
            ["convert", ["convert", str(folder / "f.pt"), out]],
            ["save", out, 2],
            ["io", out, 2],
            ["save", str(folder / "ck"), 2]]  # over an earlier checkpoint: it stays whole
    r = _run_script(INTERRUPTED_SAVES, json.dumps(runs), str(folder))
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    assert r.returncode == 0 and results, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    before = {json.dumps(what): entries for what, n, outcome, entries in results if n == 0}
    done = {json.dumps(what): entries for what, n, outcome, entries in results if outcome == 0}
    assert len(done) == len(before) == len(runs), results
    interrupted = {json.dumps(what): 0 for what in runs}
    for what, n, outcome, entries in results:
        if n == 0 or outcome == 0:
            continue
        interrupted[json.dumps(what)] += 1
        assert outcome == (143 if what[0] == "convert" else "interrupted"), (what, n, outcome, r.stderr[-3000:])
        # was: "a", "a/b" left, empty; or a committed ".distckpt-staging-..." beside the output
        assert entries in (before[json.dumps(what)], done[json.dumps(what)]), (what, n, entries)
    # every kind of save stopped at several of its steps (how many of its fsyncs run in Python, and so can be
    # stopped at, varies a little with the threads' timing: a count over all runs would depend on it)
    assert min(interrupted.values()) >= 3, interrupted


def test_a_failed_async_save_into_new_folders_takes_them_back(tmp_path, monkeypatch):
    """``DistCheckpointIO(async_save=True)`` into folders it made (its placeholder in them), the write failing:
    the failure is reported, and nothing is left of the placeholder nor of the folders made for it."""
    def write_local(prep):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_request, "write_local", write_local)
    io = DistCheckpointIO({"async_save": True})
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 1}, str(tmp_path / "a" / "b" / "ck"))
    with pytest.raises(SaveFailedError, match="No space left on device"):
        io.wait()
    assert os.listdir(tmp_path) == []  # was: a/b


def test_a_failed_save_keeps_folders_that_hold_something_else(tmp_path, monkeypatch):
    """The folders a failed save made are taken back only while empty: a file put there meanwhile keeps its
    folder and those above it."""
    from lightning_distckpt.saving import save_commit

    def write_local(prep):
        (tmp_path / "a" / "mine").write_text("kept")  # made meanwhile, by someone else
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_commit, "write_local", write_local)
    (tmp_path / "a").mkdir()
    with pytest.raises(SaveFailedError):
        ldc.save(_tree(1.0), str(tmp_path / "a" / "b" / "c" / "ck"))
    assert sorted(os.listdir(tmp_path / "a")) == ["mine"]


def _hashes(root):
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (hashlib.sha1(f.read()).hexdigest(), st.st_mtime_ns, st.st_mode)
    return out


class ReadsInterrupted:
    """A KeyboardInterrupt (as Ctrl-C) at the n-th open of a file under ``root``; records every open's flags,
    so a test can say that no file of the checkpoint was opened for writing."""

    def __init__(self, monkeypatch, root, n):
        self.flags, self.root, self.n, self.raised = [], os.path.realpath(root), n, False
        real_os_open, real_open = os.open, open
        held = self

        def seen(path, writing):
            p = os.path.realpath(os.fspath(path)) if isinstance(path, (str, bytes, os.PathLike)) else ""
            if isinstance(p, str) and p.startswith(held.root + os.sep):
                held.flags.append((p, writing))
                if len(held.flags) == held.n:
                    held.raised = True
                    raise KeyboardInterrupt

        def os_open(path, flags, *args, **kwargs):
            seen(path, bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)))
            return real_os_open(path, flags, *args, **kwargs)

        def builtin_open(file, mode="r", *args, **kwargs):
            seen(file, any(c in mode for c in "wax+"))
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr("builtins.open", builtin_open)


@pytest.mark.parametrize("how", ["ldc.load", "DistCheckpointIO.load_checkpoint"])
def test_ctrl_c_at_every_open_of_a_load_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch, how):
    """A load interrupted at each file it opens in turn (tensorstore's own reads, in C++, are not seen: the
    opens Python makes are): KeyboardInterrupt raised, nothing opened for writing, every file of the
    checkpoint as it was (bytes, mtime, mode), and the next load whole."""
    path = str(tmp_path / "ck")
    if how == "ldc.load":
        ldc.save(_tree(3.0), path)
    else:
        DistCheckpointIO().save_checkpoint({"state_dict": {"w": torch.full((4,), 3.0)}, "global_step": 3}, path)
    was = _hashes(path)

    def load():
        if how == "ldc.load":
            template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4)),
                        "b": ldc.ShardedTensor.from_rank_offsets("b", torch.zeros(4))}
            return ldc.load(template, path)["w"]
        return DistCheckpointIO().load_checkpoint(path)["state_dict"]["w"]

    interrupted = 0
    for n in range(1, 200):
        with monkeypatch.context() as m:
            reads = ReadsInterrupted(m, path, n)
            try:
                load()
            except KeyboardInterrupt:
                pass
        assert not [p for p, writing in reads.flags if writing], reads.flags
        assert _hashes(path) == was, n
        assert not [x for x in os.listdir(tmp_path) if x != "ck"]
        if not reads.raised:
            break
        interrupted += 1
    assert interrupted >= 3
    assert load().eq(3.0).all()


# A Trainer (one process, DistCheckpointIO sync or async_save) checkpointing every step, sent a signal by the
# process to itself at the n-th fsync once step 3's checkpoint begins (armed by a callback that runs before
# ModelCheckpoint's); then every checkpoint left is checked and a second Trainer resumes from "last". Prints
# [mode, signal, n, outcome, checkpoints, resumed at, fsyncs seen] per run.
TRAINER = """
import json, logging, os, shutil, signal, sys, warnings
warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage.staging import is_staging_dir
real, calls, at, sig = os.fsync, [0], [0], [signal.SIGTERM]
def fsync(fd):
    calls[0] += 1
    if calls[0] == at[0]:
        os.kill(os.getpid(), sig[0])
    return real(fd)
os.fsync = fsync
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, even when started with `&`
class Arm(Callback):  # user callbacks run before ModelCheckpoint's own hooks
    def __init__(self, n):
        self.n = n
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            calls[0], at[0] = 0, self.n
class Started(Callback):
    def on_train_start(self, trainer, *args):
        self.step = trainer.global_step
def trainer(root, mode, steps, *callbacks):
    last = "link" if mode == "async" else True
    return Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=[DistCheckpointIO({"async_save": mode == "async"})],
                   callbacks=[*callbacks, ModelCheckpoint(root, every_n_train_steps=1, save_top_k=2,
                                                          save_last=last, monitor="step", mode="max")])
def checkpoints(root):
    out = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if is_staging_dir(path):
            out[name] = "staging"
            continue
        try:
            out[name] = DistCheckpointIO().load_checkpoint(path)["global_step"]
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out
root = sys.argv[1]
for mode, signame, n in json.loads(sys.argv[2]):
    sig[0] = getattr(signal, signame)
    shutil.rmtree(root, ignore_errors=True)
    try:
        trainer(root, mode, 5, Arm(n)).fit(BoringModel())
        outcome = "finished"
    except SystemExit as e:  # Lightning's sys.exit(1) after Ctrl-C; its SIGTERMException
        outcome = type(e).__name__
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores Ctrl-C from its first on
    seen, at[0] = calls[0], 0
    found, started = checkpoints(root), Started()
    trainer(root, mode, 6, started).fit(BoringModel(), ckpt_path="last")
    print(json.dumps([mode, signame, n, outcome, found, started.step, seen]), flush=True)
"""


def _trainer_runs(tmp_path, runs):
    r = _run_script(TRAINER, str(tmp_path / "ckpts"), json.dumps(runs))
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    assert r.returncode == 0 and len(results) == len(runs), (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    for mode, signame, n, outcome, found, resumed_at, seen in results:
        where = (mode, signame, n, outcome, found, resumed_at, seen)
        assert "staging" not in found.values(), where  # a single-process save removes its own
        links_to = found.pop("last.ckpt")
        assert isinstance(links_to, int) and resumed_at == links_to, where  # "last" whole, and resumed from
        steps = {name: step for name, step in found.items()}
        assert all(isinstance(s, int) and f"step={s}" in name for name, s in steps.items()), where
        assert links_to <= max(steps.values()), where  # Ctrl-C in last's own save: the earlier last stays
        if seen < n:  # the signal was never sent (the run had fewer fsyncs): the fit ran to its end
            assert outcome == "finished" and links_to == 5, where
        elif signame == "SIGTERM":  # Lightning only flags it: the checkpoint being written commits, the fit stops
            assert outcome == "SIGTERMException" and links_to == max(steps.values()), where
        else:  # Ctrl-C: step 3's checkpoint is committed only if it was in place (or written in the background)
            assert outcome == "SystemExit" and links_to in (2, 3), where
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trainer_stopped_during_a_checkpoint_resumes_from_a_whole_one(tmp_path, mode):
    """SIGTERM and Ctrl-C at two fsyncs once step 3's checkpoint begins (its first; one in ``last``'s save):
    every checkpoint left loads, none is a staging directory, ``last`` is the newest whole one, and
    ``ckpt_path="last"`` resumes from it."""
    _trainer_runs(tmp_path, [[mode, s, n] for s in ("SIGTERM", "SIGINT") for n in (1, 15)])


@pytest.mark.long
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trainer_stopped_at_every_fsync_of_a_checkpoint_resumes_from_a_whole_one(tmp_path, mode):
    _trainer_runs(tmp_path, [[mode, s, n] for s in ("SIGTERM", "SIGINT") for n in range(1, 30)])


@pytest.fixture
def s3_bucket(monkeypatch):
    """A moto S3 server on loopback (as ``tests/s3/conftest.py``'s) and a fresh bucket; the AWS environment
    points at it."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket="bkt")
    yield client
    server.stop()


class RequestsInterrupted:
    """A KeyboardInterrupt (as Ctrl-C) at the n-th request the library makes to S3 through ``ObjectStore`` (the
    marker, metadata, common state, listings, deletions; the shards' writes are tensorstore's, between them)."""

    def __init__(self, monkeypatch, n):
        from lightning_distckpt.storage.s3 import ObjectStore

        self.calls, self.n = 0, n
        for name in ("read", "size", "write", "list_keys", "delete", "delete_keys"):
            real = getattr(ObjectStore, name)

            def step(store, *args, _real=real, **kwargs):
                self.calls += 1
                if self.calls == self.n:
                    raise KeyboardInterrupt
                return _real(store, *args, **kwargs)

            monkeypatch.setattr(ObjectStore, name, step)


@pytest.mark.parametrize("how", ["save", "convert"])
def test_ctrl_c_at_every_request_of_an_s3_save_leaves_one_whole_checkpoint(tmp_path, s3_bucket, monkeypatch, how):
    """``ldc.save`` / ``convert --to distckpt`` to ``s3://`` over an earlier checkpoint, Ctrl-C at each request in
    turn: a load gives the earlier checkpoint or the new one, whole; ``inspect`` agrees; ``clean`` leaves the
    marker and the one version it names. Was (``convert``, and a save once a stopped commit removed its
    staging): Ctrl-C while the commit deleted the previous version, after the marker named the new one, deleted
    the new one too: the marker named nothing, and the checkpoint was lost."""
    from lightning_distckpt.cli.main import main

    url = "s3://bkt/ck"
    ldc.save(_tree(1.0), url)
    current, interrupted = 1.0, 0
    for n in range(1, 80):
        value = float(n + 1)
        source = str(tmp_path / f"src{n}")
        if how == "convert":
            ldc.save(_tree(value), source)
        with monkeypatch.context() as m:
            requests = RequestsInterrupted(m, n)
            try:
                if how == "save":
                    ldc.save(_tree(value), url)
                else:
                    assert main(["convert", source, url, "--to", "distckpt", "-q"]) in (0, 130)
            except KeyboardInterrupt:
                pass
        loaded = ldc.load_plain_tensors(url)
        assert loaded["w"].eq(loaded["w"].flatten()[0]).all() and loaded["b"].eq(loaded["w"][0, 0]).all(), n
        assert float(loaded["w"][0, 0]) in (current, value), (n, current, value)
        current = float(loaded["w"][0, 0])
        assert main(["inspect", url, "-q"]) == 0, n
        if requests.calls < n:  # the save ran to its end: every request was interrupted once
            break
        interrupted += 1
    assert interrupted >= 5 and current == value
    assert main(["clean", "s3://bkt/", "--older-than", "0", "-q"]) == 0
    listed = s3_bucket.list_objects_v2(Bucket="bkt").get("Contents", [])
    version = json.loads(s3_bucket.get_object(Bucket="bkt", Key="ck/COMMITTED")["Body"].read())["version"]
    left = {o["Key"].split("/")[1] for o in listed}
    assert left == {"COMMITTED", version}, left
