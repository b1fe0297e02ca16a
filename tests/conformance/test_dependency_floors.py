"""What the declared dependency floors need from our code, checked on whatever versions are installed
(tools/floors/run.sh runs the suites at the floors themselves; see its README).

* omegaconf before 2.4 merges the user's settings into the schema's node in place, and refuses a
  read-only node there: a frozen dataclass's section (``storage``: StorageOptions) is one. The schema
  node we merge into has every section writable, so ``storage:`` settings load on 2.3 as on 2.4.
* Lightning before 2.6 has no ``weights_only`` argument in the stock ModelParallelStrategy's
  ``load_checkpoint`` (pytorch and fabric): the stock-DCP fallback passes it only where it is taken.
"""

import inspect

import pytest
from omegaconf import OmegaConf

from lightning_distckpt.lightning.config import (DistCheckpointConfig, StrategyConfig, _schema_node,
                                                 load_checkpoint_config)
from lightning_distckpt.lightning.model_parallel import stock_weights_only
from lightning_distckpt.storage.options import StorageOptions


@pytest.mark.parametrize("schema", [DistCheckpointConfig, StrategyConfig])
def test_the_schema_node_takes_section_settings_in_place(schema):
    """As omegaconf 2.3's merge does (in place, flags kept): on the bare structured node this raises
    ReadonlyConfigError for ``storage.layout`` on every omegaconf release."""
    node = _schema_node(schema)
    storage = {"layout": "zarr", "chunk_bytes": 4096, "pack_max_bytes": 0}
    node.merge_with({"storage": storage} if schema is DistCheckpointConfig else {"checkpoint": {"storage": storage}})
    built = OmegaConf.to_object(node)
    cfg = built if schema is DistCheckpointConfig else built.checkpoint
    assert isinstance(cfg.storage, StorageOptions) and cfg.storage.layout == "zarr" and cfg.storage.chunk_bytes == 4096
    with pytest.raises(AttributeError):  # still the frozen dataclass (dataclasses.FrozenInstanceError)
        cfg.storage.layout = "ocdbt"


def test_a_storage_section_loads_and_is_still_checked():
    cfg = load_checkpoint_config({"storage": {"layout": "zarr", "pack_max_bytes": 0}})
    assert cfg.storage.layout == "zarr" and cfg.storage.pack_max_bytes == 0
    with pytest.raises(Exception, match="unknown storage layout 'tar'"):
        load_checkpoint_config({"storage": {"layout": "tar"}})
    with pytest.raises(Exception, match="storage.compresion"):
        load_checkpoint_config({"storage": {"compresion": "zstd"}})


def test_weights_only_is_passed_only_where_the_stock_load_takes_it():
    def before_2_6(self, checkpoint_path):  # Lightning 2.4 / 2.5's ModelParallelStrategy.load_checkpoint
        return checkpoint_path

    def since_2_6(self, checkpoint_path, weights_only=None):
        return checkpoint_path

    assert stock_weights_only(before_2_6) == {}
    assert stock_weights_only(since_2_6) == {"weights_only": True}
    from lightning.fabric.strategies import ModelParallelStrategy as FabricMP
    from lightning.pytorch.strategies import ModelParallelStrategy

    # the calls the stock-DCP fallbacks make, as the installed Lightning's signatures take them
    inspect.signature(ModelParallelStrategy.load_checkpoint).bind(
        None, "ck", **stock_weights_only(ModelParallelStrategy.load_checkpoint))
    inspect.signature(FabricMP.load_checkpoint).bind(
        None, "ck", {}, strict=True, **stock_weights_only(FabricMP.load_checkpoint))
