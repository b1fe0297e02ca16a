"""Progress and logging you can see: a tqdm bar on a terminal for validate / convert / inspect (none
in a pipe or with --quiet), -v / --log-level, byte counts where the bytes move, and the library's one
INFO line per save / load / load_plain_tensors: silent in plain Python, shown with
logging.basicConfig or under Lightning.

The CLI runs in this process (``main(argv)``, what ``python -m lightning_distckpt`` calls) with its
stderr on a real pseudo-terminal, or on a file: a process start costs seconds, a command here
milliseconds. One run goes through ``python -m`` on a terminal, as a user types it.
"""

import contextlib
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_distckpt as ldc
from lightning_distckpt import validate
from lightning_distckpt.cli import output
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.cli.foreign import open_foreign, summarize_foreign
from lightning_distckpt.cli.inspect import summarize
from lightning_distckpt.cli.main import main
from lightning_distckpt.convert import relayout_checkpoint
from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
from lightning_distckpt.storage.tensorstore_io import StorageOptions
from terminal import drain, run_on_terminal

BAR = re.compile(rb"\d+%\|.*B/s")  # tqdm's meter: percentage, bar, bytes per second
KEY_BAR = re.compile(rb"\d+%\|.*key/s")  # inspect's: keys described
CLI = [sys.executable, "-m", "lightning_distckpt"]
RATE = r"\d+\.\d+ s \(\d+\.\d [KMG]?B/s\)"  # the INFO line's "0.052 s (25.4 MB/s)"


class Counter:
    """What the library reports to: tqdm's ``total`` and ``update``."""

    def __init__(self):
        self.total, self.n = None, 0

    def update(self, n=1):
        self.n += n


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("progress") / "ckpt")
    ldc.save({"a": ldc.ShardedTensor.from_rank_offsets("a", torch.randn(256, 64)),
              "b": ldc.ShardedTensor.from_rank_offsets("b", torch.randn(100)),
              "o": ldc.ShardedObject("o", {"x": 1}, (1,), (0,)), "step": 3}, path)
    return path


@pytest.fixture(scope="module")
def foreign(ckpt, tmp_path_factory):
    """A PyTorch DCP directory written by torch, and a Megatron-Core torch_dist directory."""
    root = tmp_path_factory.mktemp("foreign")
    with warnings.catch_warnings():  # torch's "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.randn(64, 32), "v": torch.arange(10.0)}, checkpoint_id=str(root / "dcp"), no_dist=True)
    ldc.export.to_megatron(ckpt, str(root / "megatron"))
    return {"dcp": str(root / "dcp"), "megatron": str(root / "megatron")}


