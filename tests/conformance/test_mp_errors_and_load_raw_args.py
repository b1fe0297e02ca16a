"""Three conformance points of the ModelParallel / Fabric load paths, each beside the stock strategy.

One real 2-rank run (forked as torchrun would start them; FSDP2 over the data-parallel mesh under the
ModelParallel strategies) tries, under stock Lightning and ours:

1. a load from a path that is no checkpoint (an empty directory, a directory of other files, nothing there):
   stock ``ModelParallelStrategy`` (Trainer's and Fabric's) raises ``ValueError`` ("does not point to a valid
   checkpoint"), so ours must be a ``ValueError`` too (``IncompleteCheckpointError`` is one), and a missing path
   still a ``FileNotFoundError`` (as stock DDP's ``TorchCheckpointIO`` says it);
2. ``fabric.load_raw(path, obj, strict, weights_only=...)``, Lightning's signature: taken by our Fabric strategies;
   ``weights_only=False`` runs no code (a file holding a type outside the allow-list is refused, the error saying
   that ``weights_only=False`` is not honoured and how to allow the type), where stock unpickles it;
3. ``trainer.fit(ckpt_path=<ModelCheckpoint's folder>)``: the error says once what the folder is and what to
   pass instead (a checkpoint inside it, or ``ckpt_path="last"``).
"""

import os
import textwrap

import pytest

from script_ranks import agreed_outcomes

