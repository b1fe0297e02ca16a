"""Hugging Face model directories and tensor files read through the rank-0 ingest API
(``lightning_distckpt.ingest``) and ``ldc.load`` / ``load_plain_tensors`` / ``load_tensors_metadata``:
an index that does not match its shard files, and a source dtype the model's entry cannot take,
are errors naming the file and the tensor, raised before anything is loaded; the source directory
is left as it was.

* An index whose ``weight_map`` is empty (shard files beside it) read as a model of no tensors.
* A shard file holding a tensor its index gives to another file (two different tensors under one
  name) was read from the file the index names, with no word of the other: refused (Hugging Face
  writes each tensor once, in the file its index names: such a directory is damaged or mixed from
  two saves). One holding a tensor the index does not list was silently missed: it is read, as
  transformers reads every tensor of the files an index names.
* A complex tensor loaded by the ingest API into an integer or floating entry kept only its real
  parts (complex counted as an integer kind); a quantized one failed only after the broadcasts, as
  a bare ``RuntimeError`` text.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError, ShardingError
from lightning_distckpt.ingest import DistModule, load_state_dict
from trust.hostile import snapshot

INDEX = "model.safetensors.index.json"
A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _hf(tmp_path, shards, weight_map):
    d = tmp_path / "hf"
    d.mkdir()
    for name, tensors in shards.items():
        save_file(tensors, str(d / name))
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return str(d)


def _refused_by_every_reader(path, *needles):
    """Every reader of ``path`` raises a FormatError holding ``needles``; nothing in it changes."""
    before = snapshot(path)
    for read in (ldc.load_tensors_metadata, ldc.load_plain_tensors, load_state_dict,
                 lambda p: ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, p)):
        with pytest.raises(FormatError) as e:
            read(path)
        assert all(n in str(e.value) for n in needles), e.value
    assert snapshot(path) == before


def test_an_empty_weight_map_beside_shard_files_is_refused(tmp_path):
    path = _hf(tmp_path, {A: {"w": torch.arange(4.0)}, B: {"v": torch.ones(2)}}, {})
    _refused_by_every_reader(path, os.path.join(path, INDEX), "'weight_map' is empty")


def test_a_tensor_the_index_gives_to_another_shard_file_is_refused(tmp_path):
    shards = {A: {"w": torch.arange(4.0)}, B: {"w": torch.full((4,), 7.0), "v": torch.ones(2)}}
    path = _hf(tmp_path, shards, {"w": A, "v": B})
    _refused_by_every_reader(path, os.path.join(path, INDEX), f"shard file {B!r} holds tensor 'w'",
                             f"the index gives it to {A!r}")
    os.remove(os.path.join(path, B))  # the index made whole again: read exactly
    save_file({"v": torch.ones(2)}, os.path.join(path, B))
    loaded = ldc.load_plain_tensors(path)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and torch.equal(loaded["v"], torch.ones(2))


def test_a_tensor_the_index_does_not_list_is_read_as_transformers_reads_it(tmp_path):
    shards = {A: {"w": torch.arange(4.0), "extra": torch.full((3,), 5.0)}, B: {"v": torch.ones(2)}}
    path = _hf(tmp_path, shards, {"w": A, "v": B})
    before = snapshot(path)
    for read in (ldc.load_plain_tensors, load_state_dict):
        loaded = read(path)
        assert set(loaded) == {"w", "v", "extra"} and torch.equal(loaded["extra"], torch.full((3,), 5.0)), read
    assert ldc.load_tensors_metadata(path)["extra"].global_shape == (3,)
    out = ldc.load({"extra": ldc.ShardedTensor.from_rank_offsets("extra", torch.zeros(3))}, path)
    assert torch.equal(out["extra"], torch.full((3,), 5.0))
    assert snapshot(path) == before


class _Buffer(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.register_buffer("w", torch.zeros(3, dtype=dtype))


@pytest.mark.parametrize("into", [torch.int64, torch.int32])  # complex counted as "integer" before
def test_a_complex_tensor_is_not_loaded_into_a_real_entry(tmp_path, into):
    path = str(tmp_path / "pytorch_model.bin")
    torch.save({"w": torch.tensor([1 + 2j, 3 + 4j, 5 + 6j])}, path)
    before = snapshot(str(tmp_path))
    module = DistModule(_Buffer(into))
    with pytest.raises(ShardingError, match=f"{path}: 'w' is stored as complex64 but .* is {str(into)[6:]}"):
        module.load_state_dict(load_state_dict(path))
    assert torch.equal(module.module.w, torch.zeros(3, dtype=into))  # nothing loaded
    assert snapshot(str(tmp_path)) == before
    both = DistModule(_Buffer(torch.complex128))  # complex into complex still converts
    both.load_state_dict(load_state_dict(path))
    assert torch.equal(both.module.w, torch.tensor([1 + 2j, 3 + 4j, 5 + 6j], dtype=torch.complex128))


def test_a_quantized_tensor_is_refused_before_the_transfer(tmp_path):
    path = str(tmp_path / "q.pt")
    with pytest.warns(UserWarning):  # quantized tensors are deprecated in torch: made here only to be refused
        q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)
    torch.save({"w": q}, path)
    module = DistModule(_Buffer(torch.int64))
    with pytest.raises(FormatError, match=f"{path}: 'w' is a quantized tensor \\(quint8\\); dequantize it"):
        module.load_state_dict(load_state_dict(path))
    assert torch.equal(module.module.w, torch.zeros(3, dtype=torch.int64))


def test_a_safetensors_header_naming_a_tensor_twice_is_refused(tmp_path):
    """Two header entries under one name: Python's json and safetensors' serde keep the last, another
    reader may take the first; which tensor is meant cannot be known."""
    path = str(tmp_path / "dup.safetensors")
    save_file({"w": torch.arange(4.0), "v": torch.ones(4)}, path)
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].decode()
    twice = header.replace('"v":', '"w":', 1)
    assert twice != header and len(twice) == len(header)
    with open(path, "wb") as f:
        f.write(raw[:8] + twice.encode() + raw[8 + n:])
    for read in (ldc.load_tensors_metadata, ldc.load_plain_tensors, load_state_dict):
        with pytest.raises(FormatError, match="names 'w' twice"):
            read(path)


def test_a_tensor_named_by_the_empty_string_is_named_in_the_error_and_can_be_mapped(tmp_path):
    """safetensors takes ``""`` as a name, no key of ours is empty: each reader names the file and
    says how to load it (was a bare ShardingError about a ShardedTensor key, naming no file)."""
    path = str(tmp_path / "empty.safetensors")
    save_file({"": torch.ones(2), "w": torch.arange(2.0)}, path)
    for read in (ldc.load_tensors_metadata, ldc.load_plain_tensors,
                 lambda p: ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, p)):
        with pytest.raises(FormatError, match=f"{path}: tensor '' would be loaded under key ''.*key_map"):
            read(path)
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2)),
                    "e": ldc.ShardedTensor.from_rank_offsets("e", torch.zeros(2))}, path, key_map={"": "e"})
    assert torch.equal(out["e"], torch.ones(2)) and torch.equal(out["w"], torch.arange(2.0))
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, path, key_map={"": None})
    assert torch.equal(out["w"], torch.arange(2.0))
