"""Odd arguments give a clear CheckpointingError (or, on the command line, exit status 2 and one
line naming the option), never a raw Python error.

* Every numeric option of the CLI (but ``clean --older-than``, tested in test_trust_commit.py) with
  ``nan``, ``inf``, ``-1``, ``0`` and ``x``.
* Every public function that takes a checkpoint path, with an int, None, a list and a float: an
  ArgumentTypeError (a CheckpointingError and a TypeError) naming the argument; bytes are decoded as
  the OS does, everywhere (a save with bytes loads with bytes and with str).
* The other arguments of save / load / the exports with a wrong type: an error naming the argument.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt import convert
from lightning_distckpt.cli.main import main
from lightning_distckpt import validate
from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError, CheckpointingError
from lightning_distckpt.ingest import load_state_dict

WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)
NOT_PATHS = [7, None, ["ck"], 1.5]
BAD_NUMBERS = ["nan", "inf", "-inf", "-1", "0", "x", "1e400"]


def _state():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", WEIGHT.clone()), "step": 1}


def _template():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros_like(WEIGHT))}


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("args") / "ck")
    ldc.save(_state(), path)
    torch.save({"w": WEIGHT}, os.path.join(os.path.dirname(path), "plain.pt"))
    return path


# -- the command line ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_chunk_mib_must_be_a_finite_size(ck, tmp_path, value, capsys):
    for argv in (["--chunk-mib", value], [f"--chunk-mib={value}"]):
        with pytest.raises(SystemExit) as exit_:
            main(["convert", ck, str(tmp_path / "out"), "--to", "distckpt", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --chunk-mib" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", BAD_NUMBERS + ["1.5"])
def test_max_inflight_mib_must_be_a_positive_whole_number(ck, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["validate", ck, f"--max-inflight-mib={value}"])
    assert exit_.value.code == 2 and "argument --max-inflight-mib" in capsys.readouterr().err


@pytest.mark.parametrize("value", BAD_NUMBERS + ["9" * 400 + "TB"])
def test_max_shard_size_must_be_a_size(ck, tmp_path, value, capsys):
    status = main(["convert", ck, str(tmp_path / "hf"), "--to", "safetensors", f"--max-shard-size={value}"])
    err = capsys.readouterr().err
    if value.endswith("TB"):  # absurd but a size: one file
        assert status == 0 and os.path.isfile(tmp_path / "hf" / "model.safetensors")
        return
    assert status == 2 and "--max-shard-size" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf").exists()


def test_chunk_mib_nan_in_a_real_process_is_one_line(ck, tmp_path):
    """The reported bug: ``convert --chunk-mib nan`` ended in a traceback."""
    r = subprocess.run([sys.executable, "-m", "lightning_distckpt", "convert", ck, str(tmp_path / "o"), "--to",
                        "distckpt", "--chunk-mib", "nan"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--chunk-mib" in r.stderr, r.stderr


def test_a_valid_fractional_chunk_mib_is_taken(ck, tmp_path):
    assert main(["convert", ck, str(tmp_path / "out"), "--to", "distckpt", "--chunk-mib", "0.5"]) == 0
    assert torch.equal(ldc.load_plain_tensors(tmp_path / "out")["w"], WEIGHT)


# -- path arguments -----------------------------------------------------------------------------------
def path_calls(ck: str, out: str):
    """(name of the path argument, call taking that argument) for each public function."""
    plain = os.path.join(os.path.dirname(ck), "plain.pt")
    return [
        ("checkpoint_dir", lambda p: ldc.save(_state(), p)),
        ("checkpoint_dir", lambda p: ldc.load(_template(), p)),
        ("checkpoint_dir", lambda p: ldc.AsyncSaver().save(_state(), p)),
        ("checkpoint_dir", lambda p: ldc.load_plain_tensors(p)),
        ("checkpoint_dir", lambda p: ldc.load_tensors_metadata(p)),
        ("checkpoint_dir", lambda p: ldc.load_common_state_dict(p)),
        ("source", lambda p: ldc.export.relayout(p, out, ldc.StorageOptions())),
        ("destination", lambda p: ldc.export.relayout(ck, p, ldc.StorageOptions())),
        ("source", lambda p: convert.export_torch_file(p, out)),
        ("destination", lambda p: convert.export_torch_file(ck, p)),
        ("source", lambda p: convert.import_torch_file(p, out)),
        ("destination", lambda p: convert.import_torch_file(plain, p)),
        ("source", lambda p: ldc.export.to_torch_file(p, out)),
        ("destination", lambda p: ldc.export.to_torch_file(ck, p)),
        ("source", lambda p: ldc.export.from_torch_file(p, out)),
        ("destination", lambda p: ldc.export.from_torch_file(plain, p)),
        ("checkpoint", lambda p: ldc.export.to_safetensors(p, out)),
        ("out_dir", lambda p: ldc.export.to_safetensors(ck, p)),
        ("checkpoint", lambda p: ldc.export.to_dcp(p, out)),
        ("out_dir", lambda p: ldc.export.to_dcp(ck, p)),
        ("checkpoint", lambda p: ldc.export.to_megatron(p, out)),
        ("out_dir", lambda p: ldc.export.to_megatron(ck, p)),
        ("checkpoint", lambda p: validate(p)),
        ("checkpoint_file", lambda p: load_state_dict(p)),
        ("checkpoint", lambda p: ldc.lightning.load_module_weights(torch.nn.Linear(4, 3), p)),
        ("path", lambda p: ldc.lightning.DistCheckpointIO().save_checkpoint({"w": WEIGHT}, p)),
        ("path", lambda p: ldc.lightning.DistCheckpointIO().load_checkpoint(p)),
        ("path", lambda p: ldc.lightning.DistCheckpointIO().open_source(p)),
        ("path", lambda p: ldc.lightning.DistCheckpointIO().remove_checkpoint(p)),
        ("checkpoint_dir", lambda p: ldc.lightning.DistCheckpointIO().save_sharded(_state(), p)),
        ("checkpoint_dir", lambda p: ldc.lightning.DistCheckpointIO().load_sharded(_template(), p)),
    ]


def test_a_path_argument_that_is_no_path_is_an_argument_type_error(ck, tmp_path):
    out = str(tmp_path / "out")
    for name, call in path_calls(ck, out):
        for value in NOT_PATHS:
            with pytest.raises(ArgumentTypeError, match=rf"{name} must be a path.*got {type(value).__name__}"):
                call(value)
            with pytest.raises(TypeError):  # ArgumentTypeError is a TypeError too
                call(value)
    assert sorted(os.listdir(tmp_path)) == []  # nothing written


def test_an_empty_or_nul_path_is_an_argument_error(ck, tmp_path):
    for name, call in path_calls(ck, str(tmp_path / "out")):
        for value in ("", b"", "ck\0x"):
            with pytest.raises(ArgumentError, match=name):
                call(value)
    assert sorted(os.listdir(tmp_path)) == []


def test_bytes_paths_are_decoded_everywhere(tmp_path):
    """save with bytes, load with bytes or str: the same checkpoint (a non-ASCII name too)."""
    raw = os.fsencode(str(tmp_path)) + "/ck-é".encode()
    ldc.save(_state(), raw)
    text = os.fsdecode(raw)
    assert os.path.isdir(text)
    for path in (raw, text):
        assert torch.equal(ldc.load(_template(), path)["w"], WEIGHT)
        assert torch.equal(ldc.load_plain_tensors(path)["w"], WEIGHT)
        assert ldc.load_common_state_dict(path) == {"step": 1}
        assert set(ldc.load_tensors_metadata(path)) == {"w"}
    report = ldc.export.to_safetensors(raw, os.fsencode(str(tmp_path / "hf")))
    assert report.destination == str(tmp_path / "hf") and isinstance(report.source, str)
    convert.export_torch_file(raw, os.fsencode(str(tmp_path / "x.pt")))
    assert torch.equal(torch.load(tmp_path / "x.pt")["tensors"]["w"], WEIGHT)
    request = ldc.AsyncSaver().save(_state(), os.fsencode(str(tmp_path / "async")))
    request.finalize()
    assert torch.equal(ldc.load_plain_tensors(tmp_path / "async")["w"], WEIGHT)


def test_a_path_that_is_not_utf8_is_refused_alike_everywhere(ck, tmp_path):
    """Bytes that do not decode as UTF-8 (tensorstore opens only UTF-8 paths): save and load say so."""
    raw = os.fsencode(str(tmp_path)) + b"/ck-\xff"
    for call in (lambda p: ldc.save(_state(), p), lambda p: ldc.load(_template(), p), ldc.load_plain_tensors,
                 lambda p: ldc.export.to_dcp(ck, p)):
        for path in (raw, os.fsdecode(raw)):
            with pytest.raises(ArgumentError, match="not valid UTF-8"):
                call(path)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_backslash_in_a_checkpoint_path_is_refused(ck, tmp_path):
    """tensorstore reads a backslash as a separator: ``x\\y`` would be written to ``x/y`` (a
    relayout's staging directory, ``.x\\y.distckpt-staging-*``, landed in ``.x/``)."""
    for call in (lambda p: ldc.save(_state(), p), lambda p: ldc.export.relayout(ck, p, ldc.StorageOptions()),
                 lambda p: ldc.load(_template(), p)):
        for name in ("x\\y", "\\", "0\\0"):
            with pytest.raises(ArgumentError, match="backslash"):
                call(str(tmp_path / name))
    assert sorted(os.listdir(tmp_path)) == []


# -- the other arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,name", [
    (dict(validate_access_integrity="no"), "validate_access_integrity"),
    (dict(balance_writes=1), "balance_writes"),
    (dict(storage={"layout": "zarr"}), "storage"),
    (dict(async_save=5), "async_save"),
    (dict(plan_cache=object()), "plan_cache"),
])
def test_save_arguments_of_the_wrong_type(tmp_path, kwargs, name):
    with pytest.raises(ArgumentTypeError, match=name):
        ldc.save(_state(), tmp_path / "ck", **kwargs)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("state", [5, None, [1], "w"])
