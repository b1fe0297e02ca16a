"""Tiers, round 5: a tier restore whose every local copy is found damaged while reading falls back to the durable
checkpoint; that checkpoint must be restored as ``ckpt_path=<it>`` (or ``fabric.load(<it>)``) restores it, whatever
its layout. And a strict Fabric ModelParallel refusal must name the same keys from the tier as from ``fabric.load``.

What a red-team probe found (on the old code):

* **The durable fallback inside a tier restore** (``tiers/recover.load_local``) read the durable checkpoint with a
  plain ``lightning_distckpt.load`` of the local template, not through the strategy's own durable restore. A
  ``last.ckpt`` of another layout than the strategy's own was then read unlike ``ckpt_path=last.ckpt``: a stock
  ``torch.save`` file, the plugin's (``DistCheckpointIO``) by-path directory, one another strategy wrote (never
  re-keyed, its writer never checked), a ``save_weights_only`` one (no ``ModelOnlyCheckpointError``, no fresh
  optimizers for a non-strict resume). Now ``LocalTier.load(durable_reader=...)`` hands a durable point to the
  strategy's own restore (``load_before_setup``, ``DistCheckpointModelParallelStrategy.load_checkpoint``, the
  Fabric strategy's ``load_checkpoint``): the tier's resume is the durable one, value for value or word for word.
* **FabricDistCheckpointModelParallelStrategy, strict**: ``fabric.load`` left an optimizer's 0-d ``step`` in the
  template's common state (never checked, never named) where FabricTiers' load keys it by path; a refusal of a
  parameter without saved state named ``.../step`` from the tier only. Its template of our own layout now keys plain
  tensors as a save stores them (``shard_tensors``), as the Trainer's does since round 4.

Real Trainer fits and Fabric loops on 2 gloo processes as 2 simulated nodes (``ranks_per_node: 1``), every local
copy of every step overwritten (found only by reading); hang guard: each group's timeout (GROUP_TIMEOUT_S), a rank
left waiting gets a CollectiveError, told apart from the error asserted.
"""

import json
import os
import re

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from tier_parity_scripts import AGREED, GROUP_TIMEOUT_S, launch_fabric, overwrite_every_local_copy, run_trainer_script
from tier_parity_scripts import snapshot

pytestmark = pytest.mark.tiers


# ------------------------------------------------------------------ Trainer: ckpt_path="last" against last.ckpt
RANKS = r"""import json
import shutil
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_distckpt.lightning import DistCheckpointIO
from tier_parity_scripts import (GROUP_TIMEOUT_S, Recorder, StepModule, dist_strategy, fit_trainer, last,
                                 overwrite_every_local_copy, tier_config)

folder, out, SCENARIO = sys.argv[1:4]
WANTED = json.loads(sys.argv[4])
TIMEOUT = timedelta(seconds=GROUP_TIMEOUT_S)
record = Recorder(out, rank, WANTED)


class Model(StepModule):
    def __init__(self, fsdp=False, strict=True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.fsdp, self.strict_loading = fsdp, strict

    def forward(self, x):
        return self.a(x) + self.b(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


def last_saver(root, weights_only=False):
    return ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), save_last=True, every_n_train_steps=2,
                           save_top_k=0, save_weights_only=weights_only)


def write_last(root, layout):
    '''A durable last.ckpt of step 2 in the tiers' folder, of ``layout``: written by a Trainer as its users do.'''
    other = "ddp" if SCENARIO == "mp" else "mp"
    if layout == "torch_file":  # stock DDP: one torch.save file
        strategy, kw = DDPStrategy(timeout=TIMEOUT, find_unused_parameters=True), {}
    elif layout == "plugin_dir":  # stock DDP with the plugin: a directory, tensors by path
        strategy, kw = DDPStrategy(timeout=TIMEOUT, find_unused_parameters=True), {"plugins": [DistCheckpointIO()]}
    elif layout == "other_strategy":
        strategy, kw = dist_strategy(other), {}
    else:  # weights_only: this strategy's own layout, module only
        strategy, kw = dist_strategy(SCENARIO), {}
    model = Model(fsdp=layout == "other_strategy" and other == "mp")
    fit_trainer(model, root, 2, strategy, callbacks=[last_saver(root, layout == "weights_only")], **kw)


def fit(root, steps, ckpt_path, tiers=True, strict=True):
    config = tier_config(root) if tiers else None
    return fit_trainer(Model(fsdp=SCENARIO == "mp", strict=strict), root, steps, dist_strategy(SCENARIO, config),
                       ckpt_path)


base = os.path.join(folder, "base")
fit(base, 3, None)  # local steps 2 and 3 on each node (its own store, its partner's copy)
dist.barrier()
for layout, strict in json.loads(sys.argv[5]):
    root = os.path.join(folder, f"{layout}_{strict}")
    if rank == 0:
        shutil.copytree(base, root, symlinks=True)
    dist.barrier()
    write_last(root, layout)
    dist.barrier()
    if rank == 0:
        overwrite_every_local_copy(root)
    dist.barrier()
    record(f"{layout} {strict} durable", lambda: fit(root, 3, last(root), tiers=False, strict=strict))
    record(f"{layout} {strict} tier", lambda: fit(root, 3, "last", strict=strict))
"""

