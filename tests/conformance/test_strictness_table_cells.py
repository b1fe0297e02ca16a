"""The cells of docs/lightning.md's strictness table that no test showed, each beside the stock strategy.

One real 2-rank run (forked as torchrun would start them; FSDP2 over the data-parallel mesh under the
ModelParallel strategies) saves and resumes the same pairs under stock Lightning and ours:

1. the module has a layer (a LayerNorm ``norm``) the checkpoint lacks: stock ``ModelParallelStrategy`` (Trainer's
   and Fabric's) vs our subclasses, ``strict_loading`` / ``fabric.load(strict=)`` True and False;
2. extra state holding a tensor (``get_extra_state()`` returning ``{"n": 3, "t": tensor}``) in a checkpoint written
   by stock ``ModelParallelStrategy``, resumed under our subclass, and in our own, resumed by ours;
3. a non-strict ``fit`` (``strict_loading = False``) of a checkpoint whose removed layer's parameters were in the
   optimizer (its saved param groups no longer fit), under ``DistCheckpointStrategy`` and stock DDP, and under the
   ModelParallel strategies.
"""

import textwrap

import pytest

from conformance.test_mismatch_errors_both_sides import _ours
from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import json, logging, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy as FabricMP
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy, DistCheckpointStrategy
    from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy
    from lightning_helpers import TPMLP, SmallMLP

    class Sharded(TPMLP):
        """TPMLP (AdamW, StepLR); under a ModelParallel strategy FSDP2 over the data-parallel mesh."""
        def configure_model(self):
            super().configure_model()
            if self.device_mesh is not None:
                for layer in [self.fc1, self.fc2, *([self.norm] if self.hparams.extra_layer else []), self]:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    class ShardedSGD(Sharded):
        """Plain SGD: no per-parameter state, only the param groups name the parameters."""
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    class XS(nn.Module):
        """Extra state {"n": n, "t": tensor}: fresh n=0 and zeros; trained n=3 and seeded random values."""
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)
            self.n, self.t = 0, torch.zeros(3)
        def trained(self):
            self.n, self.t = 3, torch.randn(3, generator=torch.Generator().manual_seed(3))
        def get_extra_state(self):
            return {"n": self.n, "t": self.t}
        def set_extra_state(self, state):
            self.got = state

    class XM(LightningModule):
        def __init__(self, lenient=False):
            super().__init__()
            self.sub = XS()
            self.strict_loading = not lenient
        def configure_model(self):
            if self.device_mesh is not None and not isinstance(self.sub.lin.weight, DTensor):
                for layer in (self.sub.lin, self):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        def training_step(self, batch, i):
            self.sub.trained()  # the same on every rank: what the saves store
            return self.sub.lin(batch).sum()
        def train_dataloader(self):
            return DataLoader(torch.randn(8, 4), batch_size=2)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Plain(nn.Module):
        """SmallMLP with an optional LayerNorm after it (Fabric runs)."""
        def __init__(self, extra):
            super().__init__()
            self.mlp = SmallMLP()
            if extra:
                self.norm = nn.LayerNorm(4)

    class FX(nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = XS()

    def parallelize(model, mesh):
        for layer in [*model.children(), model]:
            fully_shard(layer, mesh=mesh["data_parallel"])
        return model

    logs = []
    class Kept(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())
    logging.getLogger().addHandler(Kept())
    logging.getLogger().setLevel(logging.INFO)

    def show(x):
        if isinstance(x, torch.Tensor):
            return {"dtype": str(x.dtype), "values": x.tolist()}
        return {str(k): show(v) for k, v in x.items()} if isinstance(x, dict) else x

    def weights(model):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().tolist()
                for n, p in model.named_parameters()}

    def opt_state(t):
        """Each optimizer's per-parameter state by parameter name (whole tensors)."""
        names, out = {id(p): n for n, p in t.lightning_module.named_parameters()}, {}
        for o in t.optimizers:
            for p, s in o.state.items():
                for k, v in s.items():
                    v = v.full_tensor() if isinstance(v, DTensor) else v
                    out[f"{names[id(p)]}/{k}"] = v.tolist() if isinstance(v, torch.Tensor) else v
        return out

    def same(got, want):
        return sorted(k for k in got if k in want and got[k] == want[k])

    from script_ranks import write_outcomes

    def outcome(call):
        logs.clear()
        try:
            return {"type": None, **(call() or {}), "logged_norm": any("norm.weight" in m for m in logs)}
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            return {"type": type(e).__name__, "message": str(e)}

    root, out = sys.argv[1], sys.argv[2]
    res = {}

    def trainer(strategy):
        return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                       strategy=strategy)

    MP = {"stock_mp": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
          "ours_mp": lambda: DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)}
    DDP = {"stock": DDPStrategy, "ours": DistCheckpointStrategy}

    def pair(kind, strategy, saved_extra, modes, cls=Sharded):
        """Save after one step with (or without) the norm layer, resume without (or with) it in each mode."""
        ck = os.path.join(root, f"{kind}_{saved_extra}.ckpt")
        t = trainer(strategy())
        t.fit(cls(extra_layer=saved_extra))
        t.save_checkpoint(ck)
        want, want_state = weights(t.lightning_module), opt_state(t)
        for mode in modes:
            def resume():
                model = cls(extra_layer=not saved_extra)
                model.strict_loading = mode == "strict"
                tr = trainer(strategy())  # max_steps=1 reached: nothing trained after the restore
                (tr.test if mode == "lenient_test" else tr.fit)(model, ckpt_path=ck)
                got, state = weights(model), opt_state(tr) if mode != "lenient_test" else {}
                return {"restored": same(got, want), "fresh": sorted(k for k in got if k not in want),
                        "state_restored": same(state, want_state),
                        "state_other": sorted(k for k in state if k not in same(state, want_state))}
            res[f"{kind}/{'removed_layer' if saved_extra else 'new_layer'}/{mode}"] = outcome(resume)

    for kind, strategy in MP.items():  # 1. a layer the checkpoint lacks; 3. under ModelParallel
        pair(kind, strategy, False, ("strict", "lenient_test", "lenient_fit"))
    for kind, strategy in {**MP, **DDP}.items():  # 3. the removed layer's parameters were in the optimizer
        pair(kind, strategy, True, ("lenient_fit",))
        pair(kind + "_sgd", strategy, True, ("lenient_fit",), ShardedSGD)

    for saver in MP:  # 2. extra state holding a tensor (Trainer)
        t = trainer(MP[saver]())
        t.fit(XM())
        t.save_checkpoint(os.path.join(root, f"xs_{saver}.ckpt"))
        res[f"xs/saved_by_{saver}"] = show(t.lightning_module.sub.get_extra_state())
    for resumer, saver in (("stock_mp", "stock_mp"), ("ours_mp", "stock_mp"), ("ours_mp", "ours_mp")):
        for lenient in (False, True):
            def resume():
                m = XM(lenient)
                trainer(MP[resumer]()).fit(m, ckpt_path=os.path.join(root, f"xs_{saver}.ckpt"))
                return {"got": show(m.sub.got)}
            res[f"xs/{resumer}<-{saver}/{'lenient' if lenient else 'strict'}"] = outcome(resume)

    FABRICS = {"fabric_stock_mp": lambda: FabricMP(parallelize, data_parallel_size=2, tensor_parallel_size=1),
               "fabric_ours_mp": lambda: FabricDistCheckpointModelParallelStrategy(
                   parallelize, data_parallel_size=2, tensor_parallel_size=1)}
    for kind, strategy in FABRICS.items():  # 1. and 2. under Fabric
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        ck = os.path.join(root, kind + "_ck")
        saved = fabric.setup_module(Plain(False))
        fabric.save(ck, {"model": saved})
        want = weights(saved)
        for strict in (True, False):
            def load():
                model = fabric.setup_module(Plain(True))
                rest = fabric.load(ck, {"model": model}, strict=strict)
                got = weights(model)
                return {"rest": sorted(rest), "restored": same(got, want),
                        "fresh": sorted(k for k in got if k not in want)}
            res[f"{kind}/new_layer/{'strict' if strict else 'lenient'}"] = outcome(load)
        m = FX()
        m.sub.trained()
        fabric.save(os.path.join(root, kind + "_xs"), {"model": fabric.setup_module(m)})
        res[f"xs/saved_by_{kind}"] = show(m.sub.get_extra_state())
    for reader, writer in (("fabric_stock_mp", "fabric_stock_mp"), ("fabric_ours_mp", "fabric_stock_mp"),
                           ("fabric_ours_mp", "fabric_ours_mp")):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=FABRICS[reader]())
        fabric.launch()
        for strict in (True, False):
            def load():
                m = FX()
                fabric.load(os.path.join(root, writer + "_xs"), {"model": fabric.setup_module(m)}, strict=strict)
                return {"got": show(m.sub.got)}
            res[f"xs/{reader}<-{writer}/{'strict' if strict else 'lenient'}"] = outcome(load)
    write_outcomes(out, res)
