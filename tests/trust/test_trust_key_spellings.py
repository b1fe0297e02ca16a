"""Key spellings end to end: every reader and writer takes a key as it is spelled, or all refuse it alike.

Holes closed here: the rank-0 ingest (``ingest.load_state_dict``) handed out a tensor named ``""``, which
``ldc.load`` and ``load_plain_tensors`` refuse naming the file and the key; and a Lightning checkpoint whose
tree holds a tensor under a ``bytes``, ``tuple``, ``None``, ``float`` or ``bool`` dict key was saved (named
``str(key)``) but never loaded back: the manifest that puts it back was read as JSON steps (str or int keys).
The rest checks what was found sound: odd spellings (dots, slashes, backslashes, ``..`` segments, NUL and
control characters, the two Unicode spellings of ``é``, case, our own file names, a key of 5,000 characters)
round-trip bit-exact through our save (both layouts), load, ``load_plain_tensors``, the exporters, ``relayout``
and ``inspect``; in the zarr layout each key is one folder of its own inside the checkpoint; and leaves whose
names coincide once flattened are refused by every reader of a ``torch.save`` file, naming the name.
Keys spelled like a shortened long key: tests/trust/test_trust_keys.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import lightning_distckpt as ldc
from lightning_distckpt.export import from_torch_file, relayout, to_dcp, to_safetensors, to_torch_file
from lightning_distckpt.ingest import load_state_dict
from lightning_distckpt.storage.layout import encode_key
from lightning_distckpt.storage.tensorstore_io import StorageOptions

ODD = ["a..b", ".a", "a.", "/a", "a/", "a/b", "a\\b", "a/../b", "../x", "a\x00b", "a\nb", "\x1b[2J", "x" * 5000,
       "\u00e9", "e\u0301", "\ufb01", "fi", "A", "a", "metadata.json", "common.pt", "COMMITTED", "data", "0", "%2E",
       "%", "~", " ", "\t", "\\t"]


def _value(i: int) -> torch.Tensor:
    # distinct bits per key (a NaN payload and -0.0 included): a mix-up or a cast shows
    return torch.tensor([float(i), -0.0, float("nan"), 1e-38 * (i + 1)], dtype=torch.float32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


# -- holes -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["torch", "safetensors"])
def test_the_ingest_refuses_an_empty_name_as_every_other_reader_does(tmp_path, kind):
    path = str(tmp_path / ("f.pt" if kind == "torch" else "f.safetensors"))
    tensors = {"": torch.ones(2), "w": torch.zeros(2)}
    torch.save(tensors, path) if kind == "torch" else save_file(tensors, path)
    errors = []
    for read in (load_state_dict, ldc.load_plain_tensors):
        with pytest.raises(ldc.FormatError) as e:
            read(path)
        errors.append(str(e.value))
    wanted = f"{path}: tensor '' would be loaded under key '', not a non-empty string"
    assert all(wanted in m for m in errors), errors


NON_STR_KEYS = [b"x", ("a", "b"), None, 1.5, True]


@pytest.mark.parametrize("key", NON_STR_KEYS, ids=repr)
def test_a_lightning_checkpoint_with_a_tensor_under_a_non_str_key_loads_back(tmp_path, key):
    from lightning_distckpt.lightning import DistCheckpointIO

    io = DistCheckpointIO()
    state = {"state_dict": {"w": torch.ones(2)}, "extra": {key: _value(3), "s": _value(4)}}
    io.save_checkpoint(state, str(tmp_path / "ck"))
    out = io.load_checkpoint(str(tmp_path / "ck"))
    assert list(out["extra"]) == [key, "s"] and type(list(out["extra"])[0]) is type(key)
    assert _same(out["extra"][key], _value(3)) and _same(out["extra"]["s"], _value(4))
    to_torch_file(str(tmp_path / "ck"), str(tmp_path / "out.pt"))  # the exporter reads the same manifest
    back = torch.load(str(tmp_path / "out.pt"), weights_only=True)
    assert _same(back["extra"][key], _value(3))


def test_from_torch_file_of_non_str_keys_converts_back_whole(tmp_path):
    tree = {k: _value(i) for i, k in enumerate(NON_STR_KEYS[:4])} | {7: _value(9)}
    torch.save(tree, str(tmp_path / "in.pt"))
    from_torch_file(str(tmp_path / "in.pt"), str(tmp_path / "ck"))
    to_torch_file(str(tmp_path / "ck"), str(tmp_path / "out.pt"))
    back = torch.load(str(tmp_path / "out.pt"), weights_only=True)
    assert list(back) == list(tree) and all(_same(back[k], v) for k, v in tree.items())


# -- sound: checked, kept so ---------------------------------------------------------------------------------------
def _odd_state(make):
    return {f"s{i}": ldc.ShardedTensor.from_rank_offsets(k, make(i)) for i, k in enumerate(ODD)}


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_odd_keys_round_trip_bit_exact_through_save_load_and_relayout(tmp_path, layout):
    ck = str(tmp_path / "ck")
    ldc.save(_odd_state(_value), ck, storage=StorageOptions(layout=layout, pack_max_bytes=0))
    out = ldc.load(_odd_state(lambda i: torch.zeros(4)), ck)
    assert all(_same(out[f"s{i}"], _value(i)) for i in range(len(ODD)))
    relayout(ck, str(tmp_path / "rl"), StorageOptions(layout="zarr" if layout == "ocdbt" else "ocdbt"))
    for where in (ck, str(tmp_path / "rl")):
        got = ldc.load_plain_tensors(where)
        assert sorted(got) == sorted(ODD) and all(_same(got[k], _value(i)) for i, k in enumerate(ODD)), where


@pytest.mark.long  # the exporters of three formats and a CLI process: about 10-20 s; checks what was sound
def test_odd_keys_round_trip_bit_exact_through_the_exporters_and_inspect(tmp_path):
    ck = str(tmp_path / "ck")
    ldc.save(_odd_state(_value), ck)
    to_safetensors(ck, str(tmp_path / "st"))
    to_dcp(ck, str(tmp_path / "dcp"))
    to_torch_file(ck, str(tmp_path / "t.pt"))
    readers = {name: lambda name=name: ldc.load_plain_tensors(str(tmp_path / name)) for name in ("st", "dcp")}
    readers["torch"] = lambda: torch.load(str(tmp_path / "t.pt"), weights_only=True)["tensors"]
    for name, read in readers.items():
        got = read()
        assert sorted(got) == sorted(ODD), name
        assert all(_same(got[k], _value(i)) for i, k in enumerate(ODD)), name
    listed = json.loads(subprocess.run([sys.executable, "-m", "lightning_distckpt", "inspect", "--json", ck],
                                       capture_output=True, text=True, check=True).stdout)
    assert sorted(t["key"] for t in listed["tensors"]) == sorted(ODD)  # each key exact, once


def test_in_the_zarr_layout_each_key_is_one_folder_of_its_own_inside_the_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    objects = {f"o{i}": ldc.ShardedObject(k, {"v": i}, (1,), (0,)) for i, k in enumerate(ODD)}
    ldc.save({**_odd_state(_value), **objects}, str(ck), storage=StorageOptions(layout="zarr", pack_max_bytes=0))
    for kind in ("t", "o"):
        folders = os.listdir(ck / "data" / "rank_00000" / kind)
        assert sorted(folders) == sorted(encode_key(k) for k in ODD) and len(set(folders)) == len(ODD)
        assert all(f not in (".", "..") and "/" not in f and len(f) <= 180 for f in folders)
    for root, dirs, files in os.walk(ck):
        assert os.path.realpath(root).startswith(os.path.realpath(ck))
    assert sorted(os.listdir(ck)) == ["COMMITTED", "common.pt", "data", "metadata.json"]
    template = {f"o{i}": ldc.ShardedObject(k, None, (1,), (0,)) for i, k in enumerate(ODD)}
    assert ldc.load(template, str(ck)) == {f"o{i}": {"v": i} for i in range(len(ODD))}


@pytest.mark.parametrize("payload, name", [
    ({"a": {"b": torch.ones(1)}, "a/b": torch.zeros(1)}, "a/b"),
    ({1: torch.ones(1), "1": torch.zeros(1)}, "1"),
    ({"a": [torch.ones(1)], "a/0": torch.zeros(1)}, "a/0"),
    ({b"x": torch.ones(1), "b'x'": torch.zeros(1)}, "b'x'"),
], ids=["nested-vs-flat", "int-vs-str", "list-vs-flat", "bytes-vs-str"])
def test_leaves_named_alike_once_flattened_are_refused_by_every_reader(tmp_path, payload, name):
    path = str(tmp_path / "f.pt")
    torch.save(payload, path)
    for read in (ldc.load_plain_tensors, lambda p: from_torch_file(p, str(tmp_path / "ck"))):
        with pytest.raises(ldc.FormatError, match=f"two tensors of the file are both named {name!r}"):
            read(path)
    assert not (tmp_path / "ck").exists()


def test_our_save_refuses_the_empty_key_and_a_dot_key_naming_it(tmp_path):
    with pytest.raises(ldc.ShardingError, match="non-empty string, got ''"):
        ldc.ShardedTensor.from_rank_offsets("", torch.ones(1))
    for key in (".", ".."):
        with pytest.raises(ldc.CheckpointingError, match=f"key {key!r} is not allowed"):
            ldc.save({"k": ldc.ShardedTensor.from_rank_offsets(key, torch.ones(1))}, str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()
