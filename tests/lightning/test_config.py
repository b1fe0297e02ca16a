"""YAML / omegaconf configuration: the schema, the shipped configs/*.yaml, from_config, and a real
LightningCLI run configured from YAML (examples/cli_gpt.py + configs/cli_gpt_tp.yaml)."""

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from lightning_distckpt import StrictHandling, load_common_state_dict
from lightning_distckpt.lightning import (
    ConfigError,
    DistCheckpointConfig,
    DistCheckpointIO,
    DistCheckpointStrategy,
    FabricDistCheckpointStrategy,
    load_checkpoint_config,
    load_strategy_config,
)
from lightning_distckpt.storage.layout import read_metadata
from script_ranks import run_ranks, script_env

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def test_defaults_match_the_reference_yaml():
    assert load_checkpoint_config(CONFIGS / "checkpoint.yaml") == DistCheckpointConfig()
    assert load_checkpoint_config(None) == DistCheckpointConfig()


@pytest.mark.parametrize("name", ["checkpoint.yaml", "checkpoint_async.yaml", "checkpoint_portable.yaml"])
def test_shipped_checkpoint_configs_load(name):
    cfg = load_checkpoint_config(CONFIGS / name)
    raw = yaml.safe_load((CONFIGS / name).read_text())
    for key, value in raw.items():  # every value in the file made it into the config
        if key == "storage":
            for k, v in value.items():
                assert getattr(cfg.storage, k) == v
        else:
            assert getattr(cfg, key) == value


def test_values_reach_the_plugin_and_strategies():
    io = DistCheckpointIO.from_config(CONFIGS / "checkpoint_portable.yaml")
    assert io.config.storage_options.layout == "zarr" and io.config.storage_options.chunk_bytes == 1 << 20
    assert io.config.strict_handling is StrictHandling.RAISE_ALL
    s = DistCheckpointStrategy.from_config(CONFIGS / "strategy_tp2.yaml")
    assert s.tensor_parallel_size == 2
    assert s.checkpoint_io.config.async_save is True and s.checkpoint_io.config.loader == "two_stage"
    assert s.checkpoint_io.config.storage.layout == "zarr"
    f = FabricDistCheckpointStrategy.from_config({"tensor_parallel_size": 4, "checkpoint": {"balance_writes": False}})
    assert f.tensor_parallel_size == 4 and f.checkpoint_io.config.balance_writes is False
    # The strategy's own checkpoint= argument takes a mapping, a YAML path or a config object.
    assert DistCheckpointStrategy(checkpoint={"strict": "log_all"}).checkpoint_io.config.strict == "log_all"
    assert DistCheckpointStrategy(checkpoint=str(CONFIGS / "checkpoint_async.yaml")).checkpoint_io.config.async_save
    io = DistCheckpointIO.from_config({"storage": {"pack_max_bytes": 0}})
    assert io.config.storage_options.pack_max_bytes == 0


def test_a_plugin_beside_the_strategys_own_settings_is_said_to_win(caplog):
    # Lightning hands the Trainer's plugin to the strategy: its config is used, checkpoint= is not (once said)
    strategy = DistCheckpointStrategy(checkpoint={"async_save": True})
    strategy.checkpoint_io = DistCheckpointIO()
    with caplog.at_level("WARNING", logger="lightning_distckpt.lightning.tp_strategy"):
        assert strategy.checkpoint_io.config.async_save is False  # the plugin's
        assert strategy.checkpoint_io.config.async_save is False
    said = [r.getMessage() for r in caplog.records if "checkpoint= settings are not used" in r.getMessage()]
    assert len(said) == 1 and "DistCheckpointStrategy" in said[0], caplog.text
    caplog.clear()
    for quiet in (DistCheckpointStrategy(), DistCheckpointStrategy(checkpoint={"async_save": True})):
        quiet.checkpoint_io = DistCheckpointIO() if quiet.checkpoint_io.config.async_save is False else \
            DistCheckpointIO(DistCheckpointConfig(async_save=True))  # no settings of its own, or the same ones
        with caplog.at_level("WARNING", logger="lightning_distckpt.lightning.tp_strategy"):
            quiet.checkpoint_io
    assert "checkpoint= settings are not used" not in caplog.text


