"""A Megatron-Core ``torch_dist`` directory whose names or config are hostile or damaged.

ShardedObject names (``<key>/shard_<offset>_<shape>``) carry numbers: a number of thousands of
digits made ``int`` raise a raw ValueError (past Python's 4300-digit limit), and ``\\d`` took other
scripts' digits. A ``metadata.json`` padded past 1 MiB, or damaged, made the directory read as
plain DCP: its common state silently became the DCP bytes entries. Each is a FormatError naming
the directory or the file now, through the API and the CLI (exit status 2), and a plain DCP
directory (no ``metadata.json``) still reads. The checkpoints are written by ``dcp.save`` itself
(one process), with ``common.pt`` by ``torch.save`` and Megatron's ``metadata.json`` beside them,
as Megatron-Core lays them out.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import FormatError

WEIGHT = torch.arange(6, dtype=torch.float32).reshape(2, 3)
COMMON = {"iteration": 5, "nested": {"lr": 0.5}}
CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
          "common_backend_version": 1}
GOOD_OBJECTS = {"obj/shard_0_2": {"rank": 0}, "obj/shard_1_2": {"rank": 1}}


def dcp_save(path: str, objects: dict) -> None:
    """``dcp.save`` of a tensor and of each object as Megatron stores a ShardedObject element: a
    bytes entry under its unique key holding a one-element list."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = {"w": WEIGHT.clone(), **{name: [value] for name, value in objects.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), planner=DefaultSavePlanner(flatten_state_dict=False),
                 no_dist=True)


def torch_dist(path: str, objects: dict = GOOD_OBJECTS, config: bytes = json.dumps(CONFIG).encode()) -> str:
    dcp_save(path, objects)
    torch.save(COMMON, os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(config)
    return path


def cli(argv) -> tuple:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, err.getvalue()


def readers(path: str) -> dict:
    return {"load_tensors_metadata": lambda: ldc.load_tensors_metadata(path),
            "load_common_state_dict": lambda: ldc.load_common_state_dict(path),
            "load_plain_tensors": lambda: ldc.load_plain_tensors(path),
            "load": lambda: ldc.load({"o": ldc.ShardedObject("obj", None, (2,), (1,))}, path)}


def test_the_builder_makes_a_checkpoint_that_reads(tmp_path):
    """The control: the same writer, Megatron's names, reads back exactly."""
    path = torch_dist(str(tmp_path / "m"))
    assert ldc.load_common_state_dict(path) == COMMON
    assert torch.equal(ldc.load_plain_tensors(path)["w"], WEIGHT)
    assert ldc.load({"o": ldc.ShardedObject("obj", None, (2,), (1,))}, path)["o"] == {"rank": 1}
    assert cli(["validate", path])[0] == 0


BAD_NAMES = {
    "5000-digit shape": "obj/shard_0_" + "9" * 5000,
    "5000-digit offset": "obj/shard_" + "1" * 5000 + "_2",
    "19-digit shape": "obj/shard_0_" + "1" * 19,
    "arabic-indic digits": "obj/shard_\u0660_\u0662",
    "fullwidth digits": "obj/shard_\uff10_\uff12",
    "trailing newline": "obj/shard_0_2\n",
}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_an_object_name_with_bad_numbers_is_a_format_error(tmp_path, case):
    name = BAD_NAMES[case]
    path = torch_dist(str(tmp_path / "m"), {name: {"rank": 0}})
    for what, read in readers(path).items():
        with pytest.raises(FormatError, match="not a Megatron-Core ShardedObject") as err:
            read()
        message = str(err.value)
        assert path in message and len(message) < 600, (case, what, message)  # names it, cut short
    for command in ("inspect", "validate"):
        status, err_text = cli([command, path])
        assert status == 2 and "Traceback" not in err_text and "ShardedObject" in err_text, (case, command, err_text)


def test_the_largest_accepted_number_reads(tmp_path):
    """18 digits: the key parses, and the object's element reads (its shape is what the name says)."""
    big = 10 ** 17
    path = torch_dist(str(tmp_path / "m"), {f"obj/shard_{big - 1}_{big}": {"last": True}})
    got = ldc.load({"o": ldc.ShardedObject("obj", None, (big,), (big - 1,))}, path)
    assert got["o"] == {"last": True} and got["iteration"] == 5


BAD_CONFIGS = {
    "padded past 1 MiB": json.dumps(CONFIG).encode() + b" " * (1 << 20) + b"\n",
    "not JSON": b'{"sharded_backend": "torch_dist", ',
    "a key flipped": json.dumps(CONFIG).replace("sharded_backend", "sharded_backenf", 1).encode(),
    "a list": b'["torch_dist"]',
    "empty": b"",
    "version NaN": b'{"sharded_backend": "torch_dist", "sharded_backend_version": NaN}',
    "version a string": b'{"sharded_backend": "torch_dist", "common_backend_version": "1"}',
    "backend a list": b'{"sharded_backend": ["torch_dist"]}',
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_metadata_json_beside_dcp_files_is_a_format_error(tmp_path, case):
    """Never read as plain DCP: the common state would be the objects instead of common.pt."""
    path = torch_dist(str(tmp_path / "m"), config=BAD_CONFIGS[case])
    config = os.path.join(path, "metadata.json")
    for what, read in readers(path).items():
        with pytest.raises(FormatError) as err:
            read()
        assert config in str(err.value), (case, what, str(err.value))
    for command in ("inspect", "validate", "convert"):
        argv = [command, path] + ([str(tmp_path / f"out-{command}.pt")] if command == "convert" else [])
        status, err_text = cli(argv)
        assert status == 2 and config in err_text and "Traceback" not in err_text, (case, command, err_text)
    assert not os.path.exists(tmp_path / "out-convert.pt")


def test_a_plain_dcp_directory_still_reads(tmp_path):
    """No metadata.json: plain DCP, its bytes entries its common state."""
    path = str(tmp_path / "dcp")
    dcp_save(path, {"step": 7})
    assert torch.equal(ldc.load_plain_tensors(path)["w"], WEIGHT)
    common = ldc.load_common_state_dict(path)
    assert common["step"] == [7]
    assert cli(["validate", path])[0] == 0


def test_our_own_checkpoint_with_a_large_metadata_json_still_reads(tmp_path):
    """Ours is also named metadata.json, without DCP files beside it, and may pass 1 MiB: still ours."""
    tensors = {f"layer{i:05d}.weight_with_a_long_name_" + "x" * 40: torch.full((2,), float(i)) for i in range(6000)}
    path = str(tmp_path / "ours")
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()} | {"step": 3}, path)
    assert os.path.getsize(os.path.join(path, "metadata.json")) > 1 << 20
    back = ldc.load_plain_tensors(path)
    assert len(back) == len(tensors) and torch.equal(back[next(iter(tensors))], torch.zeros(2))
    assert ldc.load_common_state_dict(path) == {"step": 3}
