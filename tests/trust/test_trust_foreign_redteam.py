"""Foreign checkpoints (``torch.save`` files, DCP and Megatron-Core ``torch_dist`` directories) whose
bytes are consistent with their checksums but whose contents lie, each built with the real writer
and then edited:

* a ``torch.save`` archive whose ``data.pkl`` claims more bytes for a storage than its zip record
  holds (the CRCs rewritten to match): torch's memory-mapped load takes the claim from the record's
  start unchecked, so the tensor's values were the following records, local headers and zip
  directory. Refused now by every reader of such a file, naming the file and the record;
* a Megatron-Core ShardedObject element named twice (``shard_0_2`` and ``shard_00_2``: the same
  offset), of which a load silently returned one;
* a ``key_map`` that joins two DCP bytes entries, of which ``load_common_state_dict`` silently kept one.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
import zipfile

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.ingest.files import load_state_dict

sys.path.insert(0, os.path.dirname(__file__))
from test_trust_megatron_metadata import dcp_save, torch_dist  # noqa: E402  (the builders of real directories)

SAVED = {"a": torch.arange(4, dtype=torch.float32), "b": torch.arange(100, 104, dtype=torch.float32)}


def rezip(raw: bytes, edit) -> bytes:
    """The archive ``raw`` rewritten record by record (``edit(name, data)``), each with a correct
    CRC-32: only what the pickle says changed, nothing a checksum would catch."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, edit(info.filename, src.read(info)))
    return out.getvalue()


def claim_more(path: str, numel: int) -> None:
    """``torch.save(SAVED)`` at ``path`` with tensor ``a``'s storage and shape claiming ``numel``
    elements where its record holds 4."""
    buf = io.BytesIO()
    torch.save(SAVED, buf)

    def edit(name: str, data: bytes) -> bytes:
        if not name.endswith("/data.pkl"):
            return data
        at = data.index(b"cpu")  # ('storage', FloatStorage, '0', 'cpu', 4): BININT1 4 follows the location
        claim = data.index(b"K\x04", at)
        size = data.index(b"K\x04\x85", claim + 2)  # the tensor's size (4,): BININT1 4, TUPLE1
        new = bytes([0x4B, numel])
        return data[:claim] + new + data[claim + 2:size] + new + data[size + 2:]

    with open(path, "wb") as f:
        f.write(rezip(buf.getvalue(), edit))


def test_a_storage_claimed_past_its_zip_record_is_refused_by_every_reader(tmp_path):
    path = str(tmp_path / "forged.pt")
    claim_more(path, 64)  # 256 bytes from a 16-byte record
    hf = tmp_path / "hf"
    hf.mkdir()
    os.link(path, hf / "pytorch_model.bin")
    readers = {
        "load_plain_tensors": lambda: ldc.load_plain_tensors(path),
        "load": lambda: ldc.load({"a": ldc.ShardedTensor.from_rank_offsets("a", torch.zeros(64))}, path),
        "ingest": lambda: load_state_dict(path),
        "hf directory": lambda: ldc.load_plain_tensors(str(hf)),
    }
    for name, read in readers.items():
        with pytest.raises(FormatError, match=r"claims 64 elements of torch\.float32 \(256 bytes\) but its zip "
                                              r"record 'archive/data/0' holds 16 bytes") as e:
            read()
        assert path in str(e.value) or str(hf) in str(e.value), name


def test_a_storage_claimed_short_of_its_record_is_refused_as_torch_refuses_it_unmapped(tmp_path):
    """torch's own unmapped load refuses it ("record size ... does not match"): the mapped one now too."""
    path = str(tmp_path / "forged.pt")
    claim_more(path, 2)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.load(io.BytesIO(open(path, "rb").read()), weights_only=True)
    with pytest.raises(FormatError, match=f"{path}: .*claims 2 elements .* holds 16 bytes"):
        ldc.load_plain_tensors(path)


def test_a_forged_claim_beside_a_tensor_without_a_meta_form_is_still_refused(tmp_path):
    """The size check replays data.pkl on the meta device; a nested tensor has no meta form, so such
    a file is loaded unmapped, where torch checks each record's size itself: placing one before the
    forged storage does not get the forged one through."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are in prototype stage"
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    buf = io.BytesIO()
    torch.save({"n": nested, **SAVED}, buf)

    def edit(name: str, data: bytes) -> bytes:
        if not name.endswith("/data.pkl"):
            return data
        at = data.index(b"K\x04\x85")  # tensor 'a': size (4,) and, before it, its storage's numel 4
        claim = data.rindex(b"K\x04", 0, at)
        return data[:claim] + b"K\x40" + data[claim + 2:at] + b"K\x40\x85" + data[at + 3:]

    path = str(tmp_path / "forged.pt")
    with open(path, "wb") as f:
        f.write(rezip(buf.getvalue(), edit))
    with pytest.raises(FormatError, match=f"{path}: .*record size \\(16 bytes\\) does not match"):
        ldc.load_plain_tensors(path)


def test_real_torch_files_with_shared_and_untyped_storages_still_load_exactly(tmp_path):
    """The control: what torch.save writes (views, tied names, a bare untyped storage, a Lightning
    layout) passes the check and loads exactly."""
    base = torch.arange(12, dtype=torch.float64)
    saved = {"state_dict": {"w": base.view(3, 4), "tied": base.view(3, 4), "col": base.view(3, 4)[:, 1],
                            "h": torch.ones(3, dtype=torch.bfloat16)},
             "raw": torch.UntypedStorage(7), "epoch": 2}
    path = str(tmp_path / "real.ckpt")
    torch.save(saved, path)
    got = ldc.load_plain_tensors(path)
    for key in ("w", "tied", "col", "h"):
        assert torch.equal(got[f"state_dict/{key}"], saved["state_dict"][key])


def test_a_megatron_object_element_named_twice_is_refused(tmp_path):
    forged = {"obj/shard_0_2": {"rank": 0}, "obj/shard_00_2": {"rank": "forged"}, "obj/shard_1_2": {"rank": 1}}
    path = torch_dist(str(tmp_path / "m"), forged)
    with pytest.raises(FormatError, match=r"'obj/shard_00_2' and 'obj/shard_0_2' are both element \[0\] of "
                                          r"ShardedObject 'obj'"):
        ldc.load({"o": ldc.ShardedObject("obj", None, (2,), (0,))}, path)


def test_a_key_map_joining_two_megatron_objects_is_refused(tmp_path):
    path = torch_dist(str(tmp_path / "m"), {"x/shard_0_1": {"v": 1}, "y/shard_0_1": {"v": 2}})
    with pytest.raises(FormatError, match=r"both element \[0\] of ShardedObject 'z'"):
        ldc.load({"o": ldc.ShardedObject("z", None, (1,), (0,))}, path, key_map={"x": "z", "y": "z"})
    got = ldc.load({"o": ldc.ShardedObject("z", None, (1,), (0,))}, path, key_map={"x": "z", "y": None})
    assert got["o"] == {"v": 1}  # the control: one of them, named, loads


def test_a_key_map_joining_two_dcp_objects_is_refused(tmp_path):
    path = str(tmp_path / "d")
    dcp_save(path, {"first": 1, "second": 2})
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}
    got = ldc.load(template, path, key_map={"first": "one"})  # the control: a map that joins nothing
    assert (got["one"], got["second"]) == ([1], [2])
    with pytest.raises(FormatError, match=f"{path}: two DCP entries map to key 'both'"):
        ldc.load(template, path, key_map={"first": "both", "second": "both"})
