"""Top-level names of release 0.2 that moved to the layer they belong to: they still resolve, for one
release, with a ``DeprecationWarning`` that names the new import (``lightning_distckpt.__getattr__``)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Dict, Tuple

_LIGHTNING = "lightning_distckpt.lightning"
_EXPORT = "lightning_distckpt.export"
_INGEST = "lightning_distckpt.ingest"
_OPTIM = "lightning_distckpt.optim"
_FACTORIES = "lightning_distckpt.core.factories"

#: old top-level name -> (module it lives in now, its name there)
DEPRECATED: Dict[str, Tuple[str, str]] = {
    **{name: (_LIGHTNING, name) for name in (
        "DistCheckpointIO", "DistCheckpointStrategy", "DistCheckpointModelParallelStrategy", "DistModelCheckpoint",
        "FabricDistCheckpointStrategy", "FabricDistCheckpointModelParallelStrategy", "DistCheckpointConfig",
        "StrategyConfig", "ParallelState", "module_sharded_state_dict", "parallel_state_of",
        "load_lightning_module", "load_module_weights")},
    "export_torch_file": (_EXPORT, "to_torch_file"),
    "import_torch_file": (_EXPORT, "from_torch_file"),
    "export_safetensors": (_EXPORT, "to_safetensors"),
    "export_dcp": (_EXPORT, "to_dcp"),
    "export_megatron": (_EXPORT, "to_megatron"),
    "relayout_checkpoint": (_EXPORT, "relayout"),
    "ConvertReport": (_EXPORT, "ConvertReport"),
    **{name: (_INGEST, name) for name in ("DistModule", "broadcast_and_shard_state_dict",
                                          "shard_broadcasted_state_dict")},
    **{name: (_OPTIM, name) for name in ("init_optimizer_state", "optimizer_sharded_state_dict",
                                         "restore_optimizer_state")},
    "fused_split_factory": (_FACTORIES, "fused_split_factory"),
    "transposed_factory": (_FACTORIES, "transposed_factory"),
    "AsyncSaveRequest": ("lightning_distckpt.saving.async_save", "AsyncSaveRequest"),
    "SavePlanCache": ("lightning_distckpt.saving.save", "SavePlanCache"),
}


def warn_moved(old: str, module: str, attr: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a dotted name) moved to ``module.attr``. The message starts with
    ``lightning_distckpt.`` (pyproject.toml turns these warnings into errors in our own tests, outside
    the test of this shim). ``stacklevel`` (as ``warnings.warn``'s, from here) points at the code that used
    the old name: 3 from a module ``__getattr__``."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use `from {module} import {attr}`",
                  DeprecationWarning, stacklevel=stacklevel)


def resolve(name: str) -> Any:
    """The object the old top-level ``name`` now is, after a DeprecationWarning naming its new import."""
    module, attr = DEPRECATED[name]
    warn_moved(f"lightning_distckpt.{name}", module, attr, stacklevel=4)  # via resolve
    return getattr(importlib.import_module(module), attr)
