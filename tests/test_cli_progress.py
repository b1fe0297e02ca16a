"""Progress and logging you can see: a tqdm bar on a terminal for validate / convert (none in a pipe
or with --quiet), -v / --log-level, byte counts where the bytes move, and the library's one INFO
line per save / load: silent in plain Python, shown with logging.basicConfig or under Lightning."""

import os
import re
import select
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt import validate
from lightning_distckpt.convert import relayout_checkpoint
from lightning_distckpt.storage.tensorstore_io import StorageOptions

BAR = re.compile(rb"\d+%\|.*B/s")  # tqdm's meter: percentage, bar, bytes per second
CLI = [sys.executable, "-m", "lightning_distckpt"]


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


def _on_terminal(args, timeout=120):
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe); returns (rc, stdout, terminal bytes)."""
    master, slave = os.openpty()
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer closed it
                break
            if not chunk:
                break
            seen += chunk
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode(), seen


def test_bar_on_a_terminal_none_in_a_pipe_or_quiet(ckpt, tmp_path):
    for args in (["validate", ckpt], ["convert", ckpt, str(tmp_path / "hf"), "--to", "safetensors"],
                 ["convert", ckpt, str(tmp_path / "zarr"), "--to", "distckpt", "--layout", "zarr"]):
        rc, out, term = _on_terminal(args)
        assert rc == 0 and out, term
        assert BAR.search(term) and b"100%" in term, term  # a meter in bytes, finished
    rc, out, term = _on_terminal(["--quiet", "validate", ckpt])
    assert rc == 0 and out.startswith("OK") and b"%|" not in term and b"B/s" not in term, term
    rc, _, term = _on_terminal(["validate", ckpt, "-q"])  # after the command name too
    assert rc == 0 and b"%|" not in term
    piped = subprocess.run(CLI + ["validate", ckpt], capture_output=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout.startswith(b"OK")
    assert b"%|" not in piped.stderr and b"B/s" not in piped.stderr, piped.stderr


def test_verbose_and_log_level(ckpt, tmp_path):
    r = subprocess.run(CLI + ["convert", ckpt, str(tmp_path / "a.pt")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "INFO" not in r.stderr, r.stderr  # WARNING by default
    r = subprocess.run(CLI + ["-v", "convert", str(tmp_path / "a.pt"), str(tmp_path / "back")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.search(r"INFO lightning_distckpt\S*: save \S+: \d+\.\d KB in \d+\.\d+ s \(\d+\.\d [KMG]?B/s\)", r.stderr)
    r = subprocess.run(CLI + ["convert", ckpt, str(tmp_path / "b.pt"), "-vv", "--log-level", "warning"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "INFO" not in r.stderr and "DEBUG" not in r.stderr, r.stderr
    r = subprocess.run(CLI + ["validate", ckpt, "--log-level", "DEBUG", "-v"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "checked a" in r.stderr  # validate -v names each key
    r = subprocess.run(CLI + ["--log-level", "loud", "validate", ckpt], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'loud' is not a log level" in r.stderr


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


LIBRARY = textwrap.dedent("""
    import logging, sys, torch
    import lightning_distckpt as ldc
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "configured":
        logging.basicConfig(level=logging.INFO)
    if mode == "lightning":  # what a Trainer / Fabric run has: Lightning imported, our plugin set up
        import lightning
        from lightning.fabric.utilities.rank_zero import rank_zero_only
        ldc.lightning.DistCheckpointIO()
    state = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(1300, 250))}
    ldc.save(state, path)
    ldc.load(state, path)
    if mode == "lightning":
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

    assert "lightning_distckpt" not in run("plain") and "GB/s" not in run("plain")
    lines = [ln for ln in run("configured").splitlines() if "lightning_distckpt" in ln]
    assert len(lines) == 2, lines  # one per save and one per load
    assert re.search(r"INFO:lightning_distckpt\S*:save \S+: 1\.3 MB in \d+\.\d+ s \(\d+\.\d [KMG]?B/s\)$", lines[0])
    assert "load " in lines[1] and "1.3 MB" in lines[1]
    shown = run("lightning")
    assert re.search(rf"save {re.escape(str(tmp_path / 'lightning'))}: 1\.3 MB in", shown), shown
    assert "load " in shown and f"save {tmp_path / 'lightning'}2" not in shown and "a warning of rank 1" in shown
