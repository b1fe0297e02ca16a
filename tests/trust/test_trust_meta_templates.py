"""A load template on the meta device (a model built under ``torch.device("meta")``) used to come
back from the load still on meta, with no error and no values: a load that read nothing for it. A
meta tensor is now read as a template without data, into a fresh CPU tensor holding the stored
values (DCP materializes meta tensors the same way), on every loader, whole, sliced across ranks
and as a flattened range; ranks whose templates are real tensors still load in place."""

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed

FULL = torch.arange(24.0).reshape(4, 6)


def _load_half(rank, world, path, loader):
    rows = slice(2 * rank, 2 * rank + 2)
    meta = rank == 1  # one rank's model on meta, the other's real
    data = torch.empty(2, 6, device="meta") if meta else torch.zeros(2, 6)
    flat = torch.empty(5, device="meta") if meta else torch.zeros(5)
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", data, (0, rank, world)),
                "f": ldc.ShardedTensor.from_rank_offsets_flat("f", flat, (2, 6), (0, rank, world),
                                                               flattened_range=slice(3, 8))}
    out = ldc.load(template, path, loader=loader)
    for key in ("w", "f"):
        assert out[key].device.type == "cpu", (key, out[key].device)
    assert torch.equal(out["w"], FULL[rows])
    assert torch.equal(out["f"], FULL[rows].flatten()[3:8])
    assert (out["w"].data_ptr() == data.data_ptr()) == (not meta)  # real templates are written in place


@pytest.mark.parametrize("loader", ["every_rank", "parallel", "two_stage"])
def test_a_meta_template_loads_the_stored_values_on_cpu(tmp_path, loader):
    path = str(tmp_path / "ck")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", FULL.clone()),
              "f": ldc.ShardedTensor.from_rank_offsets("f", FULL.clone())}, path)
    run_distributed(_load_half, 2, path, loader)


def test_a_meta_template_alone(tmp_path):
    path = str(tmp_path / "ck")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", FULL.clone())}, path)
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, device="meta"))}, path)
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], FULL)
