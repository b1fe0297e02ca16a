"""``load_tensors_metadata`` of tensors saved as flattened pieces (the distributed optimizer's
``flattened_range``), beside Megatron-Core.

Megatron-Core 0.12-0.15 describe such a tensor with a ``flattened_range`` over the whole tensor, so a
load with that description gives the 1-D tensor ((8, 5, 40) -> (1600,)); Megatron-LM's
``test_load_tensor_metadata`` relies on it. 0.16 no longer saves flattened tensors. We describe
the N-D tensor by default and Megatron's form with ``flattened=True``. Megatron-LM's scenario
(``tests/fixtures/megatron/build_flattened.py``) is saved by us on 4 gloo ranks under 4 layouts;
our descriptions and loads are compared field by field with what megatron-core 0.15.3 answered for
the same scenario (recorded by that script, ``flattened_0.15.3.json``), and our N-D form with what
the installed megatron-core (0.16) answers for the same tensors exported to ``torch_dist``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import ArgumentTypeError
from fixtures.megatron import build_flattened as scenario

from .megatron_side import FIXTURES, cpu_only_megatron

RECORDED = os.path.join(FIXTURES, "flattened_0.15.3.json")
WHOLE = torch.arange(scenario.SHAPE[0] * scenario.SHAPE[1] * scenario.SHAPE[2])


def _name(layout) -> str:
    return "x".join(map(str, layout))


def _described_and_loaded(path: str, rank: int, flattened: bool) -> Dict[str, Any]:
    """Megatron-LM's check, with our functions: the description, then a load with it (every rank
    asking for everything, replica id = rank)."""
    meta = ldc.load_tensors_metadata(path, flattened=flattened)
    described = {key: scenario.describe(meta[key]) for key in sorted(meta)}
    for sharded_tensor in meta.values():
        sharded_tensor.replica_id = rank
    got = ldc.load(meta, path)
    nd = WHOLE.reshape(scenario.SHAPE)
    return {"described": described, "loaded": {"unflat": scenario.loaded(got["unflat"], nd),
                                               "flat": scenario.loaded(got["flat"], WHOLE if flattened else nd)}}


def _megatron_on_export(rank: int, path: str, exported: str) -> Dict[str, Any]:
    """The installed megatron-core's description of our checkpoint exported to ``torch_dist``,
    and its load with that description."""
    if rank == 0:
        ldc.export.to_megatron(path, exported)
    dist.barrier()
    cpu_only_megatron()
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(exported)
    described = {key: scenario.describe(meta[key]) for key in sorted(meta)}
    for sharded_tensor in meta.values():
        sharded_tensor.replica_id = rank
    got = dist_checkpointing.load(meta, exported)
    return {"described": described, "loaded": {"unflat": scenario.loaded(got["unflat"], WHOLE.reshape(scenario.SHAPE)),
                                               "flat": scenario.loaded(got["flat"], WHOLE.reshape(scenario.SHAPE))}}


def _save_and_describe(rank: int, world: int, root: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for layout in scenario.SAVE_LAYOUTS:
        path = os.path.join(root, _name(layout))
        ldc.save(scenario.scenario(ldc, rank, layout), path)
        out[_name(layout)] = {flattened: _described_and_loaded(path, rank, flattened) for flattened in (True, False)}
    out["megatron"] = _megatron_on_export(rank, os.path.join(root, "2x2"), os.path.join(root, "exported"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every rank's descriptions and loads (one 4-process run for the module's tests)."""
    return run_distributed(_save_and_describe, scenario.WORLD, str(tmp_path_factory.mktemp("flat")), timeout_s=300)


@pytest.fixture(scope="module")
def recorded():
    with open(RECORDED) as f:
        return json.load(f)["ranks"]


def test_flattened_true_is_megatron_cores_description(results, recorded):
    """Field by field (shapes, offset, fragmentations, flattened_range, dtype, replica id, no data)
    as megatron-core 0.15.3 describes the same scenario, and a load with it gives what Megatron's
    gives: the 1-D tensor of all elements for ``flat``, the N-D tensor for ``unflat``."""
    for rank, (ours, theirs) in enumerate(zip(results, recorded)):
        for layout in scenario.SAVE_LAYOUTS:
            name = _name(layout)
            assert ours[name][True] == theirs["metadata"][name], f"rank {rank}, saved under {name}"
            assert ours[name][True]["described"]["flat"]["flattened_range"] == [0, 1600]
            assert ours[name][True]["loaded"]["flat"] == {"shape": [1600], "dtype": "int64", "equal": True}


def test_default_is_the_n_d_tensor(results):
    """By default ``flat`` is described as ``unflat`` is (no flattened_range) and loads as the N-D
    tensor; Megatron-LM's own check (flat and unflat have the same local and global shape) holds in
    both forms."""
    for rank, ours in enumerate(results):
        for layout in scenario.SAVE_LAYOUTS:
            for flattened in (True, False):
                described = ours[_name(layout)][flattened]["described"]
                for field in ("local_shape", "global_shape"):
                    assert described["flat"][field] == described["unflat"][field] == list(scenario.SHAPE)
            default = ours[_name(layout)][False]
            assert default["described"]["flat"] == default["described"]["unflat"], f"rank {rank}"
            assert default["loaded"]["flat"] == {"shape": list(scenario.SHAPE), "dtype": "int64", "equal": True}
            assert default["loaded"]["unflat"] == default["loaded"]["flat"]


def test_default_matches_the_installed_megatron_core_on_the_export(results):
    """megatron-core 0.16 (which no longer saves flattened tensors) describes the same tensors,
    exported by ``export_megatron``, as our default does, and loads them N-D."""
    for rank, ours in enumerate(results):
        assert ours["megatron"]["described"] == ours["2x2"][False]["described"], f"rank {rank}"
        assert ours["megatron"]["loaded"] == ours["2x2"][False]["loaded"], f"rank {rank}"


def test_flattened_must_be_a_bool(tmp_path):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3))}, tmp_path / "ck")
    with pytest.raises(ArgumentTypeError, match="flattened must be a bool"):
        ldc.load_tensors_metadata(tmp_path / "ck", flattened="yes")
    plain = ldc.load_tensors_metadata(tmp_path / "ck", flattened=True)["w"]
    assert plain.flattened_range is None and plain.global_shape == (3,)  # not flattened when saved: as it is
