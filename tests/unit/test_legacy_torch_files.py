"""torch's pre-1.6 (legacy) torch.save format: pickles, then each storage's element count and bytes,
nothing after, and no checksum. What can still be checked is that the file ends where its last
storage does (storage/safe_pickle.py)."""

import io

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.storage.safe_pickle import load_file, loads

W = torch.arange(4096, dtype=torch.float32)


def _legacy() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": W, "b": torch.ones(3)}, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def _last_storage(data: bytes) -> int:
    """Where the last storage's bytes begin: storages are written in an order of their own (by key), each
    as its 8-byte element count, then its bytes, the last one running to the end of the file."""
    return max(data.index(W.numpy().tobytes()), data.index(torch.ones(3).numpy().tobytes()))


@pytest.mark.parametrize("damage", ["insert_in_size", "append", "insert_in_data", "drop_from_data"])
def test_a_legacy_file_that_does_not_end_with_its_last_storage_is_refused(tmp_path, damage):
    """torch's pre-1.6 format has no checksum, and torch ignores what follows the last storage: a zero
    byte inserted into that storage's element count where it was zero read the same count and the data
    one byte later (found by tests/trust/test_hostile_damage.py as wrong values)."""
    data = _legacy()
    (tmp_path / "ok.pt").write_bytes(data)
    assert torch.equal(load_file(str(tmp_path / "ok.pt"))["w"], W)
    assert torch.equal(loads(data, "blob")["w"], W)
    at = _last_storage(data)
    damaged = {"insert_in_size": data[:at - 1] + b"\0" + data[at - 1:], "append": data + b"\0",
               "insert_in_data": data[:at + 4] + b"\x7f" + data[at + 4:],
               "drop_from_data": data[:at + 4] + data[at + 5:]}[damage]
    (tmp_path / "bad.pt").write_bytes(damaged)
    with pytest.raises(FormatError, match="bad.pt"):
        load_file(str(tmp_path / "bad.pt"))
    with pytest.raises(FormatError, match="blob"):
        loads(damaged, "blob")
    with pytest.raises(ldc.CheckpointingError, match="bad.pt"):
        ldc.load_plain_tensors(str(tmp_path / "bad.pt"))


def test_a_file_in_no_torch_format_is_still_given_to_torch_by_its_name(tmp_path):
    """Only a file that starts as the pre-1.6 format is read from an open file: torch.load reads a
    safetensors file when named by its path (not from an open file), and convert relies on it."""
    from safetensors.torch import save_file

    save_file({"w": W}, str(tmp_path / "m.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "m.safetensors"))["w"], W)
    (tmp_path / "junk.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(FormatError, match="junk.pt is not a checkpoint"):
        load_file(str(tmp_path / "junk.pt"))
