"""The state written into each format witness (``build.py``) and expected back by
``tests/interop/test_format_witnesses.py``: deterministic values (``torch.arange``-based), so a test
re-creates them bit for bit. Depends on torch alone: ``build.py`` runs it under an old checkout of
the library, the test under today's. From format 8 on a witness also holds a tied pair
(``tied_tensors``), written once."""

from typing import Any, Dict, Optional

import torch

WORLD = 2  # every witness was written by 2 gloo processes


def full_tensors() -> Dict[str, torch.Tensor]:
    """The global tensors, by checkpoint key."""
    return {
        # fp32, tensor-parallel rows: rank r wrote rows 48r..48r+47 (an even dim-0 split; 1.5 KiB a
        # rank, so 2 chunks of the ``-zarr`` witnesses' 1 KiB chunks)
        "model.tp_row.weight": torch.arange(96 * 8, dtype=torch.float32).reshape(96, 8) / 8 - 2,
        # bf16, tensor-parallel columns: rank r wrote columns 3r..3r+2 (exact in bf16: multiples of 1/4)
        "model.tp_col.weight": (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 4 - 1).to(torch.bfloat16),
        # int64, replicated on both ranks (values past 2**32 catch a narrowing)
        "model.ids": torch.arange(5, dtype=torch.int64) * 1_000_000_007 - 3,
        # fp32, distributed-optimizer layout: the flattened tensor split unevenly (10 | 14 elements)
        "optimizer.exp_avg": torch.arange(24, dtype=torch.float32).reshape(4, 6) * -0.5,
    }


# the axis each tensor was split along when saved (None: replicated; "flat": flattened ranges)
SAVE_AXES: Dict[str, Optional[Any]] = {
    "model.tp_row.weight": 0, "model.tp_col.weight": 1, "model.ids": None, "optimizer.exp_avg": "flat",
}
FLAT_SPLIT = (0, 10, 24)  # rank r held elements FLAT_SPLIT[r]:FLAT_SPLIT[r + 1] of the flattened tensor

# ShardedObject "model.extra_state", one element per rank (global shape (2,), offset (r,))
OBJECT_KEY = "model.extra_state"
OBJECTS = ({"rank": 0, "tag": "zero", "ids": [1, 2]}, {"rank": 1, "tag": "one", "ids": [3]})

# common state (rank 0's non-sharded leaves)
COMMON = {"step": 11, "config": {"lr": 0.25, "names": ["a", "b"]}}


def plain_tensors() -> Dict[str, torch.Tensor]:
    """Plain ``torch.Tensor`` leaves under ``"scores"``: common state in formats 1-5, stored tensors
    (``plain_tensors`` in metadata.json) in format 6."""
    return {"best": torch.tensor(0.5, dtype=torch.float64), "history": torch.arange(4, dtype=torch.int32) * 3}


# From format 8 (tied tensors stored once): a tied pair, one memory under two keys on each rank, split by rows
# over the 2 ranks. 64 KiB a rank (planning/aliases.TIE_MIN_BYTES); rows of 32 KiB, so every chunk of the
# ``-zarr`` witness is one row (2 chunks a rank) and the witnesses stay a few files. The smaller key is the
# one stored; the other is recorded in metadata.json's ``aliases``. Witnesses v1-v7 do not hold it.
TIED_SINCE = 8
TIED_KEYS = ("model.embed.weight", "model.lm_head.weight")  # (stored target, alias)


def tied_tensor() -> torch.Tensor:
    """The tied pair's global tensor: fp32 (4, 8192), multiples of 1/16 (exact)."""
    return torch.arange(4 * 8192, dtype=torch.float32).reshape(4, 8192) / 16 - 7


def full_tensors_of(version: int) -> Dict[str, torch.Tensor]:
    """The global tensors a witness of format ``version`` holds, by key (the tied pair: one tensor, twice)."""
    out = full_tensors()
    if version >= TIED_SINCE:
        tied = tied_tensor()
        out.update({key: tied for key in TIED_KEYS})
    return out
