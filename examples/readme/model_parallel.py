# Run: python examples/readme/model_parallel.py 1 2 4 && python examples/readme/model_parallel.py 2 1 8
# (DP 1 x TP 2 to step 4; then DP 2 x TP 1, FSDP2 alone, to step 8)
import sys

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy


class MLP(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def configure_model(self):  # torch's tensor parallel, then FSDP2, on Lightning's device mesh
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(self.layer, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for module in (self.layer[0], self.layer[2], self):
            fully_shard(module, mesh=dp)


dp, tp, steps = (int(a) for a in sys.argv[1:4])
seed_everything(0)  # the same data on tensor-parallel ranks
strategy = DistCheckpointModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
trainer = Trainer(accelerator="cpu", devices=dp * tp, strategy=strategy, max_steps=steps, logger=False,
                  callbacks=[ModelCheckpoint("checkpoints/model_parallel", every_n_train_steps=2, save_last=True)])
trainer.fit(MLP(), ckpt_path="last")
print(f"rank {trainer.global_rank}: DP {dp} x TP {tp}, at step {trainer.global_step}")
