"""A DCP checkpoint whose ``.metadata`` or chunks lie, made by a real ``dcp.save`` and then edited:

* Pickle opcodes that change an object on the stack (``BUILD``, ``SETITEM``, ``APPEND``) act only
  on records and containers the pickle built itself. A ``BUILD`` placed before the real metadata,
  on a class the allow-list resolves (``pathlib.PurePosixPath``: every path of the process would
  read as the attacker's string), on a function, or on an enum member, is an UnsafeContentError
  naming the file, and every such object is as it was; so is a ``BUILD`` setting a record's
  ``__class__``.
* A stored chunk of another dtype than ``.metadata`` declares (int32 or complex64 read as float32,
  float64 narrowed) is a FormatError naming the tensor and the file, contiguous or read whole.
* Chunks sharing stored bytes (rows repeated; one 1 MiB chunk named by many chunks of a tensor many
  times its size) are refused when the directory is opened, before anything is allocated.
* A size beyond torch's int64 strides (``[0, 2**64]``, of no elements) is refused from the metadata.
"""

import enum
import os
import pathlib
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   _MEM_FORMAT_ENCODING)

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError, UnsafeContentError
from trust.hostile import edit_dcp_metadata


def _save(tmp_path, name, state):
    path = str(tmp_path / name)
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def _s(text):
    """A pickle BINUNICODE of ``text``."""
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _global(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _prefix(path, opcodes):
    """Put ``opcodes`` (protocol 2, leaving the stack as they found it) before the real metadata,
    which the pickle then returns: a load that ignores them gives the right tensors."""
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        legit = f.read()
    body = legit[2:]  # without PROTO
    if body[:1] == pickle.FRAME:  # framing is optional: drop the frame header
        body = body[9:]
    with open(meta, "wb") as f:
        f.write(b"\x80\x02" + opcodes + body)
    return meta


def _slot_build(target, attrs):
    """``target`` (opcodes pushing it), then ``BUILD`` with slot state ``attrs``: setattr on it."""
    state = b"}" + b"".join(_s(k) + _s(v) + b"s" for k, v in attrs.items())
    return target + b"N" + state + b"\x86b0"  # (None, {...}) BUILD POP


_ENUM_MEMBER = _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING") + b"K\x01\x85R"
HOSTILE = {  # name -> (opcodes, the objects they would change)
    "path class": (_slot_build(_global("pathlib", "PurePosixPath"), {"_str": "/tmp/ATTACKER_CHOSEN"}),
                   [pathlib.PurePosixPath]),
    "path method": (_slot_build(_global("pathlib", "PosixPath"), {"exists": "pwned"}), [pathlib.PosixPath]),
    "dcp class": (_slot_build(_global("torch.distributed.checkpoint.metadata", "Metadata"), {"pwned": "yes"}),
                  [Metadata]),
    "function": (_global("torch.serialization", "_get_layout") + b"}" + _s("cache") + b"Nsb0",
                 [torch.serialization._get_layout]),
    "enum member": (_slot_build(_ENUM_MEMBER, {"pwned": "yes"}), [_MEM_FORMAT_ENCODING(1)]),
    "setitem on a class": (_global("pathlib", "PurePosixPath") + _s("k") + _s("v") + b"s0", [pathlib.PurePosixPath]),
    "append on a function": (_global("torch.serialization", "_get_layout") + _s("v") + b"a0",
                             [torch.serialization._get_layout]),
    "record's class": (_global("torch.distributed.checkpoint.filesystem", "_StorageInfo") + b")\x81N}" + _s("__class__")
                       + _global("pathlib", "PurePosixPath") + b"s\x86b0", [_StorageInfo]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_pickle_changing_what_it_did_not_build_is_refused_and_changes_nothing(tmp_path, case):
    opcodes, watched = HOSTILE[case]
    path = _save(tmp_path, "ck", {"w": torch.arange(4.0)})
    meta = _prefix(path, opcodes)
    before = [dict(vars(o)) for o in watched]
    try:
        with pytest.raises(UnsafeContentError) as err:
            ldc.load_plain_tensors(path)
        changed = [o for o, was in zip(watched, before) if dict(vars(o)) != was]
    finally:  # a regression must not leave the rest of the session's paths poisoned
        for o, was in zip(watched, before):
            for name in set(vars(o)) - set(was):
                delattr(o, name)
            for name, value in was.items():
                if vars(o).get(name, object()) is not value:
                    setattr(o, name, value)
    message = str(err.value)
    assert meta in message and ("sets attributes ['__class__']" if case == "record's class"
                                else "did not create") in message, message
    assert changed == []
    assert str(pathlib.PurePosixPath("/x")) == "/x" and pathlib.Path("/").exists() is True
    assert not hasattr(Metadata, "pwned") and not hasattr(_MEM_FORMAT_ENCODING(1), "pwned")
    assert isinstance(_MEM_FORMAT_ENCODING(1), enum.Enum) and torch.serialization._get_layout("torch.strided") \
        is torch.strided


def test_real_metadata_with_nested_containers_still_loads(tmp_path):
    """What torch writes (records filled by BUILD, dicts by SETITEMS, lists by APPENDS) still loads."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "nested": {"b": torch.ones(2, dtype=torch.bfloat16),
                                                              "i": torch.arange(3, dtype=torch.int64)},
             "obj": {"list": [1, 2, 3], "s": "x"}}
    path = _save(tmp_path, "ck", state)
    out = ldc.load_plain_tensors(path)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["nested.b"], state["nested"]["b"])
    assert out["nested.i"].dtype == torch.int64 and torch.equal(out["nested.i"], state["nested"]["i"])


# ---------------------------------------------------------------------------------------- dtypes

DTYPE_LIES = {  # stored tensor, the dtype .metadata then declares
    "int32 as float32": (torch.arange(4, dtype=torch.int32), torch.float32),
    "complex64 as float32": (torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64), torch.float32),
    "float64 as float32": (torch.tensor([1.5, 2.5], dtype=torch.float64), torch.float32),
    "non-contiguous float32 as int32": (torch.arange(48.0).reshape(6, 8).t(), torch.int32),  # read whole
}


@pytest.mark.parametrize("case", list(DTYPE_LIES))
def test_a_chunk_of_another_dtype_than_declared_is_refused(tmp_path, case):
    stored, declared = DTYPE_LIES[case]
    path = _save(tmp_path, "ck", {"x": stored})

    def lie(meta):
        meta.state_dict_metadata["x"].properties.dtype = declared
    edit_dcp_metadata(path, lie)
    needles = ("'x'", os.path.join(path, "__0_0.distcp"), f"dtype {stored.dtype}", f"declares {declared}")
    with pytest.raises(FormatError) as err:
        ldc.load_plain_tensors(path)
    assert all(n in str(err.value) for n in needles), str(err.value)
    with pytest.raises(FormatError) as err:
        ldc.load({"x": ldc.ShardedTensor.from_rank_offsets("x", torch.zeros(stored.shape, dtype=declared))}, path)
    assert all(n in str(err.value) for n in needles), str(err.value)
    report = ldc.validate(path)
    assert not report.ok and any(f"dtype {stored.dtype}" in p for p in report.problems), report


# ------------------------------------------------------------------------------------ shared bytes

def _info(meta, fqn, offset):
    return meta.storage_data[MetadataIndex(fqn, torch.Size(offset))]


def _repeated_rows(meta):  # w [4, 4] declared [8, 4]: rows 4-8 named at the bytes of rows 0-4
    entry = meta.state_dict_metadata["w"]
    entry.size = torch.Size([8, 4])
    entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([4, 4])))
    meta.storage_data[MetadataIndex("w", torch.Size([4, 0]))] = _info(meta, "w", [0, 0])


def _amplified(meta):  # one 256 x 1024 chunk named by 64 chunks of a [256 * 64, 1024] tensor
    entry = meta.state_dict_metadata["w"]
    entry.size = torch.Size([256 * 64, 1024])
    info = _info(meta, "w", [0, 0])
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([256 * i, 0]), sizes=torch.Size([256, 1024]))
                    for i in range(64)]
    for i in range(64):
        meta.storage_data[MetadataIndex("w", torch.Size([256 * i, 0]))] = info


def _inside_another(meta):  # v's chunk at bytes inside w's (a range of its own, overlapping)
    w = _info(meta, "w", [0, 0])
    meta.storage_data[MetadataIndex("v", torch.Size([0]))] = _StorageInfo(w.relative_path, w.offset + 64,
                                                                          w.length - 64)


SHARED = {"repeated rows": (_repeated_rows, torch.arange(16.0).reshape(4, 4)),
          "amplified": (_amplified, torch.ones(256, 1024)),
          "inside another": (_inside_another, torch.arange(16.0).reshape(4, 4))}


@pytest.mark.parametrize("case", list(SHARED))
def test_chunks_sharing_stored_bytes_are_refused_when_opened(tmp_path, case):
    edit, w = SHARED[case]
    path = _save(tmp_path, "ck", {"w": w, "v": torch.arange(4.0)})
    edit_dcp_metadata(path, edit)
    for read in (ldc.load_tensors_metadata, ldc.load_plain_tensors, ldc.validate):
        with pytest.raises(FormatError) as err:
            read(path)
        message = str(err.value)
        assert os.path.join(path, "__0_0.distcp") in message and "overlap" in message, message


def test_distinct_chunks_of_one_file_still_load(tmp_path):
    """Many items in one .distcp file, each with bytes of its own, side by side."""
    state = {f"t{i}": torch.full((3, i + 1), float(i)) for i in range(8)}
    path = _save(tmp_path, "ck", state)
    out = ldc.load_plain_tensors(path)
    assert set(out) == set(state) and all(torch.equal(out[k], v) for k, v in state.items())


# ------------------------------------------------------------------------------------------ sizes

@pytest.mark.parametrize("size", [[0, 2**64], [0, 2**62, 2], [2**63]], ids=["0x2^64", "0x2^62x2", "2^63"])
def test_a_size_beyond_torch_strides_is_refused_from_the_metadata(tmp_path, size):
    path = _save(tmp_path, "ck", {"w": torch.zeros(0, 4), "x": torch.ones(2)})

    def huge(meta):
        meta.state_dict_metadata["w"].size = torch.Size(size)
        meta.state_dict_metadata["w"].chunks[0].offsets = torch.Size([0] * len(size))
        meta.state_dict_metadata["w"].chunks[0].sizes = torch.Size([0] * len(size))
    edit_dcp_metadata(path, huge)
    for read in (ldc.load_tensors_metadata, ldc.load_plain_tensors):
        with pytest.raises(FormatError) as err:
            read(path)
        message = str(err.value)
        assert os.path.join(path, ".metadata") in message and "'w'" in message and "2**63" in message, message


def test_a_size_just_within_torch_strides_loads(tmp_path):
    """The bound is torch's, not lower: ``[0, 2**62]`` is an empty tensor torch can make."""
    path = _save(tmp_path, "ck", {"w": torch.zeros(0, 4)})

    def big(meta):
        meta.state_dict_metadata["w"].size = torch.Size([0, 2**62])
    edit_dcp_metadata(path, big)
    assert ldc.load_tensors_metadata(path)["w"].global_shape == (0, 2**62)
    out = ldc.load_plain_tensors(path)
    assert out["w"].shape == (0, 2**62) and out["w"].dtype == torch.float32


def test_an_empty_dcp_key_is_a_format_error_naming_the_way_around(tmp_path):
    """DCP saves a key ``""``; no template can have it. Every entry point says so, with the key_map that
    loads the rest (it was a bare ShardingError from deep inside before), and the key_map does load it."""
    dcp.save({"": torch.arange(4.0), "a": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    path = str(tmp_path / "ck")
    for call in (lambda: ldc.load_plain_tensors(path), lambda: ldc.load_tensors_metadata(path),
                 lambda: ldc.load({"a": torch.zeros(2)}, path),
                 lambda: ldc.export.to_safetensors(path, str(tmp_path / "out"))):
        with pytest.raises(FormatError, match=r"tensor '' would be loaded under key ''.*key_map \(\{'': 'a_name'\}"):
            call()
    assert not os.path.exists(tmp_path / "out")
    got = ldc.load({"a": torch.zeros(2), "x": torch.zeros(4)}, path, key_map={"": "x"})
    assert torch.equal(got["x"], torch.arange(4.0)) and torch.equal(got["a"], torch.ones(2))
