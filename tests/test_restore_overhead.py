"""The overhead of a Lightning / Fabric restore around the load (issue 17): a restore opens the
checkpoint (parses its metadata.json) and reads its common state once, and the optimizer state the
load fills is built without an optimizer step for the optimizers whose fresh state is known."""

import copy
from typing import Any, Callable, Dict

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_distckpt.reading.checkpoint as reading_checkpoint
import lightning_distckpt.storage.integrity as integrity
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, FabricDistCheckpointStrategy
from lightning_distckpt.optim.sharded_optimizer import _init_state_by_step, fresh_state, init_optimizer_state
from lightning_helpers import TPMLP, full_weights


# -- opened once -----------------------------------------------------------------------------------
@pytest.fixture
def counts(monkeypatch) -> Dict[str, int]:
    """Calls of the metadata.json parse (``open_metadata``) and of the common state's read, counted
    by wrapping the real functions (their behaviour unchanged)."""
    seen = {"metadata": 0, "common": 0}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(integrity, "open_metadata", counting("metadata", integrity.open_metadata))
    monkeypatch.setattr(reading_checkpoint, "read_common", counting("common", reading_checkpoint.read_common))
    return seen


def _trainer(strategy: Any, steps: int, **kwargs: Any) -> Trainer:
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, **{**options, **kwargs})


def test_plugin_load_checkpoint_opens_once(tmp_path, counts):
    io = DistCheckpointIO()
    state = {"state_dict": {"w": torch.randn(4, 3)}, "loops": {"step": 2}, "pytorch-lightning_version": "2"}
    io.save_checkpoint(state, tmp_path / "ck")
    counts.update(metadata=0, common=0)
    loaded = io.load_checkpoint(tmp_path / "ck")
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and loaded["loops"] == {"step": 2}
    assert counts == {"metadata": 1, "common": 1}


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
    counts.update(metadata=0, common=0)
    resumed = TPMLP(total_steps=4)
    _trainer(strategy(), 4, plugins=plugins()).fit(resumed, ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert counts == {"metadata": 1, "common": 1}
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
    counts.update(metadata=0, common=0)
    rest = fabric.load(tmp_path / "ck", state)
    assert counts == {"metadata": 1, "common": 1}
    assert state["step"] == 1 and torch.equal(rest["extra"], torch.arange(3))
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state[model2.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


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
