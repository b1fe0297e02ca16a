"""``torch.compile``'d models through our Trainer plugin (``DistCheckpointIO``), ``DistCheckpointStrategy``,
``FabricDistCheckpointStrategy`` and ``DistCheckpointModelParallelStrategy``, run side by side with stock
Lightning / Fabric on 2 gloo processes: a checkpoint of a compiled model resumes into a compiled model bit-exact,
and into the other variant exactly where stock's does (failing, where stock fails, naming the keys).

Three variants of one model: ``plain``; ``whole`` (``torch.compile(model)`` handed to ``trainer.fit`` /
``fabric.setup``: Lightning and Fabric unwrap it, the keys are the plain ones); ``sub`` (a compiled submodule,
``self.net = torch.compile(net)``: its keys carry ``net._orig_mod.``). ``backend="eager"``: the wrapper and the
key names are what matter here, not inductor's code.

This file is also the script its 2 ranks run (``python test_compiled_models.py trainer fabric model_parallel
--dir D --out O``); every rank writes ``O.rank<r>.json`` with the outcome of each (mode, saved variant, loaded
variant): ``{"diffs": [...]}`` (what differs after the restore: weights, optimizer state, step) or
``{"failed": "<error>"}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from datetime import timedelta
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.join(TESTS, "lightning_scripts")]

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lightning_helpers import StepBatches, quiet_trainer, state_differences  # noqa: E402

VARIANTS = ("plain", "whole", "sub")
STEPS = 3


def _body() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _named_state(named_params: Any, optimizer: torch.optim.Optimizer, step: int) -> Dict[str, Any]:
    """Whole weights and optimizer state by parameter name, without ``_orig_mod.`` (one name for a
    parameter in every variant), and the step."""
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out: Dict[str, Any] = {"step": step}
    for name, p in named_params:
        name = name.replace("_orig_mod.", "")
        out[name] = whole(p)
        for k, v in sorted(optimizer.state[p].items()):
            out[f"{name}/{k}"] = whole(v)
    return out


def _outcome(run: Any) -> Dict[str, Any]:
    try:
        return {"diffs": run()}
    except Exception as e:  # the outcome compared with stock's
        return {"failed": f"{type(e).__name__}: {e}"}


# -- Trainer: stock DDP, our plugin under stock DDP, DistCheckpointStrategy ------------------------------------
def _lightning_module(variant: str) -> Any:
    from lightning.pytorch import LightningModule

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            body = _body()
            self.net = torch.compile(body, backend="eager") if variant == "sub" else body

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)

        def train_dataloader(self) -> StepBatches:
            t = self.trainer
            return StepBatches(t.global_step, STEPS + 1, 8, 8, 4, t.global_rank, t.world_size)

    return Net()


def _trainer_state(trainer: Any) -> Dict[str, Any]:
    return _named_state(trainer.lightning_module.named_parameters(), trainer.optimizers[0], trainer.global_step)


def _trainer_kwargs(mode: str) -> Dict[str, Any]:
    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy

    if mode == "strategy":
        return {"strategy": DistCheckpointStrategy(timeout=TIMEOUT)}
    from lightning.pytorch.strategies import DDPStrategy

    return {"strategy": DDPStrategy(timeout=TIMEOUT), **({"plugins": [DistCheckpointIO()]} if mode == "plugin" else {})}


def _fit(mode: str, variant: str, max_steps: int, ckpt_path: Any = None) -> Tuple[Any, Dict[str, Any]]:
    """Fit ``variant`` under ``mode`` to ``max_steps``; the state is taken when training starts
    (after a restore from ``ckpt_path``)."""
    from lightning.pytorch import Callback

    class AtStart(Callback):
        state: Dict[str, Any] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            AtStart.state = _trainer_state(trainer)

    torch._dynamo.reset()  # each run compiles its own module, not another run's cached frames
    model = _lightning_module(variant)
    trainer = quiet_trainer(devices=2, max_steps=max_steps, callbacks=[AtStart()], enable_checkpointing=False,
                            **_trainer_kwargs(mode))
    trainer.fit(torch.compile(model, backend="eager") if variant == "whole" else model, ckpt_path=ckpt_path)
    return trainer, AtStart.state


def trainer_scenario(args: Any, res: Dict[str, Any]) -> None:
    for mode in ("stock", "plugin", "strategy"):
        for src in VARIANTS:
            trainer, _ = _fit(mode, src, STEPS)
            path = os.path.join(args.dir, f"trainer_{mode}_{src}.ckpt")
            trainer.save_checkpoint(path)
            want = _trainer_state(trainer)
            for dst in VARIANTS:
                res[f"trainer:{mode}/{src}->{dst}"] = _outcome(
                    lambda: state_differences(_fit(mode, dst, STEPS + 1, path)[1], want))


class FabricNet(torch.nn.Module):
    """The body, compiled as a submodule (``net._orig_mod.`` keys) when ``compile_body``."""

    def __init__(self, compile_body: bool) -> None:
        super().__init__()
        body = _body()
        self.net = torch.compile(body, backend="eager") if compile_body else body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# -- Fabric: stock DDP's fabric.save / fabric.load, FabricDistCheckpointStrategy --------------------------------
def _fabric_run(mode: str, variant: str) -> Tuple[Any, Any, Any, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    torch._dynamo.reset()
    strategy = FabricDistCheckpointStrategy(timeout=TIMEOUT) if mode == "ours" else DDPStrategy(timeout=TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = FabricNet(variant == "sub")
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.01)
    model, opt = fabric.setup(torch.compile(net, backend="eager") if variant == "whole" else net, optimizer)
    return fabric, net, model, opt


def fabric_scenario(args: Any, res: Dict[str, Any]) -> None:
    for mode in ("stock", "ours"):
        for src in VARIANTS:
            fabric, net, model, opt = _fabric_run(mode, src)
            for x, y in StepBatches(0, STEPS, 8, 8, 4, fabric.global_rank, fabric.world_size):
                fabric.backward(F.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            path = os.path.join(args.dir, f"fabric_{mode}_{src}.ckpt")
            fabric.save(path, {"model": model, "optimizer": opt, "step": STEPS})
            want = _named_state(net.named_parameters(), opt.optimizer, STEPS)
            for dst in VARIANTS:
                def resume() -> List[str]:
                    fabric2, net2, model2, opt2 = _fabric_run(mode, dst)
                    state = {"model": model2, "optimizer": opt2, "step": 0}
                    fabric2.load(path, state)
                    return state_differences(_named_state(net2.named_parameters(), opt2.optimizer, state["step"]), want)

                res[f"fabric:{mode}/{src}->{dst}"] = _outcome(resume)


# -- ModelParallel (FSDP2): stock ModelParallelStrategy, DistCheckpointModelParallelStrategy --------------------
def _mp_module(variant: str) -> Any:
    from lightning.pytorch import LightningModule
    from torch.distributed.fsdp import fully_shard

    class FSDPNet(LightningModule):
        """FSDP2 over the data-parallel mesh in ``configure_model``, then (``sub``) the body compiled,
        as users compile after sharding."""

        def __init__(self) -> None:
            super().__init__()
            self.net = _body()

        def configure_model(self) -> None:
            if hasattr(self.net, "_orig_mod") or hasattr(self.net[0], "reshard"):
                return
            for layer in (self.net[0], self.net[2], self):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            if variant == "sub":
                self.net = torch.compile(self.net, backend="eager")

        def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)

        def train_dataloader(self) -> StepBatches:
            dp = self.device_mesh["data_parallel"]
            return StepBatches(self.trainer.global_step, STEPS + 1, 8, 8, 4, dp.get_local_rank(), dp.size())

    return FSDPNet()


def _mp_fit(mode: str, variant: str, max_steps: int, ckpt_path: Any = None) -> Tuple[Any, Dict[str, Any]]:
    from lightning.pytorch import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy

    class AtStart(Callback):
        state: Dict[str, Any] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            AtStart.state = _trainer_state(trainer)

    torch._dynamo.reset()
    cls = DistCheckpointModelParallelStrategy if mode == "ours" else ModelParallelStrategy
    strategy = cls(data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
    trainer = quiet_trainer(devices=2, max_steps=max_steps, strategy=strategy, callbacks=[AtStart()],
                            enable_checkpointing=False)
    model = _mp_module(variant)
    trainer.fit(torch.compile(model, backend="eager") if variant == "whole" else model, ckpt_path=ckpt_path)
    return trainer, AtStart.state


def model_parallel_scenario(args: Any, res: Dict[str, Any]) -> None:
    for mode in ("stock", "ours"):
        res[f"mp:{mode}/fit whole"] = _outcome(lambda: _mp_fit(mode, "whole", STEPS) and [])
        for src in ("plain", "sub"):
            trainer, _ = _mp_fit(mode, src, STEPS)
            path = os.path.join(args.dir, f"mp_{mode}_{src}.ckpt")
            trainer.save_checkpoint(path)
            want = _trainer_state(trainer)
            for dst in ("plain", "sub"):
                res[f"mp:{mode}/{src}->{dst}"] = _outcome(
                    lambda: state_differences(_mp_fit(mode, dst, STEPS + 1, path)[1], want))


TIMEOUT = timedelta(seconds=120)  # a hang fails the run instead of blocking it
SCENARIOS = {"trainer": trainer_scenario, "fabric": fabric_scenario, "model_parallel": model_parallel_scenario}


# -- the tests --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Tuple[Any, Dict[str, Any]]:
    from script_ranks import run_ranks, script_env

    d = tmp_path_factory.mktemp("compiled")
    out = str(d / "out")
    code, output = run_ranks(os.path.abspath(__file__), [*SCENARIOS, "--dir", str(d), "--out", out], script_env(),
                             2, 600)
    results = []
    for rank in range(2):
        path = f"{out}.rank{rank}.json"
        assert os.path.isfile(path), f"rank {rank} wrote no results (exit {code}):\n{output[-12000:]}"
        with open(path) as f:
            results.append(json.load(f))
    assert code == 0 and not any("error" in r for r in results), f"exit {code}\n{output[-12000:]}"
    assert results[0].keys() == results[1].keys()
    return d, results[0]


def _ok(outcome: Dict[str, Any]) -> bool:
    assert "failed" in outcome or outcome["diffs"] == [], outcome  # a restore that runs is bit-exact
    return "failed" not in outcome


@pytest.mark.parametrize("mode", ["plugin", "strategy"])
def test_trainer_compiled_resumes_bit_exact_where_stock_does(runs: Any, mode: str) -> None:
    """Stock DDP's TorchCheckpointIO resumes a compiled model (``trainer.fit(torch.compile(model))`` or a compiled
    submodule) into the same variant, and the whole-compiled / plain ones into each other (Lightning unwraps the
    OptimizedModule: the keys are the same); a compiled submodule's ``_orig_mod.`` keys and the plain keys do not
    load into each other (load_state_dict's missing / unexpected keys). Ours, as plugin and as strategy: the same
    outcome for every pair, each restore bit-exact (weights, AdamW state, step), each failure naming the keys."""
    _, res = runs
    for src in VARIANTS:
        for dst in VARIANTS:
            stock, ours = res[f"trainer:stock/{src}->{dst}"], res[f"trainer:{mode}/{src}->{dst}"]
            assert _ok(ours) == _ok(stock), (src, dst, stock, ours)
            assert _ok(stock) == (("sub" in (src, dst)) <= (src == dst)), (src, dst, stock)
            if not _ok(ours):
                # the keys the module has and the checkpoint lacks, named
                wanted = "net._orig_mod.0.weight" if dst == "sub" else "net.0.weight"
                assert wanted in ours["failed"], ours
                if mode == "strategy":  # our error also says what the keys differ by
                    assert "is what torch.compile adds" in ours["failed"], ours


def test_fabric_compiled_loads_where_stock_does(runs: Any) -> None:
    """Stock Fabric (DDP) ``fabric.save`` / ``fabric.load``: ``fabric.setup(torch.compile(model))`` is unwrapped
    in save and load (plain keys); a compiled submodule keeps ``_orig_mod.`` keys, loadable only into a compiled
    submodule. FabricDistCheckpointStrategy: the same outcome for every pair, bit-exact where it loads, and a
    MissingKeysError naming the module's and the optimizer's keys where stock's load_state_dict fails."""
    _, res = runs
    for src in VARIANTS:
        for dst in VARIANTS:
            stock, ours = res[f"fabric:stock/{src}->{dst}"], res[f"fabric:ours/{src}->{dst}"]
            assert _ok(ours) == _ok(stock), (src, dst, stock, ours)
            if not _ok(ours):
                wanted = "model.net._orig_mod.0.weight" if dst == "sub" else "model.net.0.weight"
                assert "MissingKeysError" in ours["failed"] and wanted in ours["failed"], ours
                assert f"optimizer.state.exp_avg.{wanted}" in ours["failed"], ours
                assert "is what torch.compile adds" in ours["failed"], ours


def test_model_parallel_compiled_after_sharding_resumes_either_way(runs: Any) -> None:
    """ModelParallel (FSDP2 on 2 ranks), the body compiled after ``fully_shard`` in ``configure_model``. Stock
    ModelParallelStrategy saves DCP keys without ``_orig_mod.`` (get_model_state_dict strips them) yet fails to
    resume into a model compiled this way, even the one it saved ("Error(s) in loading state_dict"); a plain
    model resumes from either. Ours reads and writes through the same get/set_model_state_dict: all four pairs
    resume bit-exact. ``trainer.fit(torch.compile(model))`` is refused by both alike (Lightning's check)."""
    _, res = runs
    for src in ("plain", "sub"):
        for dst in ("plain", "sub"):
            assert _ok(res[f"mp:ours/{src}->{dst}"]), (src, dst)
            assert _ok(res[f"mp:stock/{src}->{dst}"]) == (dst == "plain"), (src, dst, res[f"mp:stock/{src}->{dst}"])
    stock, ours = res["mp:stock/fit whole"], res["mp:ours/fit whole"]
    assert "failed" in stock and "incompatible with the current strategy" in stock["failed"]
    assert "failed" in ours and ours["failed"] == stock["failed"].replace("ModelParallelStrategy",
                                                                          "DistCheckpointModelParallelStrategy")


def _cli(args: List[str]) -> Tuple[int, str]:
    from lightning_distckpt.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    return code, out.getvalue()


def test_inspect_and_convert_show_the_keys_stock_writes(runs: Any, tmp_path: Any) -> None:
    """A compiled submodule's checkpoint, saved by the strategy: ``inspect`` lists the module's keys as stock's
    torch file holds them (``net._orig_mod.0.weight``), and ``convert`` to a torch file gives stock's checkpoint
    dict: the same state_dict keys and values, the optimizer state keyed by parameter index as stock's."""
    d, _ = runs
    stock = torch.load(d / "trainer_stock_sub.ckpt", weights_only=False)
    for mode in ("plugin", "strategy"):
        ours = str(d / f"trainer_{mode}_sub.ckpt")
        code, text = _cli(["inspect", "--json", ours])
        assert code == 0, text
        listed = json.dumps(json.loads(text))
        assert all(f'"{k}"' in listed or f'"state_dict/{k}"' in listed for k in stock["state_dict"]), text
        assert "net.0.weight" not in listed
        target = tmp_path / f"{mode}.pt"
        code, text = _cli(["convert", ours, str(target)])
        assert code == 0, text
        back = torch.load(target, weights_only=False)
        assert list(back["state_dict"]) == list(stock["state_dict"])
        assert state_differences(back["optimizer_states"], stock["optimizer_states"]) == []
        assert back["global_step"] == stock["global_step"] == STEPS


if __name__ == "__main__":
    from scenario_runner import scenario_main

    scenario_main(SCENARIOS)
