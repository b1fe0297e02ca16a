"""A resume from the node-local tier refuses a checkpoint's module weights the module no longer has, as the
durable resume of the same step refuses them (Lightning's ``strict_loading = True`` / ``fabric.load(strict=True)``
with the config's ``strict`` left unset: stock's ``load_state_dict(strict=True)``), with the same words, on every
rank alike and before any rank trains; ``strict_loading = False`` / ``strict=False`` loads the rest alike, and a
``strict`` set in the config keeps Megatron-Core's meaning (``assume_ok_unexpected`` does not look for them).

Was: a Trainer's ``fit(ckpt_path="last")`` resuming a local step, and ``FabricTiers.restore(strict=True)``, loaded
such a checkpoint silently (the extra layer dropped) where the durable restore refuses it: a resume depended on
which tier happened to hold the newest step.

Real Trainer fits (DistCheckpointStrategy, and DistCheckpointModelParallelStrategy under FSDP2) and Fabric loops
(both Fabric strategies) on 2 gloo processes as 2 simulated nodes (``ranks_per_node: 1``): a module with layers
``a`` and ``b`` saves step 1 to both tiers, and a module with ``a`` alone resumes it from each. Hang guard: each
group's timeout (GROUP_TIMEOUT_S), a rank left waiting gets a CollectiveError, which no test accepts.
"""

import os
import re

import pytest
import torch
from torch import nn

from lightning_distckpt.core.errors import CheckpointingError
from dist_utils import run_distributed
from tier_parity_scripts import AGREED, GROUP_TIMEOUT_S, launch_fabric, run_trainer_script, snapshot

pytestmark = pytest.mark.tiers

RANKS = r"""import torch
from torch import nn

from lightning_distckpt.lightning.tiers import tier_callback
from tier_parity_scripts import Recorder, StepModule, dist_strategy, fit_trainer, last, tier_config

folder, out, SCENARIO = sys.argv[1:4]
record = Recorder(out, rank)


class Layers(StepModule):
    '''One linear layer per letter of ``layers``: a checkpoint of "ab" resumed into "a" has a layer removed.'''

    def __init__(self, name, layers="ab", strict=True):
        super().__init__()
        self.name, self.point = name, None
        torch.manual_seed(0)
        self.names = layers
        for n in layers:
            setattr(self, n, nn.Linear(3, 3))
        self.strict_loading, self.fsdp = strict, SCENARIO == "mp"

    def forward(self, x):
        return sum(getattr(self, n)(x) for n in self.names)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def on_load_checkpoint(self, checkpoint):  # once the strategy's load returned: the point its tier read
        RESTORED.append(self.name)
        cb = tier_callback(self.trainer)
        point = cb.local_tier.last_point if cb is not None and cb.local_tier is not None else None
        self.point = None if point is None else [point.step, point.source]


RESTORED = []  # the fits whose strategy's restore returned a checkpoint (on_load_checkpoint called), by name


def fit(name, root, ckpt_path=None, tiers=True, config=None, **model_kw):
    config = tier_config(root, durable=1, config=config) if tiers else config
    model = Layers(name=name, **model_kw)
    got = fit_trainer(model, root, 1, dist_strategy(SCENARIO, config), ckpt_path)
    return {"point": model.point, "state": got["state"]}


def case(name, *args, **kw):
    record(name, lambda: fit(name, *args, **kw))


root = os.path.join(folder, "run")
fit("save", root)  # step 1 in the local tier and in the durable last.ckpt; below: resumed at max_steps 1, nothing
assumed = {"strict": "assume_ok_unexpected"}  # trained, nothing saved
case("durable strict", root, last(root), tiers=False, layers="a")
case("tier strict", root, "last", layers="a")
case("durable lenient", root, last(root), tiers=False, layers="a", strict=False)
case("tier lenient", root, "last", layers="a", strict=False)
case("durable assume", root, last(root), tiers=False, config=assumed, layers="a")
case("tier assume", root, "last", config=assumed, layers="a")
case("tier same", root, "last")  # after the refusals: the module that saved it resumes
record("restored", lambda: RESTORED)
"""


