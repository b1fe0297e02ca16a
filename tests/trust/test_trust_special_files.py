"""A FIFO, a Unix socket or a directory in place of any file a reader opens (our checkpoints in both
layouts, ``torch.save`` and ``.safetensors`` files, Hugging Face directories with and without an
index, DCP, Megatron-Core ``torch_dist``) ends ``load``, ``validate``, ``inspect`` and ``convert``
with a clear error naming the file and what it is, never a wait for a writer that never comes; a
FIFO owner note in a leftover staging directory is no evidence of a live save (``save``,
``inspect`` and ``clean`` go on). Each command runs in a fresh process, bounded at 60 s
(:func:`special_files.run_bounded`)."""

import os
import shutil
import socket
import stat
import subprocess
import sys
import threading

import pytest

from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.storage import paths
from special_files import BOUND_S, Runner, build, make_special, save_ours, target_paths, unblock_fifos

KIND_WORD = {"fifo": "FIFO", "socket": "socket", "dir": "directory"}
OURS = ("ocdbt", "zarr")


@pytest.fixture(scope="module")
def runner():
    """One process runs this module's commands (a hang kills it; the next command starts another)."""
    r = Runner()
    yield r
    r.close()


def commands(fmt, ckpt, out):
    """What each format is read by: ``load`` always; ``validate`` / ``inspect`` where the CLI reads
    the format; ``convert`` (our checkpoints to a torch file, a torch file to a checkpoint, the
    others to another format)."""
    cmds = [{"op": "load", "fmt": fmt, "path": ckpt}]
    if fmt in OURS + ("dcp", "megatron"):
        cmds += [{"op": "cli", "argv": ["validate", ckpt]}, {"op": "cli", "argv": ["inspect", ckpt]}]
    to = {"ocdbt": "torch", "zarr": "torch", "torch": "distckpt", "safetensors": "distckpt",
          "dcp": "safetensors"}.get(fmt, "dcp")
    cmds.append({"op": "cli", "argv": ["convert", ckpt, out, "--to", to]})
    return cmds


def check_outcome(o, special, kind):
    """A clear error, or (``inspect``, which reads metadata only; a read that never needs the file)
    success. A refusal names the file and, for a FIFO or socket, what it is."""
    what = o["op"] if o["op"] != "cli" else o["argv"][0]
    assert o.get("checkpointing_error", True), f"{what} {special}: not a CheckpointingError: {o}"
    if o["ok"]:
        assert what == "inspect" or (what == "load" and o.get("exact")), f"{what} {special} succeeded: {o}"
        return
    message = o.get("message", "")
    if kind in ("fifo", "socket") and what != "validate":  # validate's report goes to stdout (exit 1)
        assert os.path.basename(special) in message and KIND_WORD[kind] in message, f"{what} {special}: {o}"


def _run_variant(runner, tmp_path, fmt, kind):
    """For each file of ``fmt`` a reader opens: a fresh checkpoint with that file replaced by
    ``kind``, every command run on it."""
    cmds, specials = [], []
    template = tmp_path / "template"
    template.mkdir()
    original = build(fmt, str(template / ("model.pt" if fmt == "torch" else "model.safetensors" if
                                          fmt == "safetensors" else "ck")))
    for i, rel in enumerate(target_paths(fmt, original)):
        case = tmp_path / f"case{i}"
        case.mkdir()
        copy = str(case / os.path.basename(original))
        if os.path.isdir(original):
            shutil.copytree(original, copy, symlinks=True)
        else:
            shutil.copy(original, copy)
        special = copy + rel[len(original):]
        make_special(special, kind)
        for c in commands(fmt, copy, str(case / "out")):
            cmds.append(c)
            specials.append(special)
    try:
        outcomes = runner.run(cmds)
    finally:
        unblock_fifos(str(tmp_path))
    for o, special in zip(outcomes, specials):
        check_outcome(o, special, kind)
    return outcomes


