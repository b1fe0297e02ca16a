"""A module's extra state holding tensors (``get_extra_state()`` returning ``{"n": 5, "t": tensor, "more": [...]}``),
resumed from a stock checkpoint file, restores the stored values bit-exact, as stock does.

Stock stores such a tensor by its tree path (``state_dict/sub._extra_state/t`` in a Trainer's ``.ckpt``,
``model/sub._extra_state/t`` in ``fabric.save``'s file) and hands ``set_extra_state`` the stored one. Before,
our read of a stock file asked only for the module's ShardedTensors: the nested tensor went unread, so a strict
resume refused it as an unused weight and ``strict_loading = False`` silently gave ``set_extra_state`` the
module's own fresh tensor. One real 2-rank run (forked as torchrun would start them) saves with stock DDP (Trainer
and Fabric), our strategy and the plugin, then restores each way beside stock DDP restoring the stock file:
Trainer under DistCheckpointStrategy (TP 1, TP 2), DDP + DistCheckpointIO (Lightning's own load_state_dict),
FabricDistCheckpointStrategy; strict and not; a dict extra state and a bare tensor one.
"""


import pytest

from script_ranks import agreed_outcomes

RUNS = r'''import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from torch import nn
from torch.utils.data import DataLoader
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch import Trainer, LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, FabricDistCheckpointStrategy
from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of

class XS(nn.Module):
    """Extra state: a dict holding tensors of four dtypes (in a list, a nested dict; one 0-d), or a bare tensor."""
    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(4, 4)
        self.set_values(0)
    def set_values(self, n):
        g = torch.Generator().manual_seed(n)
        self.n = n
        self.t = torch.randn(3, generator=g) if n else torch.zeros(3)  # bits a rounding would change
        self.u = torch.arange(2, dtype=torch.int64) + n
        self.v = torch.randn(2, 2, generator=g, dtype=torch.float64) if n else torch.zeros(2, 2, dtype=torch.float64)
        self.s = torch.tensor(n * 1.5, dtype=torch.bfloat16)  # 0-d, a dtype of its own
    def get_extra_state(self):
        if self.kind == "tensor":
            return self.t
        return {"n": self.n, "t": self.t, "more": [self.u, {"v": self.v, "s": self.s}]}
    def set_extra_state(self, s):
        self.got = s

class M(LightningModule):
    def __init__(self, kind, lenient=False):
        super().__init__()
        torch.manual_seed(0)
        self.sub = XS(kind)
        self.strict_loading = not lenient
    def training_step(self, b, i):
        self.sub.set_values(5)  # the same on every rank: what the saves store
        return self.sub.lin(b).sum()
    def train_dataloader(self):
        return DataLoader(torch.randn(8, 4), batch_size=2)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class TP(M):
    """Under TP 2 a module describes its tensors: here all replicated, the extra state too."""
    def sharded_state_dict(self, prefix=""):
        return module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)

def show(x):
    """A value as JSON, each tensor with its dtype and exact values (floats: their bits)."""
    if isinstance(x, torch.Tensor):
        ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
        bits = x.view(ints[x.dtype]) if x.is_floating_point() else x
        return {"dtype": str(x.dtype), "bits": bits.tolist()}
    if isinstance(x, dict):
        return {str(k): show(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [show(v) for v in x]
    return x

from script_ranks import write_outcomes

def outcome(call):
    try:
        return {"type": None, "got": show(call())}
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}

root, out = sys.argv[1], sys.argv[2]
res = {}
def trainer(strategy, plugin=False):
    return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, strategy=strategy,
                   plugins=[DistCheckpointIO()] if plugin else None)
SAVERS = {"stock": (DDPStrategy, False), "ours": (DistCheckpointStrategy, False), "plugin": (DDPStrategy, True)}
RESUMERS = {"stock": SAVERS["stock"], "ours": SAVERS["ours"], "plugin": SAVERS["plugin"],
            "ours_tp2": (lambda: DistCheckpointStrategy(tensor_parallel_size=2), False)}
for kind in ("dict", "tensor"):
    for saver, (strategy, plugin) in SAVERS.items():
        t = trainer(strategy(), plugin); t.fit(M(kind)); t.save_checkpoint(os.path.join(root, f"{kind}_{saver}.ckpt"))
        res[f"{kind}/saved_by_{saver}"] = show(t.lightning_module.sub.get_extra_state())
    for resumer, (strategy, plugin) in RESUMERS.items():
        for saver in {"stock", "ours" if "ours" in resumer else resumer, *(["plugin"] if resumer == "ours" else [])}:
            for lenient in (False, True):
                def resume():
                    m = (TP if resumer == "ours_tp2" else M)(kind, lenient)  # max_steps reached: nothing trained
                    trainer(strategy(), plugin).fit(m, ckpt_path=os.path.join(root, f"{kind}_{saver}.ckpt"))
                    return m.sub.got
                res[f"{kind}/{resumer}<-{saver}/{'lenient' if lenient else 'strict'}"] = outcome(resume)

class FM(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.sub = XS(kind)

for kind in ("dict", "tensor"):
    for writer, strategy in {"stock": FabricDDP, "ours": FabricDistCheckpointStrategy}.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        model = FM(kind)
        model.sub.set_values(5)
        fabric.save(os.path.join(root, f"{kind}_fabric_{writer}"), {"model": fabric.setup_module(model)})
    for reader, strategy in {"stock": FabricDDP, "ours": FabricDistCheckpointStrategy}.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        for saved in ("fabric_stock", "stock.ckpt"):  # fabric.save's file; a Trainer's file into one module
            path = os.path.join(root, f"{kind}_fabric_stock" if saved == "fabric_stock" else f"{kind}_stock.ckpt")
            for strict in (True, False):
                if saved == "stock.ckpt" and reader == "stock":
                    continue  # stock Fabric loads no Trainer file into a module
                def load():
                    model = FM(kind)
                    fabric.load(path, {"model": fabric.setup_module(model)}, strict=strict)
                    return model.sub.got
                res[f"{kind}/fabric_{reader}<-{saved}/{'strict' if strict else 'lenient'}"] = outcome(load)
        if reader == "ours":
            def own():
                model = FM(kind)
                fabric.load(os.path.join(root, f"{kind}_fabric_ours"), {"model": fabric.setup_module(model)})
                return model.sub.got
            res[f"{kind}/fabric_ours<-fabric_ours/strict"] = outcome(own)
write_outcomes(out, res)
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save / restore pair (one 2-rank run serves every test here)."""
    import lightning_distckpt
    print("lightning_distckpt from", lightning_distckpt.__file__)
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


def _stored(runs, kind):
    """What every saver stored (the same trained values), checked to differ from a fresh module's."""
    saved = runs[f"{kind}/saved_by_stock"]
    assert runs[f"{kind}/saved_by_ours"] == saved == runs[f"{kind}/saved_by_plugin"]
    tensor = saved if kind == "tensor" else saved["t"]
    assert (kind == "tensor" or saved["n"] == 5) and any(tensor["bits"]), saved  # trained, not a fresh module's
    return saved


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("resumer", ["ours", "ours_tp2", "plugin"])
@pytest.mark.parametrize("kind", ["dict", "tensor"])
def test_a_trainer_resume_of_a_stock_ckpt_restores_the_stored_extra_state(runs, kind, resumer, mode):
    """A stock DDP .ckpt resumed under DistCheckpointStrategy (TP 1, TP 2) or DDP + DistCheckpointIO, strict or
    not: set_extra_state gets the stored values (dtypes and bits), as under stock DDP. Before, for a dict holding
    tensors: strict refused 'state_dict/sub._extra_state/t' as unused, lenient gave the module's fresh zeros."""
    stock = runs[f"{kind}/stock<-stock/{mode}"]
    assert stock == {"type": None, "got": _stored(runs, kind)}, stock
    ours = runs[f"{kind}/{resumer}<-stock/{mode}"]
    assert ours == stock, (ours, stock)


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("pair", ["ours<-ours", "ours_tp2<-ours", "plugin<-plugin", "ours<-plugin"])
@pytest.mark.parametrize("kind", ["dict", "tensor"])
def test_a_resume_of_our_own_checkpoint_restores_the_stored_extra_state(runs, kind, pair, mode):
    """Our own checkpoints restore the same stored extra state as stock's file does: the strategy's directory
    resumed at TP 1 and TP 2, the plugin's by the plugin and by the strategy (stored by tree path, as stock's)."""
    got = runs[f"{kind}/{pair}/{mode}"]
    assert got == {"type": None, "got": _stored(runs, kind)}, got


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("kind", ["dict", "tensor"])
def test_a_fabric_load_of_a_stock_fabric_file_restores_the_stored_extra_state(runs, kind, mode):
    """fabric.load of stock Fabric DDP's fabric.save file into FabricDistCheckpointStrategy, strict or not: the
    stored extra state, as stock Fabric loads it (before: refused as unused, or the fresh tensors kept)."""
    stock = runs[f"{kind}/fabric_stock<-fabric_stock/{mode}"]
    assert stock == {"type": None, "got": _stored(runs, kind)}, stock
    assert runs[f"{kind}/fabric_ours<-fabric_stock/{mode}"] == stock
    assert runs[f"{kind}/fabric_ours<-fabric_ours/strict"] == stock  # our own fabric.save alike


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("kind", ["dict", "tensor"])
def test_a_fabric_load_of_a_stock_trainer_file_restores_the_stored_extra_state(runs, kind, mode):
    """fabric.load of a stock Trainer .ckpt into a Fabric state's one module (its state_dict read into the module):
    the stored extra state too, as a Trainer resume of that file gets it."""
    got = runs[f"{kind}/fabric_ours<-stock.ckpt/{mode}"]
    assert got == {"type": None, "got": _stored(runs, kind)}, got
