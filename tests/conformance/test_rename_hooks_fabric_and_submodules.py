"""Keys renamed on load by ``load_state_dict`` pre-hooks under Fabric, and by a submodule's own pre-hook, beside stock.

Real 2-rank runs (forked as torchrun would start them). Fabric: a module saved with a LayerNorm ``norm`` (or a
submodule ``post`` whose parameters were ``gamma`` / ``beta``) by ``fabric.save``, loaded by ``fabric.load`` into a
module whose LayerNorm is ``post``, the saved keys renamed by (pre) a private pre-hook on the module, (public)
``register_load_state_dict_pre_hook`` on it, (child, child_public) a pre-hook on the submodule ``post``, which torch
hands only its own prefix's keys (``post.gamma`` -> ``post.weight``), (none) nothing; strict and not; stock Fabric
DDP, ours at TP 1 and 2. Trainer: the submodule's pre-hook on a resume (stock DDP, ours at TP 1 and 2). Where stock
loads the saved values under the new names, ours loads them bit-exact (read under their stored keys).
"""

import textwrap

import pytest

from conformance.test_mismatch_errors_both_sides import _sides, _torchs
from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy
    import lightning_distckpt
    from lightning_distckpt.lightning import DistCheckpointStrategy, FabricDistCheckpointStrategy
    from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of
    from lightning_helpers import SGDMLP, full_weights
    from script_ranks import outcome, write_outcomes

    RANK = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's subprocess launcher leaves rank 0's unset

    def rename(sd, old, new, prefix=""):
        for key in [k for k in sd if k.startswith(prefix + old)]:
            sd[prefix + new + key[len(prefix + old):]] = sd.pop(key)

    def rename_child(sd, prefix):  # within the submodule's own prefix: gamma/beta -> weight/bias
        rename(sd, "gamma", "weight", prefix)
        rename(sd, "beta", "bias", prefix)

    class OldNorm(torch.nn.Module):
        """The submodule's earlier version: its parameters named gamma and beta."""
        def __init__(self, d):
            super().__init__()
            self.gamma = torch.nn.Parameter(torch.ones(d))
            self.beta = torch.nn.Parameter(torch.zeros(d))
        def forward(self, x):
            return x * self.gamma + self.beta

    def add_hook(module, post, hook):
        """The rename hooks of each case, registered on the module or on its submodule post."""
        if hook == "pre":
            module._register_load_state_dict_pre_hook(lambda sd, prefix, *a: rename(sd, "norm.", "post.", prefix))
        if hook == "public":
            module.register_load_state_dict_pre_hook(lambda m, sd, prefix, *a: rename(sd, "norm.", "post.", prefix))
        if hook == "child" or (hook == "child_rank0" and RANK == 0):
            post._register_load_state_dict_pre_hook(lambda sd, prefix, *a: rename_child(sd, prefix))
        if hook == "child_public":
            post.register_load_state_dict_pre_hook(lambda m, sd, prefix, *a: rename_child(sd, prefix))

    class Net(torch.nn.Module):
        """fc then a norm: saved as ``norm`` (v1) or ``post`` with gamma/beta (old); loaded as ``post`` (v2)."""
        def __init__(self, version, hook="none"):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(4, 4)
            if version == "v1":
                self.norm = torch.nn.LayerNorm(4)
            else:
                self.post = OldNorm(4) if version == "old" else torch.nn.LayerNorm(4)
            if version != "v2":  # saved values unlike the fresh ones, the same on every rank
                torch.manual_seed(7)
                with torch.no_grad():
                    for p in self.parameters():
                        p.copy_(torch.randn_like(p))
            else:
                add_hook(self, self.post, hook)

        def sharded_state_dict(self, prefix=""):  # under TP 2 a module describes its tensors: all replicated here
            return module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)

    def values(module):
        return {k: v.tolist() for k, v in module.state_dict().items()}

    def renamed(saved):
        out = {}
        for k, v in values(saved).items():
            k = k.replace("norm.", "post.").replace("post.gamma", "post.weight").replace("post.beta", "post.bias")
            out[k] = v
        return out

    def compared(got, want):
        assert set(got) == set(want), (sorted(got), sorted(want))
        fresh = torch.nn.LayerNorm(4)
        return {"restored": sorted(k for k in got if got[k] == want[k]),
                "fresh_post": [got["post.weight"], got["post.bias"]] == [fresh.weight.tolist(), fresh.bias.tolist()]}

    root, out = sys.argv[1], sys.argv[2]
    res = {"package": os.path.dirname(lightning_distckpt.__file__)}
    FABRICS = {"stock": lambda: "ddp", "ours": lambda: FabricDistCheckpointStrategy(),
               "ours_tp2": lambda: FabricDistCheckpointStrategy(tensor_parallel_size=2)}
    for kind, strategy in FABRICS.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        wants = {}
        for version in ("v1", "old"):
            saved = Net(version)
            fabric.save(os.path.join(root, f"fabric_{kind}_{version}"), {"model": fabric.setup_module(saved)})
            wants[version] = renamed(saved)

        def load(hook, strict, writer=kind):
            version = "old" if hook.startswith("child") or hook == "none_child" else "v1"
            model = Net("v2", hook)
            fabric.load(os.path.join(root, f"fabric_{writer}_{version}"), {"model": fabric.setup_module(model)},
                        strict=strict)
            return compared(values(model), wants[version])
        hooks = ["pre", "public", "child", "child_public", "none", "none_child"]
        for hook in hooks + (["child_rank0"] if kind == "ours" else []):  # stock's rank 1 raises alone: not run
            for strict in (True, False):
                res[f"fabric/{kind}/{hook}/{'strict' if strict else 'lenient'}"] = outcome(lambda: load(hook, strict))
                if kind == "ours" and hook in ("pre", "child"):  # stock's torch.save file (the same saved values)
                    res[f"fabric/ours<-stock/{hook}/{'strict' if strict else 'lenient'}"] = outcome(
                        lambda: load(hook, strict, "stock"))

    class Renamed(SGDMLP):
        """SGDMLP and a norm post: saved as OldNorm (gamma, beta), resumed as a LayerNorm whose pre-hook renames."""
        def __init__(self, version, hook="none", **kw):
            super().__init__(**kw)
            self.version, self.hook = version, hook

        def configure_model(self):
            if self.fc1 is None:
                super().configure_model()
                self.post = OldNorm(self.hparams.d_out) if self.version == "old" else torch.nn.LayerNorm(
                    self.hparams.d_out)
                if self.version == "old":
                    with torch.no_grad():
                        torch.manual_seed(7)
                        self.post.gamma.copy_(torch.randn(self.hparams.d_out))
                        self.post.beta.copy_(torch.randn(self.hparams.d_out))
                else:
                    add_hook(self, self.post, self.hook)

        def forward(self, x):
            return self.post(super().forward(x))

    TRAINERS = {"stock": lambda: DDPStrategy(), "ours": lambda: DistCheckpointStrategy(),
                "ours_tp2": lambda: DistCheckpointStrategy(tensor_parallel_size=2)}

    def trainer(strategy):
        return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                       strategy=strategy)

    for kind, strategy in TRAINERS.items():
        ck = os.path.join(root, kind + ".ckpt")
        t = trainer(strategy())
        saved = Renamed("old")
        t.fit(saved)
        t.save_checkpoint(ck)
        want = {k.replace("post.gamma", "post.weight").replace("post.beta", "post.bias"): v.tolist()
                for k, v in full_weights(saved).items()}

        def resume(hook, strict):
            model = Renamed("v2", hook)
            model.strict_loading = strict
            trainer(strategy()).fit(model, ckpt_path=ck)  # max_steps=1 reached: nothing trained after the restore
            return compared({k: v.tolist() for k, v in full_weights(model).items()}, want)
        for hook in ("child", "child_public", "none_child") + (("child_rank0",) if kind == "ours" else ()):
            for strict in (True, False):
                res[f"trainer/{kind}/{hook}/{'strict' if strict else 'lenient'}"] = outcome(
                    lambda: resume(hook, strict))
    write_outcomes(out, res)
