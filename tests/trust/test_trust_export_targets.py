"""What an export may replace at its destination, and what it writes through.

* A ``torch.save`` output (``to_torch_file``, ``convert --to torch``) replaces only a regular file
  that is a ``torch.save`` archive, or empty: a text file, a zip of another kind, a directory or a link
  (to a file or a dangling one) is refused with an ArgumentError naming it (exit status 2), nothing
  touched. Its temporary file is created with a fresh random name: a link planted at the name an
  earlier release used (``.out.pt.tmp-<pid>``) is neither written through nor renamed into place.
* A DCP / Megatron-Core output (``to_dcp``, ``to_megatron``) replaces only an empty directory or a
  DCP / ``torch_dist`` checkpoint: a directory holding a user's file beside a ``.metadata``, a
  ``.metadata`` that is no DCP metadata or is a link, a ``metadata.json`` that is not Megatron's,
  or a directory named like a ``.distcp`` file is refused, and nothing in it is deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import stat
import warnings
import zipfile

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import ArgumentError

WEIGHT = torch.arange(24, dtype=torch.float32).reshape(6, 4)
PRECIOUS = b"years of work\n"


def tree_hashes(root) -> dict:
    """relative path -> sha256 of every file under ``root`` (links as their target text)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in files + [n for n in dirs if os.path.islink(os.path.join(d, n))]:
            path = os.path.join(d, name)
            if os.path.islink(path):
                out[os.path.relpath(path, root)] = "link:" + os.readlink(path)
            else:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def cli(argv) -> tuple:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, err.getvalue()


@pytest.fixture
def ck(tmp_path) -> str:
    path = str(tmp_path / "CK")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", WEIGHT.clone()),
              "rng": ldc.ShardedObject("rng", {"seed": 7}, (1,), (0,)), "step": 3}, path)
    return path


