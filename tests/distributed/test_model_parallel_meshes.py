"""The ModelParallel strategies on the mesh shapes users of torch's FSDP2 / tensor parallel build (4 gloo processes).

One module (column / row split linear layers of uneven sizes, a LayerNorm and a pair of tied weights left out of TP, a
persistent and a non-persistent buffer) under several recipes, each a few Adam steps then ``fabric.save``
(``FabricDistCheckpointModelParallelStrategy``):

* ``std``: TP over ``tensor_parallel``, FSDP2 per layer and at the root over ``data_parallel`` (DP 2 x TP 2), the
  root with ``reshard_after_forward=False``;
* ``hsdp``: FSDP2 over a 2-D data-parallel mesh (replicate 2 x shard 2; placements (Replicate(), Shard(0))), no TP;
* ``swapped``: the user's own mesh with TP on the outer dim and DP inner (rank = 2 * tp + dp);
* ``partial``: TP'd layers left out of FSDP (on the TP sub-mesh), the rest FSDP2'd over ``data_parallel`` only.

Each checkpoint is loaded under another recipe at 4 processes and under DP 1 x TP 2 at 2 processes: model and Adam
state bit-exact as saved (whole, every rank alike), buffers too. Async saves, background snapshots and the local tier
(``FabricTiers``, 2 simulated nodes) on the 2-D mesh likewise. Behind ``long``: Trainer fits on DP 2 x TP 2
(``DistCheckpointModelParallelStrategy``) interrupted and resumed (async + background snapshot, the local tier, a
checkpoint Lightning's own ModelParallelStrategy wrote as DCP) end bit-exact as the uninterrupted fit.

Before 31570d3 (the data-parallel sub-mesh fix) every recipe with a parameter left out of TP on a 2-D mesh was refused
("a main replica on ranks 2 and 3"); these tests pin every recipe above against it.

Hang guard: every group's timeout (GROUP_TIMEOUT_S); a rank left waiting raises a collective error, which fails the
test as any other error would.
"""

import os

import pytest
import torch

from dist_utils import run_distributed
from tier_parity_scripts import GROUP_TIMEOUT_S, launch_fabric

STEPS = 2
RECIPES = ("std", "hsdp", "swapped", "partial")
# Where each recipe's checkpoint is loaded at 4 processes (another mesh shape / placement).
CROSS = {"std": "hsdp", "hsdp": "swapped", "swapped": "partial", "partial": "std"}


