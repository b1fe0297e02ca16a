"""Local-tier restores restore exactly what a durable restore of the same checkpoint restores: the optimizer
state, the key checks of the configured ``strict`` handling, the strategy's load settings, and a failure on one
rank agreed by every rank. Each case restores one step both ways (the durable ``last.ckpt`` / ``fabric.save``
directory, and the same step from the local tier) and compares.

What a red-team probe found (each a difference from the durable restore, on the old code):

* **ModelParallel, non-strict** (``strict_loading = False``, ``fabric.load``'s ``strict=False``): a parameter
  without optimizer state when saved (a layer not used yet: torch keeps none before its first gradient) got the
  fresh template's state (torch's init step on zero gradients) from the local tier, none from durable storage.
  Adam, NAdam, SGD with dampening went on from another state than the saved run's: silently not the run. The
  local templates (``tiers_restore.load_model_parallel_recovery``, ``FabricTiers``) now leave out what the
  checkpoint holds no state for (``drop_unsaved_states``), as the durable loads do.
* **DistCheckpointStrategy's two parts** read the whole local copy under a relaxed mode: ``strict: raise_all``
  (or ``log_all``) never saw a checkpoint's keys the module lacks (a layer removed: refused from durable storage,
  loaded silently from the tier), and ``return_all`` / ``return_unexpected`` refused a template key the checkpoint
  lacks (a layer added) that the durable restore skips. Each part now reads its own view of the copy under the
  configured mode, as the durable restore does.
* **What ``CheckpointIO.load_sharded`` adds to a durable load** was missing from the local one: the config's
  ``allow_shape_mismatch`` (a shape mismatch refused from the tier, padded / truncated from durable storage), and,
  for a non-strict load, the template's own common values where the checkpoint has none (now applied alike).
* **FabricTiers (FabricDistCheckpointStrategy), strict**: an entry of the state the checkpoint lacks was kept as
  it was; ``fabric.load`` refuses it (MissingKeysError naming it). Now refused alike.

Found sound, kept as regressions: a non-strict Fabric restore into a module with a new layer, strict restores
refusing a parameter without saved state (both ways, the same
keys named), ``momentum=0.9`` saved into ``SGD(momentum=0)`` refused both ways with the same words, a stateful
object refusing its state on one rank failing every rank alike.

Real Trainer fits and Fabric loops on 2 gloo processes as 2 simulated nodes (``ranks_per_node: 1``); hang guard:
each group's timeout (GROUP_TIMEOUT_S), a rank left waiting gets a CollectiveError, told apart from the error
asserted, and a scenario stops at the first outcome not agreed.
"""

import os

import pytest
import torch
from torch import nn

from lightning_distckpt.core.errors import CheckpointingError
from dist_utils import run_distributed
from tier_parity_scripts import AGREED, GROUP_TIMEOUT_S, launch_fabric as _fabric, run_trainer_script
from tier_parity_scripts import snapshot as _snapshot

pytestmark = pytest.mark.tiers

