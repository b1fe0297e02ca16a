"""Safety of what a save replaces and of what a load trusts: a save never removes files that are
not a committed checkpoint of ours; paths with a URL scheme are refused; nothing under a checkpoint
is followed through a symbolic link; malformed metadata is a FormatError naming the field."""

import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ArgumentError


def state(value=1.0):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((64,), value)), "step": 3}


def template():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64))}


# -- never destroy what is not ours --------------------------------------------------------------
@pytest.mark.parametrize("contents", [["data/"], ["data/", "data/rank_00000/", "notes.txt"],
                                      ["metadata.json"], ["COMMITTED", "data/"], ["notes.txt"]])
def test_save_refuses_a_directory_that_is_not_a_committed_checkpoint(tmp_path, contents):
    target = tmp_path / "ck"
    target.mkdir()
    for name in contents:
        if name.endswith("/"):
            (target / name).mkdir()
        else:
            (target / name).write_text("the user's")
    (target / "data" if (target / "data").is_dir() else target).joinpath("precious.txt").write_text("mine")
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    with pytest.raises(ldc.CheckpointingError, match="refusing to replace"):
        ldc.save(state(), target)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
    assert not [n for n in os.listdir(tmp_path) if n != "ck"]  # no staging directory left either


def test_save_replaces_a_committed_checkpoint_and_fills_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    ldc.save(state(1.0), tmp_path / "empty")
    ldc.save(state(2.0), tmp_path / "empty")
    assert torch.equal(ldc.load(template(), tmp_path / "empty")["w"], torch.full((64,), 2.0))


# -- URLs are refused, never written locally -------------------------------------------------
URLS = ["s3://bucket/ckpt", "gs://bucket/ckpt", "http://host/ckpt", "file:///tmp/ckpt", "hf+https://x/y"]


@pytest.fixture
def no_aws(tmp_path, monkeypatch):
    """No S3 credentials anywhere: s3:// (supported, docs/object_storage.md) is then refused like
    the schemes that have no store (tests/s3/test_s3.py covers s3:// with a server)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("url", URLS)
def test_urls_are_refused_by_save_and_load_and_nothing_is_written(tmp_path, monkeypatch, no_aws, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.save(state(), url)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.save(state(), url, async_save=True)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.load(template(), url)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.load_plain_tensors(url)
    assert os.listdir(tmp_path) == []  # the fixture's HOME is never created


def test_urls_are_refused_by_every_command(tmp_path, monkeypatch, capsys, no_aws):
    from lightning_distckpt.cli import main
    from lightning_distckpt.cli.clean import clean
    from lightning_distckpt import validate
    from lightning_distckpt.convert import export_torch_file, relayout_checkpoint

    ldc.save(state(), tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    url = "s3://bucket/ckpt"
    for argv in (["inspect", url], ["validate", url], ["clean", url], ["convert", url, "out.pt"],
                 ["convert", str(tmp_path / "ck"), url], ["convert", str(tmp_path / "ck"), url, "--to", "distckpt"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "URLs are not supported" in err and len(err.strip().splitlines()) == 1, err
    for call in (lambda: validate(url), lambda: clean(url, 0, True),
                 lambda: export_torch_file(str(tmp_path / "ck"), url),
                 lambda: relayout_checkpoint(str(tmp_path / "ck"), url, ldc.StorageOptions())):
        with pytest.raises(ArgumentError, match="URLs are not supported"):
            call()
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# -- nothing under a checkpoint is followed through a link -----------------------------------
def _two_checkpoints(tmp_path, layout="ocdbt"):
    """``ck`` (the one loaded, value 1) and ``other`` (value 2) beside it, a link's likely target."""
    opts = ldc.StorageOptions(layout=layout)
    ldc.save(state(1.0), tmp_path / "ck", storage=opts)
    ldc.save({**state(2.0), "step": 9}, tmp_path / "other", storage=opts)
    return tmp_path / "ck", tmp_path / "other"


def _link_in(ck, other, rel):
    victim = ck / rel
    if victim.is_dir():
        import shutil

        shutil.rmtree(victim)
    else:
        victim.unlink()
    os.symlink(other / rel, victim)
    return str(victim)