class Net(torch.nn.Module):
    """TP'd ``up`` / ``down`` (10 and 7 rows: uneven over 2 and over 2 x 2), a LayerNorm and two tied linear layers
    off TP, a one-element parameter (empty shards on all FSDP ranks but one), a persistent buffer (saved) and a
    non-persistent one (not)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(7, 10)
        self.down = torch.nn.Linear(10, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.tied = torch.nn.Sequential(torch.nn.Linear(7, 7, bias=False), torch.nn.Tanh(),
                                        torch.nn.Linear(7, 7, bias=False))
        self.tied[2].weight = self.tied[0].weight  # tied: one parameter, two names
        self.head = torch.nn.Linear(7, 5, bias=False)
        self.gate = torch.nn.Parameter(torch.full((1,), 0.5))  # one row: the other FSDP ranks' shards are empty
        self.register_buffer("scale", torch.arange(1.0, 8.0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.down(torch.relu(self.up(x)))) * self.scale
        return self.head(self.tied(h)) * self.gate


def _tp(model: Net, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _parallelize(recipe: str):
    def apply(model: Net, mesh) -> Net:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if recipe == "std":
            _tp(model, mesh["tensor_parallel"])
            for layer in (model.up, model.down, model.tied):
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(model, mesh=mesh["data_parallel"], reshard_after_forward=False)
        elif recipe == "hsdp":
            hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            fully_shard(model.tied, mesh=hsdp)
            fully_shard(model, mesh=hsdp)
        elif recipe == "swapped":
            own = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
            _tp(model, own["tp"])
            fully_shard(model.tied, mesh=own["dp"])
            fully_shard(model, mesh=own["dp"])
        else:  # partial: the TP'd layers not FSDP'd at all
            _tp(model, mesh["tensor_parallel"])
            fully_shard(model.norm, mesh=mesh["data_parallel"])
            fully_shard(model.tied, mesh=mesh["data_parallel"])
        return model
    return apply


def _fabric(rank: int, world: int, recipe: str, dp: int, tp: int, checkpoint=None):
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy

    strategy = FabricDistCheckpointModelParallelStrategy(_parallelize(recipe), dp, tp, checkpoint=checkpoint)
    return launch_fabric(rank, world, strategy)


def _mesh_of(recipe: str, world: int):
    return {"hsdp": (4, 1)}.get(recipe, (2, 2)) if world == 4 else (1, 2)


def _fresh(fabric):
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.05))
    return model, opt


def _whole(model, opt) -> dict:
    """Every parameter, Adam moment and persistent buffer whole (collective ``full_tensor``, one order on all ranks)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().cpu()

    module = getattr(model, "module", model)
    out = {f"param/{n}": full(p) for n, p in module.named_parameters()}
    out["buffer/scale"] = full(module.scale)
    names = {id(p): n for n, p in module.named_parameters()}
    for p, state in opt.state.items():
        for k in sorted(state):
            out[f"opt/{names[id(p)]}/{k}"] = full(state[k])
    return dict(sorted(out.items()))


def _train(model, opt, rank: int, recipe: str) -> None:
    # Each data-parallel rank its own batch where the recipe syncs gradients over DP; "partial" leaves the TP'd
    # layers' gradients unsynced over DP, so every rank takes the same batch there.
    module = getattr(model, "module", model)
    gen = torch.Generator().manual_seed(0 if recipe == "partial" else rank)
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 7, generator=gen)).square().sum().backward()
        opt.step()
    with torch.no_grad():
        module.scale.add_(1.0)  # a buffer trained apart from the optimizer
        module.scratch.fill_(float(rank))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_all(rank: int, world: int, root: str) -> dict:
    out = {}
    for recipe in RECIPES:
        fabric = _fabric(rank, world, recipe, *_mesh_of(recipe, world))
        model, opt = _fresh(fabric)
        _train(model, opt, rank, recipe)
        fabric.save(os.path.join(root, recipe), {"model": model, "optimizer": opt, "step": STEPS})
        out[recipe] = _whole(model, opt)
        module = getattr(model, "module", model)
        out[f"{recipe} layout"] = {n: (getattr(p, "device_mesh", None) and p.device_mesh.mesh.tolist(),
                                       [type(q).__name__ for q in getattr(p, "placements", ())])
                                   for n, p in (("up", module.up.weight), ("norm", module.norm.weight))}
    return out


def _load_all(rank: int, world: int, root: str, into: dict) -> dict:
    """Each recipe's checkpoint loaded into a fresh module under recipe ``into[recipe]``."""
    out = {}
    for saved, recipe in into.items():
        fabric = _fabric(rank, world, recipe, *_mesh_of(recipe, world))
        model, opt = _fresh(fabric)
        state = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(os.path.join(root, saved), state)
        out[saved] = {"whole": _whole(model, opt), "step": state["step"],
                      "scratch": getattr(model, "module", model).scratch.tolist()}
    return out