@pytest.mark.parametrize("bad,needle", [
    ({"storag": {}}, "storag"),
    ({"storage": {"layot": "zarr"}}, "storage.layot"),
    ({"storage": {"layout": "tar"}}, "unknown storage layout 'tar'"),
    ({"storage": {"chunk_bytes": "big"}}, "storage.chunk_bytes"),
    ({"storage": {"pack_max_bytes": -1}}, "pack_max_bytes must be >= 0"),
    ({"balance_writes": "sometimes"}, "balance_writes"),
    ({"strict": "very"}, "unknown strict handling 'very'"),
    ({"loader": "three_stage"}, "unknown loader 'three_stage'"),
    ({"async_save": [1]}, "async_save"),
])
def test_bad_keys_and_values_are_named(bad, needle):
    with pytest.raises(ConfigError) as e:
        load_checkpoint_config(bad)
    assert needle in str(e.value)


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "ckpt.yaml"
    path.write_text("storage:\n  layout: zarr\n  io_threads: 4\n")
    with pytest.raises(ConfigError) as e:
        DistCheckpointIO.from_config(path)
    assert str(path) in str(e.value) and "storage.io_threads" in str(e.value)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        load_strategy_config({"tensor_parallel_size": 0})
    with pytest.raises(ConfigError, match="checkpoint.strct"):
        load_strategy_config({"checkpoint": {"strct": "raise_all"}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_checkpoint_config(tmp_path / "missing.yaml")


class _Run(NamedTuple):
    returncode: int
    stdout: str
    stderr: str  # the ranks' stdout and stderr are one log each: both fields hold all of it


def _cli(args, tmp_path, devices=1, timeout=300):
    """``python examples/cli_gpt.py fit ARGS`` on ``devices`` ranks, started as torchrun would
    (``script_ranks``)."""
    code, output = run_ranks(str(ROOT / "examples" / "cli_gpt.py"), ["fit", *args], script_env(), devices, timeout,
                             cwd=str(ROOT))
    return _Run(code, output, output)


@pytest.mark.slow
def test_lightning_cli_yaml_run_and_resume(tmp_path):
    """LightningCLI builds DistCheckpointStrategy (class_path / init_args) with the checkpoint settings
    from configs/cli_gpt_tp.yaml, trains on 2 processes (TP 2); a second run resumes the newest
    checkpoint (ckpt_path=last) on 1 process (TP 1, overridden on the command line)."""
    root = tmp_path / "run"
    first = _cli(["--config", str(CONFIGS / "cli_gpt_tp.yaml"), "--trainer.default_root_dir", str(root),
                  "--trainer.max_steps", "4"], tmp_path, devices=2)
    assert first.returncode == 0, first.stderr[-6000:]
    ckdir = root / "checkpoints"
    assert sorted(os.listdir(ckdir)) == ["last.ckpt", "step=4.ckpt"]
    meta = read_metadata(str(ckdir / "last.ckpt"))
    assert meta["world_size"] == 2
    assert meta["storage"] == {"backend": "tensorstore", "layout": "zarr", "chunk_bytes": 1048576}  # from the YAML
    second = _cli(["--config", str(CONFIGS / "cli_gpt_tp.yaml"), "--trainer.default_root_dir", str(root),
                   "--trainer.max_steps", "6", "--trainer.devices", "1",
                   "--trainer.strategy.init_args.tensor_parallel_size", "1", "--ckpt_path", "last"], tmp_path)
    assert second.returncode == 0, second.stderr[-6000:]
    assert f"Restored all states from the checkpoint at {ckdir / 'last.ckpt'}" in second.stdout + second.stderr
    assert load_common_state_dict(ckdir / "last.ckpt")["global_step"] == 6
    assert read_metadata(str(ckdir / "last.ckpt"))["world_size"] == 1


def test_lightning_cli_unknown_checkpoint_key(tmp_path):
    cfg = yaml.safe_load((CONFIGS / "cli_gpt_tp.yaml").read_text())
    cfg["trainer"]["strategy"]["init_args"]["checkpoint"]["storage"]["compresion"] = "zstd"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = _cli(["--config", str(bad), "--trainer.default_root_dir", str(tmp_path / "r")], tmp_path)
    assert out.returncode != 0
    assert "Key 'compresion' not in 'StorageOptions'" in out.stderr and "storage.compresion" in out.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_lightning_cli_plugin_with_stock_strategy(tmp_path):
    """The plugin from a LightningCLI YAML (plugins: class_path / init_args: config), with
    strategy="auto" on one device; and strategy="ddp_distckpt" by its registered name."""
    cfg = yaml.safe_load((CONFIGS / "cli_gpt_tp.yaml").read_text())
    trainer = cfg["trainer"]
    trainer.pop("strategy")
    trainer["devices"] = 1
    trainer["plugins"] = [{"class_path": "lightning_distckpt.lightning.DistCheckpointIO",
                           "init_args": {"config": {"storage": {"layout": "zarr", "chunk_bytes": 4096}}}}]
    path = tmp_path / "plugin.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = _cli(["--config", str(path), "--trainer.default_root_dir", str(tmp_path / "a"), "--trainer.max_steps", "4"],
               tmp_path)
    assert out.returncode == 0, out.stderr[-6000:]
    meta = read_metadata(str(tmp_path / "a" / "checkpoints" / "step=4.ckpt"))
    assert meta["storage"]["layout"] == "zarr" and meta["storage"]["chunk_bytes"] == 4096
    out = _cli(["--config", str(path), "--trainer.default_root_dir", str(tmp_path / "b"), "--trainer.max_steps", "4",
                "--trainer.strategy", "ddp_distckpt", "--trainer.plugins", "null"], tmp_path)
    assert out.returncode == 0, out.stderr[-6000:]
    assert load_common_state_dict(tmp_path / "b" / "checkpoints" / "step=4.ckpt")["__distckpt__"]["kind"] == "sharded"


CLI_SCRIPT = """
import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

LightningCLI(BoringModel, BoringDataModule)   # nothing of lightning_distckpt imported here
if dist.is_available() and dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
"""


def test_lightning_cli_strategy_by_class_path_needs_no_import(tmp_path):
    """Issue 16 defect 6. Lightning discovers strategy names only from its own modules (no entry
    points), so ``strategy: ddp_distckpt`` works only once ``lightning_distckpt.lightning`` is
    imported; ``class_path: lightning_distckpt.lightning.DistCheckpointStrategy`` works in any script, and the
    docs say so next to the registered name."""
    script = tmp_path / "cli.py"
    script.write_text(CLI_SCRIPT)
    cfg = {"trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 2, "logger": False,
                       "enable_progress_bar": False, "default_root_dir": str(tmp_path / "run"),
                       "strategy": {"class_path": "lightning_distckpt.lightning.DistCheckpointStrategy",
                                    "init_args": {"tensor_parallel_size": 1, "checkpoint": {"storage": {"layout": "zarr"}}}}}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, str(script), "fit", "--config", str(tmp_path / "cfg.yaml")], env=script_env(),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-6000:]
    (ckpt,) = (tmp_path / "run" / "checkpoints").iterdir()
    assert load_common_state_dict(ckpt)["__distckpt__"]["kind"] == "sharded"
    assert read_metadata(str(ckpt))["storage"]["layout"] == "zarr"
    docs = (ROOT / "docs" / "lightning.md").read_text()
    assert "registered only once `lightning_distckpt.lightning` is imported" in docs
    assert "class_path: lightning_distckpt.lightning.DistCheckpointStrategy" in docs
