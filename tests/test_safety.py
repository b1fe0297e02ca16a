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


@pytest.mark.parametrize("url", URLS)
def test_urls_are_refused_by_save_and_load_and_nothing_is_written(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.save(state(), url)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.save(state(), url, async_save=True)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.load(template(), url)
    with pytest.raises(ArgumentError, match="URLs are not supported"):
        ldc.load_plain_tensors(url)
    assert os.listdir(tmp_path) == []


def test_urls_are_refused_by_every_command(tmp_path, monkeypatch, capsys):
    from lightning_distckpt.cli import main
    from lightning_distckpt.cli.clean import clean
    from lightning_distckpt.cli.validate import validate
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
