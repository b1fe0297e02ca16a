"""Two keys, one place on disk (``storage/key_paths.py``): a key whose percent-encoding is longer
than 180 characters is stored as its first 120 characters, ``~`` and a hash; a shorter key spelled
like that would share its path. Saves refuse such pairs (tensors, objects, across ranks, with or
without ``validate_access_integrity``) before anything is written, naming both keys; a crafted
metadata.json listing them is refused at load. Long keys without such a partner round-trip."""

import hashlib
import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt import validate
from lightning_distckpt.core.errors import ValidationError
from lightning_distckpt.storage.key_paths import colliding_keys
from lightning_distckpt.storage.layout import COMMIT_MARKER, METADATA_FILE, encode_key
from dist_utils import run_distributed

LONG = "model.layers." + "x" * 200 + ".weight"
SHORT = encode_key(LONG)  # the shortened form, as a key of its own: stored at the same path
UNICODE = "größe/" * 40  # every non-ASCII byte percent-encoded: long


def _tensors(keys):
    return {f"k{i}": ldc.ShardedTensor.from_rank_offsets(k, torch.full((3,), float(i))) for i, k in enumerate(keys)}


def _objects(keys):
    return {f"k{i}": ldc.ShardedObject(k, {"value": i}, (1,), (0,)) for i, k in enumerate(keys)}


def test_the_short_key_is_spelled_like_the_long_key_s_path():
    assert len(SHORT) < 180 and SHORT[120] == "~" and encode_key(SHORT) == encode_key(LONG)
    assert colliding_keys([LONG, "a", SHORT]) == [(LONG, SHORT)]
    assert colliding_keys([LONG, "a", SHORT[:-1]]) == [] and colliding_keys(["a~b", "c"]) == []


@pytest.mark.parametrize("integrity", [True, False])
@pytest.mark.parametrize("make", [_tensors, _objects], ids=["tensors", "objects"])
def test_a_save_of_two_keys_at_one_path_is_refused_before_anything_is_written(tmp_path, make, integrity):
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValidationError) as e:
        ldc.save(make([LONG, "plain", SHORT]), tmp_path / "ck", validate_access_integrity=integrity)
    message = str(e.value)
    assert repr(LONG) in message and repr(SHORT) in message and "nothing was written" in message
    assert "'~' and a hash" in message and "rename one" in message
    assert sorted(os.listdir(tmp_path)) == before  # no checkpoint, no staging directory


def test_a_tensor_and_an_object_may_share_a_key_s_spelling(tmp_path):
    """Tensors and objects are stored under different folders (t/, o/): no collision."""
    sd = {"t": ldc.ShardedTensor.from_rank_offsets(LONG, torch.ones(2)), "o": ldc.ShardedObject(SHORT, 5, (1,), (0,))}
    ldc.save(sd, tmp_path / "ck")
    out = ldc.load({"t": ldc.ShardedTensor.from_rank_offsets(LONG, torch.zeros(2)),
                    "o": ldc.ShardedObject(SHORT, None, (1,), (0,))}, tmp_path / "ck")
    assert torch.equal(out["t"], torch.ones(2)) and out["o"] == 5


def _save_on_two_ranks(rank, world, path):
    key = LONG if rank == 0 else SHORT  # each rank alone has no collision
    try:
        ldc.save({"t": ldc.ShardedTensor.from_rank_offsets(key, torch.ones(2))}, path)
    except ValidationError as e:
        return str(e)
    return None


def test_keys_of_different_ranks_are_refused_on_every_rank(tmp_path):
    messages = run_distributed(_save_on_two_ranks, 2, str(tmp_path / "ck"))
    assert all(m is not None and repr(LONG) in m and repr(SHORT) in m for m in messages), messages
    assert not (tmp_path / "ck").exists()


def _rename_in_metadata(ck, kind, old, new):
    """A crafted metadata.json: ``old`` renamed ``new``, the commit marker's checksum kept consistent."""
    meta = json.load(open(ck / METADATA_FILE))
    meta[kind][new] = meta[kind].pop(old)
    raw = json.dumps(meta).encode()
    (ck / METADATA_FILE).write_bytes(raw)
    marker = json.load(open(ck / COMMIT_MARKER))
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    (ck / COMMIT_MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("kind", ["tensors", "objects"])
def test_a_metadata_json_listing_two_keys_at_one_path_is_refused_at_load(tmp_path, kind):
    make = _tensors if kind == "tensors" else _objects
    ldc.save(make([LONG, "other"]), tmp_path / "ck")
    _rename_in_metadata(tmp_path / "ck", kind, "other", SHORT)
    with pytest.raises(ldc.FormatError) as e:
        ldc.load(make([LONG, SHORT]), tmp_path / "ck")
    assert repr(LONG) in str(e.value) and repr(SHORT) in str(e.value) and "metadata.json lists" in str(e.value)
    with pytest.raises(ldc.FormatError, match="metadata.json lists"):
        validate(str(tmp_path / "ck"))


def test_long_keys_without_a_partner_round_trip(tmp_path):
    """Long keys sharing their first 120 encoded characters, non-ASCII ones, keys with '~', and a
    key spelled like a shortened form but alone: each its own path, each loads its own value."""
    keys = [LONG, LONG + "2", "model.layers." + "x" * 200 + ".bias", UNICODE, UNICODE + "~", "a~b", "~",
            SHORT.replace(SHORT[-32:], "f" * 32), "x" * 180, "x" * 181]
    assert len({encode_key(k) for k in keys}) == len(keys)
    ldc.save({**_tensors(keys), **{f"o{i}": v for i, v in enumerate(_objects(keys).values())}}, tmp_path / "ck")
    template = {**{k: ldc.ShardedTensor.from_rank_offsets(t.key, torch.zeros(3)) for k, t in _tensors(keys).items()},
                **{f"o{i}": ldc.ShardedObject(k, None, (1,), (0,)) for i, k in enumerate(keys)}}
    out = ldc.load(template, tmp_path / "ck")
    for i in range(len(keys)):
        assert torch.equal(out[f"k{i}"], torch.full((3,), float(i))) and out[f"o{i}"] == {"value": i}
    assert validate(str(tmp_path / "ck")).ok
