"""One rule for links in other formats' directories (docs/interop.md, storage/paths.py): a link is
followed only when its real path stays inside the model's root (the directory given or, for a
Hugging Face cache snapshot, its cache repo folder); any other is refused with an error naming
the link. A file the user names may itself be a link; a directory given may be reached through
links. Our own checkpoints still follow no link inside them."""

import hashlib
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

import lightning_distckpt as ldc
from lightning_distckpt.ingest import load_state_dict
from special_files import build, full, make_special, save_dcp, template

INDEX = "model.safetensors.index.json"
SHARDS = {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


def _exact(out):
    return all(torch.equal(out[k], v) for k, v in full().items())


def _load(path):
    return ldc.load(template("hf"), path)


# -- a Hugging Face cache: snapshots/<rev>/ made of links into blobs/ ----------------------------
def _blob(repo, data: bytes) -> str:
    """Store ``data`` as the cache does (named by its hash) and return the name."""
    sha = hashlib.sha256(data).hexdigest()
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    with open(os.path.join(repo, "blobs", sha), "wb") as f:
        f.write(data)
    return sha


def hf_cache(tmp_path, indexed: bool, rev: str = "0123abcd") -> str:
    """``hub/models--org--name/snapshots/<rev>/`` whose files are relative links to ``../../blobs/<sha>``,
    as ``huggingface_hub`` lays out its cache; the snapshot directory."""
    repo = str(tmp_path / "hub" / "models--org--name")
    snap = os.path.join(repo, "snapshots", rev)
    os.makedirs(snap)
    scratch = str(tmp_path / "scratch")
    os.makedirs(scratch, exist_ok=True)
    files = {}
    if indexed:
        for key, name in SHARDS.items():
            save_file({key: full()[key]}, os.path.join(scratch, name))
            files[name] = open(os.path.join(scratch, name), "rb").read()
        files[INDEX] = json.dumps({"metadata": {}, "weight_map": SHARDS}).encode()
    else:
        save_file(full(), os.path.join(scratch, "model.safetensors"))
        files["model.safetensors"] = open(os.path.join(scratch, "model.safetensors"), "rb").read()
    files["config.json"] = b"{}"
    for name, data in files.items():
        os.symlink(os.path.join("..", "..", "blobs", _blob(repo, data)), os.path.join(snap, name))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(rev)
    return snap


@pytest.mark.parametrize("indexed", [False, True])
def test_a_hugging_face_cache_snapshot_is_read(tmp_path, indexed):
    snap = hf_cache(tmp_path, indexed)
    assert _exact(_load(snap))
    sd = load_state_dict(snap)
    assert all(torch.equal(sd[k], v) for k, v in full().items())
    assert _exact(ldc.load_plain_tensors(snap))


def test_a_snapshot_linking_into_another_repos_blobs_is_refused(tmp_path):
    snap = hf_cache(tmp_path, indexed=False)
    other = str(tmp_path / "hub" / "models--evil--other")
    data = open(os.path.join(snap, "model.safetensors"), "rb").read()
    sha = _blob(other, data)
    link = os.path.join(snap, "model.safetensors")
    os.remove(link)
    os.symlink(os.path.join("..", "..", "..", "models--evil--other", "blobs", sha), link)
    with pytest.raises(ldc.CheckpointingError, match=re.escape(link) + ".*symbolic link"):
        _load(snap)


def test_a_snapshot_layout_without_blobs_is_only_its_own_directory(tmp_path):
    """``snapshots/<rev>/`` alone (no ``blobs/`` two levels up) is not a cache: its root is itself."""
    snap = hf_cache(tmp_path, indexed=False)
    repo = os.path.dirname(os.path.dirname(snap))
    os.rename(os.path.join(repo, "blobs"), os.path.join(repo, "stash"))
    link = os.path.join(snap, "model.safetensors")
    target = os.path.join("..", "..", "stash", os.path.basename(os.readlink(link)))
    os.remove(link)
    os.symlink(target, link)
    with pytest.raises(ldc.CheckpointingError, match=re.escape(link)):
        _load(snap)


# -- links out of the root, for every reader ------------------------------------------------------
def _outside(tmp_path, name, src):
    """A copy of ``src`` outside the model's directory, where a link will point."""
    dst = str(tmp_path / "elsewhere" / name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy(src, dst)
    return dst


CASES = [("hf", "model.safetensors"), ("hf_bin", "pytorch_model.bin"), ("hf_index", SHARDS["w"]),
         ("hf_index", INDEX), ("dcp", ".metadata"), ("dcp", "__0_0.distcp"), ("megatron", "common.pt"),
         ("megatron", "metadata.json"), ("megatron", ".metadata"), ("megatron", "__0_1.distcp")]


@pytest.mark.parametrize("fmt,name", CASES)
def test_a_link_out_of_the_model_is_refused_naming_it(tmp_path, fmt, name):
    ck = build(fmt, str(tmp_path / "model"))
    link = os.path.join(ck, name)
    make_special(link, "link", _outside(tmp_path, name, link))
    tpl = template(fmt)
    with pytest.raises(ldc.CheckpointingError, match=re.escape(link) + ".*symbolic link to .*elsewhere"):
        ldc.load(tpl, ck)
    if not fmt.startswith("hf"):
        from lightning_distckpt.cli.main import main

        for command in ("validate", "inspect"):
            assert main([command, ck]) == 2


@pytest.mark.parametrize("fmt,name", CASES)
def test_a_link_inside_the_model_is_followed(tmp_path, fmt, name):
    """The same files, moved into a subfolder of the model and linked (relatively) from their place."""
    ck = build(fmt, str(tmp_path / "model"))
    link = os.path.join(ck, name)
    os.makedirs(os.path.join(ck, "real"), exist_ok=True)
    os.rename(link, os.path.join(ck, "real", name))
    os.symlink(os.path.join("real", name), link)
    out = ldc.load(template(fmt), ck)
    assert _exact(out)


def test_a_dcp_file_reached_through_a_linked_folder_out_is_refused(tmp_path):
    """``.metadata`` may name files in subfolders: a linked subfolder leaving the root is refused."""
    ck = save_dcp(str(tmp_path / "dcp"))
    meta_path = os.path.join(ck, ".metadata")
    import pickle

    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    for info in meta.storage_data.values():
        info.relative_path = "sub/" + info.relative_path
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for name in os.listdir(ck):
        if name.endswith(".distcp"):
            os.rename(os.path.join(ck, name), outside / name)
    os.symlink(outside, os.path.join(ck, "sub"))
    with pytest.raises(ldc.CheckpointingError, match=re.escape(os.path.join(ck, "sub", ""))):
        ldc.load(template("dcp"), ck)
    os.remove(os.path.join(ck, "sub"))
    os.rename(outside, os.path.join(ck, "sub"))  # the same files inside: read
    assert _exact(ldc.load(template("dcp"), ck))


# -- what the user names ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_file_named_by_the_user_may_be_a_link_to_anywhere(tmp_path, fmt):
    (tmp_path / "store").mkdir()
    real = build(fmt, str(tmp_path / "store" / f"weights.{'pt' if fmt == 'torch' else 'safetensors'}"))
    link = str(tmp_path / "mine" / os.path.basename(real))
    os.makedirs(os.path.dirname(link))
    os.symlink(real, link)
    assert _exact(ldc.load(template(fmt), link))
    assert all(torch.equal(load_state_dict(link)[k], v) for k, v in full().items())


@pytest.mark.parametrize("fmt", ["hf_index", "dcp", "megatron", "ocdbt"])
def test_a_directory_given_may_be_reached_through_links(tmp_path, fmt):
    ck = build(fmt, str(tmp_path / "real" / "model"))
    os.symlink(tmp_path / "real", tmp_path / "linked_parent")
    os.symlink(ck, tmp_path / "last")
    for path in (str(tmp_path / "linked_parent" / "model"), str(tmp_path / "last")):
        assert _exact(ldc.load(template(fmt), path))


def test_our_checkpoints_follow_no_link_even_inside(tmp_path):
    """Unlike other formats, nothing in our checkpoint is read through a link, even one to a file of
    the same checkpoint."""
    ck = build("ocdbt", str(tmp_path / "ck"))
    os.rename(os.path.join(ck, "common.pt"), os.path.join(ck, "common.real"))
    os.symlink("common.real", os.path.join(ck, "common.pt"))
    with pytest.raises(ldc.CheckpointingError, match="common.pt.*symbolic link"):
        ldc.load(template("ocdbt"), ck)
