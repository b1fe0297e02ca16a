# Run: torchrun --standalone --nproc-per-node 2 examples/readme/core.py
import torch
import torch.distributed as dist

import lightning_distckpt as ldc

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
full = torch.arange(48.0).reshape(8, 6)  # the global tensor; each rank holds a piece

# Each piece says where it sits: (axis, this rank's fragment, fragments along that axis).
ldc.save({
    "weight": ldc.ShardedTensor.from_rank_offsets("weight", full.chunk(world, 0)[rank].clone(), (0, rank, world)),
    "bias": ldc.ShardedTensor.from_rank_offsets("bias", torch.ones(6), replica_id=rank),  # replicated: stored once
    "step": 100,  # anything else is common state, written once
}, "checkpoints/core")

# The template says which piece each rank wants now; its tensors are filled in place.
cols = torch.empty(8, 6 // world)
state = ldc.load({"weight": ldc.ShardedTensor.from_rank_offsets("weight", cols, (1, rank, world))}, "checkpoints/core")
assert torch.equal(cols, full.chunk(world, 1)[rank]) and state["step"] == 100
print(f"rank {rank}: columns {rank * cols.shape[1]} to {(rank + 1) * cols.shape[1]} of 'weight'")
dist.destroy_process_group()
