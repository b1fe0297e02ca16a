"""What a non-strict load with a renaming hook tells the user about the renamed layer, beside stock DDP.

Real 2-rank runs (forked as torchrun would start them), every rank's outcome compared. A module saved with a
LayerNorm ``norm`` is loaded non-strict (Trainer ``strict_loading = False``, ``fabric.load(..., strict=False)``,
a resume from the node-local tier) by one whose LayerNorm is ``post``, the saved keys renamed ``norm.*`` ->
``post.*`` by (ckpt) ``on_load_checkpoint``, (pre) a ``load_state_dict`` pre-hook, (half) a pre-hook renaming
``norm.weight`` only, (none) nothing. Every warning or log record of any logger, and every Python warning, that
names one of the layer's keys is kept.

Stock DDP (Trainer and Fabric) says nothing about those keys: torch's ``load_state_dict(strict=False)`` returns
its lists and Lightning drops them. Ours names what is true once the hooks ran: the module's keys no hook filled
(which keep their own values) and the checkpoint's weights left unused, in one line in the caller's words; the
keys a hook filled are not named (before: the read logged them "not found in the checkpoint" in Megatron-Core's
words before any hook ran, so the user was told a layer was not loaded when it was, and the unused weights came
in a second line).
"""

import re
import textwrap

import pytest

from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import logging, os, re, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy
    import lightning_distckpt
    from lightning_distckpt.lightning import DistCheckpointStrategy, FabricDistCheckpointStrategy
    from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of
    from lightning_helpers import SGDMLP, full_weights
    from script_ranks import outcome, write_outcomes
    from tier_parity_scripts import dist_strategy, last, tier_config

    LAYER = re.compile(r"(norm|post|new)[.](weight|bias)")

    class Said(logging.Handler):
        """Every log record of level WARNING and above naming one of the layer's keys (what a user is told)."""
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []
        def emit(self, record):
            if LAYER.search(record.getMessage()):
                self.lines.append(record.getMessage())
    SAID = Said()
    # the root logger, and Lightning's own, which do not propagate to it
    for name in ("", "lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).addHandler(SAID)

    def told(call):
        """call()'s outcome with ``said``: the log records and Python warnings naming the layer's keys."""
        start = len(SAID.lines)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = call()
        said = SAID.lines[start:] + [str(w.message) for w in caught if LAYER.search(str(w.message))]
        return {**got, "said": said}

    def rename(sd, prefix="", only=None):
        for key in [k for k in sd if k.startswith(prefix + "norm.")]:
            if only is None or key == prefix + only:
                sd[prefix + "post." + key[len(prefix + "norm."):]] = sd.pop(key)

    def add_hook(module, hook):
        if hook == "pre":
            module._register_load_state_dict_pre_hook(lambda sd, prefix, *a: rename(sd, prefix))
        if hook == "public":
            module.register_load_state_dict_pre_hook(lambda m, sd, prefix, *a: rename(sd, prefix))
        if hook == "half":  # norm.weight renamed, norm.bias left as it was
            module._register_load_state_dict_pre_hook(lambda sd, prefix, *a: rename(sd, prefix, "norm.weight"))

    def compared(got, want):
        assert set(got) == set(want), (sorted(got), sorted(want))
        return {"restored": sorted(k for k in got if got[k] == want[k])}

    root, out = sys.argv[1], sys.argv[2]
    res = {"package": os.path.dirname(lightning_distckpt.__file__)}

    # ---------------------------------------------------------------- Trainer
    class Renamed(SGDMLP):
        """SGDMLP whose LayerNorm after fc2 is ``post`` (saved as ``norm``), the saved keys renamed by ``hook``."""
        def __init__(self, hook="none", **kw):
            super().__init__(**kw)
            self.hook = hook
            self.strict_loading = False
            add_hook(self, hook)

        def configure_model(self):
            if self.fc1 is None:
                super().configure_model()
                self.post = nn.LayerNorm(self.hparams.d_out)

        def forward(self, x):
            return self.post(super().forward(x))

        def on_load_checkpoint(self, checkpoint):
            if self.hook == "ckpt":
                rename(checkpoint["state_dict"])

    def trainer(strategy, where=root):
        return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=where,
                       strategy=strategy, num_sanity_val_steps=0)

    TRAINERS = {"stock": lambda: DDPStrategy(), "ours": lambda: DistCheckpointStrategy(),
                "ours_tp2": lambda: DistCheckpointStrategy(tensor_parallel_size=2)}
    for kind, strategy in TRAINERS.items():
        ck = os.path.join(root, kind + ".ckpt")
        t = trainer(strategy())
        saved = SGDMLP(extra_layer=True)
        t.fit(saved)
        t.save_checkpoint(ck)
        want = {k.replace("norm.", "post."): v.tolist() for k, v in full_weights(saved).items()}

        def resume(hook):
            model = Renamed(hook)
            trainer(strategy()).fit(model, ckpt_path=ck)  # max_steps=1 reached: nothing trained after the restore
            return compared({k: v.tolist() for k, v in full_weights(model).items()}, want)
        for hook in ("ckpt", "pre", "half", "none") if kind != "ours_tp2" else ("pre", "none"):
            res[f"trainer/{kind}/{hook}"] = outcome(lambda: told(lambda: resume(hook)))

    # ---------------------------------------------------------------- Fabric
    class Net(nn.Module):
        """fc, then a LayerNorm ``norm`` (saved) or ``post`` (loaded, renamed by ``hook``); ``extra``: a Linear
        the saved module lacks (nothing in the checkpoint can fill it)."""
        def __init__(self, norm, hook="none", extra=False, marked=False):
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 4)
            setattr(self, norm, nn.LayerNorm(4))
            if extra:
                self.new = nn.Linear(4, 4)
            if marked:  # saved values unlike the fresh ones, the same on every rank
                torch.manual_seed(7)
                with torch.no_grad():
                    for p in self.parameters():
                        p.copy_(torch.randn_like(p))
            add_hook(self, hook)

        def sharded_state_dict(self, prefix=""):
            return module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)

    def values(module):
        return {k: v.tolist() for k, v in module.state_dict().items()}

    FABRICS = {"stock": lambda: "ddp", "ours": lambda: FabricDistCheckpointStrategy(),
               "ours_tp2": lambda: FabricDistCheckpointStrategy(tensor_parallel_size=2)}
    for kind, strategy in FABRICS.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        path = os.path.join(root, f"fabric_{kind}")
        saved = {"model": Net("norm", marked=True), "other": Net("post", marked=True)}
        fabric.save(path, {n: fabric.setup_module(m) for n, m in saved.items()})
        wants = {n: {k.replace("norm.", "post."): v for k, v in values(m).items()} for n, m in saved.items()}

        def load(hook, extra=False, other=False, strict=False):
            """model: renamed by ``hook``; with ``extra``, other too, which has a layer ``new`` the
            checkpoint lacks; with ``other``, other as saved."""
            state = {"model": Net("post", hook)}
            if extra or other:
                state["other"] = Net("post", extra=extra)
            fabric.load(path, {n: fabric.setup_module(m) for n, m in state.items()}, strict=strict)
            return {n: compared({k: v for k, v in values(m).items() if not k.startswith("new.")}, wants[n])
                    for n, m in state.items()}
        for hook in ("public", "half", "none"):
            res[f"fabric/{kind}/{hook}"] = outcome(lambda: told(lambda: load(hook)))
        res[f"fabric/{kind}/extra"] = outcome(lambda: told(lambda: load("public", extra=True)))
        for strict in (True, False):
            res[f"fabric/{kind}/two/{strict}"] = outcome(lambda: told(lambda: load("public", other=True,
                                                                                   strict=strict)))

    # ---------------------------------------------------------------- the node-local tier
    tiers = os.path.join(root, "tiers")
    saved = SGDMLP(extra_layer=True)
    trainer(dist_strategy("ddp", tier_config(tiers, durable=1)), tiers).fit(saved)  # step 1 local and durable
    want = {k.replace("norm.", "post."): v.tolist() for k, v in full_weights(saved).items()}
    for how, ckpt_path, config in (("durable", last(tiers), None), ("tier", "last", tier_config(tiers, 1))):
        for hook in ("pre", "none"):
            def resume_tier():
                model = Renamed(hook)
                trainer(dist_strategy("ddp", config), tiers).fit(model, ckpt_path=ckpt_path)
                return compared({k: v.tolist() for k, v in full_weights(model).items()}, want)
            res[f"tier/{how}/{hook}"] = outcome(lambda: told(resume_tier))
    write_outcomes(out, res)