# ------------------------------------------------------------------ Trainer: ckpt_path="last" against last.ckpt
RANKS = r"""import torch
from torch import nn

from tier_parity_scripts import Recorder, StepModule, dist_strategy, fit_trainer, last, summary, tier_config

folder, out, SCENARIO = sys.argv[1:4]
record = Recorder(out, rank)


class Late(StepModule):
    '''``b`` joins the loss at global step 2 (``late``): until then torch keeps no optimizer state for it.
    ``layers``: the module's linear layers (a checkpoint of "ab" into "a" or "abc": a layer removed, added).'''

    def __init__(self, opt="adam", late=True, layers="ab", strict=True, fsdp=True):
        super().__init__()
        torch.manual_seed(0)
        self.names = layers
        for n in layers:
            setattr(self, n, nn.Linear(3, 3))
        self.opt, self.late, self.strict_loading, self.fsdp = opt, late, strict, fsdp

    def forward(self, x):  # through the FSDP2 root's hooks
        used = [n for n in self.names if n == "a" or not self.late or self.global_step >= 2]
        return sum(getattr(self, n)(x) for n in used)

    def configure_optimizers(self):
        return {"adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
                "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.1),
                "sgdm": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
                "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1)}[self.opt](self.parameters())


def fit(root, steps, ckpt_path=None, tiers=True, config=None, **model_kw):
    config = tier_config(root, durable=1, config=config) if tiers else config
    return fit_trainer(Late(fsdp=SCENARIO == "mp", **model_kw), root, steps, dist_strategy(SCENARIO, config), ckpt_path)


if SCENARIO == "mp":
    for opt in ("adam", "sgdm"):  # NAdam: the Fabric case below
        root = os.path.join(folder, opt)
        plain = fit(os.path.join(root, "plain"), 4, tiers=False, opt=opt)
        fit(root, 1, opt=opt)  # a local step 1 and a durable last.ckpt of step 1, b without state in both
        # strict: both refuse (b's state is not in the checkpoint); non-strict: both resume as if never stopped
        record(f"{opt} durable strict", lambda: fit(root, 4, last(root), tiers=False, opt=opt)["first"])
        record(f"{opt} tier strict", lambda: fit(root, 4, "last", opt=opt)["first"])
        record(f"{opt} durable", lambda: summary(fit(root, 4, last(root), tiers=False, opt=opt, strict=False), plain))
        record(f"{opt} tier", lambda: summary(fit(root, 4, "last", opt=opt, strict=False), plain))
    root = os.path.join(folder, "momentum")
    fit(root, 3, opt="sgdm")  # every parameter has a momentum buffer
    record("momentum durable", lambda: fit(root, 4, last(root), tiers=False, opt="sgd")["first"])
    record("momentum tier", lambda: fit(root, 4, "last", opt="sgd")["first"])
else:  # DistCheckpointStrategy: the module and the optimizer state are restored in two parts
    root = os.path.join(folder, "keys")
    fit(root, 1, late=False)  # layers a and b; below, restored (max_steps 1: nothing trained, nothing saved)
    for mode, layers in (("raise_all", "a"), ("log_all", "a"), ("return_all", "abc"), ("return_unexpected", "abc")):
        cfg = {"strict": mode}
        record(f"{mode} durable", lambda: fit(root, 1, last(root), tiers=False, config=cfg, layers=layers,
                                              late=False)["state"])
        record(f"{mode} tier", lambda: fit(root, 1, "last", config=cfg, layers=layers, late=False)["state"])
"""


def _run_trainer(tmp_path, scenario: str) -> dict:
    return run_trainer_script(tmp_path, RANKS, [scenario], agreed=AGREED)


@pytest.fixture(scope="module")
def trainer_model_parallel(tmp_path_factory):
    return _run_trainer(tmp_path_factory.mktemp("trainer_mp"), "mp")


@pytest.fixture(scope="module")
def trainer_two_parts(tmp_path_factory):
    return _run_trainer(tmp_path_factory.mktemp("trainer_ddp"), "ddp")


def _same_words(said: str) -> str:
    """An error's words without the checkpoint's path (the local copy's differs from last.ckpt's)."""
    return (said.split(": ", 1)[1] if said.startswith("checkpoint ") else said).split(" [strict=")[0]


@pytest.mark.parametrize("optimizer", ["adam", "sgdm"])
def test_trainer_model_parallel_tier_resume_leaves_a_stateless_parameter_without_state(trainer_model_parallel,
                                                                                       optimizer):
    """Was: the local resume gave ``b`` the template's init-step state (``differ``: b's parameters and
    state after training on), the durable resume none; now both end where the uninterrupted run ends."""
    for res in trainer_model_parallel:
        assert res[f"{optimizer} durable"] == ["ok", {"first": 1, "point": None, "differ": []}]
        assert res[f"{optimizer} tier"] == ["ok", {"first": 1, "point": [1, "local"], "differ": []}]


@pytest.mark.parametrize("optimizer", ["adam", "sgdm"])
def test_trainer_model_parallel_strict_resumes_refuse_alike(trainer_model_parallel, optimizer):
    for res in trainer_model_parallel:
        durable, tier = res[f"{optimizer} durable strict"], res[f"{optimizer} tier strict"]
        assert durable[0] == tier[0] == "MissingKeysError", (durable, tier)
        # the same moments named (the durable listing also names their 0-d ``step``: see the module docstring)
        named = [_moments(said) for said in (durable[1], tier[1])]
        assert named[0] == named[1] and any("state/b.weight/" in k for k in named[1]), named


def _moments(said: str) -> list:
    import re

    return sorted(set(re.findall(r"'(optimizer_states/0/state/[ab]\.\w+/(?:exp_avg|exp_avg_sq|momentum_buffer))'",
                                 said)))


def test_trainer_model_parallel_refuses_momentum_the_optimizer_lacks_alike(trainer_model_parallel):
    for res in trainer_model_parallel:
        durable, tier = res["momentum durable"], res["momentum tier"]
        assert durable[0] == "CheckpointingError" and "has {'momentum': 0.9}" in durable[1], durable
        assert tier == durable


