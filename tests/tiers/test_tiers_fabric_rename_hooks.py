"""Fabric's node-local tier restore (``FabricTiers.restore``) of a module whose ``load_state_dict`` pre-hook renames
the saved layer, beside the durable ``fabric.load`` of the same step.

One real 2-rank run (forked as torchrun would start them; each rank its own simulated node, each saving its node's
copy): a module with a LayerNorm ``norm`` saved at step 1 by ``fabric.save`` (durable) and ``FabricTiers.save``
(local), under ``FabricDistCheckpointStrategy`` at TP 1 and 2 and under ``FabricDistCheckpointModelParallelStrategy``
(FSDP2 over both ranks); then restored into a module whose LayerNorm is ``post``, with (``pre``) a pre-hook renaming
``norm.*`` onto ``post.*`` or (``none``) no hook, strict and not, from the durable checkpoint (``fabric.load``) and
from the local tier (``FabricTiers.restore``). The local restore must end as the durable one: the saved values
bit-exact under the new names (was: strict refused before the hooks ran, non-strict kept the fresh layer silently),
the same refusal, and a non-strict unused layer named in Fabric's words. (Under the FSDP2 strategy the durable load
itself plans by the module's keys, as stock ``ModelParallelStrategy``'s does: the tier matches it there.)
"""

import re
import textwrap

import pytest

from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import logging, os, re, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.fabric import Fabric
    import lightning_distckpt
    from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy, FabricDistCheckpointStrategy
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

    class PlainNet(torch.nn.Module):
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

    class Net(PlainNet):
        def sharded_state_dict(self, prefix=""):  # under TP 2 a module describes its tensors: all replicated here
            return module_sharded_state_dict(self, prefix, replica_id=parallel_state_of(self).replicated_id)

    def values(module):  # whole (collective for FSDP2's DTensors)
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist()
                for k, v in module.state_dict().items()}

    def fsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard
        return fully_shard(model, mesh=mesh["data_parallel"])

    def strategy(kind, where):  # mp: FSDP2 over both ranks, the module's own state dict (no sharded_state_dict)
        if kind == "mp":
            return FabricDistCheckpointModelParallelStrategy(fsdp, data_parallel_size=2, tensor_parallel_size=1,
                                                             checkpoint=tier_config(where))
        return FabricDistCheckpointStrategy(tensor_parallel_size=int(kind[2:]), checkpoint=tier_config(where))

    def words(message, durable):  # each rank may name its own node's copy; the durable load names its path
        return re.sub(r"/node\\d/", "/node?/", message.replace(durable, "<durable>"))

    root, out = sys.argv[1], sys.argv[2]
    res = {"package": os.path.dirname(lightning_distckpt.__file__)}
    fresh = torch.nn.LayerNorm(4)
    res["fresh_post"] = {"post.weight": fresh.weight.tolist(), "post.bias": fresh.bias.tolist()}
    for kind in ("tp1", "tp2", "mp"):
        where = os.path.join(root, kind)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy(kind, where))
        fabric.launch()
        Model = PlainNet if kind == "mp" else Net
        saved = Model(True)
        state = {"model": fabric.setup_module(saved), "step": 1}
        durable = os.path.join(where, "durable")
        fabric.save(durable, state)
        tiers = FabricTiers(fabric)
        tiers.save(state, 1)
        tiers.wait()
        tiers.close()
        res[f"{kind}/saved"] = {k.replace("norm.", "post."): v for k, v in values(saved).items()}

        def restore(how, hook, strict):
            model = Model(False, hook)
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


def _same_words(outcome):
    """``outcome`` with the checkpoint it names (the durable path, or a node's local step) as one word."""
    def words(text):
        return re.sub(r"\S*/local/node\?/step_\d+", "<checkpoint>", text).replace("<durable>", "<checkpoint>")
    out = dict(outcome)
    if "message" in out:
        out["message"] = words(out["message"])
    if "said" in out:
        out["said"] = [words(line) for line in out["said"]]
    return out


@pytest.mark.parametrize("hook", ["pre", "none"])
@pytest.mark.parametrize("strict", STRICTS)
def test_model_parallel_restores_from_the_local_tier_as_its_durable_load(runs, hook, strict):
    """FSDP2 (FabricDistCheckpointModelParallelStrategy): the local restore ends as fabric.load of the durable
    checkpoint of the same step, hook or not, strict or not: the same values bit for bit, the same error in the
    same words, the same warnings about norm.*. Under this strategy the read plans by the module's own keys (as
    stock ModelParallelStrategy's DCP load does), so a renaming pre-hook finds nothing to rename: strict refuses
    the checkpoint's norm.* beside the module's post.*, non-strict keeps post.* fresh and says so."""
    durable, tier = runs[f"mp/durable/{hook}/{strict}"], runs[f"mp/tier/{hook}/{strict}"]
    want = _same_words(durable if durable["type"] is not None else {**durable, "point": [1, "local"]})
    assert _same_words(tier) == want, (tier, durable)
    if strict == "strict":
        assert durable["type"] == "MissingKeysError" and "model/norm.weight" in durable["message"], durable
    else:
        saved = runs["mp/saved"]
        assert durable["values"] == {**{k: v for k, v in saved.items() if k.startswith("fc.")},
                                     **runs["fresh_post"]}, durable
        assert len(durable["said"]) == 1 and "model/post.weight" in durable["said"][0], durable
