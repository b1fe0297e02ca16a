"""torch.save zip archives checked before torch reads them (storage/zip_records.py): torch takes a
record's data offset from its local header and checks no CRC, so damaged bytes there were values."""

import io
import struct
import warnings
import zipfile

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.storage.safe_pickle import load_file, loads
from lightning_distckpt.storage.zip_records import check_records

W = torch.arange(4096, dtype=torch.float32)


def _saved() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": W, "b": torch.ones(3)}, buf)
    return buf.getvalue()


def _record(data: bytes, suffix: str) -> zipfile.ZipInfo:
    return next(i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith(suffix))


def _data_start(data: bytes, info: zipfile.ZipInfo) -> int:
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def test_an_intact_archive_loads_from_a_file_and_from_bytes(tmp_path):
    data = _saved()
    (tmp_path / "m.pt").write_bytes(data)
    assert torch.equal(load_file(str(tmp_path / "m.pt"))["w"], W)
    assert torch.equal(loads(data, "blob")["w"], W)


def test_a_zeroed_extra_field_length_is_refused_not_read_from_elsewhere(tmp_path):
    data = bytearray(_saved())
    info = _record(bytes(data), "data/0")
    struct.pack_into("<H", data, info.header_offset + 28, 0)  # torch would read w from earlier bytes
    (tmp_path / "m.pt").write_bytes(data)
    with pytest.raises(FormatError, match="data/0.*local header"):
        load_file(str(tmp_path / "m.pt"))
    with pytest.raises(FormatError, match="data/0"):
        ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros_like(W))}, str(tmp_path / "m.pt"))


def test_a_flipped_data_byte_is_found_by_the_records_crc(tmp_path):
    data = bytearray(_saved())
    data[_data_start(bytes(data), _record(bytes(data), "data/0")) + 100] ^= 0x10
    with pytest.raises(FormatError, match="data/0.*CRC-32"):
        loads(bytes(data), "blob")
    (tmp_path / "m.pt").write_bytes(data)
    with pytest.raises(FormatError, match=r"m\.pt: zip record .*data/0"):
        load_file(str(tmp_path / "m.pt"))


def test_with_verification_off_the_headers_are_still_checked_the_crcs_not(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DISTCKPT_VERIFY", "0")  # salvaging what still reads
    data = bytearray(_saved())
    info = _record(bytes(data), "data/0")
    flipped = bytearray(data)
    flipped[_data_start(bytes(data), info) + 4] ^= 0x40  # w[1]
    assert loads(bytes(flipped), "blob")["w"][1] != W[1]
    struct.pack_into("<H", data, info.header_offset + 28, 0)
    with pytest.raises(FormatError, match="data/0.*local header"):
        loads(bytes(data), "blob")


@pytest.mark.parametrize("damage", ["signature", "name"])
def test_a_damaged_local_header_is_named(damage):
    data = bytearray(_saved())
    info = _record(bytes(data), "data/0")
    data[info.header_offset + (0 if damage == "signature" else 30)] ^= 0x01
    with pytest.raises(FormatError, match="data/0.*local header"):
        check_records(io.BytesIO(bytes(data)), "blob")


def test_a_record_named_twice_is_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        for _ in range(2):
            zf.writestr("archive/data.pkl", b"x")
    with pytest.raises(FormatError, match="twice"):
        check_records(io.BytesIO(buf.getvalue()), "blob")


def test_an_archive_written_without_crcs_still_loads(tmp_path):
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": W}, tmp_path / "m.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert _record((tmp_path / "m.pt").read_bytes(), "data/0").CRC == 0
    assert torch.equal(load_file(str(tmp_path / "m.pt"))["w"], W)


def test_the_check_leaves_a_file_objects_position():
    buf = io.BytesIO(_saved())
    buf.seek(7)
    check_records(buf, "blob")
    assert buf.tell() == 7


def _dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process, no process group: DCP says so
        warnings.simplefilter("ignore")
        dcp.save({"w": W.reshape(64, 64)}, checkpoint_id=str(tmp_path / "dcp"))
    data_file = tmp_path / "dcp" / "__0_0.distcp"
    data = data_file.read_bytes()
    return data_file, bytearray(data), data.index(W.numpy().tobytes())


def _load_dcp(tmp_path, rows=64):
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64, 64))}
    if rows < 64:  # the first of 64 // rows pieces along axis 0: a piece of the stored chunk
        template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 64), (0, 0, 64 // rows))}
    return ldc.load(template, str(tmp_path / "dcp"))["w"]


def test_a_dcp_chunk_read_whole_is_checked_by_its_records_crc(tmp_path):
    data_file, data, at = _dcp(tmp_path)
    data[at + 4 * 64 * 40] ^= 0x04  # w[40, 0]
    data_file.write_bytes(data)
    with pytest.raises(FormatError, match="__0_0.distcp.*CRC-32"):
        _load_dcp(tmp_path)
    # a piece of the chunk away from the damage: the record is read whole for its CRC to be checked
    with pytest.raises(FormatError, match="__0_0.distcp.*CRC-32"):
        _load_dcp(tmp_path, rows=32)


def test_a_dcp_chunk_whose_local_header_is_damaged_is_refused_even_in_part(tmp_path):
    data_file, data, at = _dcp(tmp_path)
    name_len_at = data.rindex(b"PK\x03\x04", 0, at) + 26
    struct.pack_into("<H", data, name_len_at + 2, 0)  # extra-field length 0: the data would move
    data_file.write_bytes(data)
    for rows in (64, 32):
        with pytest.raises(FormatError, match="local header"):
            _load_dcp(tmp_path, rows)


def test_the_crc32_used_is_zlibs_polynomial():
    import zlib

    import numpy as np

    from lightning_distckpt.storage.zip_records import crc32

    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    for view in (data.tobytes(), memoryview(data)[3:], data[: (1 << 20) - 5], b""):
        assert crc32(view) == zlib.crc32(view)


@pytest.mark.parametrize("raw", ["[1, 2]", '{"w": -1}', '{"w": 4294967296}', '{"w": "12"}', "{", "x" * 10])
def test_malformed_safetensors_crcs_are_format_errors(raw):
    from lightning_distckpt.storage.safetensors_crcs import CRC_KEY, recorded_crcs

    with pytest.raises(FormatError, match="malformed"):
        recorded_crcs({CRC_KEY: raw}, "f.safetensors")
    assert recorded_crcs({"format": "pt"}, "f.safetensors") == {}  # a file someone else wrote
    assert recorded_crcs(None, "f.safetensors") == {}

