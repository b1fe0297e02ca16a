# Run: python examples/readme/files.py
import torch
from safetensors.torch import load_file, save_file

import lightning_distckpt as ldc

# Out: whole tensors of any checkpoint, whatever split wrote it.
whole = torch.randn(8, 4)
ldc.save({"fc.weight": ldc.ShardedTensor.from_rank_offsets("fc.weight", whole)}, "checkpoints/files")
ldc.export.to_safetensors("checkpoints/files", "checkpoints/files_hf")  # model.safetensors (+ index)
assert torch.equal(load_file("checkpoints/files_hf/model.safetensors")["fc.weight"], whole)
assert torch.equal(ldc.load_plain_tensors("checkpoints/files")["fc.weight"], whole)

# In: safetensors, Hugging Face and torch.save files load into any split (here rows 4:8, rank 1 of 2);
# key_map renames keys (None skips one).
save_file({"model.fc.weight": torch.arange(32.0).reshape(8, 4)}, "checkpoints/pretrained.safetensors")
rows = torch.empty(4, 4)
template = {"fc.weight": ldc.ShardedTensor.from_rank_offsets("fc.weight", rows, (0, 1, 2))}
ldc.load(template, "checkpoints/pretrained.safetensors", key_map=lambda k: k.removeprefix("model."))
assert torch.equal(rows, torch.arange(16.0, 32.0).reshape(4, 4))
