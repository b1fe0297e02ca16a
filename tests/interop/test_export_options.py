"""``convert --to safetensors`` as users want it: a directory holding another model's weights is
refused (exit status 2, nothing touched), files get the mode the umask gives, ``--only model`` /
``--include PREFIX`` leave out optimizer state and other tensors, ``--config`` makes the directory
one ``transformers.from_pretrained`` reads (a tiny Llama built here)."""

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main as cli_main
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.export.hf_owned import INDEX_FILE
from hf_helpers import tiny_llama


def _whole(key, t):
    return ldc.ShardedTensor.from_rank_offsets(key, t)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama's weights saved as a checkpoint beside Adam-like state (``optimizer.state.*``)
    and a second optimizer keyed by tree path (``opt/state/...``, its param_groups in the common
    state), and the model's config.json."""
    root = tmp_path_factory.mktemp("llama")
    model = tiny_llama()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {
        "model": {k: _whole(k, v) for k, v in weights.items()},
        "optimizer": {"state": {k: {"exp_avg": _whole(f"optimizer.state.exp_avg.{k}", torch.ones_like(v))}
                                for k, v in list(weights.items())[:3]}, "param_groups": [{"lr": 0.1}]},
        "opt": {"state": {"0": {"exp_avg_sq": _whole("opt/state/0/exp_avg_sq", torch.ones(3))}},
                "param_groups": [{"lr": 0.2}]},
        "step": 7,
    }
    ckpt = str(root / "ckpt")
    ldc.save(state, ckpt)
    model.config.save_pretrained(str(root / "cfg"))
    return ckpt, weights, str(root / "cfg" / "config.json")


def _exported_keys(out_dir):
    names = []
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, f), "pt") as sf:
                names += list(sf.keys())
    return sorted(names)


def test_only_model_include_and_config_make_a_from_pretrained_directory(llama, tmp_path, capsys):
    from transformers import LlamaForCausalLM

    ckpt, weights, config = llama
    out = tmp_path / "hf"
    assert cli_main(["convert", ckpt, str(out), "--to", "safetensors", "--only", "model", "--config", config,
                     "--max-shard-size", "40KB"]) == 0
    assert f"(safetensors): {len(weights)} tensor(s)" in capsys.readouterr().out
    assert _exported_keys(out) == sorted(weights)  # no optimizer moments, by either rule
    assert json.loads((out / "config.json").read_text()) == json.loads(open(config).read())
    loaded = LlamaForCausalLM.from_pretrained(str(out))
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, weights[k]), k

    assert cli_main(["convert", ckpt, str(tmp_path / "part"), "--to", "safetensors", "--include", "model.embed",
                     "--include", "lm_head."]) == 0
    assert _exported_keys(tmp_path / "part") == ["lm_head.weight", "model.embed_tokens.weight"]
    everything = tmp_path / "all"
    assert cli_main(["convert", ckpt, str(everything), "--to", "safetensors"]) == 0
    assert "opt/state/0/exp_avg_sq" in _exported_keys(everything)  # without --only: every tensor
    # the Python API and DCP take the same selection
    ldc.export.to_dcp(ckpt, str(tmp_path / "dcp"), only="model", include=["lm_head"])
    assert sorted(ldc.load_tensors_metadata(str(tmp_path / "dcp"))) == ["lm_head.weight"]
    with pytest.raises(ArgumentError, match="only='optimizer'"):
        ldc.export.to_safetensors(ckpt, str(tmp_path / "x"), only="optimizer")
    assert cli_main(["convert", ckpt, str(tmp_path / "y.pt"), "--only", "model"]) == 2
    assert "--only / --include apply to --to safetensors, dcp or megatron" in capsys.readouterr().err


def test_a_directory_holding_another_models_weights_is_refused(llama, tmp_path, capsys):
    ckpt, _, config = llama
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    save_file({"w": torch.ones(2)}, str(theirs / "model.safetensors"))  # not written by us
    (theirs / "config.json").write_text('{"model_type": "gpt2"}')
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in theirs.iterdir()}
    assert cli_main(["convert", ckpt, str(theirs), "--to", "safetensors"]) == 2
    assert "were not written by lightning_distckpt" in capsys.readouterr().err
    # a config.json of another model is not replaced either, even where the weights could be written
    (theirs / "model.safetensors").unlink()
    del before["model.safetensors"]
    assert cli_main(["convert", ckpt, str(theirs), "--to", "safetensors", "--config", config]) == 2
    assert "config.json exists and differs" in capsys.readouterr().err
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in theirs.iterdir()} == before


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_get_the_mode_the_umask_gives(llama, tmp_path, umask):
    ckpt, _, config = llama
    old = os.umask(umask)
    try:
        ldc.export.to_safetensors(ckpt, str(tmp_path / "hf"), max_shard_size="40KB", only="model", config=config)
    finally:
        os.umask(old)
    files = sorted(os.listdir(tmp_path / "hf"))
    assert INDEX_FILE in files and "config.json" in files and len(files) > 3
    modes = {f: stat.S_IMODE(os.stat(tmp_path / "hf" / f).st_mode) for f in files}
    assert modes == {f: 0o666 & ~umask for f in files}
