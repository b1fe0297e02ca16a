"""Lightning and Fabric integration: the ``DistCheckpointIO`` plugin, ``DistCheckpointStrategy``
(Trainer), ``FabricDistCheckpointStrategy`` (Fabric), TP x DP process groups and their config.

Import these names from here (``from lightning_distckpt.lightning import DistCheckpointIO``): this
package imports Lightning, ``import lightning_distckpt`` does not. The strategy names
(``strategy="ddp_distckpt"``, ...) are registered by ``import lightning_distckpt`` alone.
"""

from ..core.errors import ConfigError
from .checkpoint_io import DistCheckpointIO
from .config import DistCheckpointConfig, StrategyConfig, load_checkpoint_config, load_strategy_config
from .fabric import FabricDistCheckpointStrategy
from .fabric_model_parallel import FabricDistCheckpointModelParallelStrategy
from .fabric_tiers import FabricTiers
from .model_parallel import DistCheckpointModelParallelStrategy
from .model_checkpoint import DistModelCheckpoint
from .inference import load_lightning_module, load_module_weights
from .parallel import ParallelState, module_sharded_state_dict, parallel_state_of
from .strategy import DistCheckpointStrategy
from .tiers import TierCheckpoint

__all__ = [
    "DistCheckpointIO",
    "DistCheckpointStrategy",
    "DistCheckpointModelParallelStrategy",
    "DistModelCheckpoint",
    "FabricDistCheckpointStrategy",
    "FabricDistCheckpointModelParallelStrategy",
    "FabricTiers",
    "TierCheckpoint",
    "DistCheckpointConfig",
    "StrategyConfig",
    "ConfigError",
    "ParallelState",
    "module_sharded_state_dict",
    "parallel_state_of",
    "load_lightning_module",
    "load_module_weights",
    "load_checkpoint_config",
    "load_strategy_config",
]

# export_torch_file / import_torch_file were here in release 0.2: one function per direction now, in
# lightning_distckpt.export (a Lightning checkpoint handled inside it).
_MOVED = {"export_torch_file": "to_torch_file", "import_torch_file": "from_torch_file"}


def __getattr__(name: str):
    if name in _MOVED:
        from .. import export
        from ..deprecated import warn_moved

        warn_moved(f"{__name__}.{name}", export.__name__, _MOVED[name])
        return getattr(export, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
