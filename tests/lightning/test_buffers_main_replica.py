"""Replicated tensors that may differ by rank are saved from the main replica (rank 0's), as stock does.

DDP and FSDP2 keep the parameters equal on every data-parallel rank, not the buffers: a buffer the
forward updates from the rank's own batch (BatchNorm's running statistics) differs by rank. Stock Fabric
DDP (``fabric.save``: rank 0's state) and stock ``ModelParallelStrategy`` with a full state dict save rank
0's (stock DCP keeps whichever holder's copy its load balancing picks). On 2 gloo processes
a ``fabric.save`` under ``FabricDistCheckpointStrategy``, under Fabric's DDP with ``DistCheckpointIO``
and under ``FabricDistCheckpointModelParallelStrategy`` (FSDP2), and a Trainer's save under
``DistCheckpointStrategy`` and ``DistCheckpointModelParallelStrategy``, are loaded into fresh modules: the
buffers are rank 0's on every rank, bit-exact as stock's, and so are the parameters and the optimizer
state; and no save warns that the ranks' common state differs (its manifest is the same on every rank).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Callable, Dict, List

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import free_port, run_distributed
from lightning_helpers import state_differences

GROUP_TIMEOUT_S = 30  # a hang guard only: every wait below is on a collective
STEPS = 2


class Net(nn.Module):
    """A linear layer, then BatchNorm: its running statistics follow each rank's own batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def _batch(step: int, rank: int) -> torch.Tensor:
    """This rank's batch of ``step``: different on each rank, and so are the running statistics."""
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank)) * (rank + 1)


def _fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh["data_parallel"])


def _snapshot(net: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, Any]:
    """The module's state (parameters and buffers, whole: collective for DTensors) and the Adam moments, cloned."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    state = {k: whole(v) for k, v in net.state_dict().items()}
    moments = {n: {k: whole(v) for k, v in opt.state[p].items()} for n, p in net.named_parameters()}
    return {"state": state, "moments": moments}


def _fabric_run(strategy: Any, path: str) -> Dict[str, Any]:
    """Train STEPS steps under ``strategy``, ``fabric.save`` to ``path``, load into a fresh module and optimizer."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = Net()
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    for step in range(STEPS):
        opt.zero_grad()
        fabric.backward(model(_batch(step, fabric.global_rank)).square().mean())
        opt.step()
    saved = _snapshot(net, opt)
    fabric.save(path, {"model": model, "optimizer": opt})
    fresh = Net()
    model2 = fabric.setup_module(fresh)
    opt2 = fabric.setup_optimizers(torch.optim.Adam(model2.parameters(), lr=0.1))
    fabric.load(path, {"model": model2, "optimizer": opt2})
    return {"saved": saved, "loaded": _snapshot(fresh, opt2)}


class BNModule(LightningModule):
    """Net under the Trainer (FSDP2 over the data-parallel mesh with ``fsdp``); each rank trains on its own batches."""

    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        self.net, self.fsdp = Net(), fsdp

    def configure_model(self) -> None:
        if self.fsdp:
            _fsdp(self.net, self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(_batch(self.global_step, self.global_rank)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=1)


def _trainer_run(strategy: Callable[[], Any], fsdp: bool, path: str) -> Dict[str, Any]:
    """STEPS steps under ``strategy()``, ``trainer.save_checkpoint(path)``; a fresh module resumed from it."""
    def trainer() -> Trainer:
        return Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                       strategy=strategy())

    model, first = BNModule(fsdp), trainer()
    first.fit(model)
    saved = _snapshot(model.net, first.optimizers[0])
    first.save_checkpoint(path)
    fresh, second = BNModule(fsdp), trainer()
    second.fit(fresh, ckpt_path=path)  # max_steps reached: restores, trains no further
    return {"saved": saved, "loaded": _snapshot(fresh.net, second.optimizers[0])}


