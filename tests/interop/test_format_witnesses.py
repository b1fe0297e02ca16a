"""Checked-in checkpoints of every format version (tests/data/formats/vN, made by
tests/data/formats/build.py with the library at the commit that wrote that version, on 2 gloo
processes) load bit-exactly with today's code: in one process (every tensor whole) and on 2 gloo
ranks under another split than the one that wrote them (rows <-> columns, the flattened optimizer
tensor as a column split, the two ShardedObject elements swapped), with each loader; convert's
relayout brings each to today's format. ``inspect`` and ``validate`` (the CLI, in this process, and
``python -m lightning_distckpt`` for two) read each of them. tests/data/README.md lists them."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.cli import main as cli_main
from lightning_distckpt.export import relayout
from lightning_distckpt.core.format_versions import FORMAT_VERSION

FORMATS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "formats")
# directory -> (format version, plain tensors stored as tensors?); v5-plain-tensors: format 5 as the
# commits between plain-tensor storage and the format-6 bump wrote it (with ``plain_tensors``);
# vN-zarr: the zarr layout (a file per chunk) with 1 KiB chunks (arrays and packs of 2 chunks)
WITNESSES = {"v1": (1, False), "v2": (2, False), "v3": (3, False), "v4": (4, False), "v5": (5, False),
             "v5-plain-tensors": (5, True), "v6": (6, True), "v7": (7, True), "v8": (8, True),
             **{f"v{n}-zarr": (n, n >= 6) for n in range(1, 9)}}


def _witness_module():
    spec = importlib.util.spec_from_file_location("format_witness", os.path.join(FORMATS, "witness.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _witness_module()
# the split each tensor is loaded under on 2 ranks: another axis than the save's (flat: columns)
# (format 8 on: the tied pair, saved by rows, loaded by columns as the stored key and by rows as the alias)
LOAD_AXES = {"model.tp_row.weight": 1, "model.tp_col.weight": 0, "model.ids": 0, "optimizer.exp_avg": 1,
             "model.embed.weight": 1, "model.lm_head.weight": 0}


def _path(name):
    return os.path.join(FORMATS, name)


def _full(name):
    """The global tensors witness ``name`` holds (format 8 on: the tied pair too, one tensor under both keys)."""
    return W.full_tensors_of(WITNESSES[name][0])


def _template(name, rank, world):
    """This rank's template: its piece of each tensor (zeros), its object elements, plain-tensor slots. In one
    process the tied pair's template is tied too (one tensor under both keys), on 2 ranks untied (two splits)."""
    tensors = {}
    for key, full in _full(name).items():
        if world == 1:
            tied = tensors.get(W.TIED_KEYS[0]) if key == W.TIED_KEYS[1] else None
            data = tied.data if tied is not None else torch.zeros_like(full)
            tensors[key] = ldc.ShardedTensor.from_rank_offsets(key, data)
        else:
            axis = LOAD_AXES[key]
            pieces = full.chunk(world, axis)  # uneven where the axis does not divide (model.ids: 3 | 2)
            offset = [0] * full.dim()
            offset[axis] = sum(p.shape[axis] for p in pieces[:rank])
            tensors[key] = ldc.ShardedTensor.from_offsets(
                key, torch.zeros_like(pieces[rank]).contiguous(), full.shape, offset)
    elements = range(W.WORLD) if world == 1 else [W.WORLD - 1 - rank]  # 2 ranks: the other rank's element
    objects = {f"obj{i}": ldc.ShardedObject(W.OBJECT_KEY, None, (W.WORLD,), (i,)) for i in elements}
    plain = {k: torch.full_like(v, 99) for k, v in W.plain_tensors().items()}
    return {"tensors": tensors, "objects": objects, "scores": plain}


def _expected(name, rank, world):
    full = _full(name)
    tensors = full if world == 1 else {k: t.chunk(world, LOAD_AXES[k])[rank] for k, t in full.items()}
    elements = range(W.WORLD) if world == 1 else [W.WORLD - 1 - rank]
    return tensors, {f"obj{i}": W.OBJECTS[i] for i in elements}


def _mismatches(name, rank, world, loader=None, path=None):
    """Load witness ``name`` (or its copy at ``path``) under this group's split with ``loader``; the
    names of whatever is not exactly as written."""
    template = _template(name, rank, world)
    plain_slots = dict(template["scores"])
    out = ldc.load(template, path or _path(name), loader=loader)
    tensors, objects = _expected(name, rank, world)
    bad = [k for k, t in tensors.items()
           if out["tensors"][k].dtype != t.dtype or not torch.equal(out["tensors"][k], t)]
    bad += [k for k, o in objects.items() if out["objects"][k] != o]
    for k, t in W.plain_tensors().items():
        got = out["scores"][k]
        if got.dtype != t.dtype or not torch.equal(got, t) or got is not plain_slots[k]:
            bad.append(f"scores.{k}")  # wrong, or not read into the template's own tensor
    bad += [k for k, v in W.COMMON.items() if out.get(k) != v]
    return bad