def test_every_recipe_saves_and_loads_at_another_mesh_bit_exact(tmp_path):
    root = str(tmp_path)
    saved = run_distributed(_save_all, 4, root, timeout_s=GROUP_TIMEOUT_S)
    layouts = [{r: s[f"{r} layout"] for r in RECIPES} for s in saved]
    assert layouts[1]["std"]["norm"] == ([1, 3], ["Shard"]), layouts[1]  # a sub-mesh without rank 0
    assert layouts[3]["std"]["up"] == ([[0, 1], [2, 3]], ["_StridedShard", "Shard"]), layouts[3]  # FSDP2 over TP
    assert layouts[3]["hsdp"]["up"] == ([[0, 1], [2, 3]], ["Replicate", "Shard"]), layouts[3]
    assert layouts[3]["swapped"]["norm"] == ([2, 3], ["Shard"]), layouts[3]  # DP inner: ranks 2 and 3
    assert layouts[2]["partial"]["up"] == ([2, 3], ["Shard"]), layouts[2]  # TP alone, on a sub-mesh
    for recipe in RECIPES:
        want = saved[0][recipe]
        assert all(_same(s[recipe], want) for s in saved), recipe
    for world, into in ((4, CROSS), (2, {r: "std" for r in RECIPES})):
        got = run_distributed(_load_all, world, root, into, timeout_s=GROUP_TIMEOUT_S)
        for r, res in enumerate(got):
            for recipe in RECIPES:
                loaded = res[recipe]
                assert loaded["step"] == STEPS and loaded["scratch"] == [0.0] * 3, (world, r, recipe)
                assert _same(loaded["whole"], saved[0][recipe]), (world, r, recipe)


def _async_and_tiers(rank: int, world: int, root: str) -> dict:
    """On DP 2 x TP 2 (``std``): an async save with a background snapshot, then a step more (fenced by the strategy)
    and a local-tier save (2 simulated nodes of 2 ranks); each resumed into a fresh module at the same mesh."""
    from lightning_distckpt.lightning import FabricTiers
    from lightning_distckpt.tiers import TierOptions

    options = TierOptions(local_dir=os.path.join(root, "local", "{node}"), ranks_per_node=2, local_every_n_steps=1)
    config = {"async_save": True, "background_snapshot": True}
    fabric = _fabric(rank, world, "std", 2, 2, checkpoint=config)
    model, opt = _fresh(fabric)
    _train(model, opt, rank, "std")
    state = {"model": model, "optimizer": opt, "step": STEPS}
    fabric.save(os.path.join(root, "async"), state)
    at_async = _whole(model, opt)  # what the background copy must hold (no step taken yet)
    _train(model, opt, rank, "std")  # the first optimizer step waits for the snapshot
    state["step"] = 2 * STEPS
    tiers = FabricTiers(fabric, options=options, run="meshes")
    tiers.save(state, 2 * STEPS)
    at_tier = _whole(model, opt)
    tiers.wait()
    fabric.strategy.checkpoint_io.wait()
    out = {"at_async": at_async, "at_tier": at_tier}
    fabric = _fabric(rank, world, "std", 2, 2)
    model, opt = _fresh(fabric)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(os.path.join(root, "async"), state)
    out["async"] = {"whole": _whole(model, opt), "step": state["step"]}
    fabric = _fabric(rank, world, "std", 2, 2)
    model, opt = _fresh(fabric)
    state = {"model": model, "optimizer": opt, "step": 0}
    tiers = FabricTiers(fabric, options=options, run="meshes")
    point = tiers.restore(state)
    tiers.close()
    out["tier"] = {"whole": _whole(model, opt), "step": state["step"], "point": (point.step, point.source)}
    return out