def test_a_state_dict_that_is_no_dict(ck, tmp_path, state):
    with pytest.raises(ArgumentTypeError, match="sharded_state_dict must be a dict"):
        ldc.save(state, tmp_path / "ck")
    with pytest.raises(ArgumentTypeError, match="sharded_state_dict must be a dict"):
        ldc.load(state, ck)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("kwargs,name,error", [
    (dict(strict=5), "strict", ArgumentTypeError),
    (dict(strict=None), "strict", ArgumentTypeError),
    (dict(strict="sometimes"), "strict", ArgumentError),
    (dict(extra_safe_globals=5), "extra_safe_globals", ArgumentTypeError),
    (dict(extra_safe_globals="os.system"), "extra_safe_globals", ArgumentTypeError),
    (dict(key_map=5), "key_map", ArgumentTypeError),
    (dict(loader=5), "loader", ArgumentTypeError),
])
def test_load_arguments_of_the_wrong_type(ck, kwargs, name, error):
    with pytest.raises(error, match=name if name != "strict" or error is ArgumentTypeError else "strict handling"):
        ldc.load(_template(), ck, **kwargs)


@pytest.mark.parametrize("size,error", [(1.5, ArgumentTypeError), (None, ArgumentTypeError), ([1], ArgumentTypeError),
                                        (True, ArgumentTypeError), ("nan", ArgumentError), ("-5GB", ArgumentError),
                                        ("0.1", ArgumentError)])
