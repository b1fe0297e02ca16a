"""A module's extra state that grew since the module was built, and the unused-weights refusal while a tier's
restore falls back to the durable checkpoint.

1. ``get_extra_state()`` returning tensors in containers whose shape changes with training: a per-step list of
   tensors (``hist``, longer in the checkpoint than in a fresh module), a list mixing a string and tensors, and a
   key added only after the first step (``late: {"t": tensor, "k": 7}``); also a module whose extra state is None
   until then. Stock DDP and stock Fabric hand ``set_extra_state`` exactly the stored value. Was: reading a
   tree-path checkpoint (a stock Trainer .ckpt, stock ``fabric.save``'s file, the plugin's directory) under
   DistCheckpointStrategy (TP 1, TP 2) or FabricDistCheckpointStrategy asked only for the tensors at places the
   fresh value had: strict refused the rest as unused weights (``state_dict/sub._extra_state/hist/1``: a refusal
   where stock loads), ``strict_loading = False`` handed ``set_extra_state`` the fresh list and ``None`` in the
   stored tensors' places (silently wrong). One 2-rank run saves and restores every way, beside stock.
2. ``fit(ckpt_path="last")`` under tiers whose every local copy is damaged falls back to the durable checkpoint
   while the local copy's refusal scope is set: it refuses and accepts exactly what ``ckpt_path=<that last.ckpt>``
   does (same words, same restored state), also where the durable step is older and its module keys differ from the
   local step's (a layer added by a lenient resume). 2 gloo processes as 2 simulated nodes, DistCheckpointStrategy
   and its ModelParallel subclass (FSDP2). No defect found there: these tests hold it.
"""

import re

import pytest

from script_ranks import agreed_outcomes
from tier_parity_scripts import run_trainer_script

EXTRA_RUNS = r'''import os, sys, warnings
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
from script_ranks import write_outcomes

class XS(nn.Module):
    """Extra state that grows: a per-step list of tensors, and a key added only after the first step
    (KIND "none_first": None before the first step, as a module with nothing to say yet returns)."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hist, self.late = [torch.zeros(2)], None
    def step(self, i):
        g = torch.Generator().manual_seed(i)
        self.hist.append(torch.randn(2, generator=g))
        self.late = torch.randn(3, generator=g, dtype=torch.float64)
    def get_extra_state(self):
        if KIND == "none_first" and self.late is None:
            return None
        s = {"n": len(self.hist), "hist": list(self.hist), "mixed": ["a"] + self.hist[1:]}
        if self.late is not None:
            s["late"] = {"t": self.late, "k": 7}
        return s
    def set_extra_state(self, s):
        self.got = s

class M(LightningModule):
    def __init__(self, lenient=False):
        super().__init__()
        torch.manual_seed(0)
        self.sub = XS()
        self.strict_loading = not lenient
    def training_step(self, b, i):
        self.sub.step(i + 1)
        return self.sub.lin(b).sum()
    def train_dataloader(self):
        return DataLoader(torch.randn(8, 4), batch_size=2)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class TP(M):
    def sharded_state_dict(self, prefix=""):
        return module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)

def show(x):
    if isinstance(x, torch.Tensor):
        ints = {torch.float64: torch.int64, torch.float32: torch.int32}
        return {"dtype": str(x.dtype), "bits": (x.view(ints[x.dtype]) if x.is_floating_point() else x).tolist()}
    if isinstance(x, dict):
        return {str(k): show(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [show(v) for v in x]
    return x

def outcome(call):
    try:
        return {"type": None, "got": show(call())}
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)[:600]}

root, out, KIND = sys.argv[1], sys.argv[2], sys.argv[3]
res = {}
def trainer(strategy, plugin=False, steps=3):
    return Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, strategy=strategy,
                   plugins=[DistCheckpointIO()] if plugin else None)
SAVERS = {"stock": (DDPStrategy, False), "ours": (DistCheckpointStrategy, False), "plugin": (DDPStrategy, True)}
RESUMERS = {"stock": SAVERS["stock"], "ours": SAVERS["ours"], "plugin": SAVERS["plugin"],
            "ours_tp2": (lambda: DistCheckpointStrategy(tensor_parallel_size=2), False)}
for saver, (strategy, plugin) in SAVERS.items():
    t = trainer(strategy(), plugin); t.fit(M()); t.save_checkpoint(os.path.join(root, f"{saver}.ckpt"))
    res[f"saved_by_{saver}"] = show(t.lightning_module.sub.get_extra_state())
for resumer, (strategy, plugin) in RESUMERS.items():
    for saver in SAVERS:
        for lenient in (False, True):
            def resume():
                m = (TP if resumer == "ours_tp2" else M)(lenient)
                trainer(strategy(), plugin).fit(m, ckpt_path=os.path.join(root, f"{saver}.ckpt"))
                return m.sub.got
            res[f"{resumer}<-{saver}/{'lenient' if lenient else 'strict'}"] = outcome(resume)

class FM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.sub = XS()
for writer, strategy in {"stock": FabricDDP, "ours": FabricDistCheckpointStrategy}.items():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
    fabric.launch()
    model = FM(); model.sub.step(1); model.sub.step(2); model.sub.step(3)
    fabric.save(os.path.join(root, f"fabric_{writer}"), {"model": fabric.setup_module(model)})
for reader, strategy in {"stock": FabricDDP, "ours": FabricDistCheckpointStrategy}.items():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
    fabric.launch()
    for saved in ("fabric_stock", "fabric_ours", "stock.ckpt"):
        for strict in (True, False):
            if reader == "stock" and saved != "fabric_stock":
                continue
            def load():
                model = FM()
                fabric.load(os.path.join(root, saved), {"model": fabric.setup_module(model)}, strict=strict)
                return model.sub.got
            res[f"fabric_{reader}<-{saved}/{'strict' if strict else 'lenient'}"] = outcome(load)
write_outcomes(out, res)
'''