''')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save-then-resume pair (one 2-rank run serves every test here)."""
    import lightning_distckpt
    print("lightning_distckpt from", lightning_distckpt.__file__)
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


NORM = {"norm.weight", "norm.bias"}
KEPT = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
ADAMW = sorted(f"{p}/{s}" for p in KEPT for s in ("exp_avg", "exp_avg_sq", "step"))
ADAMW_NORM = {f"{p}/{s}" for p in NORM for s in ("exp_avg", "exp_avg_sq", "step")}
DCP_MISSING = "Missing key in checkpoint state_dict: {}norm.weight."


@pytest.mark.parametrize("mode", ["strict", "lenient_test", "lenient_fit"])
def test_stock_model_parallel_refuses_a_new_layer_strict_or_not(runs, mode):
    """Stock Trainer ModelParallelStrategy: a module layer the checkpoint lacks is refused by DCP's load planner
    (``Missing key in checkpoint state_dict``) whatever ``strict_loading`` says (it reads the module's keys before
    ``load_state_dict(strict=...)``)."""
    stock = runs[f"stock_mp/new_layer/{mode}"]
    assert stock["type"] == "CheckpointException", stock
    assert DCP_MISSING.format("state_dict.") in stock["message"], stock


def test_our_model_parallel_refuses_a_new_layer_naming_it(runs):
    """DistCheckpointModelParallelStrategy, ``strict_loading = True``: refused as stock refuses, naming the
    module's keys the checkpoint lacks, and the new layer's AdamW state, which it lacks too (no checkpoint key
    named as missing), with the way out."""
    ours = runs["ours_mp/new_layer/strict"]
    assert ours["type"] == "MissingKeysError", ours
    named = _ours(ours["message"], "Unexpected keys (of all ranks)")
    assert {"state_dict/" + k for k in NORM} | {f"optimizer_states/0/state/{k}" for k in ADAMW_NORM} == named, ours
    assert "Missing keys" not in ours["message"] and "strict_loading = False" in ours["message"], ours


@pytest.mark.parametrize("mode", ["lenient_test", "lenient_fit"])
def test_our_model_parallel_non_strict_keeps_the_new_layer_fresh(runs, mode):
    """``strict_loading = False`` (where stock ModelParallel refuses either way): the checkpoint's layers restored,
    the new layer left with its fresh weights and logged; a fit also restores the kept parameters' AdamW state
    (bit-exact) and gives the new layer none (torch keeps none before its first step)."""
    ours = runs[f"ours_mp/new_layer/{mode}"]
    assert ours["type"] is None and ours["logged_norm"], ours
    assert ours["restored"] == KEPT and ours["fresh"] == sorted(NORM), ours
    if mode == "lenient_fit":
        assert ours["state_restored"] == ADAMW and ours["state_other"] == [], ours


@pytest.mark.parametrize("strict", ["strict", "lenient"])
def test_fabric_model_parallel_new_layer(runs, strict):
    """Fabric: stock ModelParallelStrategy's ``fabric.load`` refuses the new layer through DCP, strict or not; ours
    refuses ``strict=True`` naming ``model/norm.*`` and with ``strict=False`` loads the rest, the new layer fresh."""
    stock = runs[f"fabric_stock_mp/new_layer/{strict}"]
    assert stock["type"] == "CheckpointException" and DCP_MISSING.format("model.") in stock["message"], stock
    ours = runs[f"fabric_ours_mp/new_layer/{strict}"]
    if strict == "strict":
        assert ours["type"] == "MissingKeysError", ours
        assert _ours(ours["message"], "Unexpected keys (of all ranks)") == {"model/" + k for k in NORM}, ours
        assert "strict=False" in ours["message"], ours
    else:
        assert ours["type"] is None and ours["rest"] == [] and ours["logged_norm"], ours
        assert [k.rsplit("mlp.", 1)[-1] for k in ours["restored"]] == KEPT and len(ours["fresh"]) == 2, ours


XS_STORED = {"n": 3, "t": {"dtype": "torch.float32"}}


def _stored(runs, savers):
    """What the savers stored (the same trained values on each), checked to differ from a fresh module's."""
    saved = [runs[f"xs/saved_by_{s}"] for s in savers]
    assert all(s == saved[0] for s in saved) and saved[0]["n"] == 3 and any(saved[0]["t"]["values"]), saved
    return saved[0]


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("pair", ["ours_mp<-stock_mp", "ours_mp<-ours_mp"])
def test_trainer_model_parallel_extra_state_holding_a_tensor(runs, pair, mode):
    """Extra state ``{"n": 3, "t": tensor}`` in stock ModelParallelStrategy's DCP checkpoint, resumed under
    DistCheckpointModelParallelStrategy, and in ours resumed by ours, strict or not: ``set_extra_state`` gets the
    stored values exactly, as stock resuming its own checkpoint gets them."""
    stored = _stored(runs, ["stock_mp", "ours_mp"])
    stock = runs[f"xs/stock_mp<-stock_mp/{mode}"]
    assert stock == {"type": None, "got": stored, "logged_norm": False}, stock
    assert runs[f"xs/{pair}/{mode}"] == stock


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("pair", ["fabric_ours_mp<-fabric_stock_mp", "fabric_ours_mp<-fabric_ours_mp"])
def test_fabric_model_parallel_extra_state_holding_a_tensor(runs, pair, mode):
    """The same under Fabric: stock ModelParallelStrategy's ``fabric.save`` and ours, loaded by ours with
    ``strict`` True and False: the stored values, as stock loads its own."""
    stored = _stored(runs, ["fabric_stock_mp", "fabric_ours_mp"])
    stock = runs[f"xs/fabric_stock_mp<-fabric_stock_mp/{mode}"]
    assert stock == {"type": None, "got": stored, "logged_norm": False}, stock
    assert runs[f"xs/{pair}/{mode}"] == stock


GROUP = "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"


def _resumed(outcome, state):
    """A non-strict fit that resumed: the kept layers' weights and optimizer ``state`` restored bit-exact."""
    assert outcome["type"] is None, outcome
    assert outcome["restored"] == KEPT and outcome["fresh"] == [], outcome
    assert outcome["state_restored"] == state and outcome["state_other"] == [], outcome


def test_a_non_strict_fit_whose_saved_param_groups_no_longer_fit_under_ddp(runs):
    """``strict_loading = False`` fit of a checkpoint whose removed layer's parameters were in the optimizer (AdamW,
    SGD). Stock DDP: refused by torch's ``optimizer.load_state_dict`` (the saved group is larger). Ours
    (DistCheckpointStrategy): resumes, the weights and the kept parameters' state restored by name, the saved
    groups' hyper-parameters, the removed layer's entries logged and skipped."""
    for opt, state in (("", ADAMW), ("_sgd", [])):
        assert runs[f"stock{opt}/removed_layer/lenient_fit"] == {"type": "ValueError", "message": GROUP}
        ours = runs[f"ours{opt}/removed_layer/lenient_fit"]
        _resumed(ours, state)
        assert ours["logged_norm"], ours


def test_a_non_strict_fit_whose_saved_param_groups_no_longer_fit_under_model_parallel(runs):
    """The same under the ModelParallel strategies, stock and ours alike (torch's ``set_optimizer_state_dict``
    decides): with AdamW (state by name) both resume, the kept state restored; with SGD (no per-parameter state)
    both are refused by torch's group-size check (ours agreed over the ranks, naming no key)."""
    _resumed(runs["stock_mp/removed_layer/lenient_fit"], ADAMW)
    _resumed(runs["ours_mp/removed_layer/lenient_fit"], ADAMW)
    assert runs["ours_mp/removed_layer/lenient_fit"]["logged_norm"]
    assert runs["stock_mp_sgd/removed_layer/lenient_fit"] == {"type": "ValueError", "message": GROUP}
    ours = runs["ours_mp_sgd/removed_layer/lenient_fit"]
    assert ours["type"] == "CheckpointingError" and GROUP in ours["message"] and "norm." not in ours["message"], ours