@pytest.mark.long  # CI time: 4 processes; async and tiers on 1-D meshes run by default elsewhere
def test_async_background_snapshot_and_local_tier_on_the_2d_mesh(tmp_path):
    got = run_distributed(_async_and_tiers, 4, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    for r, res in enumerate(got):
        assert _same(res["at_async"], got[0]["at_async"]) and _same(res["at_tier"], got[0]["at_tier"]), r
        assert not _same(res["at_async"], res["at_tier"])
        assert res["async"]["step"] == STEPS and _same(res["async"]["whole"], got[0]["at_async"]), r
        assert res["tier"]["point"] == (2 * STEPS, "local") and res["tier"]["step"] == 2 * STEPS, (r, res["tier"])
        assert _same(res["tier"]["whole"], got[0]["at_tier"]), r


TRAINER_SCRIPT = r'''
import json

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy
from test_model_parallel_meshes import Net, _parallelize
from tier_parity_scripts import Recorder, snapshot, tier_config

ck, out = sys.argv[1], sys.argv[2]
record = Recorder(out, rank)


class Module(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def configure_model(self):  # the std recipe on Lightning's DP 2 x TP 2 mesh
        _parallelize("std")(self.net, self.device_mesh)

    def training_step(self, batch, batch_idx):
        dp = self.device_mesh["data_parallel"].get_local_rank()
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * self.global_step + dp))
        return self.net(x).square().sum()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(64)), batch_size=1)


class First(Callback):
    step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def fit(strategy, steps, root, ckpt_path=None, every=None):
    first = First()
    callbacks = [first, *([ModelCheckpoint(root, every_n_train_steps=every, save_last=True)] if every else [])]
    model = Module()
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                      callbacks=callbacks, enable_checkpointing=bool(every), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                      default_root_dir=root)
    trainer.fit(model, ckpt_path=ckpt_path)
    state = snapshot(model.net, trainer.optimizers[0])
    state["scale"] = model.net.scale.tolist()
    return {"state": state, "step": trainer.global_step, "first": first.step}


def ours(config=None):
    return DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, checkpoint=config)


record("reference", lambda: fit(ours(), 4, os.path.join(ck, "ref")))
async_config = {"async_save": True, "background_snapshot": True}
record("async save", lambda: fit(ours(async_config), 2, os.path.join(ck, "async"), every=2))
record("async resume", lambda: fit(ours(), 4, os.path.join(ck, "async"),
                                   ckpt_path=os.path.join(ck, "async", "last.ckpt")))
tiers = tier_config(os.path.join(ck, "tiers"))
tiers["tiers"]["ranks_per_node"] = 2
record("tier save", lambda: fit(ours(tiers), 2, os.path.join(ck, "tiers"), every=100))
record("tier resume", lambda: fit(ours(tiers), 4, os.path.join(ck, "tiers"), ckpt_path="last"))
stock = lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
record("dcp save", lambda: fit(stock(), 2, os.path.join(ck, "dcp"), every=2))
record("dcp resume", lambda: fit(ours(), 4, os.path.join(ck, "dcp"), ckpt_path=os.path.join(ck, "dcp", "last.ckpt")))
'''


@pytest.mark.long
def test_trainer_async_snapshot_tiers_and_stock_dcp_on_the_2d_mesh(tmp_path):
    """Trainer fits on DP 2 x TP 2 (4 processes): interrupted at step 2 and resumed to step 4, the run ends
    bit-exact as the uninterrupted one, for an async save with a background snapshot, the local tier (2 simulated
    nodes) and a checkpoint Lightning's own ModelParallelStrategy wrote (DCP)."""
    import json

    from script_ranks import run_ranks, script_env
    from tier_parity_scripts import script_preamble

    path = tmp_path / "ranks.py"
    path.write_text(script_preamble() + f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                    + TRAINER_SCRIPT)
    (tmp_path / "ck").mkdir()
    code, output = run_ranks(str(path), [str(tmp_path / "ck"), str(tmp_path / "out")], script_env(), 4, timeout=600)
    results = []
    for rank in range(4):
        res = tmp_path / f"out.rank{rank}.json"
        assert res.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        results.append(json.loads(res.read_text()))
    assert code == 0, output[-6000:]
    for res in results:
        assert all(kind == "ok" for kind, _ in res.values()), {k: v for k, v in res.items() if v[0] != "ok"}
        want = res["reference"][1]
        assert want["step"] == 4
        for name in ("async resume", "tier resume", "dcp resume"):
            got = res[name][1]
            assert got["first"] == 2 and got["step"] == 4 and got["state"].keys() == want["state"].keys(), name
            assert [k for k in want["state"] if got["state"][k] != want["state"][k]] == [], name
