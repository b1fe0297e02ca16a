"""Whether a directory holds a committed checkpoint of ours (what a save may replace) is known from the first bytes
of its metadata.json where they are ours as a save writes them, else from the file parsed whole: a save over a
checkpoint asks twice, and a 10,000-tensor index is megabytes. What is not ours stays refused."""

import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.storage.layout import is_checkpoint_dir, is_our_committed_checkpoint


def _sd(value):
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((4,), float(value)))}


def _load(path):
    return ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(4))}, path)["w"]


def test_an_index_that_begins_as_ours_and_is_damaged_further_on_is_ours_to_replace(tmp_path):
    path = str(tmp_path / "ck")
    ldc.save(_sd(1), path)
    meta = os.path.join(path, "metadata.json")
    with open(meta, "r+b") as f:  # the end of the index damaged: loading it fails
        f.seek(os.path.getsize(meta) - 40)
        f.write(b"\0" * 40)
    with pytest.raises(ldc.CheckpointingError):
        _load(path)
    assert is_our_committed_checkpoint(path)
    ldc.save(_sd(2), path)  # replaced by a whole one
    assert torch.equal(_load(path), torch.full((4,), 2.0))


def test_an_index_of_ours_written_in_another_key_order_is_parsed_whole(tmp_path):
    path = str(tmp_path / "ck")
    ldc.save(_sd(1), path)
    meta = os.path.join(path, "metadata.json")
    with open(meta) as f:
        index = json.load(f)
    reordered = {k: index[k] for k in sorted(index, key=lambda k: k == "format")}  # "format" last
    with open(meta, "w") as f:
        json.dump(reordered, f)
    assert not open(meta).read().startswith('{"format"')
    assert is_our_committed_checkpoint(path) and is_checkpoint_dir(path)


@pytest.mark.parametrize("text", ['{"dataset": "not ours"}', '{"format" : "lightning_distckpt"', "[]", "",
                                  '{"format": "lightning_distckpt"}x', '{"format": "lightning_distckptX", "a": 1}'])
def test_an_index_that_is_not_ours_keeps_its_directory(tmp_path, text):
    """A user's metadata.json beside a file named COMMITTED: refused, the files kept (an index that only
    resembles ours is parsed whole: invalid JSON or another format is not ours)."""
    path = tmp_path / "theirs"
    path.mkdir()
    (path / "COMMITTED").write_text("{}")
    (path / "metadata.json").write_text(text)
    assert not is_our_committed_checkpoint(str(path))
    with pytest.raises(ldc.CheckpointingError, match="refusing to replace it"):
        ldc.save(_sd(1), str(path))
    assert sorted(os.listdir(path)) == ["COMMITTED", "metadata.json"] and (path / "metadata.json").read_text() == text


def test_an_index_over_the_cap_is_not_ours_even_if_it_begins_as_ours(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    ldc.save(_sd(1), path)
    monkeypatch.setenv("LIGHTNING_DISTCKPT_MAX_METADATA_BYTES", "64")
    assert open(os.path.join(path, "metadata.json")).read().startswith('{"format": "lightning_distckpt", ')
    assert not is_our_committed_checkpoint(path)
