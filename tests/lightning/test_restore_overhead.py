"""The overhead of a Lightning / Fabric restore around the load (issue 17): a restore opens the
checkpoint (parses its metadata.json, or unpickles a torch.save file) and reads its common state
once, whichever strategy restores it and whoever wrote it, and the optimizer state the load fills is
built without an optimizer step for the optimizers whose fresh state is known."""

import copy
import math
import os
from typing import Any, Callable, Dict

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import lightning_distckpt.reading.checkpoint as reading_checkpoint
import lightning_distckpt.storage.local_store as local_store
from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy, DistCheckpointStrategy,
                                         FabricDistCheckpointStrategy)
from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy
from lightning_distckpt.lightning.stock import open_torch_file
from lightning_distckpt.reading.checkpoint import open_checkpoint
from lightning_distckpt.reading.formats.files import TorchFile
from lightning_distckpt.optim.sharded_optimizer import _init_state_by_step, fresh_state, init_optimizer_state
from lightning_helpers import TPMLP, SmallMLP, StepBatches, full_weights


# -- opened once -----------------------------------------------------------------------------------
@pytest.fixture
def counts(monkeypatch) -> Dict[str, int]:
    """Calls of the metadata.json parse (``open_metadata``), of the common state's read and of
    ``torch.load`` of a file by its path (a ``torch.save`` checkpoint unpickled), counted by wrapping
    the real functions (their behaviour unchanged)."""
    seen = {"metadata": 0, "common": 0, "file": 0}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(local_store, "open_metadata", counting("metadata", local_store.open_metadata))
    monkeypatch.setattr(reading_checkpoint, "read_common", counting("common", reading_checkpoint.read_common))
    real_load = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)):  # common.pt is unpickled from its bytes: not counted here
            seen["file"] += 1
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return seen


ONCE_DIR = {"metadata": 1, "common": 1, "file": 0}  # a checkpoint directory: metadata.json and common.pt once
ONCE_FILE = {"metadata": 0, "common": 0, "file": 1}  # a torch.save file: unpickled once


def _trainer(strategy: Any, steps: int, **kwargs: Any) -> Trainer:
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, **{**options, **kwargs})


def test_plugin_load_checkpoint_opens_once(tmp_path, counts):
    io = DistCheckpointIO()
    state = {"state_dict": {"w": torch.randn(4, 3)}, "loops": {"step": 2}, "pytorch-lightning_version": "2"}
    io.save_checkpoint(state, tmp_path / "ck")
    counts.update(metadata=0, common=0, file=0)
    loaded = io.load_checkpoint(tmp_path / "ck")
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and loaded["loops"] == {"step": 2}
    assert counts == ONCE_DIR, counts


@pytest.mark.parametrize("mode", ["strategy", "plugin"])
def test_trainer_restore_opens_once(tmp_path, counts, isolated_process_group, mode):
    """A Trainer restart (``fit(ckpt_path=...)``): DistCheckpointStrategy, or a single-device Trainer
    with the plugin; the restored run continues exactly like the uninterrupted one."""
    strategy = (lambda: DistCheckpointStrategy()) if mode == "strategy" else (lambda: "auto")
    plugins = (lambda: []) if mode == "strategy" else (lambda: [DistCheckpointIO()])
    whole = TPMLP(total_steps=4)
    _trainer(strategy(), 4, plugins=plugins()).fit(whole)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    _trainer(strategy(), 2, plugins=plugins(), callbacks=[saver], enable_checkpointing=True).fit(TPMLP(total_steps=4))
    counts.update(metadata=0, common=0, file=0)
    resumed = TPMLP(total_steps=4)
    _trainer(strategy(), 4, plugins=plugins()).fit(resumed, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert counts == ONCE_DIR, counts
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k >= 2}
    assert all(torch.equal(a, b) for a, b in zip(full_weights(resumed).values(), full_weights(whole).values()))


