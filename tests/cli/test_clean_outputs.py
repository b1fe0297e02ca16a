"""``clean DIR`` removes the temporaries a killed export or conversion left (``.NAME.tmp-PID-RANDOM``)
once their writer is gone, keeps an earlier export moved aside while its name is missing (the only
copy), and touches nothing else."""

import os
import subprocess
import sys

from lightning_distckpt.cli.clean import clean
from lightning_distckpt.cli.main import main
from lightning_distckpt.storage.output_files import temp_name
from lightning_distckpt.storage.output_leftovers import find_output_leftovers


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _named(directory, name, tag, pid):
    """A name as ``temp_name`` makes it, for a writer of ``pid``."""
    ours = os.path.basename(temp_name(os.path.join(directory, name), tag))
    prefix, _, random = ours.rpartition("-")
    return os.path.join(directory, f"{prefix.rsplit('-', 1)[0]}-{pid}-{random}")


def test_killed_writers_temporaries_are_removed_and_nothing_else(tmp_path):
    d = str(tmp_path)
    dead = _dead_pid()
    tmp_file = _named(d, "model.ckpt", "tmp", dead)
    open(tmp_file, "wb").write(b"x" * 1000)
    tmp_dir = _named(d, "export_dcp", "tmp", dead)
    os.makedirs(os.path.join(tmp_dir, "sub"))
    open(os.path.join(tmp_dir, "sub", "__0_0.distcp"), "wb").write(b"y" * 500)
    os.makedirs(os.path.join(d, "hf"))  # an output whose earlier copy was moved aside: superseded
    old_superseded = _named(d, "hf", "old", dead)
    os.makedirs(old_superseded)
    old_only_copy = _named(d, "gone", "old", dead)  # its name is missing: the only copy of it
    os.makedirs(old_only_copy)
    keep = [os.path.join(d, ".notes.tmp-12-zz"), os.path.join(d, "model.ckpt.tmp-1-0123456789abcdef")]
    for path in keep:
        open(path, "w").write("the user's")
    link = _named(d, "linked", "tmp", dead)
    os.symlink(str(tmp_path / "hf"), link)
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        busy = _named(d, "busy.ckpt", "tmp", live.pid)
        open(busy, "wb").write(b"z")
        found = {os.path.basename(lo.path): lo for lo in find_output_leftovers(d)}
        assert set(found) == {os.path.basename(p) for p in (tmp_file, tmp_dir, old_superseded, old_only_copy, busy)}
        assert found[os.path.basename(tmp_dir)].nbytes == 500
        actions = {os.path.basename(a.leftover.path): a for a in clean(d, 0.0, dry_run=False)}
        running = actions[os.path.basename(busy)]
        assert running.action == "kept" and "still runs" in running.reason
        only = actions[os.path.basename(old_only_copy)]
        assert only.action == "kept" and "the only copy" in only.reason and "mv " in only.reason
        for path in (tmp_file, tmp_dir, old_superseded):
            assert actions[os.path.basename(path)].action == "removed" and not os.path.lexists(path)
        assert all(os.path.exists(p) for p in keep + [busy, old_only_copy]) and os.path.islink(link)
        assert os.path.isdir(tmp_path / "hf")
    finally:
        live.stdin.close()
        live.wait()


def test_recent_temporaries_wait_for_older_than_and_dry_run_removes_nothing(tmp_path, capsys):
    d = str(tmp_path)
    path = _named(d, "out.ckpt", "tmp", _dead_pid())
    open(path, "wb").write(b"x")
    assert main(["clean", d]) == 0  # the default --older-than 600: changed just now
    assert os.path.exists(path) and "changed" in capsys.readouterr().out
    assert main(["clean", d, "--older-than", "0", "--dry-run"]) == 0
    assert os.path.exists(path) and "would remove" in capsys.readouterr().out
    assert main(["clean", d, "--older-than", "0"]) == 0
    assert not os.path.exists(path) and "removed" in capsys.readouterr().out
