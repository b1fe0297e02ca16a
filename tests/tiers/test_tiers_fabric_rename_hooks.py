"""Fabric's node-local tier restore (``FabricTiers.restore``) of a module whose ``load_state_dict`` pre-hook renames
the saved layer, beside the durable ``fabric.load`` of the same step.

One real 2-rank run (forked as torchrun would start them; each rank its own simulated node, each saving its node's
copy): a module with a LayerNorm ``norm`` saved at step 1 by ``fabric.save`` (durable) and ``FabricTiers.save``
(local), under ``FabricDistCheckpointStrategy`` at TP 1 and 2; then restored into a module whose LayerNorm is
``post``, with (``pre``) a pre-hook renaming ``norm.*`` onto ``post.*`` or (``none``) no hook, strict and not, from
the durable checkpoint (``fabric.load``) and from the local tier (``FabricTiers.restore``). The local restore must
end as the durable one: the saved values bit-exact under the new names (was: strict refused before the hooks ran,
non-strict kept the fresh layer silently), the same refusal, and a non-strict unused layer named in Fabric's words.
"""

import textwrap

import pytest

from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import logging, os, re, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.fabric import Fabric
    import lightning_distckpt
    from lightning_distckpt.lightning import FabricDistCheckpointStrategy
    from lightning_distckpt.lightning.fabric_tiers import FabricTiers
    from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of
    from script_ranks import outcome, write_outcomes
    from tier_parity_scripts import tier_config

    class Said(logging.Handler):
        """The package's log lines of level WARNING and above (what a user sees), kept to be read by each case."""
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []
        def emit(self, record):
            self.lines.append(record.getMessage())
    SAID = Said()
    logging.getLogger("lightning_distckpt").addHandler(SAID)

    def rename(sd, prefix):
        for key in [k for k in sd if k.startswith(prefix + "norm.")]:
            sd[prefix + "post." + key[len(prefix + "norm."):]] = sd.pop(key)

    class Net(torch.nn.Module):
        """fc then a LayerNorm: ``norm`` with values unlike a fresh one's (saved), or ``post`` (restored)."""
        def __init__(self, saved, hook="none"):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(4, 4)
            if saved:
                self.norm = torch.nn.LayerNorm(4)
                torch.manual_seed(7)  # the same on every rank
                with torch.no_grad():
                    for p in self.parameters():
                        p.copy_(torch.randn_like(p))
            else:
                self.post = torch.nn.LayerNorm(4)
                if hook == "pre":
                    self._register_load_state_dict_pre_hook(lambda sd, prefix, *a: rename(sd, prefix))

        def sharded_state_dict(self, prefix=""):  # under TP 2 a module describes its tensors: all replicated here
            return module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)

    def values(module):
        return {k: v.tolist() for k, v in module.state_dict().items()}

    def words(message, durable):  # each rank may name its own node's copy; the durable load names its path
        return re.sub(r"/node\\d/", "/node?/", message.replace(durable, "<durable>"))

    root, out = sys.argv[1], sys.argv[2]
    res = {"package": os.path.dirname(lightning_distckpt.__file__)}
    fresh = torch.nn.LayerNorm(4)
    res["fresh_post"] = {"post.weight": fresh.weight.tolist(), "post.bias": fresh.bias.tolist()}
    for kind, tp in (("tp1", 1), ("tp2", 2)):
        where = os.path.join(root, kind)
        fabric = Fabric(accelerator="cpu", devices=2,
                        strategy=FabricDistCheckpointStrategy(tensor_parallel_size=tp, checkpoint=tier_config(where)))
        fabric.launch()
        saved = Net(True)
        state = {"model": fabric.setup_module(saved), "step": 1}
        durable = os.path.join(where, "durable")
        fabric.save(durable, state)
        tiers = FabricTiers(fabric)
        tiers.save(state, 1)
        tiers.wait()
        tiers.close()
        res[f"{kind}/saved"] = {k.replace("norm.", "post."): v for k, v in values(saved).items()}

        def restore(how, hook, strict):
            model = Net(False, hook)
            state = {"model": fabric.setup_module(model), "step": 0}
            start = len(SAID.lines)
            point = None
            if how == "durable":
                fabric.load(durable, state, strict=strict)
            else:
                tiers = FabricTiers(fabric)
                try:
                    got = tiers.restore(state, strict=strict)
                finally:
                    tiers.close()
                point = None if got is None else [got.step, got.source]
            said = [words(line, durable) for line in SAID.lines[start:] if "norm." in line]
            return {"values": values(model), "step": state["step"], "point": point, "said": said}
        for hook in ("pre", "none"):
            for strict in (True, False):
                for how in ("durable", "tier"):
                    got = outcome(lambda: restore(how, hook, strict))
                    if "message" in got:
                        got["message"] = words(got["message"], durable)
                    res[f"{kind}/{how}/{hook}/{'strict' if strict else 'lenient'}"] = got
    write_outcomes(out, res)
