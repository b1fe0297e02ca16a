"""Checked-in PyTorch DCP checkpoints (tests/data/dcp/torch-2.5, torch-2.13), written by
``torch.distributed.checkpoint.save`` of torch 2.5.1 and of torch 2.13 on 2 gloo processes
(tests/data/dcp/build.py: DTensors with Shard(0), Shard(1), uneven Shard(0) and Replicate
placements in fp32, bf16, fp16 and int64, an optimizer-like nested dict with a plain 0-d tensor, and
objects DCP stored as bytes), load bit-exactly through ``ldc.load``: whole in one process and on 2
gloo ranks under another split, with each loader. ``inspect`` and ``validate`` (the CLI) read them."""

import importlib.util
import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.cli import main as cli_main

DCP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "dcp")
FIXTURES = ("torch-2.5", "torch-2.13")


def _state_module():
    spec = importlib.util.spec_from_file_location("dcp_fixture_state", os.path.join(DCP, "dcp_state.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


S = _state_module()
# the split each tensor is loaded under on 2 ranks (None: whole on every rank): not the save's
LOAD_AXES = {"model.embed.weight": 1, "model.proj.weight": 0, "model.proj.bias": 1, "model.ids": 0,
             "optim.state.embed.weight.exp_avg": 1, "optim.state.embed.weight.step": None}
# the objects as they come back: DCP flattens lists too, so each param group entry is its own key
COMMON = {"step": 7, "meta.names": ["x", "y"], "optim.param_groups.0.lr": 0.01,
          "optim.param_groups.0.betas": (0.9, 0.999), "optim.param_groups.0.params": ["embed.weight"]}


def _piece(full, axis, rank, world):
    """``(offset, piece)`` of ``full`` for ``rank``: ``chunk``'s split along ``axis`` (uneven allowed)."""
    pieces = full.chunk(world, axis)
    offset = [0] * full.dim()
    offset[axis] = sum(p.shape[axis] for p in pieces[:rank])
    return offset, pieces[rank]


def _template(rank, world):
    template = {}
    for key, full in S.full_tensors().items():
        axis = LOAD_AXES[key] if world > 1 else None
        if axis is None:
            template[key] = ldc.ShardedTensor.from_rank_offsets(key, torch.zeros_like(full), replica_id=rank)
        else:
            offset, piece = _piece(full, axis, rank, world)
            template[key] = ldc.ShardedTensor.from_offsets(key, torch.zeros_like(piece).contiguous(), full.shape,
                                                           offset)
    return template


def _mismatches(name, rank, world, loader=None):
    """Load fixture ``name`` under this group's split with ``loader``; the keys of whatever is not
    exactly as saved."""
    out = ldc.load(_template(rank, world), os.path.join(DCP, name), loader=loader)
    bad = []
    for key, full in S.full_tensors().items():
        axis = LOAD_AXES[key] if world > 1 else None
        want = full if axis is None else _piece(full, axis, rank, world)[1]
        if out[key].dtype != want.dtype or not torch.equal(out[key], want):
            bad.append(key)
    return bad + [k for k, v in COMMON.items() if out.get(k) != v]


@pytest.mark.parametrize("name", FIXTURES)
def test_loads_whole_in_one_process(name):
    assert _mismatches(name, 0, 1) == []


LOADERS = (None, "every_rank", "parallel", "two_stage")


def _mismatches_all(rank, world):
    return {(name, loader): _mismatches(name, rank, world, loader) for name in FIXTURES for loader in LOADERS}


def test_loads_under_another_split_on_two_ranks():
    """One pair of gloo processes loads both fixtures with every loader (one spawn for all)."""
    for rank, bad in enumerate(run_distributed(_mismatches_all, 2)):
        assert bad == {(name, loader): [] for name in FIXTURES for loader in LOADERS}, f"rank {rank}"


@pytest.mark.parametrize("name", FIXTURES)
def test_metadata_plain_tensors_and_common(name):
    path = os.path.join(DCP, name)
    full = S.full_tensors()
    meta = ldc.load_tensors_metadata(path)
    assert {k: (st.global_shape, st.dtype) for k, st in meta.items()} == \
        {k: (tuple(t.shape), t.dtype) for k, t in full.items()}
    plain = ldc.load_plain_tensors(path)
    assert all(plain[k].dtype == t.dtype and torch.equal(plain[k], t) for k, t in full.items())
    assert ldc.load_common_state_dict(path) == COMMON


@pytest.mark.parametrize("name", FIXTURES)
def test_cli_inspect_and_validate(name, capsys):
    """The command line (``lightning_distckpt.cli.main``, in this process)."""
    path = os.path.join(DCP, name)
    capsys.readouterr()
    assert cli_main(["inspect", "--json", path]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "PyTorch DCP"
    assert {t["key"]: (tuple(t["shape"]), t["dtype"]) for t in summary["tensors"]} == \
        {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in S.full_tensors().items()}
    assert cli_main(["validate", "--json", path]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["problems"] == []
    assert report["bytes_read"] == sum(t.numel() * t.element_size() for t in S.full_tensors().values())