class _Warnings(logging.Handler):
    """The package's warnings while installed (a save warns when the ranks' common state differs)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: List[str] = []
        logging.getLogger("lightning_distckpt").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())

    def stop(self) -> List[str]:
        logging.getLogger("lightning_distckpt").removeHandler(self)
        return self.records


def _runs(rank: int, world: int, base: str, port: int) -> Dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # Fabric and the Trainer join the group run_distributed made
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_distckpt.lightning import (DistCheckpointIO, DistCheckpointModelParallelStrategy,
                                              DistCheckpointStrategy, FabricDistCheckpointStrategy)
    from lightning_distckpt.lightning.fabric_model_parallel import FabricDistCheckpointModelParallelStrategy

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    mp = dict(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout)
    at = lambda name: os.path.join(base, name)  # noqa: E731
    out: Dict[str, Any] = {"warnings": {}}
    fabric = {"stock": (lambda: DDPStrategy(timeout=timeout), "stock.pt"),
              "ours": (lambda: FabricDistCheckpointStrategy(timeout=timeout), "ours"),
              "plugin": (lambda: DDPStrategy(checkpoint_io=DistCheckpointIO(), timeout=timeout), "plugin"),
              "stock_mp": (lambda: ModelParallelStrategy(_fsdp, save_distributed_checkpoint=False, **mp), "mp.pt"),
              "ours_mp": (lambda: FabricDistCheckpointModelParallelStrategy(_fsdp, **mp), "ours_mp")}
    trainer = {"trainer_ddp": (lambda: DistCheckpointStrategy(timeout=timeout), False),
               "trainer_mp": (lambda: DistCheckpointModelParallelStrategy(**mp), True)}
    for name, (strategy, path) in fabric.items():
        warned = _Warnings()
        out[name] = _fabric_run(strategy(), at(path))
        out["warnings"][name] = warned.stop()
    for name, (strategy, fsdp) in trainer.items():
        warned = _Warnings()
        out[name] = _trainer_run(strategy, fsdp, at(name))
        out["warnings"][name] = warned.stop()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_runs, 2, str(tmp_path_factory.mktemp("buffers")), free_port(), timeout_s=120)


def _rank_zeros(ranks: List[Dict[str, Any]], how: str) -> None:
    """Every rank loaded what rank 0 had when it saved (the buffers differed by rank: the check means something)."""
    saved = [r[how]["saved"]["state"] for r in ranks]
    assert not torch.equal(saved[0]["bn.running_mean"], saved[1]["bn.running_mean"]), how
    for rank, runs in enumerate(ranks):
        diff = state_differences(runs[how]["loaded"]["state"], saved[0])
        assert not diff, f"rank {rank}, {how}: not rank 0's state:\n" + "\n".join(diff)


@pytest.mark.parametrize("how", ["ours", "plugin"])
def test_fabric_ddp_save_loads_rank_zeros_buffers_as_stock_fabric(ranks, how):
    """``fabric.save`` under FabricDistCheckpointStrategy (and stock DDP + DistCheckpointIO): loaded, the module
    and the optimizer are stock Fabric DDP's, bit for bit, on every rank; the BatchNorm statistics rank 0's."""
    _rank_zeros(ranks, "stock")
    _rank_zeros(ranks, how)
    for rank, runs in enumerate(ranks):
        diff = state_differences(runs[how]["loaded"], runs["stock"]["loaded"])
        assert not diff, f"rank {rank}, {how} vs stock:\n" + "\n".join(diff)


def test_fabric_fsdp2_save_loads_rank_zeros_buffers_as_stock_full_state_dict(ranks):
    """FabricDistCheckpointModelParallelStrategy: as stock ModelParallelStrategy's full state dict (rank 0's)."""
    _rank_zeros(ranks, "stock_mp")
    _rank_zeros(ranks, "ours_mp")
    for rank, runs in enumerate(ranks):
        diff = state_differences(runs["ours_mp"]["loaded"], runs["stock_mp"]["loaded"])
        assert not diff, f"rank {rank}, ours_mp vs stock_mp:\n" + "\n".join(diff)


@pytest.mark.parametrize("how", ["trainer_ddp", "trainer_mp"])
def test_trainer_resume_restores_rank_zeros_buffers(ranks, how):
    """DistCheckpointStrategy and DistCheckpointModelParallelStrategy (FSDP2): a resume restores rank 0's buffers,
    and the parameters and Adam moments as they were (equal on every rank)."""
    _rank_zeros(ranks, how)
    for rank, runs in enumerate(ranks):
        diff = state_differences(runs[how]["loaded"]["moments"], ranks[0][how]["saved"]["moments"])
        assert not diff, f"rank {rank}, {how}: moments:\n" + "\n".join(diff)


def test_no_save_warns_that_the_common_state_differs(ranks):
    """Leaving a rank's buffer copies out keeps the manifest (common state) the same on every rank."""
    for rank, runs in enumerate(ranks):
        assert runs["warnings"] == {name: [] for name in runs["warnings"]}, (rank, runs["warnings"])