def _run_trainer(tmp_path, scenario: str) -> list:
    return run_trainer_script(tmp_path, RANKS, [scenario], agreed=AGREED)


@pytest.fixture(scope="module", params=["ddp", "mp"])
def trainer(request, tmp_path_factory):
    """Every rank's outcomes under DistCheckpointStrategy ("ddp") or its ModelParallel subclass ("mp")."""
    return _run_trainer(tmp_path_factory.mktemp(f"strict_{request.param}"), request.param)


def _words(said: str) -> str:
    """An error's words without the checkpoint's path (the local copy's differs from last.ckpt's), also where the
    ranks' agreement on a restore's failure wraps them ("restore of ... failed after reading: rank 0: checkpoint")."""
    return re.sub(r"checkpoint (local step \d+|\S+): ", "checkpoint: ", said)


def _alike(ranks: list) -> None:
    """Every rank met the same outcomes, an error's words the same (each rank names its own node's local copy)."""
    said = [{k: [v[0], _words(v[1])] if v[0] != "ok" else v for k, v in res.items()} for res in ranks]
    assert said[0] == said[1], "the ranks' outcomes differ"


def test_trainer_tier_resume_refuses_the_module_weights_a_durable_resume_refuses(trainer, request):
    """Was: ``fit(ckpt_path="last")`` from the local step loaded the checkpoint of layers a and b into a module
    with a alone (b dropped silently); the durable resume of the same step refuses it. Now both refuse, on both
    ranks, with the same words (b's weights named, the way out given), before any rank trains. Under the
    ModelParallel subclass, as under stock ModelParallelStrategy (DCP reads only what the module asks for),
    neither refuses: both restore the same state."""
    _alike(trainer)
    res = trainer[0]
    durable, tier = res["durable strict"], res["tier strict"]
    if request.node.callspec.params["trainer"] == "mp":
        assert durable[0] == "ok" and tier[0] == "ok", (durable, tier)
        assert tier[1]["point"] == [1, "local"] and tier[1]["state"] == durable[1]["state"], (durable, tier)
        return
    assert durable[0] == "MissingKeysError", durable
    assert tier[0] == "MissingKeysError", tier
    assert "b.weight'" in tier[1] and "b.bias'" in tier[1] and "strict_loading = False" in tier[1], tier
    assert _words(tier[1]) == _words(durable[1]), (durable, tier)
    # the refused fits reach on_load_checkpoint, as stock DDP's do (the refusal is load_state_dict's, after the hook)
    refused = ["durable strict", "tier strict"]
    assert res["restored"][1] == [*refused, "durable lenient", "tier lenient", "durable assume", "tier assume",
                                  "tier same"], res["restored"]


@pytest.mark.parametrize("case", ["lenient", "assume"])
def test_trainer_tier_resume_relaxed_loads_what_the_durable_resume_loads(trainer, case):
    """``strict_loading = False`` (logged: the rest loaded), and ``strict: assume_ok_unexpected`` set in the config
    (Megatron-Core's meaning: not looked for): the local resume restores what the durable one restores."""
    for res in trainer:
        durable, tier = res[f"durable {case}"], res[f"tier {case}"]
        assert durable[0] == "ok" and tier[0] == "ok", (durable, tier)
        assert tier[1]["point"] == [1, "local"] and durable[1]["point"] is None, tier
        assert tier[1]["state"] == durable[1]["state"]


def test_trainer_tier_resume_after_the_refusal_resumes_the_same_module(trainer):
    """The refusals left the tier and the ranks agreed: the module that saved the step resumes it locally."""
    for res in trainer:
        assert res["tier same"][0] == "ok", res["tier same"]
        assert res["tier same"][1]["point"] == [1, "local"]