@pytest.mark.parametrize("name", WITNESSES)
def test_loads_whole_in_one_process(name):
    assert _mismatches(name, 0, 1) == []


LOADERS = (None, "every_rank", "parallel", "two_stage")


def _mismatches_all(rank, world):
    return {(name, loader): _mismatches(name, rank, world, loader) for name in WITNESSES for loader in LOADERS}


def test_loads_under_another_split_on_two_ranks():
    """One pair of gloo processes loads every witness with every loader (one spawn for all)."""
    for rank, bad in enumerate(run_distributed(_mismatches_all, 2)):
        assert bad == {(name, loader): [] for name in WITNESSES for loader in LOADERS}, f"rank {rank}"


@pytest.mark.parametrize("name", WITNESSES)
def test_relayout_writes_the_current_format(name, tmp_path):
    """convert's relayout of an old format: today's format, the same values."""
    out = str(tmp_path / "relayout")
    relayout(_path(name), out, ldc.StorageOptions())
    with open(os.path.join(out, "metadata.json")) as f:
        meta = json.load(f)  # a checkpoint with aliases keeps them (format 8); others: today's version
    assert meta["format_version"] == (8 if WITNESSES[name][0] >= 8 else FORMAT_VERSION)
    assert ("aliases" in meta) == (WITNESSES[name][0] >= 8)
    assert _mismatches(name, 0, 1, path=out) == []


@pytest.mark.parametrize("name", WITNESSES)
def test_metadata_and_common_state(name):
    version, stored_plain = WITNESSES[name]
    with open(os.path.join(_path(name), "metadata.json")) as f:
        assert json.load(f)["format_version"] == version
    meta = ldc.load_tensors_metadata(_path(name))
    expected = {k: (tuple(t.shape), t.dtype) for k, t in _full(name).items()}
    if stored_plain:
        expected.update({f"scores/{k}": (tuple(t.shape), t.dtype) for k, t in W.plain_tensors().items()})
    assert {k: (st.global_shape, st.dtype) for k, st in meta.items()} == expected
    plain = ldc.load_plain_tensors(_path(name))
    assert all(torch.equal(plain[k], t) for k, t in _full(name).items())
    common = ldc.load_common_state_dict(_path(name))
    assert {k: common[k] for k in W.COMMON} == W.COMMON
    scores = common["scores"]  # plain tensors are back in their places (read whole in format 6)
    assert scores.keys() == W.plain_tensors().keys()
    assert all(torch.equal(scores[k], t) and scores[k].dtype == t.dtype for k, t in W.plain_tensors().items())


def _cli(capsys, *args):
    """The command line in this process (``lightning_distckpt.cli.main``): exit code and stdout."""
    capsys.readouterr()
    code = cli_main(list(args))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", WITNESSES)
def test_cli_inspect_and_validate(name, capsys):
    version, stored_plain = WITNESSES[name]
    code, out = _cli(capsys, "inspect", "--json", _path(name))
    assert code == 0, out
    summary = json.loads(out)
    assert summary["format_version"] == version and summary["checksums"] == (version >= 3)
    assert summary["storage"]["layout"] == ("zarr" if name.endswith("-zarr") else "ocdbt")
    shown = {t["key"]: (tuple(t["shape"]), t["dtype"]) for t in summary["tensors"]}
    want = {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in _full(name).items()}
    assert {k: shown[k] for k in want} == want
    assert [(o["key"], o["elements"]) for o in summary["objects"]] == [(W.OBJECT_KEY, W.WORLD)]

    code, out = _cli(capsys, "validate", "--json", _path(name))
    assert code == 0, out
    report = json.loads(out)
    assert report["ok"] and report["problems"] == [] and report["objects"] == W.WORLD
    if version < 3:  # written before checksums: readable, refused when checksums are required
        assert any("checksums" in w for w in report["warnings"]), report
        assert _cli(capsys, "validate", "--require-checksums", _path(name))[0] != 0
    else:
        assert report["warnings"] == []


@pytest.mark.parametrize("name", ["v1", "v6-zarr"])
def test_python_m_lightning_distckpt(name):
    """The module entry point itself (a fresh interpreter) on the oldest and the newest format."""
    for command in ("inspect", "validate"):
        done = subprocess.run([sys.executable, "-m", "lightning_distckpt", command, _path(name)],
                              capture_output=True, text=True, timeout=300)  # a bound on a hang only
        assert done.returncode == 0, done.stdout + done.stderr
        assert (f"lightning_distckpt v{WITNESSES[name][0]}," if command == "inspect" else "OK: ") in done.stdout
