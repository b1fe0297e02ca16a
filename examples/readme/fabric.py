# Run: python examples/readme/fabric.py 2 && python examples/readme/fabric.py 1
import os
import sys

import torch
from lightning.fabric import Fabric

from lightning_distckpt.lightning import FabricDistCheckpointStrategy

fabric = Fabric(accelerator="cpu", devices=int(sys.argv[1]), strategy=FabricDistCheckpointStrategy())
fabric.launch()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
state = {"model": model, "optimizer": optimizer, "step": 0}
if os.path.exists("checkpoints/fabric"):
    fabric.load("checkpoints/fabric", state)  # in place, any number of processes; sets state["step"]
for _ in range(4):
    loss = torch.nn.functional.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 2, (16,)))
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
    state["step"] += 1
fabric.save("checkpoints/fabric", state)  # every rank takes part; replaces the old one atomically
fabric.print(f"{fabric.world_size} process(es): saved step {state['step']}")