# ------------------------------------------------------------------ Fabric: FabricTiers against fabric.load
class Net(nn.Module):
    """``a``, and ``b`` with ``extra``: a layer the resuming module no longer has."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) + (self.b(x) if self.b is not None else 0)).pow(2).sum()


def _strategy(kind: str, config: dict):
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy, FabricDistCheckpointStrategy

    if kind == "fabric":
        return FabricDistCheckpointStrategy(checkpoint=config, find_unused_parameters=True)

    def fsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    return FabricDistCheckpointModelParallelStrategy(fsdp, 2, 1, checkpoint=config)


def _fabric_runs(rank: int, world: int, root: str, kind: str) -> dict:
    """Net(extra=True) saved after a step (fabric.save and a local step 1), restored into Net(extra=False) by
    fabric.load and by FabricTiers.restore: strict, non-strict, and under a config's assume_ok_unexpected."""
    from lightning_distckpt.lightning import FabricTiers
    from lightning_distckpt.tiers import TierOptions

    options = TierOptions(local_dir=os.path.join(root, "local", "{node}"), ranks_per_node=1, local_every_n_steps=1)
    fabric = launch_fabric(rank, world, _strategy(kind, {}))
    model = fabric.setup_module(Net(True))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 3, generator=torch.Generator().manual_seed(0))))
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 1}
    fabric.save(f"{root}/durable", state)
    tiers = FabricTiers(fabric, options=options, run="strict")
    tiers.save(state, 1)
    tiers.close()
    out = {}
    for case, config, strict in (("strict", {}, True), ("lenient", {}, False),
                                 ("assume", {"strict": "assume_ok_unexpected"}, True)):
        fabric = launch_fabric(rank, world, _strategy(kind, config)) if config else fabric
        for how in ("durable", "tier"):
            model = fabric.setup_module(Net(False))
            opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
            state = {"model": model, "optimizer": opt, "step": 0}
            tiers = FabricTiers(fabric, options=options, run="strict")
            try:
                if how == "durable":
                    fabric.load(f"{root}/durable", state, strict=strict)
                else:
                    point = tiers.restore(state, strict=strict)
                    assert point is not None and (point.step, point.source) == (1, "local"), point
                out[f"{case} {how}"] = ["ok", snapshot(model, opt), state["step"]]
            except CheckpointingError as e:
                out[f"{case} {how}"] = [type(e).__name__, str(e).split("\n--- traceback")[0]]
            finally:
                tiers.close()
    return out


@pytest.fixture(scope="module", params=["fabric", "fabric_model_parallel"])
def fabric(request, tmp_path_factory):
    """Every rank's outcomes under FabricDistCheckpointStrategy or FabricDistCheckpointModelParallelStrategy."""
    return run_distributed(_fabric_runs, 2, str(tmp_path_factory.mktemp(request.param)), request.param,
                           timeout_s=GROUP_TIMEOUT_S * 4)


def test_fabric_tier_restore_refuses_the_module_weights_fabric_load_refuses(fabric, request):
    """Was: ``FabricTiers.restore(state, strict=True)`` loaded b's weights' checkpoint into a module without b
    silently; ``fabric.load`` refuses it. Now both refuse, on both ranks, with the same words. Under the Fabric
    ModelParallel subclass, as under stock's, neither refuses: both restore alike."""
    _alike(fabric)
    durable, tier = fabric[0]["strict durable"], fabric[0]["strict tier"]
    if request.node.callspec.params["fabric"] == "fabric_model_parallel":
        assert durable[0] == "ok" and tier == durable, (durable, tier)
        return
    assert durable[0] == "MissingKeysError", durable
    assert tier[0] == "MissingKeysError", tier
    assert "b.weight'" in tier[1] and "strict=False" in tier[1], tier
    assert _words(tier[1]) == _words(durable[1]), (durable, tier)


@pytest.mark.parametrize("case", ["lenient", "assume"])
def test_fabric_tier_restore_relaxed_loads_what_fabric_load_loads(fabric, case):
    """``strict=False``, and a config's ``strict: assume_ok_unexpected``: a restored from either tier alike."""
    for out in fabric:
        durable, tier = out[f"{case} durable"], out[f"{case} tier"]
        assert durable[0] == "ok", durable
        assert tier == durable