def test_max_shard_size_of_the_wrong_type_or_value(ck, tmp_path, size, error):
    with pytest.raises(error, match="max_shard_size"):
        ldc.export.to_safetensors(ck, tmp_path / "hf", max_shard_size=size)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("field,value", [("chunk_bytes", "64MiB"), ("chunk_bytes", 1.5e6), ("chunk_bytes", True),
                                         ("chunk_bytes", 1 << 50), ("chunk_bytes", 0), ("io_concurrency", "8"),
                                         ("pack_max_bytes", None), ("data_file_bytes", float("nan"))])
def test_storage_options_of_the_wrong_type_or_range(field, value):
    with pytest.raises(CheckpointingError, match=field):
        ldc.StorageOptions(**{field: value})


def test_converter_options_of_the_wrong_type(ck, tmp_path):
    with pytest.raises(ArgumentTypeError, match="storage"):
        ldc.export.relayout(ck, tmp_path / "o", {"layout": "zarr"})
    with pytest.raises(ArgumentTypeError, match="extra_safe_globals"):
        convert.export_torch_file(ck, tmp_path / "o.pt", extra_safe_globals=5)
    with pytest.raises(ArgumentTypeError, match="key_map"):
        ldc.export.to_dcp(ck, tmp_path / "o", key_map=["w"])
    assert sorted(os.listdir(tmp_path)) == []
