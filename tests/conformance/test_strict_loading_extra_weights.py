"""Lightning's ``strict_loading = True`` / ``fabric.load(strict=True)``: a checkpoint's module weights the
module no longer has are refused, as stock's ``load_state_dict(strict=True)`` refuses them.

Real 2-rank Trainer fits and Fabric runs (forked as torchrun would start them), beside stock DDP on the same
pair: saved by a module with a LayerNorm ``norm`` (TPMLP(extra_layer=True)), resumed by one without it.
Under our strategies with the config's ``strict`` left at its default, the extra weights are refused on
every rank alike naming both sides; ``strict_loading = False`` / ``strict=False`` loads the rest; a
``strict`` the user set keeps Megatron-Core's meaning (``assume_ok_unexpected`` does not look for them);
entries that are not the module's (a user's extra tensor entry, a callback's state) are not refused. Under
the ModelParallel subclasses, beside stock ModelParallelStrategy (Trainer's and Fabric's), whose DCP load
reads only the keys the module asks for: the extra layer is left unread, as there.
"""

import textwrap

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.lightning import DistCheckpointConfig, load_checkpoint_config

from conformance.test_mismatch_errors_both_sides import _ours, _torchs
from dist_utils import run_distributed
from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP, ModelParallelStrategy as FabricMP
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,
                                             DistCheckpointStrategy, FabricDistCheckpointStrategy)
    from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy
    from lightning_helpers import SGDMLP, SmallMLP, StepCounter, full_weights

    class Saved(SGDMLP):
        """TPMLP with an extra top-level entry holding a tensor (not the module's: never refused)."""
        def on_save_checkpoint(self, checkpoint):
            checkpoint["user_entry"] = {"t": torch.arange(3.0)}

    class Sharded(SGDMLP):
        """Under a ModelParallel strategy: FSDP2 over the data-parallel mesh."""
        def configure_model(self):
            super().configure_model()
            if self.device_mesh is not None:
                for layer in [self.fc1, self.fc2, *([self.norm] if self.hparams.extra_layer else []), self]:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    class Plain(torch.nn.Module):
        """SmallMLP with an optional LayerNorm after it (Fabric runs)."""
        def __init__(self, extra):
            super().__init__()
            self.mlp = SmallMLP()
            if extra:
                self.norm = torch.nn.LayerNorm(4)

    def parallelize(model, mesh):
        for layer in [*model.children(), model]:
            fully_shard(layer, mesh=mesh["data_parallel"])
        return model

    from script_ranks import outcome, write_outcomes

    STRATEGIES = {
        "stock": (lambda: DDPStrategy(), Saved),
        "plugin": (lambda: DDPStrategy(checkpoint_io=DistCheckpointIO()), Saved),
        "ours": (lambda: DistCheckpointStrategy(), Saved),
        "ours_tp2": (lambda: DistCheckpointStrategy(tensor_parallel_size=2), Saved),
        "ours_config_assume": (lambda: DistCheckpointStrategy(checkpoint={"strict": "assume_ok_unexpected"}), Saved),
        "model_parallel": (lambda: DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                           Sharded),
        "stock_model_parallel": (lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), Sharded),
    }
    root, out = sys.argv[1], sys.argv[2]
    res = {}

    def trainer(strategy, callbacks=()):
        return Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                       strategy=strategy, callbacks=list(callbacks))

    for kind, (strategy, cls) in STRATEGIES.items():
        ck = os.path.join(root, kind + ".ckpt")
        t = trainer(strategy(), [StepCounter()])
        saved = cls(extra_layer=True)
        t.fit(saved)
        t.save_checkpoint(ck)
        want = {k: v.tolist() for k, v in full_weights(saved).items()} if "model_parallel" not in kind else {}

        def resume(extra, lenient=False):
            model = cls(extra_layer=extra)
            model.strict_loading = not lenient
            # max_steps=1 reached: nothing trained after the restore. Non-strict: test, as the optimizer's
            # param groups no longer fit (stock's optimizer.load_state_dict refuses them)
            (trainer(strategy()).test if lenient else trainer(strategy()).fit)(model, ckpt_path=ck)
            if "model_parallel" in kind:
                return {}
            got = {k: v.tolist() for k, v in full_weights(model).items()}
            return {"restored": all(got[k] == want[k] for k in got)}
        res[kind + "/missing"] = outcome(lambda: resume(False))
        res[kind + "/lenient"] = outcome(lambda: resume(False, lenient=True))
        res[kind + "/same"] = outcome(lambda: resume(True))  # no callback, user_entry unread: both not the module's

    def configured(model):
        model.configure_model()  # TPMLP builds its layers there (no Trainer: plain data parallelism)
        return model

    FABRICS = {"fabric": FabricDistCheckpointStrategy, "fabric_stock": FabricDDP,
               "fabric_config_assume": lambda: FabricDistCheckpointStrategy(
                   checkpoint={"strict": "assume_ok_unexpected"}),
               "fabric_model_parallel": lambda: FabricDistCheckpointModelParallelStrategy(
                   parallelize, data_parallel_size=2, tensor_parallel_size=1),
               "fabric_stock_model_parallel": lambda: FabricMP(parallelize, data_parallel_size=2,
                                                               tensor_parallel_size=1)}
    for kind, strategy in FABRICS.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        ck = os.path.join(root, kind + "_ck")
        fabric.save(ck, {"model": fabric.setup_module(Plain(True)), "extra": {"t": torch.arange(3.0)}})
        load = lambda extra, **kw: fabric.load(ck, {"model": fabric.setup_module(Plain(extra))}, **kw)  # noqa: E731
        res[kind + "/missing"] = outcome(lambda: {"rest": sorted(load(False))})
        res[kind + "/lenient"] = outcome(lambda: {"rest": sorted(load(False, strict=False))})
        res[kind + "/same"] = outcome(lambda: {"rest": sorted(load(True))})
        if kind == "fabric":  # a Trainer's torch.save file (stock DDP's) into a Fabric state's one module
            trainer_file = os.path.join(root, "stock.ckpt")
            res[kind + "/trainer_file"] = outcome(
                lambda: fabric.load(trainer_file, {"model": fabric.setup_module(configured(SGDMLP()))}) and {})
    write_outcomes(out, res)
