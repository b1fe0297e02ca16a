"""A conversion never writes over what it reads (storage/outputs.py), and an export into a Hugging
Face directory replaces only files this library wrote (export/hf_owned.py).

Every ``convert --to`` target is run, through the CLI in this process, into the checkpoint's own
``common.pt``, into the checkpoint itself, into its ``data`` directory, through a link into it, and
into the directory holding it: each is refused with exit status 2 and one line naming both paths,
every file of the checkpoint is byte-for-byte unchanged, and it still loads. The Python functions
behind the CLI refuse the same outputs with an ArgumentError.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import lightning_distckpt as ldc
from lightning_distckpt import convert
from lightning_distckpt.cli.main import main
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.export.hf_owned import INDEX_FILE, SINGLE_FILE
from lightning_distckpt.lightning import export as lightning_export

TARGETS = ["torch", "distckpt", "safetensors", "dcp", "megatron"]
WEIGHT = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def tree_hashes(root) -> dict:
    """relative path -> sha256 of every file under ``root`` (links as their target text)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in files + [n for n in dirs if os.path.islink(os.path.join(d, n))]:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            else:
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def save_checkpoint(path: str) -> None:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", WEIGHT.clone()),
              "rng": ldc.ShardedObject("rng", {"seed": 7}, (1,), (0,)), "step": 3}, path)


def assert_loads(path: str) -> None:
    assert torch.equal(ldc.load_plain_tensors(path)["w"], WEIGHT)
    assert ldc.load_common_state_dict(path) == {"step": 3}


@pytest.fixture
def ck(tmp_path):
    """A checkpoint ``run/CK`` and a link ``run/link`` to it; the hashes of everything under ``run``."""
    run = tmp_path / "run"
    run.mkdir()
    path = str(run / "CK")
    save_checkpoint(path)
    os.symlink(path, run / "link")
    return path, str(run)


def inside_outputs(ck_path: str, run: str) -> dict:
    return {"common.pt": os.path.join(ck_path, "common.pt"), "itself": ck_path, "data": os.path.join(ck_path, "data"),
            "link/x": os.path.join(run, "link", "x"), "link": os.path.join(run, "link")}


@pytest.mark.parametrize("to", TARGETS)
def test_convert_into_its_own_checkpoint_is_refused(ck, to, capsys):
    path, run = ck
    before = tree_hashes(run)
    for name, out in inside_outputs(path, run).items():
        assert main(["convert", path, out, "--to", to]) == 2, (to, name)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert out in err and path in err, (to, name, err)  # names both
        assert tree_hashes(run) == before, (to, name)
    assert_loads(path)


@pytest.mark.parametrize("to", ["torch", "distckpt", "dcp", "megatron"])
def test_convert_into_the_directory_holding_the_checkpoint_is_refused(ck, to, capsys):
    """Those outputs replace the whole destination: the checkpoint inside it would be deleted."""
    path, run = ck
    before = tree_hashes(run)
    assert main(["convert", path, run, "--to", to]) == 2
    err = capsys.readouterr().err
    assert "lies inside the destination" in err or "lies inside the export destination" in err, err
    assert tree_hashes(run) == before
    assert_loads(path)


def test_safetensors_beside_the_checkpoint_leaves_it_alone(ck):
    """A Hugging Face export writes only its own files into the directory: a checkpoint there stays."""
    path, run = ck
    before = tree_hashes(path)
    assert main(["convert", path, run, "--to", "safetensors"]) == 0
    assert torch.equal(load_file(os.path.join(run, SINGLE_FILE))["w"], WEIGHT)
    assert tree_hashes(path) == before
    assert_loads(path)


def test_python_functions_refuse_outputs_over_their_input(ck, tmp_path):
    path, run = ck
    before = tree_hashes(run)
    outs = inside_outputs(path, run)
    calls = [
        lambda out: convert.relayout_checkpoint(path, out, ldc.StorageOptions(layout="zarr")),
        lambda out: convert.export_torch_file(path, out),
        lambda out: lightning_export.export_torch_file(path, out),
        lambda out: ldc.export.to_safetensors(path, out),
        lambda out: ldc.export.to_dcp(path, out),
        lambda out: ldc.export.to_megatron(path, out),
    ]
    for call in calls:
        for name, out in outs.items():
            with pytest.raises(ArgumentError, match="overwrite what is being read"):
                call(out)
            with pytest.raises(ArgumentError):
                call(os.fsencode(out))  # bytes paths take the same check
    assert tree_hashes(run) == before
    assert_loads(path)


