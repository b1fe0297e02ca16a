# Run: python examples/readme/trainer.py 2 4 && python examples/readme/trainer.py 1 8
# (2 processes to step 4, then 1 process from the last checkpoint to step 8)
import sys

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel  # stands for your LightningModule

from lightning_distckpt.lightning import DistCheckpointIO

devices, steps = int(sys.argv[1]), int(sys.argv[2])
trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp", max_steps=steps, logger=False,
                  plugins=[DistCheckpointIO()],  # the one change: checkpoints are written by this library
                  callbacks=[ModelCheckpoint("checkpoints/trainer", every_n_train_steps=2, save_last=True)])
trainer.fit(BoringModel(), ckpt_path="last")  # the newest committed checkpoint there, if any
print(f"rank {trainer.global_rank} of {trainer.world_size}: at step {trainer.global_step}")
