"""A layer renamed between versions, its checkpoint keys renamed by the user's hooks on resume, beside stock DDP.

Real 2-rank Trainer fits (forked as torchrun would start them): saved by a module with a LayerNorm ``norm``
(TPMLP(extra_layer=True)) after one SGD step, resumed by one whose LayerNorm is ``post``, the keys renamed
``norm.*`` -> ``post.*`` by (a) ``LightningModule.on_load_checkpoint`` on ``checkpoint["state_dict"]``, (b) a
``load_state_dict`` pre-hook registered on the LightningModule, (c) a pre-hook registered on a submodule, (n)
nothing; ``strict_loading`` True and False. Stock DDP resumes (a) and (b) with the saved values under the new
names; so do ours, the stored tensors read under their stored keys (every value compared bit-exact to the saved
ones). Without a rename, strict refuses (stock: torch's "Missing key(s)"), non-strict keeps the fresh layer.
"""

import textwrap

import pytest

from conformance.test_mismatch_errors_both_sides import _sides, _torchs
from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy
    import lightning_distckpt
    from lightning_distckpt.lightning import DistCheckpointStrategy
    from lightning_helpers import SGDMLP, full_weights
    from script_ranks import outcome, write_outcomes

    def rename(state_dict, prefix=""):
        for key in [k for k in state_dict if k.startswith(prefix + "norm.")]:
            state_dict[prefix + "post." + key[len(prefix + "norm."):]] = state_dict.pop(key)

    class Renamed(SGDMLP):
        """SGDMLP whose LayerNorm after fc2 is ``post`` (saved as ``norm``); ``hook`` renames the saved keys."""
        def __init__(self, hook="none", **kw):
            super().__init__(**kw)
            self.hook = hook
            if hook == "pre":
                self._register_load_state_dict_pre_hook(lambda sd, prefix, *a: rename(sd, prefix))
            if hook == "rank0":  # a hook that renames on one rank only
                self._register_load_state_dict_pre_hook(
                    lambda sd, prefix, *a: rename(sd, prefix) if self.global_rank == 0 else None)

        def configure_model(self):
            if self.fc1 is None:
                super().configure_model()
                self.post = torch.nn.LayerNorm(self.hparams.d_out)
                if self.hook == "child":  # torch calls a submodule's pre-hook with its prefix ("post.")
                    self.post._register_load_state_dict_pre_hook(
                        lambda sd, prefix, *a: rename(sd, prefix[:-len("post.")]))

        def forward(self, x):
            return self.post(super().forward(x))

        def on_load_checkpoint(self, checkpoint):
            if self.hook == "ckpt":
                rename(checkpoint["state_dict"])
            if self.hook == "shape":  # onto a key of another shape (fc1.bias: 16 elements; norm.weight: 4)
                state_dict = checkpoint["state_dict"]
                state_dict["fc1.bias"] = state_dict.pop("norm.weight")
                rename(state_dict)

    STRATEGIES = {"stock": lambda: DDPStrategy(), "ours": lambda: DistCheckpointStrategy(),
                  "ours_tp2": lambda: DistCheckpointStrategy(tensor_parallel_size=2)}
    root, out = sys.argv[1], sys.argv[2]
    res = {"package": os.path.dirname(lightning_distckpt.__file__)}

    def trainer(strategy):
        return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                       strategy=strategy)

    for kind, strategy in STRATEGIES.items():
        ck = os.path.join(root, kind + ".ckpt")
        t = trainer(strategy())
        saved = SGDMLP(extra_layer=True)
        t.fit(saved)
        t.save_checkpoint(ck)
        want = {k.replace("norm.", "post."): v.tolist() for k, v in full_weights(saved).items()}

        def resume(hook, strict):
            model = Renamed(hook)
            model.strict_loading = strict
            trainer(strategy()).fit(model, ckpt_path=ck)  # max_steps=1 reached: nothing trained after the restore
            got = {k: v.tolist() for k, v in full_weights(model).items()}
            assert set(got) == set(want), (sorted(got), sorted(want))
            fresh = torch.nn.LayerNorm(model.hparams.d_out)  # LayerNorm's init: ones and zeros
            return {"restored": sorted(k for k in got if got[k] == want[k]),
                    "fresh_post": [got["post.weight"], got["post.bias"]] == [fresh.weight.tolist(),
                                                                            fresh.bias.tolist()]}
        for hook in ("ckpt", "pre", "child", "none"):
            for strict in (True, False):
                res[f"{kind}/{hook}/{'strict' if strict else 'lenient'}"] = outcome(lambda: resume(hook, strict))
        if kind != "ours_tp2":  # not rank0 under stock, whose rank 1 raises alone: rank 0 waits in setup
            for hook in ("rank0", "shape") if kind == "ours" else ("shape",):
                res[f"{kind}/{hook}/strict"] = outcome(lambda: resume(hook, True))
    write_outcomes(out, res)
