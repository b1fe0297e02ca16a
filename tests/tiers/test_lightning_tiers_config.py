"""The ``tiers:`` section of the checkpoint config: YAML into TierOptions, bad values named."""

import pytest

from lightning_distckpt import ArgumentTypeError, ConfigError
from lightning_distckpt.lightning import DistCheckpointConfig, load_checkpoint_config
from lightning_distckpt.lightning.tiers import TierCheckpoint
from lightning_distckpt.tiers import TierOptions


def test_yaml_section_gives_tier_options(tmp_path):
    path = tmp_path / "ckpt.yaml"
    path.write_text("tiers: {local_dir: /dev/shm/ckpt, local_every_n_steps: 50, replicas: 1, keep_local: 2}\n")
    cfg = load_checkpoint_config(str(path))
    assert cfg.tier_options == TierOptions(local_dir="/dev/shm/ckpt", local_every_n_steps=50, replicas=1, keep_local=2)
    assert load_checkpoint_config({}).tier_options is None  # off by default
    assert DistCheckpointConfig(tiers={"local_dir": "/x/{node}", "ranks_per_node": 2}).tier_options.ranks_per_node == 2


@pytest.mark.parametrize("section, named", [
    ({"local_every_n_steps": 5}, "local_dir"),  # mandatory
    ({"local_dir": "/x", "keep_local": 0}, "keep_local"),
    ({"local_dir": "/x", "replicas": -1}, "replicas"),
    ({"local_dir": "s3://bucket/x"}, "local_dir"),
    ({"local_dir": "/x", "durable_every_n_steps": "often"}, "durable_every_n_steps"),
    ({"local_dir": "/x", "every": 3}, "every"),  # unknown key
])
def test_bad_section_is_named(section, named):
    with pytest.raises(ConfigError, match=named):
        load_checkpoint_config({"tiers": section})


def test_tier_checkpoint_durable_defaults():
    durable = TierCheckpoint(TierOptions(local_dir="/x", durable_every_n_steps=6))
    assert (durable.save_last, durable._every_n_train_steps, durable._every_n_epochs, durable.save_top_k) == \
        (True, 6, 0, 0)
    local_only = TierCheckpoint(TierOptions(local_dir="/x"))  # the Trainer's other ModelCheckpoint decides
    assert (local_only.save_last, local_only._every_n_train_steps, local_only.save_top_k) == (False, 0, 0)
    with pytest.raises(ArgumentTypeError, match="TierOptions"):
        TierCheckpoint({"local_dir": "/x"})


def test_the_section_has_every_tier_option_and_no_other():
    """TiersConfig repeats TierOptions' fields (omegaconf cannot merge into a frozen dataclass): they
    must not drift apart."""
    from dataclasses import fields

    from lightning_distckpt.lightning.config import TiersConfig

    assert [f.name for f in fields(TiersConfig)] == [f.name for f in fields(TierOptions)]