@pytest.fixture
def place(tmp_path) -> str:
    """An empty folder for outputs, beside a user's file ``victim.txt`` outside it."""
    (tmp_path / "victim.txt").write_bytes(PRECIOUS)
    out = tmp_path / "out"
    out.mkdir()
    return str(out)


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def dcp_dir(path: str) -> str:
    """A DCP checkpoint written by ``dcp.save`` itself."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"x": torch.ones(3)}, checkpoint_id=path, no_dist=True)
    return path


# -- torch.save outputs -------------------------------------------------------------------------------
def test_a_link_at_the_old_temporary_name_is_not_written_through(ck, place, tmp_path):
    out = os.path.join(place, "out.pt")
    planted = os.path.join(place, f".out.pt.tmp-{os.getpid()}")
    os.symlink(tmp_path / "victim.txt", planted)
    report = ldc.export.to_torch_file(ck, out)
    assert (tmp_path / "victim.txt").read_bytes() == PRECIOUS
    assert os.path.islink(planted) and not os.path.islink(out) and stat.S_ISREG(os.lstat(out).st_mode)
    assert report.destination == out and torch.equal(torch.load(out, weights_only=True)["tensors"]["w"], WEIGHT)
    assert sorted(os.listdir(place)) == sorted(["out.pt", os.path.basename(planted)])  # no temporary file left


def test_the_file_gets_the_mode_of_a_new_file(ck, place):
    reference = write(os.path.join(place, "reference"), b"")  # created as any new file is here
    out = os.path.join(place, "out.pt")
    ldc.export.to_torch_file(ck, out)
    assert stat.S_IMODE(os.stat(out).st_mode) == stat.S_IMODE(os.stat(reference).st_mode)


def _not_torch_files(place: str, tmp_path) -> dict:
    npz = os.path.join(place, "arrays.pt")
    with zipfile.ZipFile(npz, "w") as z:  # a zip, not torch's: records not under one folder with data.pkl
        z.writestr("a.npy", b"\x93NUMPY")
    os.mkdir(os.path.join(place, "folder.pt"))
    torch.save({"w": WEIGHT}, str(tmp_path / "real.pt"))
    os.symlink(tmp_path / "real.pt", os.path.join(place, "link-to-torch.pt"))
    os.symlink(tmp_path / "victim.txt", os.path.join(place, "link-to-text.pt"))
    os.symlink(tmp_path / "absent", os.path.join(place, "dangling.pt"))
    return {"text": write(os.path.join(place, "existing.pt"), b"not a checkpoint\n"), "other zip": npz,
            "directory": os.path.join(place, "folder.pt"),
            "link to a torch file": os.path.join(place, "link-to-torch.pt"),
            "link to a text file": os.path.join(place, "link-to-text.pt"),
            "dangling link": os.path.join(place, "dangling.pt")}


def test_only_a_torch_file_is_replaced(ck, place, tmp_path):
    targets = _not_torch_files(place, tmp_path)
    before = tree_hashes(tmp_path)
    for case, out in targets.items():
        with pytest.raises(ArgumentError, match="refusing to replace|is a directory") as err:
            ldc.export.to_torch_file(ck, out)
        assert out in str(err.value), (case, str(err.value))
        status, text = cli(["convert", ck, out, "--to", "torch"])
        assert status == 2 and out in text and "Traceback" not in text, (case, text)
        assert tree_hashes(tmp_path) == before, case
    empty = write(os.path.join(place, "empty.pt"), b"")  # nothing to lose: a name made with mkstemp
    ldc.export.to_torch_file(ck, empty)
    assert torch.equal(torch.load(empty, weights_only=True)["tensors"]["w"], WEIGHT)
    old = os.path.join(place, "old.pt")
    torch.save({"anything": torch.zeros(2)}, old)  # a torch.save file: replaced
    ldc.export.to_torch_file(ck, old)
    assert torch.equal(torch.load(old, weights_only=True)["tensors"]["w"], WEIGHT)
    assert cli(["convert", ck, old])[0] == 0  # and again, over our own output


# -- DCP and Megatron-Core outputs -----------------------------------------------------------------------
def _not_checkpoints(tmp_path) -> dict:
    """Directories a DCP / Megatron export must not replace, by what makes them not a checkpoint."""
    root = tmp_path / "dirs"
    root.mkdir()

    def folder(name: str) -> str:
        os.mkdir(root / name)
        return str(root / name)

    garbage_beside = folder("garbage-metadata-and-thesis")
    write(os.path.join(garbage_beside, ".metadata"), b"garbage, not a DCP metadata pickle")
    write(os.path.join(garbage_beside, "thesis.tex"), PRECIOUS)
    garbage_only = folder("garbage-metadata")
    write(os.path.join(garbage_only, ".metadata"), b"garbage, not a DCP metadata pickle")
    real_beside = dcp_dir(str(root / "dcp-and-thesis"))
    write(os.path.join(real_beside, "thesis.tex"), PRECIOUS)
    linked = folder("metadata-link")
    os.symlink(os.path.join(dcp_dir(str(tmp_path / "elsewhere")), ".metadata"), os.path.join(linked, ".metadata"))
    not_megatron = dcp_dir(str(root / "dcp-and-other-json"))
    write(os.path.join(not_megatron, "metadata.json"), b'{"mine": true}')
    distcp_dir = dcp_dir(str(root / "dcp-and-distcp-folder"))
    os.mkdir(os.path.join(distcp_dir, "notes.distcp"))
    write(os.path.join(distcp_dir, "notes.distcp", "keep.txt"), PRECIOUS)
    json_and_thesis = folder("metadata-json-and-thesis")
    write(os.path.join(json_and_thesis, "metadata.json"), b"{}")
    write(os.path.join(json_and_thesis, "thesis.tex"), PRECIOUS)
    os.symlink(tmp_path / "victimdir", root / "link-to-dir")
    os.mkdir(tmp_path / "victimdir")
    write(str(tmp_path / "victimdir" / "keep.txt"), PRECIOUS)
    return {name: str(root / name) for name in sorted(os.listdir(root))}


@pytest.mark.parametrize("to", ["dcp", "megatron"])
def test_only_a_dcp_checkpoint_is_replaced(ck, tmp_path, to):
    export = {"dcp": ldc.export.to_dcp, "megatron": ldc.export.to_megatron}[to]
    targets = _not_checkpoints(tmp_path)
    before = tree_hashes(tmp_path)
    for case, out in targets.items():
        with pytest.raises(ArgumentError, match="refusing to replace") as err:
            export(ck, out)
        assert out in str(err.value), (case, str(err.value))
        status, text = cli(["convert", ck, out, "--to", to])
        assert status == 2 and out in text and "Traceback" not in text, (case, text)
        assert tree_hashes(tmp_path) == before, case
    assert not [n for n in os.listdir(tmp_path / "dirs") if n.startswith(".")]  # no staging left behind


def test_dcp_and_megatron_checkpoints_and_empty_directories_are_replaced(ck, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    ldc.export.to_dcp(ck, empty)
    assert torch.equal(ldc.load_plain_tensors(empty)["w"], WEIGHT)
    theirs = dcp_dir(str(tmp_path / "theirs"))  # written by dcp.save
    ldc.export.to_megatron(ck, theirs)  # a DCP checkpoint becomes a Megatron-Core one
    assert ldc.load_common_state_dict(theirs) == {"step": 3}
    ldc.export.to_dcp(ck, theirs)  # and back: Megatron's common.pt and metadata.json go with it
    assert sorted(n for n in os.listdir(theirs) if not n.endswith(".distcp")) == [".metadata"]
    assert torch.equal(ldc.load_plain_tensors(theirs)["w"], WEIGHT)
    assert cli(["convert", ck, theirs, "--to", "megatron"])[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["CK", "empty", "theirs"]  # nothing left beside them


def test_a_new_output_gets_its_parents_and_the_mode_of_a_new_directory(ck, tmp_path):
    out = tmp_path / "a" / "b" / "dcp"
    ldc.export.to_dcp(ck, out)
    assert torch.equal(ldc.load_plain_tensors(out)["w"], WEIGHT)
    os.mkdir(tmp_path / "reference")  # made as any new directory is here
    assert stat.S_IMODE(os.stat(out).st_mode) == stat.S_IMODE(os.stat(tmp_path / "reference").st_mode)
    shutil.rmtree(tmp_path / "a")


@pytest.mark.parametrize("export", ["to_dcp", "to_megatron"])
def test_an_output_below_a_file_is_an_argument_error(ck, tmp_path, export):
    """``plain.pt/x``: a component of the output path is a file (a raw NotADirectoryError from the
    target check; found by the long path-argument fuzzer). Nothing is written, the file unchanged."""
    plain = write(str(tmp_path / "plain.pt"), b"mine")
    with pytest.raises(ArgumentError, match="a component of the path is a file"):
        getattr(ldc.export, export)(ck, os.path.join(plain, "x"))
    assert open(plain, "rb").read() == b"mine"