''')

ALL = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "post.bias", "post.weight"]
KINDS = ["stock", "ours", "ours_tp2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save-then-resume (one 2-rank run serves every test here)."""
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


def test_the_runs_used_this_trees_package(runs):
    """Where the ranks imported lightning_distckpt from (the old copy when run with PYTHONPATH set to it)."""
    assert runs["package"].endswith("lightning_distckpt"), runs["package"]
    print("lightning_distckpt from", runs["package"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hook", ["ckpt", "pre"])
@pytest.mark.parametrize("strict", ["strict", "lenient"])
def test_a_hook_renaming_the_saved_layer_resumes_its_values_as_stock(runs, kind, hook, strict):
    """on_load_checkpoint / a LightningModule pre-hook renaming norm.* -> post.*: every weight, the renamed
    layer's included, is the saved one bit for bit, strict or not (before: ours refused the strict resume, its
    post.* "not found in the checkpoint", and a lenient one kept the fresh LayerNorm: a silent wrong value)."""
    assert runs[f"{kind}/{hook}/{strict}"] == {"type": None, "restored": ALL, "fresh_post": False}


@pytest.mark.parametrize("kind", KINDS[1:])
@pytest.mark.parametrize("hook", ["none", "child"])
def test_a_layer_no_hook_renames_is_refused_or_left_fresh_as_stock(runs, kind, hook):
    """No rename (or a submodule's pre-hook, which torch hands only its own prefix's keys): strict is refused
    naming both sides (the module's post.* the checkpoint lacks, its norm.* the module lacks: the sets stock's
    torch error names), now after the hooks, as stock; lenient keeps the fresh layer and restores the rest."""
    ours = runs[f"{kind}/{hook}/strict"]
    assert ours["type"] == "MissingKeysError", ours
    assert _sides(ours) == ({"norm.weight", "norm.bias"}, {"post.weight", "post.bias"}), ours
    stock = runs[f"stock/{hook}/strict"]
    assert _torchs(stock["message"], "Missing key(s) in state_dict") == {"post.weight", "post.bias"}, stock
    lenient = runs[f"{kind}/{hook}/lenient"]
    assert lenient == {"type": None, "restored": ALL[:4], "fresh_post": True} == runs[f"stock/{hook}/lenient"]


def test_a_hook_moving_a_weight_onto_another_shape_is_refused_naming_both(runs):
    """norm.weight (4) renamed onto fc1.bias (16): refused before anything is copied, naming the stored key,
    the module key and both shapes (stock: torch's size mismatch)."""
    assert "size mismatch for fc1.bias" in runs["stock/shape/strict"]["message"]
    ours = runs["ours/shape/strict"]
    assert ours["type"] == "MissingKeysError", ours
    assert "'norm.weight' (shape (4,)" in ours["message"] and "'fc1.bias'" in ours["message"], ours
    assert "shape (16,)" in ours["message"], ours


def test_ranks_whose_hooks_rename_differently_raise_alike_without_hanging(runs):
    """A pre-hook renaming on rank 0 only: every rank raises the same error naming each rank's moves, nothing
    read (stock's rank 1 raises alone and rank 0 waits in setup: not run here)."""
    ours = runs["ours/rank0/strict"]
    assert ours["type"] == "CheckpointingError", ours
    assert "rank 0: {'post.bias': 'norm.bias', 'post.weight': 'norm.weight'}; rank 1: {}" in ours["message"], ours
