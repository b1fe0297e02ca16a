"""No false refusal by Lightning's strict loading under our strategies: the checkpoint's module weights the module
does not ask for are refused where stock refuses them, after the user's hooks.

Real 2-rank Trainer fits and Fabric runs (forked as torchrun would start them), beside stock DDP on the same
pair: saved by a module with a LayerNorm ``norm`` (not optimized: a frozen head), resumed by one without it
whose ``on_load_checkpoint`` drops (pop / del / a filtered dict) or whose ``load_state_dict`` pre-hook drops the
norm's weights. Stock applies those before its ``load_state_dict(strict=True)`` and resumes; so must we (before:
refused at the read, before the hooks ran). A callback's ``on_load_checkpoint`` runs after the module's load in
stock, so its drop does not save a strict resume there: refused by both.
"""


import pytest

from conformance.test_mismatch_errors_both_sides import _ours, _torchs
from script_ranks import agreed_outcomes

RUNS = '''import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from lightning.pytorch import Trainer, Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning_distckpt.lightning import DistCheckpointStrategy, FabricDistCheckpointStrategy
from lightning_helpers import SGDMLP, SmallMLP, full_weights

class Frozen(SGDMLP):
    """The norm is not optimized (a frozen head): the optimizer state fits a model without it."""
    def configure_optimizers(self):
        return torch.optim.SGD([p for n, p in self.named_parameters() if not n.startswith("norm")], lr=0.05)

def drop_norm(sd):
    for k in ("norm.weight", "norm.bias"):
        sd.pop(k, None)

class HookPop(Frozen):
    def on_load_checkpoint(self, checkpoint):
        drop_norm(checkpoint["state_dict"])

class HookDel(Frozen):
    def on_load_checkpoint(self, checkpoint):
        del checkpoint["state_dict"]["norm.weight"], checkpoint["state_dict"]["norm.bias"]

class HookFilter(Frozen):
    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("norm.")}

class PreHook(Frozen):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_load_state_dict_pre_hook(lambda m, sd, *a: drop_norm(sd))

class CbPop(Callback):
    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        drop_norm(checkpoint["state_dict"])

from script_ranks import outcome, write_outcomes

root, out = sys.argv[1], sys.argv[2]
res = {}
def trainer(strategy, callbacks=()):
    return Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                   strategy=strategy, callbacks=list(callbacks))
STRATEGIES = {"stock": lambda: DDPStrategy(), "ours": lambda: DistCheckpointStrategy(),
              "ours_tp2": lambda: DistCheckpointStrategy(tensor_parallel_size=2)}
for kind, strategy in STRATEGIES.items():
    ck = os.path.join(root, kind + ".ckpt")
    t = Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, strategy=strategy())
    saved = Frozen(extra_layer=True)
    t.fit(saved)
    t.save_checkpoint(ck)
    want = {k: v.tolist() for k, v in full_weights(saved).items()}
    for case, cls, cbs in (("plain", Frozen, []), ("hook_pop", HookPop, []), ("hook_del", HookDel, []),
                           ("hook_filter", HookFilter, []), ("prehook", PreHook, []), ("cb_pop", Frozen, [CbPop()])):
        for how in (("fit", "test") if case in ("plain", "hook_pop") else ("test",)):
            def run():
                model = cls(extra_layer=False)
                tr = trainer(strategy(), cbs)
                if how == "fit":
                    tr.fit(model, ckpt_path=ck)
                    return {"step": tr.global_step}
                tr.test(model, ckpt_path=ck)
                got = {k: v.tolist() for k, v in full_weights(model).items()}
                return {"restored": all(got[k] == want[k] for k in got)}
            res[f"{kind}/{case}/{how}"] = outcome(run)

class Plain(torch.nn.Module):
    def __init__(self, extra, pre=False):
        super().__init__()
        self.mlp = SmallMLP()
        if extra:
            self.norm = torch.nn.LayerNorm(4)
        if pre:
            self.register_load_state_dict_pre_hook(lambda m, sd, *a: drop_norm(sd))
for kind, strategy in {"fabric": FabricDistCheckpointStrategy, "fabric_stock": FabricDDP}.items():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
    fabric.launch()
    ck = os.path.join(root, kind + "_ck")
    fabric.save(ck, {"model": fabric.setup_module(Plain(True))})
    load = lambda *a: {"rest": sorted(fabric.load(ck, {"model": fabric.setup_module(Plain(*a))}))}  # noqa: E731
    res[kind + "/prehook"] = outcome(lambda: load(False, True))
    res[kind + "/plain"] = outcome(lambda: load(False))
write_outcomes(out, res)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save-then-resume pair (one 2-rank run serves every test here)."""
    import lightning_distckpt
    print("lightning_distckpt from", lightning_distckpt.__file__)
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


NORM = {"norm.weight", "norm.bias"}
DROPS = [("hook_pop", "fit"), ("hook_pop", "test"), ("hook_del", "test"), ("hook_filter", "test"),
         ("prehook", "test")]


@pytest.mark.parametrize("case,how", DROPS)
@pytest.mark.parametrize("kind", ["stock", "ours", "ours_tp2"])
def test_a_hook_that_drops_the_removed_weights_resumes_as_stock(runs, kind, case, how):
    """on_load_checkpoint (pop, del, a filtered dict) or a load_state_dict pre-hook dropping the checkpoint's
    norm weights: stock resumes (fit goes on; test restores the saved weights); so do ours, at TP 1 and 2."""
    got = runs[f"{kind}/{case}/{how}"]
    assert got["type"] is None, got
    assert got == ({"type": None, "step": 2} if how == "fit" else {"type": None, "restored": True}), got


@pytest.mark.parametrize("case", ["plain", "cb_pop"])
@pytest.mark.parametrize("kind", ["ours", "ours_tp2"])
def test_without_a_module_hook_the_weights_are_still_refused_as_stock(runs, kind, case):
    """No hook, or a callback's on_load_checkpoint (which stock calls after the module's load): stock refuses
    the norm weights; ours too, on every rank, naming them, in the read's words (not loosened)."""
    for how in (("fit", "test") if case == "plain" else ("test",)):
        stock = runs[f"stock/{case}/{how}"]
        assert stock["type"] == "RuntimeError", stock
        assert _torchs(stock["message"], "Unexpected key(s) in state_dict") == NORM
        ours = runs[f"{kind}/{case}/{how}"]
        assert ours["type"] == "MissingKeysError", ours
        assert _ours(ours["message"], "Missing keys (for all ranks)") == NORM, ours
        assert "strict_loading=True" in ours["message"], ours


def test_fabric_load_honours_a_modules_pre_hook_as_stock(runs):
    """fabric.load(strict=True) of a module whose load_state_dict pre-hook drops the checkpoint's norm weights:
    stock Fabric DDP loads; ours too. Without the hook both refuse them."""
    assert runs["fabric_stock/prehook"] == {"type": None, "rest": []}
    assert runs["fabric/prehook"] == {"type": None, "rest": []}, runs["fabric/prehook"]
    assert runs["fabric_stock/plain"]["type"] == "RuntimeError"
    ours = runs["fabric/plain"]
    assert ours["type"] == "MissingKeysError", ours
    assert _ours(ours["message"], "Missing keys (for all ranks)") == {"model." + k for k in NORM}, ours
