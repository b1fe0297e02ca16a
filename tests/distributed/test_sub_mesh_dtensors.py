"""DTensors on a sub-mesh (a 2-D device mesh's ``data_parallel`` rows) saved and loaded on 4 real gloo processes.

On a data_parallel 2 x tensor_parallel 2 mesh (rank = 2 * dp + tp), FSDP2 shards a parameter left out of tensor
parallelism (a LayerNorm) over the ``data_parallel`` sub-mesh only: ranks 0 and 2 hold one copy of its shards, ranks
1 and 3 the same shards again, each on a mesh of its own with no ``Replicate()`` dim saying so.

Fabric: ``FabricDistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``, a module with
column / row split linear layers and such a LayerNorm, a few Adam steps, ``fabric.save``; ``fabric.load`` at the same
mesh, at TP 2 and at DP 2 (2 processes each): model and optimizer state bit-exact, every rank alike. Each TP rank's
sub-mesh claimed the main replica of the LayerNorm and every save was refused (model_parallel.on_sub_mesh).

Core: ``lightning_distckpt.save`` of such DTensors given directly (no strategy to know that every TP rank holds the
same values) is refused on every rank, naming the key, its mesh and what to do (``core/dtensors.py``), never written
from one sub-mesh or the other by chance.

Hang guard: every group's timeout (GROUP_TIMEOUT_S); a rank left waiting records a CollectiveError, told apart from
the outcomes asserted.
"""

import os

import pytest
import torch

from dist_utils import run_distributed
from tier_parity_scripts import GROUP_TIMEOUT_S, launch_fabric

STEPS = 3


class Net(torch.nn.Module):
    """Column- and row-split linear layers (tensor parallel) around a LayerNorm left out of TP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def _parallelize(model: Net, mesh) -> Net:
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _fabric(rank: int, world: int, dp: int, tp: int):
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy

    return launch_fabric(rank, world, FabricDistCheckpointModelParallelStrategy(_parallelize, dp, tp))


def _fresh(fabric):
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.05))
    return model, opt


def _whole(model, opt) -> dict:
    """Every parameter and Adam moment whole (collective ``full_tensor``, in one order on every rank), on CPU."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().cpu()

    out = {f"param/{n}": full(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k in sorted(state):
            out[f"opt/{names[id(p)]}/{k}"] = full(state[k])
    return dict(sorted(out.items()))


def _norm_mesh(model) -> list:
    return model.norm.weight.device_mesh.mesh.tolist()


def _save(rank: int, world: int, ck: str) -> dict:
    """Train on TP 2 x DP 2 (each DP rank its own batch) and save; the whole state saved and the LayerNorm's mesh."""
    fabric = _fabric(rank, world, 2, 2)
    model, opt = _fresh(fabric)
    gen = torch.Generator().manual_seed(rank // 2)
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().sum().backward()
        opt.step()
    fabric.save(ck, {"model": model, "optimizer": opt, "step": STEPS})
    return {"whole": _whole(model, opt), "norm_mesh": _norm_mesh(model)}


def _load(rank: int, world: int, ck: str, dp: int, tp: int) -> dict:
    fabric = _fabric(rank, world, dp, tp)
    model, opt = _fresh(fabric)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(ck, state)
    return {"whole": _whole(model, opt), "step": state["step"]}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.long  # CI time: test_model_parallel_meshes.py's std recipe saves the same Fabric 2-D mesh by default
def test_fabric_dp2_tp2_layernorm_off_tp_saves_and_loads_at_the_mesh_tp2_and_dp2(tmp_path):
    ck = str(tmp_path / "ck")
    saved = run_distributed(_save, 4, ck, timeout_s=GROUP_TIMEOUT_S)
    assert [s["norm_mesh"] for s in saved] == [[0, 2], [1, 3], [0, 2], [1, 3]], saved  # the sub-mesh case
    want = saved[0]["whole"]
    assert len(want) == 6 * 4 and all(_same(s["whole"], want) for s in saved)  # 6 parameters, 3 Adam states each
    for world, dp, tp in ((4, 2, 2), (2, 1, 2), (2, 2, 1)):
        got = run_distributed(_load, world, ck, dp, tp, timeout_s=GROUP_TIMEOUT_S)
        for r, res in enumerate(got):
            assert res["step"] == STEPS and _same(res["whole"], want), (world, dp, tp, r)


def _core(rank: int, world: int, root: str) -> dict:
    """``lightning_distckpt.save`` / ``load`` of an FSDP2 module's state dict on the 2-D mesh, given directly: the
    LayerNorm's DTensors are on the data_parallel sub-mesh, one copy per TP rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_distckpt as ldc
    from lightning_distckpt.core.errors import ValidationError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = _parallelize(Net(), mesh)
    sd = get_model_state_dict(model)
    out = {"norm_mesh": sd["norm.weight"].device_mesh.mesh.tolist()}
    try:
        ldc.save({"model": sd}, os.path.join(root, "direct"))
        out["save"] = "ok"
    except ValidationError as e:
        out["save"] = str(e)
    out["written"] = os.path.exists(os.path.join(root, "direct"))
    # Reading into sub-mesh DTensors is sound: every copy reads its own shard (from whole tensors saved by rank 0).
    whole = {k: v.full_tensor().detach().clone() for k, v in sd.items()}
    ldc.save({"model": {k: v + 1 for k, v in whole.items()}}, os.path.join(root, "whole"))
    got = ldc.load({"model": sd}, os.path.join(root, "whole"))["model"]
    out["loaded"] = all(torch.equal(got[k].full_tensor(), whole[k] + 1) for k in sorted(whole))
    return out


def test_core_save_of_sub_mesh_dtensors_is_refused_naming_the_key_and_what_to_do(tmp_path):
    """No strategy knows that the TP ranks' copies are alike: refused on every rank, nothing written, the key named and
    the way out said (was: only '(replica_id must differ)', a field a DTensor's caller never set)."""
    got = run_distributed(_core, 4, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for r, res in enumerate(got):
        assert res["norm_mesh"] == [[0, 2], [1, 3]][r % 2], res
        said = res["save"]
        assert said.startswith("sharded state dict for checkpoint") and "nothing was written" in said, (r, said)
        assert "'model/norm.weight'" in said and "is a main replica on ranks" in said, (r, said)
        assert "DTensor on a sub-mesh" in said and "FabricDistCheckpointModelParallelStrategy" in said, (r, said)
        assert not res["written"] and res["loaded"], (r, res)
    assert all(res["save"] == got[0]["save"] for res in got)
