"""Lightning and Fabric integration: the ``DistCheckpointIO`` plugin, ``DistCheckpointStrategy``
(Trainer), ``FabricDistCheckpointStrategy`` (Fabric), TP x DP process groups and their config."""

from .checkpoint_io import DistCheckpointIO
from .config import ConfigError, DistCheckpointConfig, StrategyConfig, load_checkpoint_config, load_strategy_config
from .export import export_torch_file, import_torch_file
from .fabric import FabricDistCheckpointStrategy
from .fabric_model_parallel import FabricDistCheckpointModelParallelStrategy
from .model_parallel import DistCheckpointModelParallelStrategy
from .model_checkpoint import DistModelCheckpoint
from .inference import load_lightning_module, load_module_weights
from .parallel import ParallelState, module_sharded_state_dict, parallel_state_of
from .strategy import DistCheckpointStrategy

from .. import _LIGHTNING_NAMES

__all__ = [*_LIGHTNING_NAMES, "load_checkpoint_config", "load_strategy_config"]