def test_fabric_load_opens_once(tmp_path, counts, isolated_process_group):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    fabric.save(tmp_path / "ck", {"model": model, "optimizer": opt, "step": 1, "extra": torch.arange(3)})
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    model2, opt2 = fabric.setup(model2, opt2)
    state = {"model": model2, "optimizer": opt2, "step": 0}
    counts.update(metadata=0, common=0, file=0)
    rest = fabric.load(tmp_path / "ck", state)
    assert counts == ONCE_DIR, counts
    assert state["step"] == 1 and torch.equal(rest["extra"], torch.arange(3))
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state[model2.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


# -- written by another writer: a torch.save file, the plugin's directory ---------------------------
def _write_trainer_checkpoint(tmp_path: Any, writer: str, module: LightningModule, steps: int = 2) -> str:
    """Train ``module`` ``steps`` steps on one device under a stock strategy and save the checkpoint
    of the last step: a torch.save ``.ckpt`` file (``stock_file``) or DistCheckpointIO's directory."""
    plugins = [DistCheckpointIO()] if writer == "plugin_dir" else []
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=steps, save_top_k=-1)
    _trainer("auto", steps, plugins=plugins, callbacks=[saver], enable_checkpointing=True).fit(module)
    path = str(tmp_path / f"step={steps}.ckpt")
    assert os.path.isfile(path) == (writer == "stock_file")
    return path


@pytest.mark.parametrize("writer", ["stock_file", "plugin_dir"])
def test_trainer_resume_of_a_tree_path_checkpoint_opens_once(tmp_path, counts, isolated_process_group, writer):
    """DistCheckpointStrategy resumes a stock Lightning ``.ckpt`` or the plugin's directory (tensors
    named by their path) with one parse of the checkpoint; the run continues as the uninterrupted one."""
    whole = TPMLP(total_steps=4)
    _trainer("auto", 4).fit(whole)
    path = _write_trainer_checkpoint(tmp_path, writer, TPMLP(total_steps=4))
    counts.update(metadata=0, common=0, file=0)
    resumed = TPMLP(total_steps=4)
    _trainer(DistCheckpointStrategy(), 4).fit(resumed, ckpt_path=path)
    assert counts == (ONCE_FILE if writer == "stock_file" else ONCE_DIR), counts
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k >= 2}
    assert all(torch.equal(a, b) for a, b in zip(full_weights(resumed).values(), full_weights(whole).values()))


def _fabric_saved(tmp_path: Any, writer: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """What stock Fabric on one device writes for ``{"model", "optimizer", "step", "extra"}``: a
    torch.save file, or (DistCheckpointIO plugin) its directory; ``trainer_file``: a Trainer's file."""
    if writer == "trainer_file":
        state: Dict[str, Any] = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                                 "loops": {"step": 1}, "pytorch-lightning_version": "2.4.0"}
    else:
        # "table": a stored tensor read whole back under an int key (its typed path, from the same unpickle)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "extra": torch.arange(3),
                 "table": {0: torch.ones(2)}}
    if writer == "plugin_dir":
        DistCheckpointIO().save_checkpoint(state, tmp_path / "ck")
        return str(tmp_path / "ck")
    torch.save(state, tmp_path / "ck.ckpt")
    return str(tmp_path / "ck.ckpt")


