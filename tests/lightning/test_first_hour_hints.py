"""Mistakes of a user's first hour, each refused with what is wrong, where, and what to do instead:
``ckpt_path`` naming ModelCheckpoint's directory, a Hugging Face model directory or a weights-only
file; checkpoint settings passed to a strategy as its own arguments; a YAML key in the wrong
section or misspelled beyond recognition; ``fabric.load_raw`` under our Fabric strategy; and the
command line pointed at a directory of checkpoints, a Hugging Face directory or a file. Trainer and
Fabric run for real, one CPU process each."""

import json
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main as cli_main
from lightning_distckpt.core.errors import ArgumentError, ConfigError

from script_ranks import script_results

FIT = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy

    mode, root, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    for path in paths:  # the plugin (single device) runs no process group: one fit after another
        kind = {"plugins": [DistCheckpointIO()]} if mode == "plugin" else {"strategy": DistCheckpointStrategy()}
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=root, **kind)
        try:
            trainer.fit(BoringModel(), ckpt_path=path)
            out = {"path": path, "type": None, "message": ""}
        except Exception as e:
            out = {"path": path, "type": type(e).__name__, "message": str(e)}
        print("RESULT " + json.dumps(out), flush=True)
""")

FABRIC_LOAD_RAW = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.fabric import Fabric
    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    model = fabric.setup(torch.nn.Linear(4, 2))
    fabric.save(sys.argv[1], {"model": model})
    try:
        fabric.load_raw(sys.argv[1], model)
        out = {"type": None, "message": ""}
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(e)}
    print("RESULT " + json.dumps(out), flush=True)
""")


_run = script_results


def _dir_of_checkpoints(tmp_path):
    """What ModelCheckpoint's dirpath looks like: committed checkpoints side by side."""
    ckpts = tmp_path / "ckpts"
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(ckpts / name))
    return ckpts


def _hf_dir(tmp_path):
    """A Hugging Face model directory (save_pretrained's files), weights only."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"}\n')
    save_file({"transformer.wte.weight": torch.zeros(8, 4), "lm_head.weight": torch.zeros(8, 4)},
              str(hf / "model.safetensors"))
    return hf


def test_trainer_ckpt_path_wrong_kinds_of_path(tmp_path):
    """Trainer(plugins=[DistCheckpointIO()]).fit(ckpt_path=...): ModelCheckpoint's directory instead of
    a checkpoint in it; a Hugging Face directory; one of its .safetensors files (weights only)."""
    ckpts, hf = _dir_of_checkpoints(tmp_path), _hf_dir(tmp_path)
    by_path = {r["path"]: r for r in _run(FIT, "plugin", tmp_path, ckpts, hf, hf / "model.safetensors",
                                          cwd=tmp_path)}

    r = by_path[str(ckpts)]
    assert r["type"] == "IncompleteCheckpointError", r
    assert f"checkpoint {ckpts}: not a lightning_distckpt checkpoint" in r["message"]
    assert "it is a directory holding checkpoints (newest first: last.ckpt, epoch=0-step=2.ckpt)" in r["message"]
    assert f"pass one of them, e.g. {ckpts / 'last.ckpt'}" in r["message"] and 'ckpt_path="last"' in r["message"]

    r = by_path[str(hf)]
    assert r["type"] == "FormatError", r
    assert f"checkpoint {hf} was written by Hugging Face save_pretrained" in r["message"]
    assert "lightning.load_module_weights(module, path, key_map=...) in configure_model" in r["message"]
    assert "without ckpt_path" in r["message"] and "lightning_distckpt.save" not in r["message"]

    r = by_path[str(hf / "model.safetensors")]
    assert r["type"] == "NotATrainerCheckpointError", r
    assert f"checkpoint {hf / 'model.safetensors'} holds model weights only" in r["message"]
    assert "load_module_weights(module, path, key_map=...)" in r["message"] and "fabric.save" not in r["message"]


def test_trainer_ckpt_path_weights_file_under_the_strategy(tmp_path):
    """The same weights-only file under DistCheckpointStrategy: named as weights, not as a fabric.save."""
    weights = tmp_path / "weights.safetensors"
    save_file({"layer.weight": torch.zeros(2, 32), "layer.bias": torch.zeros(2)}, str(weights))
    (r,) = _run(FIT, "strategy", tmp_path, weights, cwd=tmp_path)
    assert r["type"] == "CheckpointingError", r
    assert f"checkpoint {weights} holds model weights only" in r["message"]
    assert "load_module_weights(module, path, key_map=...)" in r["message"]
    assert "fabric.save" not in r["message"] and "entries []" not in r["message"]


@pytest.mark.parametrize("cls_name", ["DistCheckpointStrategy", "FabricDistCheckpointStrategy"])
def test_checkpoint_settings_given_to_a_strategy_are_refused_at_once(cls_name):
    """Before: accepted, then DistributedDataParallel's TypeError once the processes had started."""
    import lightning_distckpt.lightning as ldl

    cls = getattr(ldl, cls_name)
    with pytest.raises(ArgumentError) as e:
        cls(async_save=True)
    assert f"{cls_name}(async_save=True): 'async_save' is a checkpoint setting" in str(e.value)
    assert f"{cls_name}(checkpoint={{'async_save': True}})" in str(e.value)
    with pytest.raises(ArgumentError, match="unexpected argument 'tensor_parallel'; did you mean "
                                            "'tensor_parallel_size'"):
        cls(tensor_parallel=2)
    with pytest.raises(ArgumentError, match="'checkpoint_config'; did you mean 'checkpoint'"):
        cls(checkpoint_config={"async_save": True})
    # DDPStrategy's and DistributedDataParallel's own arguments still pass.
    cls(tensor_parallel_size=1, find_unused_parameters=True, start_method="popen")


