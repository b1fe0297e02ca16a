"""lightning_distckpt: distributed (sharded) checkpointing for PyTorch Lightning and Fabric.

Describe how each local tensor sits in its global tensor (:class:`ShardedTensor`), then call the
collective :func:`save` / :func:`load`. Checkpoints load under any world size or parallel split.

This module is the core API: the data model, ``save`` / ``load`` / ``validate``, the single-process
readers, :class:`AsyncSaver`, the loaders, :class:`StorageOptions` and every error the library
raises. The layers above it are their own subpackages (``import lightning_distckpt as ldc`` makes
each reachable as an attribute, imported on first use):

* :mod:`lightning_distckpt.lightning`: the Lightning and Fabric plugin, strategies and helpers;
* :mod:`lightning_distckpt.export`: to and from other formats (safetensors, DCP, Megatron-Core,
  one ``torch.save`` file) and between storage layouts;
* :mod:`lightning_distckpt.ingest`: rank-0 load of an ordinary checkpoint, broadcast and shard;
* :mod:`lightning_distckpt.optim`: optimizer state as sharded state dicts;
* :mod:`lightning_distckpt.core.factories`: ready-made ``ShardedTensorFactory`` s.
"""

import importlib as _importlib
import logging as _logging

# Quiet unless the application configures logging (see lightning_distckpt.logs); under the Lightning
# Trainer / Fabric our plugin prints through Lightning's logger.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

from .core.errors import (  # noqa: E402
    ArgumentError,
    ArgumentTypeError,
    CheckpointingError,
    CheckpointNotFoundError,
    CollectiveError,
    ConfigError,
    FormatError,
    IncompleteCheckpointError,
    MissingKeysError,
    SaveFailedError,
    ShardingError,
    UnsafeContentError,
    ValidationError,
)
from .core.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory  # noqa: E402
from .core.strict import StrictHandling  # noqa: E402
from .serialization import (  # noqa: E402
    load,
    load_common_state_dict,
    load_content_metadata,  # noqa: F401 (Megatron-Core's name; outside __all__, which is capped)
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
from .validation import validate  # noqa: E402
from .megatron_dirs import check_is_distributed_checkpoint, remove_sharded_tensors  # noqa: E402, F401 (Megatron-Core's)
from .storage.tensorstore_io import StorageOptions  # noqa: E402
from .saving.async_save import AsyncSaver  # noqa: E402
from .reading.loaders import EveryRankLoader, FullyParallelLoader, TwoStageDataParallelLoader  # noqa: E402
from .version import __version__  # noqa: E402, F401 (public)
from .registration import register_names as _register_names  # noqa: E402
from .deprecated import DEPRECATED as _DEPRECATED  # noqa: E402
from .deprecated import resolve as _resolve_deprecated  # noqa: E402

# The strategy names (strategy="ddp_distckpt", ...) are registered now, without importing Lightning:
# in its registries at once if it is imported, else when it is (registration.py).
_register_names()

# The layers above the core, imported on first use as attributes (``ldc.lightning.DistCheckpointIO``):
# ``import lightning_distckpt`` imports neither Lightning nor the exporters.
_SUBPACKAGES = frozenset({"export", "ingest", "lightning", "optim"})


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _DEPRECATED:
        return _resolve_deprecated(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBPACKAGES)


__all__ = [
    # the data model
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "StrictHandling",
    # save, load, validate and the single-process readers
    "save",
    "load",
    "validate",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_common_state_dict",
    "load_plain_tensors",
    "AsyncSaver",
    "EveryRankLoader",
    "FullyParallelLoader",
    "TwoStageDataParallelLoader",
    "StorageOptions",
    # every error the library raises (all CheckpointingError)
    "CheckpointingError",
    "ArgumentError",
    "ArgumentTypeError",
    "ConfigError",
    "ShardingError",
    "ValidationError",
    "IncompleteCheckpointError",
    "CheckpointNotFoundError",
    "FormatError",
    "UnsafeContentError",
    "MissingKeysError",
    "SaveFailedError",
    "CollectiveError",
]