@pytest.mark.parametrize("writer", ["stock_file", "plugin_dir", "trainer_file"])
def test_fabric_load_of_a_tree_path_checkpoint_opens_once(tmp_path, counts, isolated_process_group, writer):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = _fabric_saved(tmp_path, writer, model, opt)
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    model2, opt2 = fabric.setup(model2, opt2)
    state = {"model": model2, "optimizer": opt2} if writer == "trainer_file" else \
        {"model": model2, "optimizer": opt2, "step": 0}
    counts.update(metadata=0, common=0, file=0)
    rest = fabric.load(path, state)
    assert counts == (ONCE_DIR if writer == "plugin_dir" else ONCE_FILE), counts
    if writer == "trainer_file":
        assert rest["loops"] == {"step": 1}
    else:
        assert state["step"] == 1 and torch.equal(rest["extra"], torch.arange(3))
        assert list(rest["table"]) == [0] and torch.equal(rest["table"][0], torch.ones(2))
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state[model2.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_torch_file_opened_once_is_the_source_open_checkpoint_gives(tmp_path):
    """open_torch_file builds the TorchFile from the payload it unpickled (TorchFile.from_payload, not
    from the path again): every field as the constructor sets it, the same index, each tensor's typed path;
    but a tuple stays whole in the common state, tensors and all (as a Lightning restore keeps it), where the
    constructor names its tensors by path."""
    payload = {"state_dict": {"w": torch.randn(3, 2)}, "optimizer_states": [{"state": {0: {"m": torch.ones(3)}}}],
               "loops": {"step": 2}, "pairs": (torch.zeros(1), 5), "empty": {}}
    torch.save(payload, tmp_path / "f.ckpt")
    path = str(tmp_path / "f.ckpt")
    source, paths, orders = open_torch_file(path)
    assert orders == [[[], list(payload)]]  # its tensors' entries come first: a restore keeps the file's order
    ours, theirs = source._files[0], TorchFile(path)
    assert type(ours) is TorchFile and set(vars(ours)) == set(vars(theirs))
    assert set(theirs.tensors) - set(ours.tensors) == {"pairs/0"} and ours.tensors.keys() <= theirs.tensors.keys()
    assert all(torch.equal(ours.tensors[k], theirs.tensors[k]) for k in ours.tensors)
    common, theirs_common = dict(ours.common), dict(theirs.common)
    pairs = common.pop("pairs")
    assert type(pairs) is tuple and torch.equal(pairs[0], torch.zeros(1)) and pairs[1] == 5
    assert theirs_common.pop("pairs")[1] == 5
    assert (common, ours.payload_type, ours.is_state_dict) == (theirs_common, theirs.payload_type,
                                                               theirs.is_state_dict)
    whole = open_checkpoint(path).index
    assert source.index.tensors == {k: e for k, e in whole.tensors.items() if k != "pairs/0"}
    assert source.index.objects == whole.objects and source.load_common() is ours.common
    assert paths == {"state_dict/w": (("d", "state_dict"), ("d", "w")),
                     "optimizer_states/0/state/0/m": (("d", "optimizer_states"), ("l", 0), ("d", "state"), ("d", 0),
                                                      ("d", "m"))}
    assert open_torch_file(str(tmp_path)) is None


# -- the ModelParallel strategies (FSDP2 on a one-rank CPU mesh) ------------------------------------
class MPModel(LightningModule):
    """``fc2(gelu(fc1(x)))``, FSDP2 over the data-parallel mesh (the plain module under a stock strategy)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.losses: Dict[int, float] = {}

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            for layer in (self.fc1, self.fc2, self):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self) -> StepBatches:
        return StepBatches(self.trainer.global_step, 4, 8, 8, 4, 0, 1)


@pytest.mark.parametrize("writer", ["own", "stock_file", "plugin_dir"])
def test_model_parallel_resume_opens_once(tmp_path, counts, isolated_process_group, writer):
    """DistCheckpointModelParallelStrategy resumes its own checkpoint, a stock ``.ckpt`` or the plugin's
    directory with one parse of it (no second look at who wrote it)."""
    def strategy() -> DistCheckpointModelParallelStrategy:
        return DistCheckpointModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)

    whole = MPModel()
    _trainer(strategy(), 4).fit(whole)
    if writer == "own":
        saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
        _trainer(strategy(), 2, callbacks=[saver], enable_checkpointing=True).fit(MPModel())
        path = str(tmp_path / "step=2.ckpt")
    else:
        path = _write_trainer_checkpoint(tmp_path, writer, MPModel())
    counts.update(metadata=0, common=0, file=0)
    resumed = MPModel()
    _trainer(strategy(), 4).fit(resumed, ckpt_path=path)
    assert counts == (ONCE_FILE if writer == "stock_file" else ONCE_DIR), counts
    assert set(resumed.losses) == {2, 3}
    assert all(math.isclose(v, whole.losses[k], rel_tol=1e-5) for k, v in resumed.losses.items())


def _fully_shard(model: SmallMLP, mesh: Any) -> SmallMLP:
    for layer in (model.fc1, model.fc2, model):
        fully_shard(layer, mesh=mesh["data_parallel"])
    return model


def test_fabric_model_parallel_load_opens_once(tmp_path, counts, isolated_process_group):
    strategy = FabricDistCheckpointModelParallelStrategy(_fully_shard, data_parallel_size=1, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(SmallMLP())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    fabric.backward(model(torch.randn(2, 8)).sum())
    opt.step()
    fabric.save(tmp_path / "ck", {"model": model, "optimizer": opt, "step": 1, "extra": torch.arange(3)})
    model2 = fabric.setup_module(SmallMLP())
    opt2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=0.05))
    state = {"model": model2, "optimizer": opt2, "step": 0}
    counts.update(metadata=0, common=0, file=0)
    rest = fabric.load(tmp_path / "ck", state)
    assert counts == ONCE_DIR, counts
    assert state["step"] == 1 and torch.equal(rest["extra"], torch.arange(3))
    assert torch.equal(model2.fc1.weight.full_tensor(), model.fc1.weight.full_tensor())
    assert torch.equal(opt2.state[model2.fc1.weight]["exp_avg"].full_tensor(),
                       opt.state[model.fc1.weight]["exp_avg"].full_tensor())


# -- optimizer state without a step ----------------------------------------------------------------
def _params() -> torch.nn.ParameterList:
    g = torch.Generator().manual_seed(0)
    return torch.nn.ParameterList([
        torch.nn.Parameter(torch.randn(5, 3, generator=g)),
        torch.nn.Parameter(torch.randn(7, generator=g)),
        torch.nn.Parameter(torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)),
        torch.nn.Parameter(torch.randn((), generator=g)),
    ])


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1),
    "adam_amsgrad_wd": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True, weight_decay=0.1),
    "adam_foreach_off": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01),
    "adamw_amsgrad_maximize": lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True, maximize=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_groups": lambda ps: torch.optim.SGD([{"params": list(ps)[:2], "momentum": 0.5}, {"params": list(ps)[2:]}],
                                             lr=0.1),
}


def _describe(opt: torch.optim.Optimizer) -> list:
    """Each parameter's state: names in order, and each value's kind, dtype, device, shape, strides, values."""
    out = []
    for p in [p for g in opt.param_groups for p in g["params"]]:
        entry = []
        for name, v in opt.state.get(p, {}).items():
            entry.append((name, (v.dtype, v.device, tuple(v.shape), v.stride(), v.tolist()))
                         if isinstance(v, torch.Tensor) else (name, v))
        out.append(entry)
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fresh_state_is_what_a_zero_gradient_step_makes(name, monkeypatch):
    direct_params, stepped_params = _params(), _params()
    direct, stepped = OPTIMIZERS[name](direct_params), OPTIMIZERS[name](stepped_params)
    monkeypatch.setattr(direct, "step", lambda *a, **k: pytest.fail("an optimizer step was run"))
    before = [p.detach().clone() for p in direct_params]
    init_optimizer_state(direct)
    _init_state_by_step(stepped, list(stepped_params))
    assert _describe(direct) == _describe(stepped)
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(direct_params, before))
    # ... and the state they then evolve is the same, bit for bit
    monkeypatch.undo()
    for params, opt in ((direct_params, direct), (stepped_params, stepped)):
        for _ in range(2):
            opt.zero_grad()
            sum((p * p).sum() for p in params).backward()
            opt.step()
    assert _describe(direct) == _describe(stepped)
    assert all(torch.equal(a, b) for a, b in zip(direct_params, stepped_params))


def test_known_optimizers_only_and_existing_state_kept():
    params = _params()
    rms = torch.optim.RMSprop(params, lr=0.1)
    assert fresh_state(rms, rms.param_groups[0], params[0]) is None  # unknown layout: a step makes it
    init_optimizer_state(rms)
    assert all(rms.state[p]["step"] == 0 and not rms.state[p]["square_avg"].any() for p in params)

    class MyAdam(torch.optim.Adam):  # a subclass may keep other state: not taken for Adam's
        pass

    mine = MyAdam(params, lr=0.1)
    assert fresh_state(mine, mine.param_groups[0], params[0]) is None
    adam = torch.optim.Adam(params, lr=0.1)
    kept = {"step": torch.tensor(3.0), "exp_avg": torch.ones(5, 3), "exp_avg_sq": torch.ones(5, 3)}
    adam.state[params[0]] = copy.copy(kept)
    init_optimizer_state(adam)
    assert adam.state[params[0]]["exp_avg"] is kept["exp_avg"]
    assert set(adam.state[params[1]]) == {"step", "exp_avg", "exp_avg_sq"}