def test_trainer_tier_resume_refuses_keys_the_module_lacks_under_raise_all(trainer_two_parts):
    """Was: a checkpoint with layer ``b`` resumed into a module without it under ``strict: raise_all``: refused
    from last.ckpt (missing keys), loaded silently from the local tier."""
    for res in trainer_two_parts:
        durable, tier = res["raise_all durable"], res["raise_all tier"]
        assert durable[0] == tier[0] == "MissingKeysError", (durable, tier)
        assert "['b.bias', 'b.weight']" in tier[1] and _same_words(durable[1]) == _same_words(tier[1])


@pytest.mark.parametrize("mode", ["log_all", "return_all", "return_unexpected"])
def test_trainer_tier_resume_restores_what_the_durable_resume_restores(trainer_two_parts, mode):
    """Was (return_all, return_unexpected): the local resume of a module with a new layer ``c`` refused it
    (MissingKeysError) where the durable one skips it; now the same weights and optimizer state."""
    for res in trainer_two_parts:
        durable, tier = res[f"{mode} durable"], res[f"{mode} tier"]
        assert durable[0] == "ok", durable
        assert tier == durable


# ------------------------------------------------------------------ Fabric: FabricTiers against fabric.load
def _options(root: str):
    from lightning_distckpt.tiers import TierOptions

    return TierOptions(local_dir=os.path.join(root, "local", "{node}"), ranks_per_node=1, local_every_n_steps=1)


class LateHead(nn.Module):
    """``b`` joins the loss from step 2 on: until then torch keeps no optimizer state for it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return (self.a(x) + self.b(x)).pow(2).sum() if step >= 2 else self.a(x).pow(2).sum()


OPTIMIZERS = {"adam": lambda ps: torch.optim.Adam(ps, lr=0.1), "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.1),
              "sgdm": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5)}


def _late_run(fabric, root: str, make, how: str = "plain") -> dict:
    """LateHead under FSDP2, 4 steps; ``how``: "save" (fabric.save and a local step after step 0), or a resume
    of that step, non-strict: "durable" (fabric.load) or "tier" (FabricTiers.restore)."""
    from lightning_distckpt.lightning import FabricTiers

    model = fabric.setup_module(LateHead())
    opt = fabric.setup_optimizers(make(model.parameters()))
    tiers = FabricTiers(fabric, options=_options(root), run="parity")
    state = {"model": model, "optimizer": opt, "step": 0}
    if how == "durable":
        fabric.load(f"{root}/durable", state, strict=False)
    elif how == "tier":
        point = tiers.restore(state, strict=False)
        assert point is not None and (point.step, point.source) == (1, "local"), point
    for s in range(state["step"], 4):
        fabric.backward(model(torch.randn(2, 3, generator=torch.Generator().manual_seed(s)), s))
        opt.step()
        opt.zero_grad()
        if how == "save" and s == 0:
            state["step"] = 1
            fabric.save(f"{root}/durable", state)
            tiers.save(state, 1)
    tiers.close()
    return _snapshot(model, opt)


def _fabric_model_parallel(rank: int, world: int, root: str) -> dict:
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy

    def fsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    fabric = _fabric(rank, world, FabricDistCheckpointModelParallelStrategy(fsdp, world, 1))
    out = {}
    for name, make in OPTIMIZERS.items():
        plain = _late_run(fabric, f"{root}/{name}", make)
        _late_run(fabric, f"{root}/{name}", make, "save")
        out[name] = {how: sorted(k for k, v in _late_run(fabric, f"{root}/{name}", make, how).items()
                                 if plain.get(k) != v) for how in ("durable", "tier")}
    return out


@pytest.fixture(scope="module")
def fabric_model_parallel(tmp_path_factory):
    return run_distributed(_fabric_model_parallel, 2, str(tmp_path_factory.mktemp("fabric_mp")),
                           timeout_s=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_fabric_model_parallel_tier_restore_leaves_a_stateless_parameter_without_state(fabric_model_parallel,
                                                                                       optimizer):
    """Was: the tier restore gave ``b`` (no state when saved) the template's init-step state, the durable one
    none: Adam / NAdam / SGD with dampening went on from another state than the saved run's."""
    for out in fabric_model_parallel:
        assert out[optimizer] == {"durable": [], "tier": []}, out[optimizer]