#: (layout of the durable last.ckpt, strict resume). plugin_dir non-strict was the worst: the old fallback read
#: none of the module's keys (stored by path) and resumed, silently, with the module's initial weights.
LAYOUTS = [("torch_file", True), ("plugin_dir", True), ("plugin_dir", False), ("other_strategy", True),
           ("weights_only", True), ("weights_only", False)]


@pytest.fixture(scope="module", params=["ddp", "mp"])
def trainer_fallback(request, tmp_path_factory):
    return request.param, run_trainer_script(tmp_path_factory.mktemp(f"trainer_{request.param}"), RANKS,
                                             [request.param, json.dumps(WANTED), json.dumps(LAYOUTS)], agreed=WANTED)


#: (scenario, layout, strict) -> what ckpt_path=last.ckpt itself does: "ok", or the error every rank raises. (A
#: non-strict ModelParallel resume of a weights-only checkpoint fails in Lightning's own restore of the LR
#: schedulers, with its KeyError: the durable restore's behaviour, which the tier's must match, not this file's.)
DURABLE = {("ddp", "weights_only", True): "ModelOnlyCheckpointError", ("mp", "other_strategy", True):
           "CheckpointingError", ("mp", "weights_only", True): "MissingKeysError",
           ("mp", "weights_only", False): "unagreed KeyError"}
WANTED = (*AGREED, "ModelOnlyCheckpointError", "IncompleteCheckpointError", "unagreed KeyError")


@pytest.mark.parametrize("layout,strict", LAYOUTS)
def test_trainer_fallback_to_durable_restores_it_as_ckpt_path_does(trainer_fallback, layout, strict):
    """Was: the fallback read last.ckpt with a plain load of the local template: see the module docstring."""
    scenario, results = trainer_fallback
    for res in results:
        durable, tier = res[f"{layout} {strict} durable"], res[f"{layout} {strict} tier"]
        assert durable[0] == DURABLE.get((scenario, layout, strict), "ok"), durable
        if durable[0] != "ok":  # the same refusal, word for word (the same path: last.ckpt)
            assert tier == durable
            continue
        assert tier[0] == "ok", tier
        assert tier[1]["point"] == [2, "durable"] and tier[1]["first"] == durable[1]["first"] == 2, tier[1]["point"]
        assert summary_differ(tier[1], durable[1]) == []


def summary_differ(got: dict, want: dict) -> list:
    return sorted(k for k in set(got["state"]) | set(want["state"]) if got["state"].get(k) != want["state"].get(k))


# ------------------------------------------------------------------ FabricTiers against fabric.load
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, step: int = 9) -> torch.Tensor:
        return (self.a(x) + (self.b(x) if step >= 2 else 0)).pow(2).sum()


def _train(fabric, model, opt, steps, first: int = 0, late: bool = False) -> None:
    """Steps ``first`` to ``steps``; ``late``: ``b`` joins the loss at step 2 (no optimizer state before)."""
    for s in range(first, steps):
        fabric.backward(model(torch.randn(2, 3, generator=torch.Generator().manual_seed(s)), s if late else 9))
        opt.step()
        opt.zero_grad()


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _fabric_fallback(rank: int, world: int, root: str, model_parallel: bool) -> dict:
    """A stock Fabric DDP ``fabric.save`` file of step 2 as the durable checkpoint; local steps 2 and 3, every copy
    overwritten; then FabricTiers.restore and fabric.load of that file into fresh states, compared."""
    import torch.distributed as dist
    from lightning.fabric.strategies import DDPStrategy

    from lightning_distckpt.core.errors import CheckpointingError
    from lightning_distckpt.lightning import (FabricDistCheckpointModelParallelStrategy, FabricDistCheckpointStrategy,
                                              FabricTiers)
    from lightning_distckpt.tiers import TierOptions

    stock = launch_fabric(rank, world, DDPStrategy(find_unused_parameters=True))
    model = stock.setup_module(Net())
    opt = stock.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    _train(stock, model, opt, 2)
    durable = os.path.join(root, "stock.ckpt")
    stock.save(durable, {"model": model, "optimizer": opt, "step": 2})
    strategy = (FabricDistCheckpointModelParallelStrategy(_fsdp, world, 1) if model_parallel
                else FabricDistCheckpointStrategy(find_unused_parameters=True))
    fabric = launch_fabric(rank, world, strategy)
    options = TierOptions(local_dir=os.path.join(root, "local", "{node}"), ranks_per_node=1, local_every_n_steps=1)

    def fresh():
        model = fabric.setup_module(Net())
        opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
        return model, opt, {"model": model, "optimizer": opt, "step": 0}

    model, opt, state = fresh()
    tiers = FabricTiers(fabric, options=options, run="round5")
    for s in range(3):
        _train(fabric, model, opt, s + 1, s)
        state["step"] = s + 1
        tiers.save(state, s + 1)
    tiers.close()
    dist.barrier()
    if rank == 0:
        overwrite_every_local_copy(root)
    dist.barrier()
    out = {}
    for how in ("durable", "tier"):
        model, opt, state = fresh()
        tiers = FabricTiers(fabric, options=options, run="round5")
        try:
            if how == "durable":
                fabric.load(durable, state)
                point = None
            else:
                point = tiers.restore(state, durable=[(2, durable)])
                point = [point.step, point.source]
            out[how] = ["ok", point, state["step"], snapshot(model, opt)]
        except CheckpointingError as e:
            out[how] = [type(e).__name__, str(e).split("\n--- traceback")[0]]
        finally:
            tiers.close()
    return out


