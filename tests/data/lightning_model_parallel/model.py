"""The tiny model of the checked-in Lightning ModelParallelStrategy checkpoint, and its two programs
(each run as ``python model.py ...``, where a Trainer on 2 CPU devices re-runs the script for rank 1;
the test starts both ranks itself, ``tests/script_ranks.py``):

``build OUT``: how ``ckpt/`` and ``expected.pt`` were made (by hand, never by CI): 2 training steps
under Lightning's own ``ModelParallelStrategy`` (FSDP2 over a data-parallel mesh of 2, gloo), then
``trainer.save_checkpoint(OUT/ckpt)`` (DCP files + meta.pt) and, gathered whole by the writer,
every weight and Adam state (``expected.pt``).

``resume CKPT RESULT``: ``fit(ckpt_path=CKPT)`` under lightning_distckpt's
``DistCheckpointModelParallelStrategy`` with another split (tensor parallel 2, data parallel 1);
what the model and optimizer hold at train start, gathered whole, and the restored step go to RESULT.
"""

import sys
from typing import Any, Dict

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS = 2  # trained before the checkpoint


class Model(pl.LightningModule):
    """``fc2(gelu(fc1(x)))``: fc1 column- and fc2 row-parallel over a TP mesh, FSDP2 over the DP mesh."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def configure_model(self) -> None:
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for layer in (self.fc1, self.fc2, self):
            fully_shard(layer, mesh=dp)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.fc2(torch.nn.functional.gelu(self.fc1(x))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_state(model: Model, trainer: pl.Trainer) -> Dict[str, torch.Tensor]:
    """Whole weights and Adam state by parameter name (collective: DTensors are gathered)."""
    out = {}
    opt = trainer.optimizers[0]
    for name, p in model.named_parameters():
        out[name] = _full(p)
        for k, v in sorted(opt.state[p].items()):
            out[f"{name}.{k}"] = _full(v)
    return out


def trainer(strategy: Any, max_steps: int, callbacks: Any = ()) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, max_epochs=-1,
                      callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def build(out: str) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    t, model = trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), STEPS), Model()
    t.fit(model)
    t.save_checkpoint(out + "/ckpt")
    state = full_state(model, t)
    if t.global_rank == 0:
        torch.save(state, out + "/expected.pt")


class Captured(pl.Callback):
    """The state the restore left, gathered at train start."""

    def __init__(self) -> None:
        self.got: Dict[str, Any] = {}

    def on_train_start(self, trainer_: pl.Trainer, module: Any) -> None:
        self.got = {"state": full_state(module, trainer_), "step": trainer_.global_step}


def resume(ckpt: str, result: str) -> None:
    from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy

    cap = Captured()
    t = trainer(DistCheckpointModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), STEPS + 1, [cap])
    t.fit(Model(), ckpt_path=ckpt)
    if t.global_rank == 0:
        torch.save({**cap.got, "final_step": t.global_step}, result)


if __name__ == "__main__":
    {"build": build, "resume": resume}[sys.argv[1]](*sys.argv[2:])
    # Tear the gloo group down before exit: left to interpreter shutdown, its threads were
    # destroyed while joinable now and then ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