def cli(args, terminal=True):
    """Run the CLI in this process with stderr on a pseudo-terminal (``terminal``) or on a file, as
    ``2> FILE`` would; returns (exit status, stdout, the bytes stderr received)."""
    out, seen = io.StringIO(), []
    if terminal:
        master, slave = os.openpty()
        err = open(slave, "w", encoding="utf-8", buffering=1)
        reader = threading.Thread(target=drain, args=(master, seen), daemon=True)
        reader.start()
    else:
        err = tempfile.TemporaryFile("w+", encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as e:  # argparse's usage errors
                rc = e.code
        if not terminal:
            err.seek(0)
            seen.append(err.read().encode())
    finally:
        err.close()
        if terminal:
            reader.join(60)  # a failure bound: the reader ends at EIO once the terminal is closed
            os.close(master)
    return rc, out.getvalue(), b"".join(seen)


def test_bar_on_a_terminal_none_in_a_file_or_quiet(ckpt, tmp_path):
    for args in (["validate", ckpt], ["convert", ckpt, str(tmp_path / "hf"), "--to", "safetensors"],
                 ["convert", ckpt, str(tmp_path / "zarr"), "--to", "distckpt", "--layout", "zarr"]):
        rc, out, term = cli(args)
        assert rc == 0 and out, term
        assert BAR.search(term) and b"100%" in term, term  # a meter in bytes, finished
    rc, out, term = cli(["--quiet", "validate", ckpt])
    assert rc == 0 and out.startswith("OK") and b"%|" not in term and b"B/s" not in term, term
    rc, _, term = cli(["validate", ckpt, "-q"])  # after the command name too
    assert rc == 0 and b"%|" not in term
    rc, out, err = cli(["validate", ckpt], terminal=False)
    assert rc == 0 and out.startswith("OK") and b"%|" not in err and b"B/s" not in err, err


def test_inspect_bar_is_the_same_for_every_format(ckpt, foreign, monkeypatch):
    # inspect's bar appears once describing has taken QUICK_BAR_DELAY_S; at 0 it is drawn at once.
    monkeypatch.setattr(output, "QUICK_BAR_DELAY_S", 0.0)
    for path, shown in ((ckpt, "2 tensor(s)"), (foreign["dcp"], "PyTorch DCP"),
                        (foreign["megatron"], "Megatron-Core torch_dist")):
        rc, out, term = cli(["inspect", path])
        assert rc == 0 and shown in out, out
        assert KEY_BAR.search(term) and b"100%" in term, (path, term)
        rc, out, term = cli(["inspect", path, "--quiet"])
        assert rc == 0 and shown in out and b"%|" not in term, (path, term)
        rc, out, err = cli(["inspect", path, "--json"], terminal=False)
        assert rc == 0 and out.startswith("{") and b"%|" not in err, (path, err)


def test_a_bar_through_the_console_entry_point(foreign):
    """``python -m lightning_distckpt validate DCP_DIR`` with stderr on a terminal (stdout a pipe)."""
    returncode, out, term = run_on_terminal(CLI + ["validate", foreign["dcp"]])
    assert returncode == 0 and re.search(rb"^OK: ", out, re.M), (out, term)  # after the no-checksums warning
    assert BAR.search(term) and b"100%" in term, term


def test_verbose_and_log_level(ckpt, tmp_path):
    rc, _, err = cli(["convert", ckpt, str(tmp_path / "a.pt")], terminal=False)
    assert rc == 0 and b"INFO" not in err, err  # WARNING by default
    rc, _, err = cli(["-v", "convert", str(tmp_path / "a.pt"), str(tmp_path / "back")], terminal=False)
    assert rc == 0, err
    assert re.search(rf"INFO lightning_distckpt\S*: save \S+: \d+\.\d KB in {RATE}", err.decode()), err
    rc, _, err = cli(["convert", ckpt, str(tmp_path / "b.pt"), "-v"], terminal=False)  # reads it all whole
    assert rc == 0 and re.search(rf"INFO lightning_distckpt\S*: load_plain_tensors \S+: \d+\.\d KB in {RATE}",
                                 err.decode()), err
    rc, _, err = cli(["convert", ckpt, str(tmp_path / "c.pt"), "-vv", "--log-level", "warning"], terminal=False)
    assert rc == 0 and b"INFO" not in err and b"DEBUG" not in err, err
    rc, _, err = cli(["validate", ckpt, "--log-level", "DEBUG", "-v"], terminal=False)
    assert rc == 0 and b"checked a" in err  # validate -v names each key
    rc, _, err = cli(["--log-level", "loud", "validate", ckpt], terminal=False)
    assert rc == 2 and b"'loud' is not a log level" in err


def test_bytes_are_counted_where_they_move(ckpt, tmp_path):
    tensor_bytes = (256 * 64 + 100) * 4
    c = Counter()
    report = validate(ckpt, progress=c)
    assert report.ok and c.n == c.total == report.bytes_read and c.n > tensor_bytes  # objects, common state
    c = Counter()
    relayout_checkpoint(ckpt, str(tmp_path / "copy"), StorageOptions(layout="zarr"), progress=c)
    assert c.n == c.total and c.n > tensor_bytes
    c = Counter()
    ldc.export.to_safetensors(ckpt, str(tmp_path / "hf"), progress=c)
    assert c.n == c.total == tensor_bytes
    c = Counter()
    ldc.export.to_dcp(ckpt, str(tmp_path / "dcp"), progress=c)
    assert c.n == c.total == tensor_bytes
    c = Counter()
    ldc.export.to_torch_file(ckpt, str(tmp_path / "x.pt"), progress=c)
    assert c.n == os.path.getsize(tmp_path / "x.pt") and c.total >= tensor_bytes
    # clean: the bytes of the staging directories it removes
    stale = tmp_path / "dir" / ".ckpt.distckpt-staging-x-1"
    stale.mkdir(parents=True)
    (stale / "blob").write_bytes(b"x" * 5000)
    os.utime(stale, (0, 0))
    c = Counter()
    actions = clean(str(tmp_path / "dir"), 0, False, progress=c)
    assert [a.action for a in actions] == ["removed"] and c.n == c.total == actions[0].leftover.nbytes


def test_inspect_counts_keys_in_every_format(ckpt, foreign):
    c = Counter()
    summarize(OpenedCheckpoint.open(ckpt), c)
    assert c.n == c.total == 2
    for path, keys in ((foreign["dcp"], 2), (foreign["megatron"], 2)):
        c = Counter()
        summary = summarize_foreign(open_foreign(path), c)
        assert c.n == c.total == len(summary["tensors"]) == keys, path


def test_load_plain_tensors_logs_one_info_line(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="lightning_distckpt")
    caplog.clear()
    tensors = ldc.load_plain_tensors(ckpt)
    assert sorted(tensors) == ["a", "b"]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 1 and re.fullmatch(rf"load_plain_tensors {re.escape(ckpt)}: \d+\.\d KB in {RATE}",
                                            lines[0]), lines


LIBRARY = textwrap.dedent("""
    import logging, sys, torch
    import lightning_distckpt as ldc
    mode, path = sys.argv[1], sys.argv[2]
    state = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(1300, 250))}

    def save_and_load(path):
        ldc.save(state, path)
        ldc.load(state, path)
        ldc.load_plain_tensors(path)

    if mode == "plain":  # nothing configured (quiet), then logging.basicConfig (shown)
        save_and_load(path)
        print("-- configured --", file=sys.stderr, flush=True)
        logging.basicConfig(level=logging.INFO)
        save_and_load(path + "c")
    else:  # what a Trainer / Fabric run has: Lightning imported, our plugin set up
        import lightning
        from lightning.fabric.utilities.rank_zero import rank_zero_only
        ldc.lightning.DistCheckpointIO()
        save_and_load(path)
        rank_zero_only.rank = 1  # another rank: its INFO lines are not printed, its warnings are
        ldc.save(state, path + "2")
        logging.getLogger("lightning_distckpt.test").warning("a warning of rank 1")
""")


def test_library_logging_quiet_by_default_shown_when_configured_and_under_lightning(tmp_path):
    def run(mode):
        r = subprocess.run([sys.executable, "-c", LIBRARY, mode, str(tmp_path / mode)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stderr

    plain, configured = run("plain").split("-- configured --\n")
    assert "lightning_distckpt" not in plain and "B/s" not in plain, plain
    lines = [ln for ln in configured.splitlines() if "lightning_distckpt" in ln]
    assert len(lines) == 3, lines  # one per save, load and load_plain_tensors
    assert re.search(rf"INFO:lightning_distckpt\S*:save \S+: 1\.3 MB in {RATE}$", lines[0])
    assert "load " in lines[1] and "1.3 MB" in lines[1]
    assert re.search(rf":load_plain_tensors \S+: 1\.3 MB in {RATE}$", lines[2]), lines[2]
    shown = run("lightning")
    assert re.search(rf"save {re.escape(str(tmp_path / 'lightning'))}: 1\.3 MB in", shown), shown
    assert re.search(r"load_plain_tensors \S+: 1\.3 MB in", shown), shown
    assert "load " in shown and f"save {tmp_path / 'lightning'}2" not in shown and "a warning of rank 1" in shown