def _every_reader_refuses(ck, tmp_path, capsys, name):
    from lightning_distckpt.cli import main
    from lightning_distckpt import validate
    from lightning_distckpt.convert import export_torch_file, relayout_checkpoint

    with pytest.raises(ldc.CheckpointingError, match=f"{name}.*symbolic link"):
        ldc.load(template(), ck)
    if name != "common.pt":  # load_plain_tensors reads tensors only
        with pytest.raises(ldc.CheckpointingError, match=f"{name}.*symbolic link"):
            ldc.load_plain_tensors(ck)
    with pytest.raises(ldc.CheckpointingError, match=f"{name}.*symbolic link"):
        export_torch_file(str(ck), str(tmp_path / "out.pt"))
    with pytest.raises(ldc.CheckpointingError, match=f"{name}.*symbolic link"):
        relayout_checkpoint(str(ck), str(tmp_path / "copy"), ldc.StorageOptions(layout="zarr"))
    assert not os.path.exists(tmp_path / "copy")
    try:
        report = validate(str(ck))
        assert not report.ok and any("symbolic link" in p and name in p for p in report.problems), report.problems
    except ldc.CheckpointingError as e:
        assert "symbolic link" in str(e) and name in str(e)
    if name not in ("common.pt", "rank_00000"):  # inspect reads metadata only
        assert main(["inspect", str(ck)]) == 2
        assert "symbolic link" in capsys.readouterr().err


@pytest.mark.parametrize("rel", ["common.pt", "metadata.json", "COMMITTED", "data", "data/rank_00000"])
def test_links_inside_a_checkpoint_are_refused(tmp_path, capsys, rel):
    ck, other = _two_checkpoints(tmp_path)
    path = _link_in(ck, other, rel)
    _every_reader_refuses(ck, tmp_path, capsys, os.path.basename(path))


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_a_linked_data_file_is_refused(tmp_path, capsys, layout):
    ck, other = _two_checkpoints(tmp_path, layout)
    files = sorted(str(p.relative_to(ck)) for p in (ck / "data").rglob("*") if p.is_file())
    rel = max(files, key=lambda r: (ck / r).stat().st_size)
    _link_in(ck, other, rel)
    _every_reader_refuses(ck, tmp_path, capsys, os.path.basename(rel))


def test_the_checkpoint_itself_may_be_reached_through_links(tmp_path):
    ck, _ = _two_checkpoints(tmp_path)
    os.symlink("ck", tmp_path / "last.ckpt")  # Lightning's save_last="link"
    (tmp_path / "runs").mkdir()
    os.symlink(tmp_path, tmp_path / "runs" / "linked_parent")
    for path in (tmp_path / "last.ckpt", tmp_path / "runs" / "linked_parent" / "ck"):
        assert torch.equal(ldc.load(template(), path)["w"], torch.full((64,), 1.0))
        assert torch.equal(ldc.load_plain_tensors(path)["w"], torch.full((64,), 1.0))


def test_clean_does_not_follow_a_linked_staging_directory(tmp_path, capsys):
    from lightning_distckpt.cli import main
    from lightning_distckpt.storage.staging import new_staging_dir

    ck, other = _two_checkpoints(tmp_path)
    link = new_staging_dir(str(ck))
    os.symlink(other, link)
    assert main(["clean", str(tmp_path), "--older-than", "0", "--json"]) == 0
    actions = json.loads(capsys.readouterr().out)
    assert [a["action"] for a in actions] == ["kept"] and "symbolic link" in actions[0]["reason"]
    assert os.path.islink(link) and torch.equal(ldc.load_plain_tensors(other)["w"], torch.full((64,), 2.0))


def test_a_load_racing_a_save_to_the_same_path_says_the_checkpoint_was_replaced(tmp_path):
    from lightning_distckpt.reading.checkpoint import OpenedCheckpoint
    from lightning_distckpt.storage.base import ShardRead

    for layout, pack in (("ocdbt", 0), ("zarr", 1 << 20)):  # an array of its own, a packed shard
        ck = tmp_path / layout
        opts = ldc.StorageOptions(layout=layout, pack_max_bytes=pack)
        ldc.save(state(1.0), ck, storage=opts)
        reader = OpenedCheckpoint.open(ck).reader()  # opened: then a newer save commits to the same path
        ldc.save(state(2.0), ck, storage=opts)
        with pytest.raises(ldc.CheckpointingError, match="replaced while being read"):
            reader.read_into([ShardRead("w", 0, 0, (slice(0, 64),), torch.empty(64))])