@pytest.mark.parametrize("yaml, words", [
    ("layout: zarr\n", ["Key 'layout' not in 'DistCheckpointConfig'", "Did you mean: 'storage.layout'?",
                        "belongs under storage:"]),
    ("storage:\n  async_save: true\n", ["Key 'async_save' not in 'StorageOptions'", "Did you mean: 'async_save'?",
                                        "belongs at the top level"]),
    ("chunk_size_mb: 8\n", ["Key 'chunk_size_mb'", "The keys at the top level are: storage, balance_writes",
                            "allow_shape_mismatch, tiers."]),
    ("checkpoint:\n  async_save: true\n", ["Key 'checkpoint'", "A checkpoint config has its keys at the top level"]),
    ("asyn_save: true\n", ["Key 'asyn_save'", "Did you mean: 'async_save'?"]),  # omegaconf's own suggestion
])
def test_yaml_key_typos_name_the_key_and_the_right_one(tmp_path, yaml, words):
    from lightning_distckpt.lightning import DistCheckpointIO

    cfg = tmp_path / "checkpoint.yaml"
    cfg.write_text(yaml)
    with pytest.raises(ConfigError) as e:
        DistCheckpointIO.from_config(str(cfg))
    first = str(e.value).splitlines()[0]
    assert first.startswith(f"invalid checkpoint config {cfg}: ")
    for w in words:
        assert w in first, first
    assert first.count("Did you mean") <= 1


def test_strategy_yaml_with_a_checkpoint_key_at_the_top(tmp_path):
    from lightning_distckpt.lightning import DistCheckpointStrategy

    cfg = tmp_path / "strategy.yaml"
    cfg.write_text("tensor_parallel_size: 1\nasync_save: true\n")
    with pytest.raises(ConfigError, match=r"Did you mean: 'checkpoint.async_save'\? \(that key belongs under "
                                          r"checkpoint:\)"):
        DistCheckpointStrategy.from_config(str(cfg))


def test_a_str_of_settings_where_a_config_is_expected(tmp_path, monkeypatch):
    """A str is a YAML path: settings written as a str are named as a missing file, with the mapping to give."""
    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        DistCheckpointStrategy(checkpoint="async_save: true")
    assert "checkpoint config file async_save: true does not exist" in str(e.value)
    assert "give settings as a mapping, e.g. {'async_save': True}" in str(e.value)
    with pytest.raises(ConfigError, match=r"does not exist .*e\.g\. \{'async_save': True\}, or a DistCheckpointConfig"):
        DistCheckpointIO("async_save")


def test_fabric_load_raw_names_what_to_call(tmp_path):
    """fabric.load_raw of our checkpoint directory (it loads one state-dict file, as stock's): refused naming the
    directory, with the calls that load it."""
    (r,) = _run(FABRIC_LOAD_RAW, tmp_path / "ckpt", cwd=tmp_path)
    assert r["type"] == "ArgumentError", r
    assert "The given path must be a single file containing the full state dict" in r["message"]
    assert "was given a directory" in r["message"]
    assert "fabric.load(path, {'model': model})" in r["message"] and "load_module_weights" in r["message"]


