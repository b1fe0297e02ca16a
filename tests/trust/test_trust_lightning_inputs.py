"""Hostile or mistaken input at the Lightning layer: what a red-team probe found.

* ``DistCheckpointIO.remove_checkpoint`` (``ModelCheckpoint``'s top-k removal) removes a checkpoint of
  ours, an empty directory, a stock Lightning checkpoint file, or a link (the link only) to one of those or to
  nothing; a user's directory or file at that path is an ArgumentError and stays, as does a link's
  target.
* A checkpoint whose manifest (read from its common state) has a kind that is no string, or an
  optimizer's ``params`` that is no list, loads as it is (was a raw TypeError).
* A YAML config whose top level is a list is a ConfigError (was a raw TypeError).
* A ``tiers-last.json`` marker that is a link: ``ckpt_path="last"`` resolution neither follows nor
  touches it (its target's mtime was changed).
* A file that fails its reads (``/proc/self/mem``: EIO) is a FormatError from every reader.
"""

import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ArgumentError, CheckpointingError, ConfigError, FormatError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.lightning.config import load_checkpoint_config


def _ours(path):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, str(path))
    return path


def test_remove_checkpoint_removes_only_checkpoints_and_links(tmp_path):
    io = DistCheckpointIO()
    user_dir = tmp_path / "notes"
    user_dir.mkdir()
    (user_dir / "precious.txt").write_text("mine")
    user_file = tmp_path / "thesis.tex"
    user_file.write_text("mine")
    link_to_user = tmp_path / "last.ckpt"
    os.symlink(user_dir, link_to_user)
    for path in (user_dir, user_file, link_to_user):
        with pytest.raises(ArgumentError, match="not a checkpoint"):
            io.remove_checkpoint(path)
    assert (user_dir / "precious.txt").read_text() == "mine" and user_file.read_text() == "mine"
    assert os.path.islink(link_to_user)

    ours = _ours(tmp_path / "epoch=0.ckpt")
    link = tmp_path / "last-v1.ckpt"
    os.symlink(ours, link)
    io.remove_checkpoint(link)  # the link only
    assert not os.path.lexists(link) and ldc.load_plain_tensors(str(ours))["w"].tolist() == [0, 1, 2, 3]
    io.remove_checkpoint(ours)
    assert not os.path.exists(ours)
    dangling = tmp_path / "last-v2.ckpt"
    os.symlink(tmp_path / "gone", dangling)
    io.remove_checkpoint(dangling)
    assert not os.path.lexists(dangling)
    stock = tmp_path / "stock.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "pytorch-lightning_version": "2.6.0"}, stock)  # stock's
    io.remove_checkpoint(stock)
    empty = tmp_path / "empty"
    empty.mkdir()
    io.remove_checkpoint(empty)
    assert not stock.exists() and not empty.exists()


@pytest.mark.parametrize("kind", [[1], {"a": 1}, 3.5])
def test_a_manifest_kind_that_is_no_string_loads_as_it_is(tmp_path, kind):
    path = str(tmp_path / "ck")
    man = {"version": 1, "kind": kind, "tensor_paths": [[[["d", "model"], ["d", "w"]], "k"]]}
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("k", torch.arange(4.0)), "x": 1, "__distckpt__": man}, path)
    out = DistCheckpointIO().load_checkpoint(path)
    assert out["x"] == 1 and out["model"]["w"].tolist() == [0, 1, 2, 3]


def test_optimizer_params_that_are_no_list_load_as_they_are(tmp_path):
    path = str(tmp_path / "ck")
    man = {"version": 1, "kind": "sharded", "tensor_paths": [[[["d", "state_dict"], ["d", "w"]], "k"]]}
    opt = [{"param_groups": [{"params": 5}], "state": {}}]
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("k", torch.arange(4.0)), "optimizer_states": opt,
              "__distckpt__": man}, path)
    out = DistCheckpointIO().load_checkpoint(path)
    assert out["optimizer_states"] == opt and out["state_dict"]["w"].tolist() == [0, 1, 2, 3]


def test_a_yaml_config_that_is_a_list_is_a_config_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("- 1\n- async_save: true\n")
    with pytest.raises(ConfigError, match=f"{cfg}.*must be a mapping"):
        load_checkpoint_config(str(cfg))
    with pytest.raises(ConfigError, match="must be a mapping"):
        DistCheckpointIO(config=str(cfg))


def test_a_tiers_marker_that_is_a_link_is_neither_followed_nor_touched(tmp_path):
    from lightning_distckpt.lightning.tiers import _touch_marker

    outside = tmp_path / "outside.txt"
    outside.write_text("theirs")
    os.utime(outside, (1_000_000, 1_000_000))
    marker = tmp_path / "ckpts" / "tiers-last.json"
    marker.parent.mkdir()
    os.symlink(outside, marker)
    assert _touch_marker(str(marker)) is False
    assert os.stat(outside).st_mtime == 1_000_000
    os.remove(marker)
    marker.write_text("{}")  # a marker of ours: made the newest
    assert _touch_marker(str(marker)) is True and os.stat(marker).st_mtime > 1_000_000


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="/proc/self/mem is Linux's")
def test_a_file_that_fails_its_reads_is_a_format_error_from_every_reader():
    path = "/proc/self/mem"  # a regular file whose reads at offset 0 fail with EIO
    for read in (ldc.load_tensors_metadata, ldc.load_plain_tensors, ldc.load_common_state_dict,
                 DistCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointingError) as e:
            read(path)
        assert path in str(e.value) and "cannot be read" in str(e.value), (read, e.value)
        assert isinstance(e.value, FormatError) or "FormatError" in str(e.value), (read, e.value)
