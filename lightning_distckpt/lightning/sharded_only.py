"""``save_distributed_checkpoint``, the argument of Lightning's ``ModelParallelStrategy`` (Trainer and
Fabric) that our subclasses take so that a user swapping the stock strategy for ours keeps their
call: ``True`` is what they always do; ``False`` (one full-state file from rank 0) is refused with how
to get one file from our checkpoint."""

from __future__ import annotations

from typing import Any

from ..core.errors import ArgumentError, ArgumentTypeError


def sharded_only(strategy: Any, save_distributed_checkpoint: Any) -> bool:
    """``True`` when ``save_distributed_checkpoint`` is; ``False`` is an ArgumentError saying our
    checkpoints are always sharded and how to export one file, anything else an ArgumentTypeError
    (``strategy``: the strategy being built, named in the errors)."""
    owner = type(strategy).__name__
    if not isinstance(save_distributed_checkpoint, bool):
        raise ArgumentTypeError(f"{owner}(save_distributed_checkpoint=...) must be a bool, got "
                                f"{type(save_distributed_checkpoint).__name__} {save_distributed_checkpoint!r:.80}")
    if not save_distributed_checkpoint:
        raise ArgumentError(
            f"{owner}(save_distributed_checkpoint=False): {owner}'s checkpoints are always sharded (every rank "
            "writes its own shards; any world size or mesh loads them), so only True is taken; for one file, "
            "export a checkpoint with lightning_distckpt.export.to_torch_file(path, 'model.ckpt') or "
            "`python -m lightning_distckpt convert PATH model.ckpt`, or use Lightning's ModelParallelStrategy "
            "for a full-state file at every save")
    return True
