"""DTensor leaves at the Lightning borders: the plugin's rank-0 API saves a replicated DTensor whole
and refuses a sharded one (it holds only its own shard); its collective API, used by the strategies,
saves DTensors anywhere in the checkpoint as sharded tensors, readable whole. Never common state."""

import os

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from lightning_distckpt import load_common_state_dict
from lightning_distckpt.core.errors import ShardingError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.lightning.tree import KIND_SHARDED, MANIFEST_KEY, manifest
from dist_utils import run_distributed


def _plugin_apis(rank, world, root):
    mesh = init_device_mesh("cpu", (world,))
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    replicated = distribute_tensor(whole, mesh, [Replicate()])
    sharded = distribute_tensor(whole * 2, mesh, [Shard(0)])
    step = distribute_tensor(torch.tensor(3.0), mesh, [Replicate()])  # collective: made on every rank
    io = DistCheckpointIO()
    out = {}
    if rank == 0:  # the rank-0 API: one process, no collective
        io.save_checkpoint({"state_dict": {"w": replicated, "step": step}}, os.path.join(root, "local"))
        out["local"] = io.load_checkpoint(os.path.join(root, "local"))
        out["local_common"] = load_common_state_dict(os.path.join(root, "local"))
        try:
            io.save_checkpoint({"state_dict": {"w": sharded}}, os.path.join(root, "refused"))
            out["refused"] = "no error"
        except ShardingError as e:
            out["refused"] = str(e)
        out["refused_written"] = os.path.exists(os.path.join(root, "refused"))
    torch.distributed.barrier()
    # The collective API (what the strategies call): DTensors anywhere, listed in the manifest.
    tree = {"state_dict": {"w": sharded}, "callbacks": {"cb": {"scores": [replicated]}}, "epoch": 1}
    tree[MANIFEST_KEY] = manifest(tree, KIND_SHARDED)
    io.save_sharded(tree, os.path.join(root, "collective"))
    if rank == 0:
        out["collective"] = io.load_checkpoint(os.path.join(root, "collective"))
        out["collective_common"] = load_common_state_dict(os.path.join(root, "collective"))
    return out


def _both(rank, world, root):
    return _plugin_apis(rank, world, root), _strategy_tree(rank, world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One pair of gloo processes for both tests (a spawn costs more than the checks)."""
    return run_distributed(_both, 2, str(tmp_path_factory.mktemp("dtensor_borders")))


def test_plugin_saves_dtensors_or_refuses(runs):
    out = runs[0][0]
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    assert torch.equal(out["local"]["state_dict"]["w"], whole) and float(out["local"]["state_dict"]["step"]) == 3.0
    assert "'state_dict/w' is a DTensor sharded over a device mesh" in out["refused"]
    assert "DistCheckpointModelParallelStrategy" in out["refused"] and not out["refused_written"]
    got = out["collective"]
    assert torch.equal(got["state_dict"]["w"], whole * 2) and torch.equal(got["callbacks"]["cb"]["scores"][0], whole)
    assert got["epoch"] == 1
    for common in (out["local_common"], out["collective_common"]):
        assert not _tensors(common), common  # every tensor is stored sharded, none in the common state


def _tensors(tree):
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) and tree.ndim > 0 else []


def _strategy_tree(rank, world):
    from lightning_distckpt.core.errors import CheckpointingError
    from lightning_distckpt.lightning.parallel import data_parallel_world
    from lightning_distckpt.lightning.sharded import model_sharded_state_dict
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    module = torch.nn.Sequential(torch.nn.Linear(4, 6))
    parallelize_module(module, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel()})
    try:
        model_sharded_state_dict(module, data_parallel_world())
        return "no error"
    except CheckpointingError as e:
        return str(e)


def test_ddp_based_strategies_refuse_dtensor_parameters(runs):
    """A module with DTensor parameters under DistCheckpointStrategy / the Fabric strategy would save
    each rank's shard as the whole tensor: refused, naming the strategy that handles it."""
    for msg in (r[1] for r in runs):
        assert "'0.weight' is a DTensor parameter" in msg and "DistCheckpointModelParallelStrategy" in msg