''')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each save-then-resume pair (one 2-rank run serves every test here)."""
    return agreed_outcomes(str(tmp_path_factory.mktemp("runs")), RUNS)  # refused alike


NORM = {"norm.weight", "norm.bias"}


@pytest.mark.parametrize("kind", ["ours", "ours_tp2"])
def test_a_trainer_resume_refuses_the_checkpoints_extra_module_weights_as_stock(runs, kind):
    """Before: resumed silently (assume_ok_unexpected never looks at checkpoint keys no rank asks for).
    Now: refused as stock DDP refuses them (torch's "Unexpected key(s)"), naming the same keys, with the
    way out; under TP 2 (sharded keys) alike."""
    stock = runs["stock/missing"]
    assert stock["type"] == "RuntimeError" and _torchs(stock["message"], "Unexpected key(s) in state_dict") == NORM
    ours = runs[f"{kind}/missing"]
    assert ours["type"] == "MissingKeysError", ours
    assert _ours(ours["message"], "Missing keys (for all ranks)") == NORM, ours
    assert "Unexpected keys" not in ours["message"], ours  # the module's every key is in the checkpoint
    assert "strict_loading=True" in ours["message"] and "strict_loading = False" in ours["message"], ours
    assert runs["plugin/missing"]["type"] == "RuntimeError"  # the plugin: Lightning calls load_state_dict itself


@pytest.mark.parametrize("kind", ["stock", "ours", "ours_tp2", "model_parallel"])
def test_strict_loading_false_loads_the_rest(runs, kind):
    """``strict_loading = False`` (``trainer.test(ckpt_path=...)``): loaded as stock's load_state_dict(strict=False)
    loads, the weights the module has restored from the checkpoint."""
    lenient = runs[f"{kind}/lenient"]
    assert lenient["type"] is None, lenient
    if kind != "model_parallel":
        assert lenient["restored"] is True, lenient


@pytest.mark.parametrize("kind", ["stock", "plugin", "ours", "ours_tp2", "model_parallel"])
def test_entries_not_the_modules_are_not_refused(runs, kind):
    """The same module resumed without the saving run's callback and user entry (a tensor stored beside the
    module's): not refused, as stock ignores them."""
    assert runs[f"{kind}/same"]["type"] is None, runs[f"{kind}/same"]


def test_a_strict_the_user_set_keeps_megatron_cores_meaning(runs):
    """``strict: assume_ok_unexpected`` set in the config (Trainer and Fabric): the checkpoint's keys no rank
    asks for are not looked for, as before."""
    assert runs["ours_config_assume/missing"] == {"type": None, "restored": True}
    assert runs["fabric_config_assume/missing"] == {"type": None, "rest": ["extra"]}


def test_model_parallel_leaves_the_extra_layer_unread_as_stock_model_parallel(runs):
    """Stock ``ModelParallelStrategy`` (Trainer's and Fabric's) never refuses a checkpoint's layer the module
    lacks (its DCP load reads only what the module asks for): the ModelParallel subclasses do the same. In the
    Trainer both then fail alike on the optimizer, whose saved param groups held that layer's parameters
    (torch's optimizer.load_state_dict), naming no module key; Fabric's load (no optimizer here) succeeds."""
    stock, ours = runs["stock_model_parallel/missing"], runs["model_parallel/missing"]
    group = "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
    assert stock["type"] == "ValueError" and stock["message"] == group, stock
    assert ours["type"] == "CheckpointingError" and group in ours["message"], ours  # agreed over the ranks
    assert "norm." not in ours["message"] and "Missing keys" not in ours["message"], ours
    assert runs["fabric_stock_model_parallel/missing"]["type"] is None, runs["fabric_stock_model_parallel/missing"]
    assert runs["fabric_model_parallel/missing"] == {"type": None, "rest": ["extra"]}


@pytest.mark.parametrize("kind", ["fabric"])
def test_fabric_load_strict_refuses_the_checkpoints_extra_module_weights_as_stock(runs, kind):
    """``fabric.load(path, state)`` (strict=True): refused as stock Fabric's DDP refuses them, naming them under
    the module's entry; ``strict=False`` loads and returns the rest; the same module loads."""
    stock = runs["fabric_stock/missing"]
    assert stock["type"] == "RuntimeError" and _torchs(stock["message"], "Unexpected key(s) in state_dict") == NORM
    ours = runs[f"{kind}/missing"]
    assert ours["type"] == "MissingKeysError", ours
    assert _ours(ours["message"], "Missing keys (for all ranks)") == {"model." + k for k in NORM}, ours
    assert "strict=False" in ours["message"], ours
    for case in ("lenient", "same"):
        assert runs[f"fabric_stock/{case}"]["type"] is None, runs[f"fabric_stock/{case}"]
        assert runs[f"{kind}/{case}"] == {"type": None, "rest": ["extra"]}, runs[f"{kind}/{case}"]


def test_fabric_load_of_a_trainer_file_refuses_its_extra_module_weights(runs):
    """A Trainer's torch.save file read into a Fabric state's one module: its ``state_dict`` is the module's."""
    ours = runs["fabric/trainer_file"]
    assert ours["type"] == "MissingKeysError", ours
    assert _ours(ours["message"], "Missing keys (for all ranks)") == {"state_dict/" + k for k in NORM}, ours


def _ranks_ask_differently(rank: int, world: int, path: str) -> dict:
    """Rank 0 asks for a, rank 1 for b; the checkpoint holds a, b, c and d; a module's entries are a, b, c."""
    from lightning_distckpt.core.strict import refusing_unused  # here: the other tests run on the old code too
    mine = {"ab"[rank]: ldc.ShardedTensor.from_rank_offsets("ab"[rank], torch.zeros(1))}
    out = {}
    for scope in (None, {"a", "b", "c"}, {"a", "b"}):
        try:
            with refusing_unused(scope):
                ldc.load(mine, path)
            out[str(sorted(scope or []))] = None
        except ldc.MissingKeysError as e:
            out[str(sorted(scope or []))] = str(e)
    return out


def test_ranks_asking_for_different_keys_agree_on_the_refusal(tmp_path):
    """The unused keys are found over the key exchange every load makes (the ranks' requests compared where
    they differ): c, asked by no rank, is refused on both ranks alike; d, not the module's, is not; nothing is
    refused where every module key is asked by some rank, nor without the scope."""
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, torch.ones(1)) for k in "abcd"}, tmp_path / "ck")
    first, second = run_distributed(_ranks_ask_differently, 2, str(tmp_path / "ck"))
    assert first == second
    assert first["[]"] is None and first["['a', 'b']"] is None
    assert _ours(first["['a', 'b', 'c']"], "Missing keys (for all ranks)") == {"c"}, first


def test_the_configs_strict_records_whether_the_user_set_it():
    """``strict`` defaults to None ("as Lightning"), which loads as assume_ok_unexpected; a mode the user
    set, even assume_ok_unexpected, is kept (and differs from the default config); None round-trips YAML."""
    default, given = DistCheckpointConfig(), load_checkpoint_config({"strict": "assume_ok_unexpected"})
    assert default.strict is None and given.strict == "assume_ok_unexpected" and default != given
    assert default.strict_handling is given.strict_handling is ldc.StrictHandling.ASSUME_OK_UNEXPECTED
    assert load_checkpoint_config({"strict": None}) == default == load_checkpoint_config(None)
