"""The state saved into each DCP fixture (``build.py``) and expected back by
``tests/interop/test_dcp_fixtures.py``: deterministic values (``torch.arange``-based). Depends on torch
alone (the builder runs it under torch 2.5 and under today's torch)."""

from typing import Any, Dict

import torch

WORLD = 2  # every fixture was written by 2 gloo processes on a 1-D mesh


def full_tensors() -> Dict[str, torch.Tensor]:
    """The global tensors, by DCP's flattened key."""
    return {
        "model.embed.weight": torch.arange(48, dtype=torch.float32).reshape(8, 6) / 8 - 3,  # Shard(0)
        # Shard(1), exact in bf16 (multiples of 1/4)
        "model.proj.weight": (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 4 - 2).to(torch.bfloat16),
        "model.proj.bias": torch.arange(7 * 4, dtype=torch.float16).reshape(7, 4) / 2,  # Shard(0), uneven rows 4 | 3
        "model.ids": torch.arange(5, dtype=torch.int64) * 1_000_000_007 - 3,  # Replicate
        "optim.state.embed.weight.exp_avg": torch.arange(48, dtype=torch.float32).reshape(8, 6) * -0.25,  # Shard(0)
        "optim.state.embed.weight.step": torch.tensor(3.0),  # a plain tensor (saved once)
    }


PLACEMENTS = {  # placement on the 2-rank mesh: ("shard", dim) or "replicate"; None: a plain tensor
    "model.embed.weight": ("shard", 0), "model.proj.weight": ("shard", 1), "model.proj.bias": ("shard", 0),
    "model.ids": "replicate", "optim.state.embed.weight.exp_avg": ("shard", 0),
    "optim.state.embed.weight.step": None,
}

# non-tensor leaves (DCP stores them as bytes), by flattened key
OBJECTS: Dict[str, Any] = {
    "step": 7,
    "optim.param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["embed.weight"]}],
    "meta.names": ["x", "y"],
}


def nested(leaves: Dict[str, Any]) -> Dict[str, Any]:
    """``{"a.b": v}`` -> ``{"a": {"b": v}}`` (the state dict DCP was handed)."""
    out: Dict[str, Any] = {}
    for key, value in leaves.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out
