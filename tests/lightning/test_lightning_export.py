"""One function per direction: ``lightning_distckpt.export.to_torch_file`` / ``from_torch_file`` handle
Lightning checkpoints and any dict (their Lightning cases in lightning_distckpt/lightning/export.py);
the core convert module and the CLI's import do not import Lightning."""

import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt import convert
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.lightning import export as lightning_export


def test_one_function_per_direction():
    # release 0.2's names in lightning.export (imported by other code) are the same functions
    assert lightning_export.export_torch_file is ldc.export.to_torch_file
    assert lightning_export.import_torch_file is ldc.export.from_torch_file


def test_plugin_checkpoint_round_trips_through_one_file(tmp_path):
    ckpt = {"state_dict": {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4)}, "global_step": 7,
            "optimizer_states": [{"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(4, 3)}}}]}
    DistCheckpointIO().save_checkpoint(ckpt, tmp_path / "ck")
    report = ldc.export.to_torch_file(str(tmp_path / "ck"), str(tmp_path / "ck.pt"))
    assert report.kind == "lightning" and report.tensors == 4
    exported = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert exported["global_step"] == 7 and torch.equal(exported["state_dict"]["fc.weight"], ckpt["state_dict"]["fc.weight"])
    report = ldc.export.from_torch_file(str(tmp_path / "ck.pt"), str(tmp_path / "back"))
    assert report.kind == "tree" and report.tensors == 3  # the 0-d step stays common state
    back = DistCheckpointIO().load_checkpoint(tmp_path / "back")
    assert torch.equal(back["optimizer_states"][0]["state"][0]["exp_avg"], ckpt["optimizer_states"][0]["state"][0]["exp_avg"])


def test_core_convert_handles_only_its_own_structure(tmp_path):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2, 2)), "step": 3}, tmp_path / "raw")
    report = ldc.export.to_torch_file(str(tmp_path / "raw"), str(tmp_path / "raw.pt"))  # not Lightning's: the core's
    assert report.kind == "tensors" and report.tensors == 1
    assert convert.import_torch_file(str(tmp_path / "raw.pt"), str(tmp_path / "raw2")).kind == "tensors"
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "plain.pt")
    with pytest.raises(FormatError, match="lightning_distckpt.export.from_torch_file saves any dict"):
        convert.import_torch_file(str(tmp_path / "plain.pt"), str(tmp_path / "plain"))


def test_core_tools_do_not_import_lightning():
    code = ("import sys, lightning_distckpt, lightning_distckpt.convert, lightning_distckpt.cli.main; "
            "print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', "
            "'lightning_distckpt.lightning'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
