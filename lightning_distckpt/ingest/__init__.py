"""Start from an ordinary checkpoint: rank 0 reads it, every rank gets its shards.

* :func:`load_state_dict` reads a ``torch.save`` file, a ``.safetensors`` file or a Hugging Face
  model directory on global rank 0 (memory-mapped), ``{}`` elsewhere;
* :func:`broadcast_and_shard_state_dict` (rank 0) and :func:`shard_broadcasted_state_dict` (the
  other ranks) move what each rank's :class:`~lightning_distckpt.ShardedTensor` s describe;
* :class:`DistModule` does both inside ``module.load_state_dict``.

See docs/ingest.md.
"""

from .api import ShardOptions, ShardResult, broadcast_and_shard_state_dict, shard_broadcasted_state_dict
from .files import CheckpointStateDict, load_state_dict
from .module import DistModule

__all__ = [
    "CheckpointStateDict",
    "DistModule",
    "ShardOptions",
    "ShardResult",
    "broadcast_and_shard_state_dict",
    "load_state_dict",
    "shard_broadcasted_state_dict",
]