''')

KINDS = ["tp1", "tp2"]
STRICTS = ["strict", "lenient"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save / restore pair (one 2-rank run serves every test here)."""
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)


def test_the_runs_used_this_trees_package(runs):
    """Where the ranks imported lightning_distckpt from (the old copy when run with PYTHONPATH set to it)."""
    assert runs["package"].endswith("lightning_distckpt"), runs["package"]
    print("lightning_distckpt from", runs["package"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strict", STRICTS)
def test_a_renaming_pre_hook_restores_the_saved_values_from_the_local_tier(runs, kind, strict):
    """FabricTiers.restore (local step 1) into a module whose pre-hook renames norm.* onto post.*: every weight,
    the renamed ones included, is the saved one bit for bit, on both ranks, strict or not, as the durable
    fabric.load of the same step restores it; the step restored too, and no warning about norm.*."""
    durable, tier = runs[f"{kind}/durable/pre/{strict}"], runs[f"{kind}/tier/pre/{strict}"]
    assert durable == {"type": None, "values": runs[f"{kind}/saved"], "step": 1, "point": None, "said": []}, durable
    assert tier == {**durable, "point": [1, "local"]}, tier


@pytest.mark.parametrize("kind", KINDS)
def test_without_a_hook_a_strict_restore_is_refused_as_the_durable_one(runs, kind):
    """No hook, strict: the saved norm.* is unused and post.* absent; the local restore refuses it with the durable
    load's error type, naming the unused and the missing keys, on both ranks."""
    durable, tier = runs[f"{kind}/durable/none/strict"], runs[f"{kind}/tier/none/strict"]
    assert durable["type"] not in (None, "RuntimeError"), durable
    assert tier["type"] == durable["type"], (tier, durable)
    for key in ("norm.weight", "post.weight"):
        assert key in tier["message"] and key in durable["message"], (tier, durable)
    assert "local step 1" in tier["message"], tier


@pytest.mark.parametrize("kind", KINDS)
def test_without_a_hook_a_lenient_restore_keeps_post_fresh_in_fabrics_words(runs, kind):
    """No hook, strict=False: fc restored, post kept fresh, exactly as the durable load; the unused norm.* named in
    one warning that says fabric.load(..., strict=False) (was: strict_loading, a Trainer word)."""
    durable, tier = runs[f"{kind}/durable/none/lenient"], runs[f"{kind}/tier/none/lenient"]
    want = {**{k: v for k, v in runs[f"{kind}/saved"].items() if k.startswith("fc.")}, **runs["fresh_post"]}
    assert durable["type"] is None and durable["values"] == want, durable
    assert tier["type"] is None and tier["values"] == want and tier["point"] == [1, "local"], tier
    for got in (durable, tier):
        assert len(got["said"]) == 1, got["said"]
        assert "fabric.load(..., strict=False)" in got["said"][0] and "strict_loading" not in got["said"][0], got