@pytest.fixture(scope="module", params=["sharded", "model_parallel"])
def fabric_fallback(request, tmp_path_factory):
    return request.param, run_distributed(_fabric_fallback, 2, str(tmp_path_factory.mktemp(f"fab_{request.param}")),
                                          request.param == "model_parallel", timeout_s=GROUP_TIMEOUT_S)


def test_fabric_tiers_fallback_to_durable_restores_it_as_fabric_load_does(fabric_fallback):
    """Was: the fallback read the stock torch.save file with a plain load of the local template."""
    kind, results = fabric_fallback
    for out in results:
        durable, tier = out["durable"], out["tier"]
        if kind == "model_parallel":  # this strategy reads its own layout (and stock DCP) only: refused alike
            assert durable[0] == "CheckpointingError", durable
            assert tier == durable
            continue
        assert durable[0] == "ok" and durable[2] == 2, durable[:3]
        assert tier[:3] == ["ok", [2, "durable"], 2], tier[:3]
        assert sorted(k for k in set(tier[3]) | set(durable[3]) if tier[3].get(k) != durable[3].get(k)) == []


# ------------------------------------------------------------------ Fabric ModelParallel: strict refusals
def _fabric_strict(rank: int, world: int, root: str) -> dict:
    """Net under FSDP2 saved after step 0 (``b`` without optimizer state), both ways; restored strict both ways."""
    from lightning_distckpt.core.errors import CheckpointingError
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy, FabricTiers
    from lightning_distckpt.tiers import TierOptions

    fabric = launch_fabric(rank, world, FabricDistCheckpointModelParallelStrategy(_fsdp, world, 1))
    options = TierOptions(local_dir=os.path.join(root, "local", "{node}"), ranks_per_node=1, local_every_n_steps=1)
    out = {}
    for how in ("save", "durable", "tier"):
        model = fabric.setup_module(Net())
        opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
        state = {"model": model, "optimizer": opt, "step": 0}
        tiers = FabricTiers(fabric, options=options, run="round5")
        try:
            if how == "save":
                _train(fabric, model, opt, 1, late=True)
                state["step"] = 1
                fabric.save(os.path.join(root, "durable"), state)
                tiers.save(state, 1)
            elif how == "durable":
                fabric.load(os.path.join(root, "durable"), state)
            else:
                tiers.restore(state)
            out[how] = ["ok"]
        except CheckpointingError as e:
            out[how] = [type(e).__name__, str(e).split("\n--- traceback")[0]]
        finally:
            tiers.close()
    return out


def _listed(said: str) -> list:
    return sorted(re.findall(r"'(optimizer/state/[ab]\.\w+/\w+)'", said.split("Did you mean")[0]))


def test_fabric_model_parallel_strict_refusals_name_the_same_keys(tmp_path):
    """Was: fabric.load named b's moments only, FabricTiers.restore their 0-d ``step`` too."""
    for out in run_distributed(_fabric_strict, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S):
        durable, tier = out["durable"], out["tier"]
        assert durable[0] == tier[0] == "MissingKeysError", (durable, tier)
        assert _listed(durable[1]) == _listed(tier[1]) == [f"optimizer/state/b.{p}/{m}" for p in ("bias", "weight")
                                                           for m in ("exp_avg", "exp_avg_sq", "step")], out