RUNS = textwrap.dedent('''
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP, ModelParallelStrategy as FabricMP
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lightning_distckpt.lightning import (DistCheckpointModelParallelStrategy, DistCheckpointStrategy,
                                              FabricDistCheckpointModelParallelStrategy, FabricDistCheckpointStrategy)
    from lightning_helpers import TPMLP, SmallMLP
    from script_ranks import write_outcomes

    class Sharded(TPMLP):
        """TPMLP; under a ModelParallel strategy FSDP2 over the data-parallel mesh."""
        def configure_model(self):
            super().configure_model()
            if self.device_mesh is not None:
                for layer in [self.fc1, self.fc2, self]:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    class Custom:
        """A type outside every allow-list: the weights-only unpickler refuses it, torch.load(weights_only=False)
        builds it (running this module's code)."""
        built = 0
        def __setstate__(self, state):
            Custom.built += 1
            self.__dict__.update(state)

    def parallelize(model, mesh):
        for layer in [*model.children(), model]:
            fully_shard(layer, mesh=mesh["data_parallel"])
        return model

    def outcome(call):
        try:
            return {"type": None, **(call() or {})}
        except Exception as e:  # the outcome under test
            return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}

    root, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # unset in rank 0 when Lightning launches rank 1 itself
    paths = {n: os.path.join(root, n) for n in ("empty", "notes", "nowhere", "raw.pt", "custom.pt", "opt.pt")}
    if rank == 0:
        os.makedirs(paths["empty"])
        os.makedirs(paths["notes"])
        with open(os.path.join(paths["notes"], "notes.txt"), "w") as f:
            f.write("not a checkpoint")
        raw = SmallMLP().state_dict()
        torch.save(raw, paths["raw.pt"])
        custom = dict(raw)
        custom["extra"] = Custom()
        custom["extra"].x = 1  # a state: unpickling calls __setstate__
        torch.save(custom, paths["custom.pt"])
        opt = torch.optim.SGD(SmallMLP().parameters(), lr=0.1).state_dict()
        opt["param_groups"][0]["tag"] = custom["extra"]
        torch.save(opt, paths["opt.pt"])
    res = {}

    def trainer(strategy, **kw):
        kw = {"max_steps": 1, "enable_checkpointing": False, **kw}
        return Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=root, strategy=strategy, **kw)

    TRAINERS = {"stock_mp": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                "ours_mp": lambda: DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                "stock_ddp": DDPStrategy, "ours_ddp": DistCheckpointStrategy}
    for kind, strategy in TRAINERS.items():  # 1. no checkpoint at the path; 3. ModelCheckpoint's folder
        for case in ("empty", "notes", "nowhere"):
            res[f"trainer/{kind}/{case}"] = outcome(lambda: trainer(strategy()).fit(Sharded(), ckpt_path=paths[case]))
        folder = os.path.join(root, kind + "_ckpts")
        saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
        trainer(strategy(), max_steps=2, enable_checkpointing=True, callbacks=[saver]).fit(Sharded())
        res[f"trainer/{kind}/folder"] = outcome(lambda: trainer(strategy(), max_steps=3).fit(Sharded(),
                                                                                              ckpt_path=folder))
        res[f"trainer/{kind}/folder_names"] = sorted(os.listdir(folder))

    FABRICS = {"stock_mp": lambda: FabricMP(parallelize, data_parallel_size=2, tensor_parallel_size=1),
               "ours_mp": lambda: FabricDistCheckpointModelParallelStrategy(parallelize, data_parallel_size=2,
                                                                            tensor_parallel_size=1),
               "stock_ddp": FabricDDP, "ours_ddp": FabricDistCheckpointStrategy}
    for kind, strategy in FABRICS.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        model = fabric.setup_module(SmallMLP())
        for case in ("empty", "notes", "nowhere"):  # 1.
            res[f"fabric/{kind}/{case}"] = outcome(lambda: fabric.load(paths[case], {"model": model}))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)) if "ddp" in kind else None
        for wo in (None, True, False, "no"):  # 2.
            for name, obj in (("raw.pt", model), ("custom.pt", model), ("opt.pt", optimizer)):
                if obj is None:  # an optimizer alone: the DDP strategies load it (ModelParallel refuses it)
                    continue
                Custom.built = 0
                key = f"fabric/{kind}/{name}/{wo}"
                res[key] = outcome(lambda: fabric.load_raw(paths[name], obj, strict=False, weights_only=wo))
                res[key]["built"] = Custom.built  # Custom objects unpickled (the file's code run)
    write_outcomes(out, res)
''')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's outcome of each case (one 2-rank run serves every test here; the ranks' outcomes agree)."""
    import lightning_distckpt
    print("lightning_distckpt from", lightning_distckpt.__file__)
    root = str(tmp_path_factory.mktemp("runs"))
    return {"root": root, **agreed_outcomes(root, RUNS)}



def _refused(got, *types):
    """``got`` is an error, an instance of each of ``types`` (names from its class's MRO)."""
    assert got["type"] is not None and set(types) <= set(got["mro"]), got


@pytest.mark.parametrize("side", ["trainer", "fabric"])
@pytest.mark.parametrize("case", ["empty", "notes", "nowhere"])
def test_model_parallel_no_checkpoint_at_the_path_is_a_value_error_as_stock(runs, side, case):
    """A load from an empty directory, a directory of other files, or nothing: stock ModelParallelStrategy raises
    ``ValueError`` ("does not point to a valid checkpoint"); ours raises ``IncompleteCheckpointError``, a
    ``ValueError`` too (a missing path also a ``FileNotFoundError``), naming the path, on every rank."""
    stock, ours = runs[f"{side}/stock_mp/{case}"], runs[f"{side}/ours_mp/{case}"]
    assert stock["type"] == "ValueError" and "does not point to a valid checkpoint" in stock["message"], stock
    _refused(ours, "IncompleteCheckpointError", "ValueError", *(["FileNotFoundError"] if case == "nowhere" else []))
    assert os.path.join(runs["root"], case) in ours["message"] and "(the same on rank 1)" in ours["message"], ours


@pytest.mark.parametrize("side", ["trainer", "fabric"])
@pytest.mark.parametrize("case", ["empty", "notes", "nowhere"])
def test_ddp_based_no_checkpoint_at_the_path(runs, side, case):
    """Under the DDP-based strategies stock's ``TorchCheckpointIO`` raises ``FileNotFoundError`` for nothing at the
    path (ours too, with its words first) and ``torch.load``'s ``IsADirectoryError`` for a directory (ours: our
    checkpoints are directories, so ``IncompleteCheckpointError`` says what the directory lacks; a ``ValueError``
    as under ModelParallel)."""
    stock, ours = runs[f"{side}/stock_ddp/{case}"], runs[f"{side}/ours_ddp/{case}"]
    _refused(ours, "IncompleteCheckpointError", "ValueError")
    if case == "nowhere":
        assert stock["type"] == "FileNotFoundError", stock
        _refused(ours, "FileNotFoundError")
    else:
        assert stock["type"] == "IsADirectoryError", stock
        assert "no metadata.json / commit marker" in ours["message"], ours


@pytest.mark.parametrize("kind", ["stock_mp", "ours_mp", "stock_ddp", "ours_ddp"])
def test_load_raw_takes_weights_only_as_stock(runs, kind):
    """``fabric.load_raw(path, module, strict=False, weights_only=None / True / False)`` (Lightning's signature)
    loads a plain state-dict file under every strategy, ours included (and an optimizer's file under DDP)."""
    for wo in ("None", "True", "False"):
        for name in ("raw.pt",) + (("opt.pt",) if "ddp" in kind else ()):
            got = runs[f"fabric/{kind}/{name}/{wo}"]
            if name == "opt.pt":  # holds a Custom: only stock with weights_only=False loads it
                continue
            assert got["type"] is None and got["built"] == 0, got


@pytest.mark.parametrize("kind", ["ours_mp", "ours_ddp"])
def test_load_raw_weights_only_false_runs_no_code(runs, kind):
    """A file holding a type outside the allow-list: stock DDP's ``load_raw(weights_only=False)`` unpickles it
    (running the file's code); ours refuses it with every ``weights_only``, no object built, and under
    ``weights_only=False`` the error says the flag is not honoured and how to allow the type (said once)."""
    for name in ("custom.pt", "opt.pt"):  # the optimizer's load_state_dict deep-copies its param groups: built again
        stock = runs[f"fabric/stock_ddp/{name}/False"]
        assert stock["type"] is None and stock["built"] >= 1, stock
    for name in ("custom.pt",) + (("opt.pt",) if kind == "ours_ddp" else ()):
        for wo in ("None", "True", "False"):
            got = runs[f"fabric/{kind}/{name}/{wo}"]
            assert got["type"] == "UnsafeContentError" and got["built"] == 0, got
            assert got["message"].count("extra_safe_globals=[__main__.Custom]") == 1, got
            assert ("weights_only=False is not honoured" in got["message"]) == (wo == "False"), got
            assert got["message"].count("weights_only") == (wo == "False"), got


@pytest.mark.parametrize("kind", ["ours_mp", "ours_ddp"])
def test_load_raw_weights_only_of_another_type_is_refused_naming_it(runs, kind):
    """``weights_only="no"`` (a string, truthy for ``torch.load``) is refused naming the argument and its value."""
    got = runs[f"fabric/{kind}/raw.pt/no"]
    _refused(got, "ArgumentTypeError", "TypeError")
    assert "weights_only must be None, True or False, got 'no'" in got["message"], got


@pytest.mark.parametrize("kind", ["ours_mp", "ours_ddp"])
def test_fit_from_model_checkpoints_folder_says_once_what_to_pass(runs, kind):
    """``trainer.fit(ckpt_path=<ModelCheckpoint's dirpath>)``: stock raises ``ValueError`` (ModelParallel) or
    ``IsADirectoryError`` (DDP); ours names the folder's checkpoints once (newest first, not also as its
    listing), says to pass one of them (the newest's path) or ``ckpt_path="last"``, and is a ``ValueError``."""
    assert runs["trainer/stock_mp/folder"]["type"] == "ValueError"
    assert runs["trainer/stock_ddp/folder"]["type"] == "IsADirectoryError"
    got, folder = runs[f"trainer/{kind}/folder"], os.path.join(runs["root"], kind + "_ckpts")
    assert runs[f"trainer/{kind}/folder_names"] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    _refused(got, "IncompleteCheckpointError", "ValueError")
    message = got["message"]
    assert "newest first: epoch=0-step=2.ckpt, epoch=0-step=1.ckpt" in message, message
    assert f"pass one of them, e.g. {folder}/epoch=0-step=2.ckpt" in message, message
    assert message.count("epoch=0-step=1.ckpt") == 1 and message.count("epoch=0-step=2.ckpt") == 2, message
    assert message.count('ckpt_path="last"') == 1 and "it holds" not in message, message
