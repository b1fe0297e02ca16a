"""Three edges of the placeholders a module's weights leave for its ``load_state_dict`` (lightning/unused_weights.py),
beside stock DDP where stock applies.

One real 2-rank run (forked as torchrun would start them), every rank's outcome compared:

1. A module whose ``sharded_state_dict()`` leaves out a frozen layer its ``state_dict()`` has, resumed non-strict
   (Trainer ``strict_loading = False``, ``fabric.load(..., strict=False)``) from a stock file and from our own
   checkpoint (saved by the same module describing the layer): ours keeps the module's own frozen values, warning
   once with their names; stock loads the stored ones.
2. ``fabric.load(..., strict=False)`` of a checkpoint with a layer the module lacks: one warning naming its keys in
   Fabric's words; the Trainer's (``strict_loading = False``) as it was.
3. A resume from the node-local tier whose ``load_state_dict`` pre-hook renames the saved layer (``norm.*`` ->
   ``post.*``): restored as the durable resume of the same step restores it (the saved values), strict or not
   (was: strict refused by the read before the hooks ran, each rank naming its own copy; non-strict kept the fresh
   layer, silently).
"""

import textwrap

import pytest

from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import logging, os, re, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from lightning.fabric import Fabric
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    import lightning_distckpt
    from lightning_distckpt.lightning import DistCheckpointStrategy, FabricDistCheckpointStrategy
    from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of
    from lightning_distckpt.lightning.tiers import tier_callback
    from script_ranks import outcome, write_outcomes
    from tier_parity_scripts import GROUP_TIMEOUT_S, dist_strategy, last, tier_config

    class Said(logging.Handler):
        """The package's log lines of level WARNING and above (what a user sees), kept to be read by each case."""
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []
        def emit(self, record):
            self.lines.append(record.getMessage())
    SAID = Said()
    logging.getLogger("lightning_distckpt").addHandler(SAID)

    def rename(sd, prefix=""):
        for key in [k for k in sd if k.startswith(prefix + "norm.")]:
            sd[prefix + "post." + key[len(prefix + "norm."):]] = sd.pop(key)

    def build(module, layers, leave_out, marked):
        """Layers in order (fc, frozen, b: Linear 4 -> 4; norm, post: LayerNorm 4), seeded; ``frozen`` frozen;
        ``marked``: the saved module's values unlike a fresh one's (frozen ones included)."""
        torch.manual_seed(0)
        for n in layers:
            setattr(module, n, nn.LayerNorm(4) if n in ("norm", "post") else nn.Linear(4, 4))
        if "frozen" in layers:
            module.frozen.requires_grad_(False)
        if marked:
            torch.manual_seed(7)
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_(torch.randn_like(p))
        module.layers, module.leave_out = layers, leave_out

    def ssd(module, prefix):
        """The module's ShardedTensors (replicated), without the layers it leaves out."""
        sd = module_sharded_state_dict(module, prefix, replica_id=parallel_state_of(module).replicated_id)
        return {k: v for k, v in sd.items() if k[len(prefix):].split(".")[0] not in module.leave_out}

    class Mod(LightningModule):
        def __init__(self, layers, leave_out=(), marked=False, strict=True, hook=False):
            super().__init__()
            build(self, layers, leave_out, marked)
            self.strict_loading = strict
            if hook:
                self._register_load_state_dict_pre_hook(lambda sd, prefix, *a: rename(sd, prefix))
        def sharded_state_dict(self, prefix=""):
            return ssd(self, prefix)
        def forward(self, x):
            for n in self.layers:
                x = getattr(self, n)(x)
            return x
        def training_step(self, b, i):
            return self(b).sum()
        def test_step(self, b, i):
            pass
        def train_dataloader(self):
            return DataLoader(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), batch_size=2)
        test_dataloader = train_dataloader
        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    class Net(nn.Module):
        def __init__(self, layers, leave_out=(), marked=False):
            super().__init__()
            build(self, layers, leave_out, marked)
        def sharded_state_dict(self, prefix=""):
            return ssd(self, prefix)

    def values(module):
        return {k: v.tolist() for k, v in module.state_dict().items()}

    def said_since(start):
        return SAID.lines[start:]

    root, out = sys.argv[1], sys.argv[2]
    res = {"package": os.path.dirname(lightning_distckpt.__file__)}
    FROZEN, EXTRA = ("fc", "frozen"), ("fc", "b")
    res["fresh_frozen"] = {k: v for k, v in values(Net(FROZEN)).items() if k.startswith("frozen.")}
    res["saved_frozen"] = {k: v for k, v in values(Net(FROZEN, marked=True)).items() if k.startswith("frozen.")}

    # ---------------------------------------------------------------- Fabric: frozen left out; unused weights
    FABRICS = {"stock": lambda: "ddp", "ours": lambda: FabricDistCheckpointStrategy()}
    for kind, strategy in FABRICS.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        for name, layers in (("frozen", FROZEN), ("extra", EXTRA)):
            fabric.save(os.path.join(root, f"fabric_{kind}_{name}"),
                        {"model": fabric.setup_module(Net(layers, marked=True))})
        for writer in ("stock", "ours") if kind == "ours" else ("stock",):
            def load(name, layers, leave_out, strict=False):
                model = Net(layers, leave_out)
                start = len(SAID.lines)
                fabric.load(os.path.join(root, f"fabric_{writer}_{name}"), {"model": fabric.setup_module(model)},
                            strict=strict)
                return {"values": values(model), "said": said_since(start)}
            res[f"fabric/{kind}<-{writer}/frozen"] = outcome(lambda: load("frozen", FROZEN, ("frozen",)))
            res[f"fabric/{kind}<-{writer}/frozen_strict"] = outcome(lambda: load("frozen", FROZEN, ("frozen",), True))
            res[f"fabric/{kind}<-{writer}/extra"] = outcome(lambda: load("extra", ("fc",), ()))

    # ---------------------------------------------------------------- Trainer: frozen left out; unused weights
    def trainer(strategy, where=root):
        return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=where,
                       strategy=strategy, num_sanity_val_steps=0)
    TRAINERS = {"stock": lambda: DDPStrategy(), "ours": lambda: dist_strategy("ddp")}
    for kind, strategy in TRAINERS.items():
        for name, layers in (("frozen", FROZEN), ("extra", EXTRA)):
            t = trainer(strategy())
            t.fit(Mod(layers, marked=True))
            t.save_checkpoint(os.path.join(root, f"trainer_{kind}_{name}.ckpt"))
    for kind, strategy in TRAINERS.items():
        for writer in ("stock", "ours") if kind == "ours" else ("stock",):
            def resume(name, layers, leave_out):
                model = Mod(layers, leave_out, strict=False)
                start = len(SAID.lines)
                t = trainer(strategy())  # extra: test, as stock's fit fails on the saved optimizer's extra params
                ck = os.path.join(root, f"trainer_{writer}_{name}.ckpt")
                (t.fit if name == "frozen" else t.test)(model, ckpt_path=ck)
                return {"values": values(model), "said": said_since(start)}
            res[f"trainer/{kind}<-{writer}/frozen"] = outcome(lambda: resume("frozen", FROZEN, ("frozen",)))
            res[f"trainer/{kind}<-{writer}/extra"] = outcome(lambda: resume("extra", ("fc",), ()))

    # ---------------------------------------------------------------- the local tier: a renaming pre-hook
    tiers = os.path.join(root, "tiers")
    saved = Mod(("fc", "norm"), marked=True)
    trainer(dist_strategy("ddp", tier_config(tiers, durable=1)), tiers).fit(saved)  # step 1 local and durable
    res["tier/saved"] = {k.replace("norm.", "post."): v for k, v in values(saved).items()}
    for strict in (True, False):
        for how, ckpt_path, config in (("durable", last(tiers), None), ("tier", "last", tier_config(tiers, 1))):
            def resume_renamed():
                model = Mod(("fc", "post"), strict=strict, hook=True)
                t = trainer(dist_strategy("ddp", config), tiers)
                t.fit(model, ckpt_path=ckpt_path)
                cb = tier_callback(t)
                point = cb.local_tier.last_point if cb is not None and cb.local_tier is not None else None
                return {"values": values(model), "point": None if point is None else [point.step, point.source]}
            got = outcome(resume_renamed)
            if "message" in got:  # each rank may name its own node's copy: the rest of the words compared
                got["message"] = re.sub(r"/node\\d/", "/node?/", got["message"])
            res[f"tier/{how}/{'strict' if strict else 'lenient'}"] = got
    write_outcomes(out, res)
