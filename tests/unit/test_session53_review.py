"""Fixes from a review of session 53's product changes (helper-113).

``fabric.load_raw(path, module)`` under the Fabric ModelParallel subclass (``fabric_raw.load_raw_sharded_module``)
read every tensor of the file, the module's or not, whole into memory on every rank, then dropped those the
module lacks. Stock memory-maps the file and ignores them; ours now reads only the module's tensors (their
shapes checked from the header first). Shown with a real file whose extra tensor is damaged (its bytes differ
from the CRC-32C the file records): a tensor the module lacks is never read, so the load succeeds on both ranks.
"""

import json
import os

import torch
from safetensors.torch import save_file

from dist_utils import run_distributed
from lightning_distckpt.storage.safetensors_crcs import crc_metadata


def _load_raw(rank: int, world_size: int, path: str, strict: bool):
    """Rank body: a fresh Linear(3, 2) filled from ``path`` by the ModelParallel ``fabric.load_raw``."""
    import lightning_distckpt
    from lightning_distckpt.lightning.fabric_raw import load_raw_sharded_module

    torch.manual_seed(123)
    module = torch.nn.Linear(3, 2)
    try:
        load_raw_sharded_module(module, path, strict, ())
    except Exception as e:  # reported to the test, which shows it
        return {"error": f"{type(e).__name__}: {e}", "package": lightning_distckpt.__file__}
    return {"weight": module.weight.detach().tolist(), "bias": module.bias.detach().tolist(),
            "package": lightning_distckpt.__file__}


def _damaged_extra_file(tmp_path) -> tuple:
    """A safetensors file of a Linear(3, 2)'s weights plus an ``extra`` tensor, every tensor's CRC-32C
    recorded; ``extra``'s bytes then changed in place (so reading it is a FormatError)."""
    tensors = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([7.0, 8.0]),
               "extra": torch.full((64,), 5.0)}
    path = str(tmp_path / "raw.safetensors")
    save_file(tensors, path, metadata=crc_metadata(tensors))
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        begin, _ = json.loads(f.read(header_len))["extra"]["data_offsets"]
        f.seek(8 + header_len + begin)
        f.write(torch.full((4,), -1.0).numpy().tobytes())  # the first 4 of extra's values changed
    return path, tensors


def test_model_parallel_load_raw_never_reads_a_tensor_the_module_lacks(tmp_path):
    """A tensor of the file that the module does not have is ignored, as stock ignores it, and not read:
    its damaged bytes do not fail the load; the module's own tensors load exactly on both ranks."""
    path, tensors = _damaged_extra_file(tmp_path)
    results = run_distributed(_load_raw, 2, path, True)
    print("lightning_distckpt imported from", results[0]["package"])
    for res in results:
        assert "error" not in res, res["error"]
        assert res["weight"] == tensors["weight"].tolist() and res["bias"] == tensors["bias"].tolist()


def test_model_parallel_load_raw_still_checks_the_modules_tensors(tmp_path):
    """The module's own tensors are still read and checked: with ``weight`` damaged instead, both ranks
    refuse alike naming it."""
    tensors = {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([7.0, 8.0])}
    path = str(tmp_path / "raw.safetensors")
    save_file(tensors, path, metadata=crc_metadata(tensors))
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        begin, _ = json.loads(f.read(header_len))["weight"]["data_offsets"]
        f.seek(8 + header_len + begin)
        f.write(torch.tensor([-1.0]).numpy().tobytes())
    results = run_distributed(_load_raw, 2, path, True)
    assert os.path.isfile(path)
    for res in results:
        assert "error" in res and "'weight' is damaged" in res["error"], res



def _load_raw_empty_container(rank: int, world_size: int, path: str):
    """Rank body: ``load_checkpoint(path, nn.Sequential())`` of the Fabric ModelParallel subclass."""
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy

    strategy = FabricDistCheckpointModelParallelStrategy(parallelize_fn=lambda m, _: m)
    return strategy.load_checkpoint(path=path, state=torch.nn.Sequential())


def test_model_parallel_load_raw_of_an_empty_container_module_is_a_raw_load(tmp_path):
    """``fabric.load_raw(path, nn.Sequential())``: an empty container module is falsy; it still takes the raw
    load's path (where torch's ``set_model_state_dict`` refuses a module without state, as under the stock
    strategy: agreed, on both ranks), never ``fabric.load(path)``'s whole-checkpoint read, which returned the
    file's entries as if loaded."""
    import pytest

    path = str(tmp_path / "raw.pt")
    torch.save({"x": torch.ones(2)}, path)
    with pytest.raises(AssertionError, match=r"rank 0: CheckpointingError: fabric\.load_raw\(.*rank 1: "):
        run_distributed(_load_raw_empty_container, 2, path)
