"""Errors of the operating system say which file, and one leftover that cannot go keeps no other.

* A write or an fsync on a descriptor that fails (a full disk, a file-size limit) raises an OSError
  naming no file: a failed save named the staging directory but not the file (``common.pt``, a zarr
  chunk file written with ``O_DIRECT``). The file-size limit (``RLIMIT_FSIZE``, in a child process)
  stands for a full disk here: the write fails the same way, with no privileges or mounts needed.
* ``clean`` stopped at the first leftover it could not remove (an immutable file, a busy mount point,
  a denied delete) with a traceback, leaving every later one. Now each is reported ``failed``, the
  others are removed, and the exit status is 1.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from lightning_distckpt.cli.main import main
from lightning_distckpt.storage.staging import new_staging_dir

# Saves into FOLDER whose files may not exceed 256 KiB (SIGXFSZ ignored: a write beyond fails with
# EFBIG instead of killing the process): a 1 MiB common state (OCDBT), and a 1 MiB tensor in the zarr
# layout, whose chunk file is written by us with O_DIRECT (storage/direct_write.py). Prints each
# SaveFailedError's message, as JSON.
SAVER = """
import json, os, resource, signal, sys, torch, lightning_distckpt as ldc
folder = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
cases = {"common": ("ocdbt", 16, 1 << 20), "direct": ("zarr", 1 << 18, 0)}
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
out = {}
for name, (layout, numel, blob) in cases.items():
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(numel, dtype=torch.float32)),
          "blob": b"x" * blob}
    try:
        ldc.save(sd, os.path.join(folder, name), storage=ldc.StorageOptions(layout=layout))
        out[name] = "saved"
    except ldc.SaveFailedError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_a_failed_write_names_the_file(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SAVER, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "File too large" in messages["common"] and "common.pt" in messages["common"], messages
    assert "File too large" in messages["direct"] and f"{os.sep}c{os.sep}" in messages["direct"], messages
    assert sorted(os.listdir(tmp_path)) == []  # nothing committed, no staging directory left


def _leftover(target: str, name: str = "f") -> str:
    """What a save to ``target`` killed before its commit leaves beside it, holding one file."""
    staging = new_staging_dir(target)
    os.makedirs(os.path.join(staging, "data"))
    with open(os.path.join(staging, "data", name), "wb") as f:
        f.write(b"0" * 1000)
    return staging


def _pin(path: str) -> None:
    """Make ``path`` impossible to remove: immutable as root (where chattr works: ext4, xfs), else
    its directory read-only (which root ignores)."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", path], capture_output=True).returncode:
            pytest.skip("needs chattr +i (as root, read-only directories do not stop a removal)")
    else:
        os.chmod(os.path.dirname(path), 0o555)


def _unpin(path: str) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", path], capture_output=True)
    else:
        os.chmod(os.path.dirname(path), 0o755)


def test_clean_goes_on_past_a_leftover_it_cannot_remove(tmp_path):
    stuck = _leftover(str(tmp_path / "a"))
    others = [_leftover(str(tmp_path / n)) for n in ("b", "c")]
    pinned = os.path.join(stuck, "data", "f")
    _pin(pinned)
    try:
        proc = subprocess.run([sys.executable, "-m", "lightning_distckpt", "clean", str(tmp_path),
                               "--older-than", "0", "--json"], capture_output=True, text=True, timeout=120)
        again = _leftover(str(tmp_path / "d"))  # for the text report
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(["clean", str(tmp_path), "--older-than", "0"])
    finally:
        _unpin(pinned)
    assert proc.returncode == 1, proc.stderr[-3000:]
    actions = {a["path"]: a for a in json.loads(proc.stdout)}
    assert actions[stuck]["action"] == "failed" and "removing it failed" in actions[stuck]["reason"], actions
    assert all(actions[o]["action"] == "removed" and not os.path.exists(o) for o in others), actions
    assert os.path.exists(pinned)
    # The text report says it too, and so does its exit status.
    assert status == 1 and "could not be removed" in out.getvalue(), out.getvalue()
    assert f"failed       {stuck}" in out.getvalue() and not os.path.exists(again), out.getvalue()
