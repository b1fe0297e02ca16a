"""A tiny tensor-parallel LightningModule and deterministic, resumable data for the Lightning tests.

``StepBatches`` yields, for training step ``s``, this data-parallel rank's slice of a global batch
that depends only on ``(seed, s)``: a run resumed at global step ``s`` sees exactly the data an
uninterrupted run would, under any world size. The module records the global (data-parallel
mean) loss of every step, so runs can be compared.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from torch.nn import functional as F

from lightning_distckpt.lightning.parallel import module_sharded_state_dict, parallel_state_of
from example_layers import ColumnParallelLinear, RowParallelLinear  # examples/tp_layers.py
from script_ranks import run_ranks, script_env


class StepBatches:
    """Batches for steps ``first_step .. last_step - 1``; step ``s``'s global batch is a function of ``s``."""

    def __init__(self, first_step: int, last_step: int, global_batch: int, d_in: int, d_out: int,
                 dp_rank: int, dp_size: int, seed: int = 0) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} not divisible by data-parallel size {dp_size}")
        self.first_step, self.last_step = first_step, last_step
        self.global_batch, self.d_in, self.d_out = global_batch, d_in, d_out
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.teacher = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(seed + 7))

    def __len__(self) -> int:
        return max(0, self.last_step - self.first_step)

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(self.global_batch, self.d_in, generator=g)
        y = torch.tanh(x @ self.teacher) + 0.05 * torch.randn(self.global_batch, self.d_out, generator=g)
        part = self.global_batch // self.dp_size
        rows = slice(self.dp_rank * part, (self.dp_rank + 1) * part)
        return x[rows], y[rows]

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for step in range(self.first_step, self.last_step):
            yield self.batch(step)


TEST_STEP = 3


class SmallMLP(torch.nn.Module):
    """8 -> 16 -> 4 with a GELU, seeded: the plain module the ModelParallel tests shard (FSDP2, TP)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class StepCounter(Callback):
    """A stateful callback: counts the training batches it has seen, across resumes."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.count = state["count"]


class TPMLP(LightningModule):
    """``fc2(gelu(fc1(x)))`` with fc1 column-parallel and fc2 row-parallel over the TP group.
    ``conf`` (e.g. an omegaconf DictConfig) is only stored as a hyper-parameter."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4, lr: float = 0.05, total_steps: int = 8,
                 global_batch: int = 8, seed: int = 0, extra_layer: bool = False, conf: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.fc1 = None
        self.losses: Dict[int, float] = {}
        self.test_losses: List[float] = []

    def configure_model(self) -> None:
        if self.fc1 is not None:
            return
        hp = self.hparams
        self.ps = parallel_state_of(self)
        torch.manual_seed(hp.seed)  # the same global weights on every rank, whatever the TP size
        self.fc1 = ColumnParallelLinear(hp.d_in, hp.d_hidden, self.ps)
        self.fc2 = RowParallelLinear(hp.d_hidden, hp.d_out, self.ps)
        if hp.extra_layer:
            self.norm = torch.nn.LayerNorm(hp.d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(x)))
        return self.norm(y) if self.hparams.extra_layer else y

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, Any]:
        return module_sharded_state_dict(self, prefix, replica_id=self.ps.replicated_id)

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        value = loss.detach().clone()
        if self.ps.dp_size > 1:  # the global batch's loss, comparable across world sizes
            dist.all_reduce(value, group=self.ps.dp_group)
            value /= self.ps.dp_size
        self.losses[self.global_step] = value.item()
        return loss

    def test_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        value = F.mse_loss(self(x), y).detach().clone()
        if self.ps.dp_size > 1:
            dist.all_reduce(value, group=self.ps.dp_group)
            value /= self.ps.dp_size
        self.test_losses.append(value.item())

    def test_dataloader(self) -> StepBatches:
        """Step ``TEST_STEP``'s batch: its loss under the checkpoint of that step is the logged training loss."""
        hp = self.hparams
        return StepBatches(TEST_STEP, TEST_STEP + 1, hp.global_batch, hp.d_in, hp.d_out, self.ps.dp_rank,
                           self.ps.dp_size, hp.seed)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> StepBatches:
        hp = self.hparams
        return StepBatches(self.trainer.global_step, hp.total_steps, hp.global_batch, hp.d_in, hp.d_out,
                           self.ps.dp_rank, self.ps.dp_size, hp.seed)


class SGDMLP(TPMLP):
    """TPMLP with plain SGD and no LR scheduler: an optimizer that keeps no per-parameter state."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def quiet_trainer(**kwargs: Any) -> Any:
    """A CPU Trainer with one device, no logger, progress bar or model summary; ``kwargs`` add to or
    replace these."""
    from lightning.pytorch import Trainer

    settings = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(**{**settings, **kwargs})


def full_weights(module: TPMLP) -> Dict[str, torch.Tensor]:
    """The module's global weights, gathered over the TP group (for comparing runs)."""
    out = {}
    ps = module.ps
    for name, p in module.named_parameters():
        t = p.detach()
        axis = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}.get(name)
        if axis is not None and ps.tp_size > 1:
            parts = [torch.empty_like(t) for _ in range(ps.tp_size)]
            dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
            t = torch.cat(parts, dim=axis)
        out[name] = t.clone()
    return out


def optimizer_full_state(module: TPMLP, optimizer: torch.optim.Optimizer) -> Dict[str, List[float]]:
    """exp_avg / exp_avg_sq / step of each parameter, gathered over TP like the weights."""
    ps = module.ps
    out: Dict[str, Any] = {}
    for name, p in module.named_parameters():
        st = optimizer.state.get(p, {})
        for k, v in st.items():
            t = v.detach()
            axis = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}.get(name)
            if t.ndim and axis is not None and ps.tp_size > 1:
                parts = [torch.empty_like(t) for _ in range(ps.tp_size)]
                dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
                t = torch.cat(parts, dim=axis)
            out[f"{name}.{k}"] = t.clone()
    return out


# -- running the scripts under tests/lightning_scripts ------------------------------------------
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_scripts")


def run_script(script: str, args: List[str], out: str, world_size: int, timeout: float = 300) -> List[Dict[str, Any]]:
    """Run ``tests/lightning_scripts/<script> ARGS --out OUT`` on ``world_size`` ranks (``script_ranks``:
    forked, as torchrun would start them) and return each rank's ``OUT.rank<r>.json``. Fails with
    the output's tail."""
    code, output = run_ranks(os.path.join(SCRIPTS, script), [*args, "--out", out], script_env(), world_size, timeout)
    results = []
    for rank in range(world_size):
        path = f"{out}.rank{rank}.json"
        if not os.path.isfile(path):
            raise AssertionError(f"rank {rank} wrote no results (exit {code}):\n{output[-12000:]}")
        with open(path) as f:
            results.append(json.load(f))
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    if code != 0 or errors:
        raise AssertionError(f"exit {code}\n" + "\n".join(errors) + f"\n{output[-12000:]}")
    return results


def state_differences(got: Any, want: Any, where: str = "") -> List[str]:
    """Where ``got`` differs from ``want`` (nested dicts, lists and tuples; tensors by dtype and bit-exact
    values, anything else by type and ==), one line per difference naming its path."""
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return [] if same else [f"{where}: {got!r} != {want!r}"]
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in state_differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in state_differences(g, w, f"{where}/{i}")]
    return [] if type(got) is type(want) and got == want else [f"{where}: {got!r} != {want!r}"]