''')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save / load pair (one 2-rank run serves every test here)."""
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


def test_the_runs_used_this_trees_package(runs):
    """Where the ranks imported lightning_distckpt from (the old copy when run with PYTHONPATH set to it)."""
    assert runs["package"].endswith("lightning_distckpt"), runs["package"]
    print("lightning_distckpt from", runs["package"])


def _frozen(got: dict) -> dict:
    return {k: v for k, v in got["values"].items() if k.startswith("frozen.")}


@pytest.mark.parametrize("side", ["trainer", "fabric"])
@pytest.mark.parametrize("writer", ["stock", "ours"])
def test_a_frozen_layer_left_out_keeps_the_modules_own_values_non_strict(runs, side, writer):
    """strict_loading = False / fabric.load(strict=False), a frozen layer the module's sharded_state_dict() leaves
    out (its state_dict() has it): both ranks complete; the frozen values are exactly the module's own (never the
    stored ones, never a meta copy), the rest the stored values as stock loads them; one warning names the layer's
    keys. Stock DDP loads the stored frozen values (the difference the warning is for)."""
    assert runs["fresh_frozen"] != runs["saved_frozen"]
    stock = runs[f"{side}/stock<-stock/frozen"]
    assert stock["type"] is None and _frozen(stock) == runs["saved_frozen"], stock
    ours = runs[f"{side}/ours<-{writer}/frozen"]
    assert ours["type"] is None, ours
    assert _frozen(ours) == runs["fresh_frozen"], ours
    fc = {k: v for k, v in ours["values"].items() if k.startswith("fc.")}
    assert fc == {k: v for k, v in stock["values"].items() if k.startswith("fc.")}, (fc, stock)
    naming = [line for line in ours["said"] if "frozen.weight" in line]
    assert len(naming) == 1, ours["said"]
    assert "['frozen.bias', 'frozen.weight'] keep their own values" in naming[0], naming


@pytest.mark.parametrize("writer", ["stock", "ours"])
def test_fabric_strict_refuses_a_frozen_layer_left_out(runs, writer):
    """fabric.load(strict=True) of the same: refused on both ranks naming the layer and the way out (stock loads the
    stored values); the non-strict load above is what the message offers."""
    assert runs["fabric/stock<-stock/frozen_strict"]["type"] is None
    ours = runs[f"fabric/ours<-{writer}/frozen_strict"]
    assert ours["type"] == "MissingKeysError", ours
    assert "Net.sharded_state_dict() leaves out ['frozen.bias', 'frozen.weight']" in ours["message"], ours
    assert "fabric.load(..., strict=False)" in ours["message"], ours


def test_fabric_non_strict_unused_weights_are_one_line_in_fabrics_words(runs):
    """fabric.load(strict=False) of a checkpoint whose layer b the module lacks: the rest loaded as stock loads it,
    and b's keys named in one warning, which says fabric.load(..., strict=False) (was: two lines, the read's and
    one saying strict_loading = False, a Trainer word)."""
    stock = runs["fabric/stock<-stock/extra"]
    for writer in ("stock", "ours"):
        ours = runs[f"fabric/ours<-{writer}/extra"]
        assert ours["type"] is None and ours["values"] == stock["values"], (ours, stock)
        naming = [line for line in ours["said"] if "b.weight" in line]
        assert len(naming) == 1, ours["said"]
        assert "fabric.load(..., strict=False)" in naming[0] and "strict_loading" not in naming[0], naming


def test_trainer_non_strict_unused_weights_still_say_strict_loading(runs):
    """The Trainer's non-strict resume of the same layout keeps its wording (strict_loading = False), one line."""
    stock = runs["trainer/stock<-stock/extra"]
    for writer in ("stock", "ours"):
        ours = runs[f"trainer/ours<-{writer}/extra"]
        assert ours["type"] is None and ours["values"] == stock["values"], (ours, stock)
        naming = [line for line in ours["said"] if "b.weight" in line]
        assert len(naming) == 1 and "strict_loading = False" in naming[0], ours["said"]


@pytest.mark.parametrize("strict", ["strict", "lenient"])
def test_a_tier_resume_with_a_renaming_hook_restores_as_the_durable_one(runs, strict):
    """A local-tier resume (fit(ckpt_path="last")) of a module whose load_state_dict pre-hook renames the saved
    norm.* onto post.*: every weight is the saved one, as the durable resume of the same step restores it."""
    durable, tier = runs[f"tier/durable/{strict}"], runs[f"tier/tier/{strict}"]
    assert durable == {"type": None, "values": runs["tier/saved"], "point": None}, durable
    assert tier == {**durable, "point": [1, "local"]}, tier