class Net(nn.Module):
    """``a`` (3 -> ``width``), and ``c`` with ``extra``: a layer the checkpoint does not hold."""

    def __init__(self, width: int = 3, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, width)
        self.c = nn.Linear(3, width) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) + (self.c(x) if self.c is not None else 0)).pow(2).sum()


class Flaky:
    """A data loader's state, say, whose ``load_state_dict`` fails on rank 1 while ``fail`` is set."""

    fail = False

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        if Flaky.fail and self.rank == 1:
            raise ValueError("load_state_dict failed on rank 1")


#: (model's arguments, extra state entries, strict, Flaky fails): what a restore of the saved Net() meets.
FABRIC_CASES = {"absent_entry": ({}, {"epoch": 7}, True, False), "new_layer": ({"extra": True}, {}, False, False),
                "shape_mismatch": ({"width": 4}, {}, True, False), "one_rank_fails": ({}, {}, True, True)}


def _fabric_plain(rank: int, world: int, root: str) -> dict:
    """FabricDistCheckpointStrategy (``allow_shape_mismatch``): Net saved after a step, restored both ways."""
    from lightning_distckpt.lightning import FabricDistCheckpointStrategy, FabricTiers

    fabric = _fabric(rank, world, FabricDistCheckpointStrategy(checkpoint={"allow_shape_mismatch": True},
                                                               find_unused_parameters=True))
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 3, generator=torch.Generator().manual_seed(0))))
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 1, "loader": Flaky(rank)}
    fabric.save(f"{root}/durable", state)
    tiers = FabricTiers(fabric, options=_options(root), run="parity")
    tiers.save(state, 1)
    tiers.close()
    out = {}
    for case, (kw, extra, strict, fail) in FABRIC_CASES.items():
        for how in ("durable", "tier"):
            model = fabric.setup_module(Net(**kw))
            opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
            state = {"model": model, "optimizer": opt, "step": 0, "loader": Flaky(rank), **extra}
            tiers = FabricTiers(fabric, options=_options(root), run="parity")
            Flaky.fail = fail
            try:
                if how == "durable":
                    fabric.load(f"{root}/durable", state, strict=strict)
                else:
                    point = tiers.restore(state, strict=strict)
                    assert point is not None and point.source == "local", point
                out[f"{case} {how}"] = ["ok", _snapshot(model, opt), state["step"]]
            except CheckpointingError as e:
                out[f"{case} {how}"] = [type(e).__name__, str(e).split("\n--- traceback")[0]]
            finally:
                Flaky.fail = False
                tiers.close()
    return out


@pytest.fixture(scope="module")
def fabric_plain(tmp_path_factory):
    return run_distributed(_fabric_plain, 2, str(tmp_path_factory.mktemp("fabric_plain")), timeout_s=GROUP_TIMEOUT_S)


def test_fabric_tier_restore_refuses_an_entry_the_checkpoint_lacks_as_fabric_load_does(fabric_plain):
    """Was: FabricTiers.restore(strict=True) kept ``epoch`` as it was, silently; fabric.load refuses it."""
    for out in fabric_plain:
        for how in ("durable", "tier"):
            kind, said = out[f"absent_entry {how}"][:2]
            assert kind == "MissingKeysError" and "has no entry ['epoch']" in said, (how, said)


@pytest.mark.parametrize("case", ["new_layer", "shape_mismatch"])
def test_fabric_tier_restore_reads_what_fabric_load_reads(fabric_plain, case):
    """Was (shape_mismatch): the strategy's ``allow_shape_mismatch`` was not applied to a local restore (a
    ShardingError). new_layer (a non-strict restore into a module with a new layer): found sound, kept."""
    for out in fabric_plain:
        durable, tier = out[f"{case} durable"], out[f"{case} tier"]
        assert durable[0] == "ok", durable
        assert tier[0] == "ok", tier
        assert {k: v for k, v in tier[1].items() if durable[1].get(k) != v} == {}
        assert sorted(set(durable[1]) - set(tier[1])) == []
        assert tier == durable


def test_fabric_tier_restore_failing_on_one_rank_fails_every_rank_alike(fabric_plain):
    """Found sound (kept): a stateful object refusing its state on rank 1 fails both ranks, as fabric.load."""
    for out in fabric_plain:
        for how in ("durable", "tier"):
            kind, said = out[f"one_rank_fails {how}"][:2]
            assert kind == "CheckpointingError" and "failed after reading: rank 1: ValueError" in said, (how, said)
            assert "rank 0:" not in said, said