FALLBACK_RUNS = r'''import shutil
import torch
import torch.distributed as dist
from torch import nn
from tier_parity_scripts import (Recorder, StepModule, dist_strategy, fit_trainer, last, overwrite_every_local_copy,
                                 tier_config)

from lightning_distckpt.lightning.tiers import tier_callback
POINT = []
folder, out, SCENARIO = sys.argv[1:4]
record = Recorder(out, rank)

class Layers(StepModule):
    def __init__(self, layers="ab", strict=True):
        super().__init__()
        torch.manual_seed(0)
        self.names = layers
        for n in layers:
            setattr(self, n, nn.Linear(3, 3))
        self.strict_loading, self.fsdp = strict, SCENARIO == "mp"
    def forward(self, x):
        return sum(getattr(self, n)(x) for n in self.names)
    def on_load_checkpoint(self, checkpoint):
        cb = tier_callback(self.trainer)
        point = cb.local_tier.last_point if cb is not None and cb.local_tier is not None else None
        POINT[:] = [] if point is None else [point.step, point.source]
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)

def fit(root, ckpt_path, layers, strict=True, tiers=True, steps=1, durable=None):
    POINT[:] = []
    strategy = dist_strategy(SCENARIO, tier_config(root, durable) if tiers else None)
    got = fit_trainer(Layers(layers, strict), root, steps, strategy, ckpt_path)
    got['point'] = list(POINT)
    return got

def copy_damaged(src, name, damage=True):
    """A copy of the run in src, every local copy damaged (rank 0 copies; both wait for it)."""
    dst = os.path.join(folder, name)
    if rank == 0:
        shutil.copytree(src, dst)
        if damage:
            overwrite_every_local_copy(dst)
    dist.barrier()
    return dst

saved = os.path.join(folder, "saved")
fit(saved, None, "ab", durable=1)  # step 1: local tier and durable last.ckpt, same keys
for layers, strict in (("a", True), ("a", False), ("ab", True)):
    tag = f"{layers} {'strict' if strict else 'lenient'}"
    record(f"durable {tag}", lambda: fit(copy_damaged(saved, f"d_{layers}_{strict}", False), last(saved), layers,
                                         strict, tiers=False))
    record(f"fallback {tag}", lambda: fit(copy_damaged(saved, f"f_{layers}_{strict}"), "last", layers, strict))
# local step 2 of "abc" (a lenient resume that added c), durable last.ckpt still step 1 of "ab"
grown = copy_damaged(saved, "grown", False)
record("grow", lambda: fit(grown, last(grown), "abc", strict=False, steps=2, durable=100))
for layers, strict in (("ab", True), ("abc", True), ("abc", False), ("a", True)):
    tag = f"{layers} {'strict' if strict else 'lenient'}"
    record(f"grown durable {tag}", lambda: fit(copy_damaged(grown, f"gd_{layers}_{strict}", False), last(grown),
                                               layers, strict, tiers=False))
    record(f"grown fallback {tag}", lambda: fit(copy_damaged(grown, f"gf_{layers}_{strict}"), "last", layers, strict))
'''


@pytest.fixture(scope="module", params=["grown", "none_first"])
def extra(request, tmp_path_factory):
    """Every save / restore pair's outcome (rank 0's, checked equal to rank 1's), for one kind of module."""
    import lightning_distckpt
    print("lightning_distckpt from", lightning_distckpt.__file__)
    return agreed_outcomes(str(tmp_path_factory.mktemp(request.param)), EXTRA_RUNS, request.param)