def test_command_line_on_a_directory_of_checkpoints_a_hf_directory_and_a_file(tmp_path, capsys):
    ckpts, hf = _dir_of_checkpoints(tmp_path), _hf_dir(tmp_path)
    for argv in (["inspect", str(ckpts)], ["validate", str(ckpts)], ["convert", str(ckpts), str(tmp_path / "o.pt")]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert "it is a directory holding checkpoints (newest first: last.ckpt, epoch=0-step=2.ckpt)" in err, err
        assert f"pass one of them, e.g. {ckpts / 'last.ckpt'}" in err
    assert cli_main(["validate", str(hf)]) == 2
    err = capsys.readouterr().err
    assert "it is a Hugging Face model directory: `lightning-distckpt convert DIR OUT` makes a checkpoint" in err, err
    assert cli_main(["validate", str(hf / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a checkpoint directory" in err
    assert f"`lightning-distckpt convert {hf / 'model.safetensors'} DIR` makes a checkpoint of it" in err
    assert not (tmp_path / "o.pt").exists()


def test_convert_makes_a_checkpoint_of_a_hugging_face_directory(tmp_path):
    """``convert HF_DIR OUT`` (was refused: only a single .safetensors file converted): the
    directory's tensors, read through its index, saved as a checkpoint; the source untouched."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"}\n')
    g = torch.Generator().manual_seed(0)
    parts = {"model-00001-of-00002.safetensors": {"a.weight": torch.randn(4, 4, generator=g)},
             "model-00002-of-00002.safetensors": {"b.bias": torch.randn(3, generator=g)}}
    for name, tensors in parts.items():
        save_file(tensors, str(hf / name))
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, tensors in parts.items() for k in tensors}}))
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    assert cli_main(["convert", str(hf), str(tmp_path / "out")]) == 0
    loaded = ldc.load_plain_tensors(str(tmp_path / "out"))
    assert set(loaded) == {"a.weight", "b.bias"}
    for tensors in parts.values():
        for k, v in tensors.items():
            assert torch.equal(loaded[k], v), k
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before


def test_a_misspelled_template_key_names_the_checkpoint_key_it_resembles(tmp_path):
    """An unexpected template key close to a stored one (a typo, a renamed layer): the error says
    which checkpoint key was likely meant; a key like none of them gets no guess."""
    path = str(tmp_path / "ck")
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, torch.ones(3)) for k in ("layer.weight", "layer.bias")}, path)
    template = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros(3)) for k in ("layer.wieght", "zzz")}
    with pytest.raises(ldc.MissingKeysError) as e:
        ldc.load(template, path)
    text = str(e.value)
    assert "Did you mean: 'layer.weight' for 'layer.wieght'? (checkpoint keys)" in text, text
    assert "for 'zzz'" not in text


def test_a_checkpoint_setting_given_to_the_plugin_says_where_it_goes():
    from lightning_distckpt.lightning import DistCheckpointIO

    with pytest.raises(ArgumentError, match=r"DistCheckpointIO\(\{'async_save': True\}\)"):
        DistCheckpointIO(async_save=True)
    with pytest.raises(ArgumentError, match="did you mean 'extra_safe_globals'"):
        DistCheckpointIO(extra_safe_global=())


def test_a_directory_that_is_no_checkpoint_says_what_it_holds(tmp_path):
    empty, other = tmp_path / "empty", tmp_path / "other"
    empty.mkdir()
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3))}
    for path, what in ((empty, "(an empty directory)"), (other, "(it holds notes.txt)")):
        with pytest.raises(ldc.IncompleteCheckpointError) as e:
            ldc.load(template, str(path))
        assert f"{path} is not a distributed checkpoint {what}" in str(e.value), e.value
    assert (other / "notes.txt").read_text() == "mine"


def test_inspect_shows_the_tensors_of_files_and_hugging_face_directories(tmp_path, capsys):
    """``inspect`` of a .safetensors file, a torch.save file (a Lightning-like dict: its tensors by
    path, its other entries named) and a Hugging Face directory (each tensor's file); was refused."""
    hf = _hf_dir(tmp_path)
    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(2, 3)}, "epoch": 1, "global_step": 8}, str(ckpt))
    assert cli_main(["inspect", str(hf / "model.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "safetensors file" in out and "lm_head.weight" in out and "(8, 4)" in out
    assert cli_main(["inspect", str(ckpt), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "torch.save file"
    assert [(t["key"], t["shape"]) for t in summary["tensors"]] == [("state_dict/layer.weight", [2, 3])]
    assert {"epoch", "global_step"} <= set(summary["other_entries"])
    assert cli_main(["inspect", str(hf)]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face model directory" in out and "transformer.wte.weight" in out