FORMATS = ["ocdbt", "zarr", "torch", "safetensors", "hf", "hf_bin", "hf_index", "dcp", "megatron"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_fifo_in_place_of_any_file_is_refused(runner, tmp_path, fmt):
    outcomes = _run_variant(runner, tmp_path, fmt, "fifo")
    loads = [o for o in outcomes if o["op"] == "load"]
    assert loads and not any(o["ok"] for o in loads)  # every file here is needed by a load


@pytest.mark.parametrize("kind", ["socket", "dir"])
@pytest.mark.parametrize("fmt", ["ocdbt", "hf_index", "dcp"])
def test_a_socket_or_directory_in_place_of_a_file_is_refused(runner, tmp_path, fmt, kind):
    _run_variant(runner, tmp_path, fmt, kind)


def test_the_command_line_itself_says_fifo(tmp_path):
    """``python -m lightning_distckpt validate`` (the real entry point) on a FIFO ``common.pt``:
    exit 1, the report names it."""
    ck = save_ours(str(tmp_path / "ck"))
    make_special(os.path.join(ck, "common.pt"), "fifo")
    try:
        done = subprocess.run([sys.executable, "-m", "lightning_distckpt", "validate", ck], capture_output=True,
                              text=True, timeout=BOUND_S)
    finally:
        unblock_fifos(ck)
    assert done.returncode == 1, done
    assert "common.pt" in done.stdout and "FIFO" in done.stdout, done.stdout


def _staging_with_fifo_note(ck):
    staging = os.path.join(os.path.dirname(ck), f".{os.path.basename(ck)}.distckpt-staging-0123456789ab")
    os.makedirs(os.path.join(staging, ".writing"))
    os.mkfifo(os.path.join(staging, ".writing", "rank_00000.json"))
    with open(os.path.join(staging, "common.pt"), "wb") as f:
        f.write(b"half written")
    return staging


def test_a_fifo_owner_note_is_no_evidence_of_a_live_save(runner, tmp_path):
    ck = save_ours(str(tmp_path / "ck"))
    staging = _staging_with_fifo_note(ck)
    try:
        outcomes = runner.run([{"op": "save", "path": ck}, {"op": "cli", "argv": ["inspect", ck, "--json"]},
                                {"op": "cli", "argv": ["clean", str(tmp_path), "--older-than", "0"]},
                                {"op": "load", "fmt": "ocdbt", "path": ck}])
    finally:
        unblock_fifos(str(tmp_path))
    for o in outcomes:
        assert o["ok"], o
    assert outcomes[-1]["exact"] and not os.path.exists(staging)


# -- the helper itself, in this process (bounded: a regression would block the open) ------------
def _bounded(fn, root):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=_capture(fn)), daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        unblock_fifos(root)
        thread.join(BOUND_S)
        pytest.fail(f"{fn} blocked")
    return box["result"]


def _capture(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        return e


@pytest.mark.parametrize("kind", ["fifo", "socket", "dir"])
@pytest.mark.parametrize("root", [None, "dir"])
def test_open_regular_refuses_special_files_without_waiting(tmp_path, kind, root):
    path = str(tmp_path / "f")
    make_special(path, kind)
    got = _bounded(lambda: paths.read_inside(path, "file", None if root is None else str(tmp_path)), str(tmp_path))
    assert isinstance(got, FormatError) and KIND_WORD[kind] in str(got) and path in str(got), got


def test_open_regular_refuses_a_device(tmp_path):
    got = _bounded(lambda: paths.read_inside("/dev/null", "file", paths.ANYWHERE), str(tmp_path))
    assert isinstance(got, FormatError) and "character device" in str(got)


def test_a_regular_file_is_read_blocking(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100_000)
    fd = paths.open_regular(str(tmp_path / "f"), "file")
    try:
        assert os.get_blocking(fd) and len(os.read(fd, 200_000)) == 100_000
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_scan_tree_refuses_special_entries(tmp_path, kind):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"12")
    make_special(str(tmp_path / "d" / "sub" / "x"), kind)
    with pytest.raises(FormatError, match=f"sub/x is (a|an) .*{KIND_WORD[kind]}"):
        paths.scan_tree(str(tmp_path / "d"), "store")
    os.remove(tmp_path / "d" / "sub" / "x")
    assert paths.scan_tree(str(tmp_path / "d"), "store") == (1, 2)


def test_a_special_file_is_named_for_what_it_is():
    assert paths.kind_of(stat.S_IFIFO) == "a FIFO (named pipe)"
    assert paths.kind_of(stat.S_IFSOCK) == "a socket"
    assert paths.kind_of(stat.S_IFBLK) == "a block device"


def test_owner_notes_that_are_no_notes_are_no_evidence(tmp_path):
    from lightning_distckpt.storage.staging import _live_owners

    notes = tmp_path / "s" / ".writing"
    notes.mkdir(parents=True)
    os.mkfifo(notes / "rank_00000.json")
    (notes / "rank_00001.json").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(notes / "rank_00002.json"))
    sock.close()
    (notes / "rank_00003.json").write_text(f'{{"host": "{socket.gethostname()}", "pid": -1}}')
    (notes / "rank_00004.json").write_text("[1, 2]")
    assert _bounded(lambda: _live_owners(str(tmp_path / "s")), str(tmp_path)) == []


@pytest.mark.parametrize("kind", ["fifo", "socket", "file"])
def test_an_entry_beside_the_rank_stores_is_reported_alike_by_inspect_and_validate(runner, tmp_path, kind):
    """Something no save writes, put in ``data/`` beside the rank stores, is never opened by a load:
    ``inspect`` and ``validate`` both succeed and both name it (``inspect`` used to refuse a FIFO
    there while ``validate`` said OK), and it is left in place."""
    ck = save_ours(str(tmp_path / "ck"))
    planted = os.path.join(ck, "data", "planted")
    if kind == "file":
        with open(planted, "wb") as f:
            f.write(b"not ours")
    else:
        make_special(planted, kind)
    try:
        outcomes = runner.run([{"op": "cli", "argv": ["inspect", ck]}, {"op": "cli", "argv": ["validate", ck]},
                               {"op": "load", "fmt": "ocdbt", "path": ck}])
    finally:
        unblock_fifos(str(tmp_path))
    inspect, validate, load = outcomes
    assert inspect["ok"] and validate["ok"] and load["ok"] and load["exact"], outcomes
    word = {"fifo": "FIFO", "socket": "socket", "file": "regular file"}[kind]
    for o in (inspect, validate):
        assert f"data/planted: a {word}" in o["stdout"], o
        assert "not written by a save" in o["stdout"], o
    assert os.path.lexists(planted)