''')

TRAINER_ALL = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "post.bias", "post.weight"]
FABRIC_ALL = ["fc.bias", "fc.weight", "post.bias", "post.weight"]
WORDS = {"trainer": "strict_loading = False", "tier": "strict_loading = False",
         "fabric": "fabric.load(..., strict=False)"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save-then-load (one 2-rank run serves every test here)."""
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


def _naming(said, key):
    """The lines of ``said`` that name the module key or stored key ``key`` (``post.weight`` is not
    ``post.weight_extra``; ``model.post.weight`` and ``state_dict.post.weight`` name it)."""
    return [line for line in said if re.search(rf"(^|[^\w]){re.escape(key)}(?![\w])", line)]


def test_the_runs_used_this_trees_package(runs):
    """Where the ranks imported lightning_distckpt from (the old copy when run with PYTHONPATH set to it)."""
    assert runs["package"].endswith("lightning_distckpt"), runs["package"]
    print("lightning_distckpt from", runs["package"])


@pytest.mark.parametrize("where,hook", [("trainer", "ckpt"), ("trainer", "pre"), ("fabric", "public")])
def test_stock_says_nothing_of_the_renamed_layer(runs, where, hook):
    """What a stock user sees of the renamed layer under a non-strict load: nothing, and the saved values."""
    every = TRAINER_ALL if where == "trainer" else FABRIC_ALL
    got = runs[f"{where}/stock/{hook}"]
    restored = got.get("restored") if where == "trainer" else got.get("model", {}).get("restored")
    assert got["type"] is None and restored == every and got["said"] == [], got


@pytest.mark.parametrize("where,hook", [("trainer/ours", "ckpt"), ("trainer/ours", "pre"),
                                        ("trainer/ours_tp2", "pre"), ("fabric/ours", "public"),
                                        ("fabric/ours_tp2", "public"), ("tier/durable", "pre"),
                                        ("tier/tier", "pre")])
def test_a_layer_a_hook_renamed_is_not_named_as_stock(runs, where, hook):
    """A hook renamed every saved key of the layer onto the module's: the saved values are loaded and nothing
    names the layer, as stock (before: its post.* were logged "not found in the checkpoint" before the hook ran)."""
    got = runs[f"{where}/{hook}"]
    assert got["type"] is None, got
    restored = got["model"]["restored"] if where.startswith("fabric") else got["restored"]
    assert restored == (FABRIC_ALL if where.startswith("fabric") else TRAINER_ALL), got
    assert got["said"] == [], got


@pytest.mark.parametrize("where", ["trainer/ours", "trainer/ours_tp2", "fabric/ours", "fabric/ours_tp2",
                                   "tier/durable", "tier/tier"])
def test_a_layer_no_hook_renamed_is_named_once_in_the_callers_words(runs, where):
    """No rename: the rest is loaded as stock loads it, the layer keeps its fresh values; one line names the
    module's post.* (not in the checkpoint, kept) and the checkpoint's norm.* (left unused), saying the caller's
    non-strict load (before: two lines, post.* in Megatron-Core's "Unexpected keys" words, from the read)."""
    got = runs[f"{where}/none"]
    assert got["type"] is None, got
    fabric = where.startswith("fabric")
    restored = got["model"]["restored"] if fabric else got["restored"]
    assert restored == (FABRIC_ALL if fabric else TRAINER_ALL)[:-2], got
    assert len(got["said"]) == 1, got
    line = got["said"][0]
    for key in ("post.weight", "post.bias", "norm.weight", "norm.bias"):
        assert _naming([line], key), (key, line)
    assert WORDS[where.split("/")[0]] in line, line
    if fabric:
        assert "strict_loading" not in line, line


@pytest.mark.parametrize("where", ["trainer/ours", "fabric/ours"])
def test_a_half_rename_names_only_what_no_hook_filled(runs, where):
    """A hook renaming norm.weight only: post.weight holds the saved value and is not named; post.bias (kept)
    and norm.bias (unused) are named in one line (stock: nothing, and the same values)."""
    fabric = where.startswith("fabric")
    every = FABRIC_ALL if fabric else TRAINER_ALL
    stock = runs[where.replace("ours", "stock") + "/half"]
    got = runs[f"{where}/half"]
    assert got["type"] is None and stock["type"] is None, (got, stock)
    pick = (lambda r: r["model"]["restored"]) if fabric else (lambda r: r["restored"])
    assert pick(got) == pick(stock) == [k for k in every if k != "post.bias"], (got, stock)
    assert stock["said"] == [], stock
    assert len(got["said"]) == 1, got
    line = got["said"][0]
    assert _naming([line], "post.bias") and _naming([line], "norm.bias"), line
    assert not _naming([line], "post.weight") and not _naming([line], "norm.weight"), line


def test_a_new_layer_of_another_module_is_named_once_and_the_renamed_one_not(runs):
    """fabric.load(strict=False) of two modules: model's layer renamed by its hook (loaded, not named); other's
    layer new (nothing in the checkpoint for it: kept fresh, named once, in Fabric's words). Stock: nothing."""
    stock = runs["fabric/stock/extra"]
    assert stock["type"] is None and stock["said"] == [], stock
    for kind in ("ours", "ours_tp2"):
        got = runs[f"fabric/{kind}/extra"]
        assert got["type"] is None, got
        assert got["model"]["restored"] == got["other"]["restored"] == FABRIC_ALL, got
        named = [line for line in got["said"] if "new.weight" in line or "new.bias" in line]
        assert len(named) == 1 and "new.weight" in named[0] and "new.bias" in named[0], got
        assert "fabric.load(..., strict=False)" in named[0], named
        assert not _naming(got["said"], "post.weight") and not _naming(got["said"], "norm.weight"), got


@pytest.mark.parametrize("strict", [True, False])
def test_a_renaming_hook_of_one_of_two_modules_loads_as_stock(runs, strict):
    """fabric.load of two modules, model's layer renamed by its hook, other as saved: both load the saved values,
    strict or not, and nothing names the layer, as stock (before: refused, strict or not, before any hook ran:
    model's norm.* were taken for other's weights without a name in it)."""
    stock = runs[f"fabric/stock/two/{strict}"]
    assert stock["type"] is None and stock["said"] == [], stock
    for kind in ("ours", "ours_tp2"):
        got = runs[f"fabric/{kind}/two/{strict}"]
        assert got == {"type": None, "model": {"restored": FABRIC_ALL}, "other": {"restored": FABRIC_ALL},
                       "said": []}, got
