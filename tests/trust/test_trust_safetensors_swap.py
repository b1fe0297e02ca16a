"""A ``.safetensors`` file replaced between the check of its header and safetensors' memory map of it
(the rank-0 API's ``mapped`` reads: another process renames a new file over the name, or swaps a link):
the map is of the file that was checked, opened once, never of whatever the name holds by then. The
replacement is made at that exact point (after the header check, before the map)."""

import os

import torch
from safetensors.torch import save_file

from lightning_distckpt.reading.formats import files


def test_the_file_mapped_is_the_file_checked(tmp_path, monkeypatch):
    path = str(tmp_path / "model.safetensors")
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, path)
    other = str(tmp_path / "other.safetensors")
    save_file({"w": torch.full((2, 3), -1.0), "extra": torch.zeros(1 << 10)}, other)
    checked = files.read_open_header

    def check_then_replace(opened, where):
        header = checked(opened, where)
        os.replace(other, path)  # a writer's atomic replace, right after our check
        return header

    monkeypatch.setattr(files, "read_open_header", check_then_replace)
    f = files.SafetensorsFile(path, mapped=True)
    assert f.names() == ["w"]
    assert torch.equal(f.read("w", ()), torch.arange(6.0).reshape(2, 3))  # the checked file's bytes
    assert torch.equal(f.read("w", (slice(1, 2),)), torch.tensor([[3.0, 4.0, 5.0]]))