''')

FABRIC_ALL = ["fc.bias", "fc.weight", "post.bias", "post.weight"]
TRAINER_ALL = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "post.bias", "post.weight"]
KINDS = ["stock", "ours", "ours_tp2"]
STRICTS = ["strict", "lenient"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save-then-load (one 2-rank run serves every test here)."""
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


def test_the_runs_used_this_trees_package(runs):
    """Where the ranks imported lightning_distckpt from (the old copy when run with PYTHONPATH set to it)."""
    assert runs["package"].endswith("lightning_distckpt"), runs["package"]
    print("lightning_distckpt from", runs["package"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hook", ["pre", "public", "child", "child_public"])
@pytest.mark.parametrize("strict", STRICTS)
def test_fabric_load_with_a_renaming_pre_hook_loads_the_saved_values_as_stock(runs, kind, hook, strict):
    """fabric.load into a module whose pre-hook (on the module, or on the submodule within its own prefix)
    renames the saved keys: every weight, the renamed ones included, is the saved one bit for bit, strict or
    not, at TP 1 and 2 (before: ours refused a strict load, the module's post.* "not found in the checkpoint",
    before any hook ran; a strict=False load kept the fresh LayerNorm: a silent wrong value)."""
    assert runs[f"fabric/{kind}/{hook}/{strict}"] == {"type": None, "restored": FABRIC_ALL, "fresh_post": False}


@pytest.mark.parametrize("hook", ["pre", "child"])
@pytest.mark.parametrize("strict", STRICTS)
def test_fabric_load_of_a_stock_fabric_file_with_a_renaming_hook_loads_the_saved_values(runs, hook, strict):
    """Ours reading stock Fabric's torch.save file (tensors stored by tree path) through a renaming pre-hook:
    the saved values bit for bit, as stock loads its own file."""
    assert runs[f"fabric/ours<-stock/{hook}/{strict}"] == {"type": None, "restored": FABRIC_ALL,
                                                           "fresh_post": False}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hook", ["child", "child_public"])
@pytest.mark.parametrize("strict", STRICTS)
def test_a_resume_whose_submodule_hook_renames_within_its_prefix_loads_the_saved_values(runs, kind, hook, strict):
    """Trainer: a pre-hook on the submodule post renaming post.gamma/beta -> post.weight/bias: resumed with the
    saved values bit for bit, strict or not, at TP 1 and 2, as stock DDP (before: torch's copy from a meta
    tensor)."""
    assert runs[f"trainer/{kind}/{hook}/{strict}"] == {"type": None, "restored": TRAINER_ALL, "fresh_post": False}


@pytest.mark.parametrize("kind", KINDS[1:])
@pytest.mark.parametrize("where,hook", [("fabric", "none"), ("fabric", "none_child"), ("trainer", "none_child")])
def test_a_rename_no_hook_makes_is_refused_or_left_fresh_as_stock(runs, kind, where, hook):
    """No hook: strict is refused naming both sides (the sets stock's torch error names); not strict keeps the
    fresh LayerNorm and loads the rest, as stock."""
    prefix = "model." if where == "fabric" else ""
    ours = runs[f"{where}/{kind}/{hook}/strict"]
    assert ours["type"] == "MissingKeysError", ours
    stock = runs[f"{where}/stock/{hook}/strict"]
    assert stock["type"] == "RuntimeError", stock
    theirs = (_torchs(stock["message"], "Unexpected key(s) in state_dict"),
              _torchs(stock["message"], "Missing key(s) in state_dict"))
    assert theirs[1] == {"post.weight", "post.bias"}, stock
    assert _sides(ours, prefix) == theirs, ours
    lenient = runs[f"{where}/{kind}/{hook}/lenient"]
    every = FABRIC_ALL if where == "fabric" else TRAINER_ALL
    stock_lenient = runs[f"{where}/stock/{hook}/lenient"]
    assert lenient == {"type": None, "restored": every[:-2], "fresh_post": True} == stock_lenient


@pytest.mark.parametrize("where", ["fabric", "trainer"])
def test_ranks_whose_submodule_hooks_rename_differently_raise_alike(runs, where):
    """A submodule pre-hook renaming on rank 0 only: every rank raises the same error naming each rank's moves,
    nothing read, no rank left waiting (strict and not)."""
    for strict in STRICTS:
        ours = runs[f"{where}/ours/child_rank0/{strict}"]
        assert ours["type"] == "CheckpointingError", ours
        assert "rank 0: {'post.bias': " in ours["message"] and "rank 1: {}" in ours["message"], ours