def test_import_never_replaces_its_own_file(tmp_path):
    """A torch.save file imported into itself, below itself, or into the directory holding it."""
    folder = tmp_path / "d"
    folder.mkdir()
    pt = str(folder / "x.pt")
    torch.save({"w": WEIGHT}, pt)
    before = tree_hashes(tmp_path)
    for out in (pt, os.path.join(pt, "sub"), str(folder), str(tmp_path)):
        for call in (convert.import_torch_file, lightning_export.import_torch_file):
            with pytest.raises(ArgumentError, match=r"source|destination"):
                call(pt, out)
    assert tree_hashes(tmp_path) == before
    lightning_export.import_torch_file(pt, str(tmp_path / "elsewhere"))  # the file itself is fine
    assert torch.equal(ldc.load_plain_tensors(tmp_path / "elsewhere")["w"], WEIGHT)


def test_relayout_through_a_link_is_compared_by_real_path(tmp_path):
    """A relayout from a link to the checkpoint into the checkpoint, and from it onto the link."""
    save_checkpoint(str(tmp_path / "CK"))
    os.symlink(tmp_path / "CK", tmp_path / "alias")
    before = tree_hashes(tmp_path / "CK")
    with pytest.raises(ArgumentError):
        convert.relayout_checkpoint(str(tmp_path / "alias"), str(tmp_path / "CK" / "copy"), ldc.StorageOptions())
    with pytest.raises(ArgumentError):
        convert.relayout_checkpoint(str(tmp_path / "CK"), str(tmp_path / "alias"), ldc.StorageOptions())
    assert tree_hashes(tmp_path / "CK") == before


# -- Hugging Face directories ------------------------------------------------------------------------
def _tiny_llama_dir(out: str, shard_bytes: int) -> None:
    """Another model's Hugging Face directory, written by transformers itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size=shard_bytes, safe_serialization=True)


@pytest.mark.parametrize("shard_bytes", [2000, 10**9], ids=["sharded", "single-file"])
def test_export_into_another_models_directory_deletes_nothing(tmp_path, shard_bytes):
    save_checkpoint(str(tmp_path / "CK"))
    hf = str(tmp_path / "hf")
    _tiny_llama_dir(hf, shard_bytes)
    names = os.listdir(hf)
    assert (INDEX_FILE in names) == (shard_bytes == 2000) and "config.json" in names
    before = tree_hashes(hf)
    for size in ("5GB", 40):  # our export as one file, and as several
        with pytest.raises(ArgumentError, match="not written by lightning_distckpt") as err:
            ldc.export.to_safetensors(tmp_path / "CK", hf, max_shard_size=size)
        assert (INDEX_FILE if shard_bytes == 2000 else SINGLE_FILE) in str(err.value)
        assert tree_hashes(hf) == before
    assert main(["convert", str(tmp_path / "CK"), hf, "--to", "safetensors"]) == 2
    assert tree_hashes(hf) == before


def test_reexport_replaces_only_our_own_files(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(4)}  # 40 bytes each
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, str(tmp_path / "CK"))
    hf = tmp_path / "hf"
    ldc.export.to_safetensors(tmp_path / "CK", hf, max_shard_size=40)  # four files and an index
    index = json.loads((hf / INDEX_FILE).read_text())
    assert index["metadata"]["written_by"] == "lightning_distckpt" and index["metadata"]["total_size"] == 160
    ours = sorted(set(index["weight_map"].values()))
    assert ours == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    # beside ours: a config, and another model's unindexed shard file with a shard file name
    (hf / "config.json").write_text("{}")
    save_file({"x": torch.zeros(3)}, str(hf / "model-00007-of-00009.safetensors"), metadata={"format": "pt"})
    kept = {n: h for n, h in tree_hashes(hf).items() if n not in ours and n != INDEX_FILE}

    ldc.export.to_safetensors(tmp_path / "CK", hf, max_shard_size=80)  # two files now
    names = set(os.listdir(hf))
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_FILE} <= names
    assert not names & set(ours)  # our earlier files were replaced or removed
    assert {n: h for n, h in tree_hashes(hf).items() if n in kept} == kept  # the others untouched
    back = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(k, torch.empty(10)) for k in tensors}, str(hf))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())

    ldc.export.to_safetensors(tmp_path / "CK", hf)  # one file: our index and shards go, nothing else
    assert set(os.listdir(hf)) == {SINGLE_FILE, *kept}
    assert load_file(str(hf / SINGLE_FILE)).keys() == tensors.keys()


def test_a_foreign_file_with_one_of_our_names_is_in_the_way(tmp_path):
    """Our index lists model-00001-of-00002; someone replaced that file with their own: the new
    export names it and leaves it in place."""
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(2)}
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, str(tmp_path / "CK"))
    hf = tmp_path / "hf"
    ldc.export.to_safetensors(tmp_path / "CK", hf)  # model.safetensors, marked
    save_file({"x": torch.zeros(3)}, str(hf / SINGLE_FILE), metadata={"format": "pt"})  # not ours any more
    before = tree_hashes(hf)
    with pytest.raises(ArgumentError, match=SINGLE_FILE):
        ldc.export.to_safetensors(tmp_path / "CK", hf, max_shard_size=40)
    assert tree_hashes(hf) == before
