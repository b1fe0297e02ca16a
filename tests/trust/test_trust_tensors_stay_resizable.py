"""A save or load leaves the caller's CPU tensors as resizable as they were.

``Tensor.numpy()`` marks a tensor's storage not resizable for good (so that the array cannot dangle):
a save that read its sources through it, or a load that wrote its destinations through it, changed
what the user may do with their own tensors afterwards (``resize_``, ``set_``, FSDP freeing storage:
"Trying to resize storage that is not resizable"). Every path here failed that way before; the
library's numpy views of a caller's tensor now borrow it (``core/tensor_bytes.numpy_view``)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import lightning_distckpt as ldc
from lightning_distckpt import StorageOptions
from dist_utils import run_distributed
from trust.hostile import resizable as _resizable


def _sources():
    return {"big": torch.randn(300, 70), "small": torch.arange(6.0), "bf16": torch.ones(4, dtype=torch.bfloat16),
            "fp8": torch.ones(8).to(torch.float8_e4m3fn), "strided": torch.arange(12.0).reshape(3, 4)}


def _sharded(tensors):
    return {k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
@pytest.mark.parametrize("direct", [True, False])
def test_save_and_load_leave_cpu_tensors_resizable(tmp_path, layout, direct):
    src = _sources()
    common = torch.ones(5, 5)  # hashed for the common-state check, pickled into common.pt
    ldc.save({**_sharded(src), "extra": {"t": common}}, str(tmp_path / "ck"), storage=StorageOptions(layout=layout))
    template = {k: torch.zeros_like(v) for k, v in src.items()}
    out = ldc.load({**_sharded(template), "extra": {"t": torch.zeros(5, 5)}}, str(tmp_path / "ck"),
                   storage=StorageOptions(direct_reads=direct))
    plain = ldc.load_plain_tensors(str(tmp_path / "ck"))
    for k, v in src.items():
        assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)) and torch.equal(
            plain[k].view(torch.uint8), v.view(torch.uint8)), k
    checked = {**{f"source {k}": v for k, v in src.items()}, "common": common,
               **{f"loaded {k}": template[k] for k in src}, **{f"plain {k}": plain[k] for k in src}}
    assert [name for name, t in checked.items() if not _resizable(t)] == []


def test_foreign_files_load_into_resizable_tensors(tmp_path):
    tensors = {"w": torch.randn(64, 8), "b": torch.arange(8.0)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    dcp.save({k: v.clone() for k, v in tensors.items()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for path in (tmp_path / "model.safetensors", tmp_path / "dcp"):
        template = {k: torch.zeros_like(v) for k, v in tensors.items()}
        loaded = ldc.load(template, str(path))
        plain = ldc.load_plain_tensors(str(path))
        assert all(torch.equal(loaded[k], v) and torch.equal(plain[k], v) for k, v in tensors.items())
        assert [k for k in tensors if not (_resizable(template[k]) and _resizable(plain[k]))] == [], path


def _two_ranks(rank, world, root):
    src = {f"t{i}": torch.full((16,), float(i)) for i in range(50)}
    sharded = {k: ldc.ShardedTensor.from_rank_offsets(k, v, replica_id=rank) for k, v in src.items()}
    ldc.save(sharded, f"{root}/ck")
    result = {}
    for loader in ("parallel", "two_stage"):
        template = {k: torch.zeros(16) for k in src}
        ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, v, replica_id=rank) for k, v in template.items()},
                 f"{root}/ck", loader=loader)
        result[loader] = all(torch.equal(template[k], src[k]) for k in src) and all(map(_resizable, template.values()))
    result["sources"] = all(map(_resizable, src.values()))
    return result


def test_exchange_loaders_leave_destinations_resizable(tmp_path):
    for result in run_distributed(_two_ranks, 2, str(tmp_path)):
        assert result == {"parallel": True, "two_stage": True, "sources": True}, result
