"""lightning_distckpt: distributed (sharded) checkpointing for PyTorch Lightning and Fabric.

Describe how each local tensor sits in its global tensor (:class:`ShardedTensor`), then call the
collective :func:`save` / :func:`load`. Checkpoints load under any world size or parallel split.
"""

import logging as _logging

# Quiet unless the application configures logging (see lightning_distckpt.logs); under the Lightning
# Trainer / Fabric our plugin prints through Lightning's logger.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

from .core.errors import (  # noqa: E402
    CheckpointingError,
    FormatError,
    IncompleteCheckpointError,
    MissingKeysError,
    SaveFailedError,
    ShardingError,
    ValidationError,
)
from .core.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from .core.factories import fused_split_factory, transposed_factory
from .core.strict import StrictHandling
from .serialization import load, load_common_state_dict, load_plain_tensors, load_tensors_metadata, save
from .convert import ConvertReport, relayout_checkpoint
from .export import export_dcp, export_megatron, export_safetensors
from .optim import init_optimizer_state, optimizer_sharded_state_dict, restore_optimizer_state
from .storage.tensorstore_io import StorageOptions
from .saving.async_save import AsyncSaver, AsyncSaveRequest
from .saving.save import SavePlanCache
from .reading import EveryRankLoader, FullyParallelLoader, TwoStageDataParallelLoader
from .ingest import DistModule, broadcast_and_shard_state_dict, shard_broadcasted_state_dict
from .version import __version__
from .registration import register_names as _register_names

# The Lightning / Fabric integration imports Lightning (slow): loaded on first use of one of its names.
# The strategy names (strategy="ddp_distckpt", ...) are registered now, without importing Lightning:
# in its registries at once if it is imported, else when it is (registration.py).
_register_names()

_LIGHTNING_NAMES = (
    "DistCheckpointIO",
    "DistCheckpointStrategy",
    "DistCheckpointModelParallelStrategy",
    "DistModelCheckpoint",
    "FabricDistCheckpointStrategy",
    "FabricDistCheckpointModelParallelStrategy",
    "DistCheckpointConfig",
    "StrategyConfig",
    "ConfigError",
    "ParallelState",
    "module_sharded_state_dict",
    "parallel_state_of",
    "load_lightning_module",
    "load_module_weights",
    "export_torch_file",  # Lightning checkpoints as Lightning's dict; others as convert.export_torch_file
    "import_torch_file",
)


def __getattr__(name: str):
    if name in _LIGHTNING_NAMES:
        from . import lightning as _lightning

        return getattr(_lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    *_LIGHTNING_NAMES,
    "AsyncSaveRequest",
    "AsyncSaver",
    "SavePlanCache",
    "EveryRankLoader",
    "FullyParallelLoader",
    "TwoStageDataParallelLoader",
    "CheckpointingError",
    "ConvertReport",
    "FormatError",
    "IncompleteCheckpointError",
    "LocalNonpersistentObject",
    "MissingKeysError",
    "SaveFailedError",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardingError",
    "DistModule",
    "broadcast_and_shard_state_dict",
    "shard_broadcasted_state_dict",
    "StorageOptions",
    "StrictHandling",
    "ValidationError",
    "__version__",
    "fused_split_factory",
    "init_optimizer_state",
    "optimizer_sharded_state_dict",
    "restore_optimizer_state",
    "transposed_factory",
    "load",
    "load_common_state_dict",
    "load_plain_tensors",
    "load_tensors_metadata",
    "relayout_checkpoint",
    "export_dcp",
    "export_megatron",
    "export_safetensors",
    "save",
]