def _stored(extra):
    """What every saver stored: the grown value (4 history tensors, the late key), not a fresh module's."""
    saved = extra["saved_by_stock"]
    assert extra["saved_by_ours"] == saved == extra["saved_by_plugin"]
    assert len(saved["hist"]) == 4 and saved["late"]["k"] == 7 and saved["mixed"][0] == "a", saved
    return saved


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("pair", ["ours<-stock", "ours_tp2<-stock", "ours<-plugin", "ours_tp2<-plugin",
                                  "plugin<-stock", "ours<-ours", "ours_tp2<-ours", "plugin<-plugin"])
def test_a_trainer_resume_hands_set_extra_state_the_grown_stored_value(extra, pair, mode):
    """A resume of a stock .ckpt, the plugin's directory or our strategy's, strict or not: set_extra_state gets the
    stored value bit-exact (the longer list, the late key, the string beside tensors), as stock DDP does. Was, for
    the tree-path files under our strategy: strict refused 'state_dict/sub._extra_state/hist/1' as unused, lenient
    gave the fresh one-element list, ['a', None, None, None] and {'k': 7} without its tensor."""
    stock = extra[f"stock<-stock/{mode}"]
    assert stock == {"type": None, "got": _stored(extra)}, stock
    assert extra[f"{pair}/{mode}"] == stock, extra[f"{pair}/{mode}"]


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("saved", ["fabric_stock", "fabric_ours", "stock.ckpt"])
def test_a_fabric_load_hands_set_extra_state_the_grown_stored_value(extra, saved, mode):
    """fabric.load into FabricDistCheckpointStrategy of stock Fabric's file, ours, and a stock Trainer .ckpt (its
    state_dict into the module), strict or not: the stored value bit-exact, as stock Fabric loads its file."""
    stock = extra[f"fabric_stock<-fabric_stock/{mode}"]
    assert stock["type"] is None and len(stock["got"]["hist"]) == 4 and "t" in stock["got"]["late"], stock
    want = {"type": None, "got": _stored(extra)} if saved == "stock.ckpt" else stock
    assert extra[f"fabric_ours<-{saved}/{mode}"] == want, extra[f"fabric_ours<-{saved}/{mode}"]


@pytest.fixture(scope="module", params=["ddp", "mp"])
def fallback(request, tmp_path_factory):
    """Every rank's outcomes (Recorder's) under DistCheckpointStrategy ("ddp") or its ModelParallel subclass."""
    return run_trainer_script(tmp_path_factory.mktemp(f"fallback_{request.param}"), FALLBACK_RUNS, [request.param],
                              agreed=("ok", "CheckpointingError", "MissingKeysError"))


def _words(said: str) -> str:
    """An error's words without the run's copy it names (each case reads its own copy of last.ckpt)."""
    return re.sub(r"/ck/[^/]+/checkpoints/", "/ck/RUN/checkpoints/", said)


@pytest.mark.parametrize("case", ["a strict", "a lenient", "ab strict", "grown ab strict", "grown abc strict",
                                  "grown abc lenient", "grown a strict"])
def test_a_fallback_to_durable_refuses_and_loads_as_the_durable_resume(fallback, case):
    """Every local copy damaged: the tier's resume reads the durable last.ckpt (the point says so) and refuses or
    restores exactly what ckpt_path=<that last.ckpt> does, on both ranks: module 'a' refuses the stored 'b' (under
    DDP; FSDP2 reads what it asks for, as stock ModelParallelStrategy), 'abc' refuses the 'c' the older durable step
    lacks although the damaged local step had it, 'ab' restores the same state; never the local step's keys."""
    grown = case.startswith("grown ")
    layers = case[len("grown "):] if grown else case
    prefix = "grown " if grown else ""
    for res in fallback:
        durable, tier = res[f"{prefix}durable {layers}"], res[f"{prefix}fallback {layers}"]
        assert durable[0] == tier[0], (durable, tier)
        if tier[0] == "ok":
            assert tier[1]["point"] == [1, "durable"] and durable[1]["point"] == [], tier[1]["point"]
            assert tier[1]["state"] == durable[1]["state"]
        else:
            assert _words(tier[1]) == _words(durable[1]), (durable, tier)
    assert fallback[0]["grow"][0] == "ok"  # the local step 2 of 'abc' the grown cases start from was saved
    if case == "grown abc strict":
        assert fallback[0]["grown fallback abc strict"][0] == "MissingKeysError"
