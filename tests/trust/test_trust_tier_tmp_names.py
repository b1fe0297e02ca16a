"""Entries of a node root named like the tier's temporary directories (``.ldc-tier-tmp-*``) that are
not directories of ours: a FIFO, a file, a link to a directory outside. A local save prunes, and
``clean`` removes, only real directories of that name: a FIFO used to block ``shutil.rmtree`` for
ever (it opens its argument), a file or link made ``clean`` fail with a traceback (and ``--dry-run``
count the bytes behind the link). Each entry stays; nothing outside changes."""

import contextlib
import io
import json
import os

import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.tiers import LocalTier, TierOptions
from trust.hostile import run_bounded, snapshot


def _state(step):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0) + step), "step": step}


def _plant(root, outside):
    os.mkfifo(os.path.join(root, ".ldc-tier-tmp-000000001-fifo"))
    with open(os.path.join(root, ".ldc-tier-tmp-000000001-file"), "w") as f:
        f.write("not ours")
    os.symlink(outside, os.path.join(root, ".ldc-tier-tmp-000000001-link"))
    os.mkdir(os.path.join(root, ".ldc-tier-tmp-000000001-ours"))  # a real one: removed


def _open_fifo(root):
    """End a blocked open of the FIFO (the writer's side), should a regression block on it."""
    fd = os.open(os.path.join(root, ".ldc-tier-tmp-000000001-fifo"), os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)


def test_a_local_save_prunes_only_real_temporary_directories(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("theirs")
    before = snapshot(str(outside))
    tier = LocalTier(TierOptions(local_dir=str(tmp_path / "root"), keep_local=2))
    _plant(tier.root, str(outside))

    def save():
        tier.save(_state(1), 1)
        tier.wait()
        return tier.recoverable()

    out = run_bounded(save, 60, on_timeout=lambda: _open_fifo(tier.root))
    assert "error" not in out, out.get("error")
    assert out["value"].step == 1
    names = sorted(os.listdir(tier.root))
    assert [n for n in names if n.startswith(".ldc-tier-tmp-")] == [
        ".ldc-tier-tmp-000000001-fifo", ".ldc-tier-tmp-000000001-file", ".ldc-tier-tmp-000000001-link"]
    tier.close()
    assert snapshot(str(outside)) == before


def test_clean_of_a_node_root_skips_what_is_not_a_directory_of_ours(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.bin").write_bytes(bytes(1 << 20))
    before = snapshot(str(outside))
    tier = LocalTier(TierOptions(local_dir=str(tmp_path / "root"), keep_local=2))
    tier.save(_state(1), 1)
    tier.close()
    root = tier.root
    _plant(root, str(outside))

    def clean(*extra):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["clean", root, "--older-than", "0", "--json", *extra])
        return code, out.getvalue(), err.getvalue()

    dry = run_bounded(lambda: clean("--dry-run"), 60, on_timeout=lambda: _open_fifo(root))["value"]
    assert dry[0] == 0 and "Traceback" not in dry[2], dry
    listed = json.dumps(json.loads(dry[1]))
    assert "-ours" in listed and "-fifo" not in listed and "-file" not in listed and "-link" not in listed
    assert str(1 << 20) not in listed  # the bytes behind the link are not counted as ours
    done = run_bounded(clean, 60, on_timeout=lambda: _open_fifo(root))["value"]
    assert done[0] == 0 and "Traceback" not in done[2], done
    assert not os.path.exists(os.path.join(root, ".ldc-tier-tmp-000000001-ours"))
    for kind in ("fifo", "file", "link"):
        assert os.path.lexists(os.path.join(root, f".ldc-tier-tmp-000000001-{kind}"))
    assert snapshot(str(outside)) == before
