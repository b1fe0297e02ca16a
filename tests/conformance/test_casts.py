"""Loading into a template of another dtype kind (integer <-> floating, anything <-> bool).

Megatron-Core and torch DCP convert silently; we refuse by default (pytorch/pytorch#187138 asks DCP
to stop narrowing silently) and convert with ``load(..., cast="any")`` or the config's ``cast: any``.
Megatron-LM's flattened-resharding scenario saves an int64 ``arange`` and loads it into float
templates under another layout (``tests/fixtures/megatron/build_flattened.py``): refused without
``cast="any"``; with it, on 4 gloo ranks and every loader, each rank gets what megatron-core 0.15.3
got (recorded, ``flattened_0.15.3.json``), and, for the tensors it still handles, bit-exactly what
the installed megatron-core (0.16) loads. Every conversion is the one ``Tensor.to`` makes, on each
read path (direct reads, packed shards, tensorstore's reads) and from other formats' files.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed
from fixtures.megatron import build_flattened as scenario
from lightning_distckpt.core.errors import ConfigError

from .megatron_side import FIXTURES, cpu_only_megatron

RECORDED = os.path.join(FIXTURES, "flattened_0.15.3.json")
LOADERS = ("two_stage", "every_rank", "parallel")


def _name(saved, wanted) -> str:
    return f"{'x'.join(map(str, saved))}->{'x'.join(map(str, wanted))}"


def _refusal(load) -> Any:
    """The error ``load()`` raised (type name, message), or None."""
    try:
        load()
    except ldc.CheckpointingError as e:
        return type(e).__name__, str(e)
    return None


def _megatron_side_by_side(rank: int, root: str) -> Dict[str, Any]:
    """megatron-core 0.16 saves the scenario's tensor it still handles (not the flattened one) and
    loads it into the float template under another layout; we load its checkpoint the same way."""
    cpu_only_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    (saved, wanted), path = scenario.RESHARDS[0], os.path.join(root, "megatron")
    if rank == 0:
        os.makedirs(path)
    dist.barrier()
    try:
        dist_checkpointing.save(scenario.scenario(dist_checkpointing.mapping, rank, saved, flat=False), path,
                                sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
        theirs = dist_checkpointing.load(scenario.scenario(dist_checkpointing.mapping, rank, wanted, random=True,
                                                           flat=False), path)["sd_key_unflat"]
    finally:  # megatron-core's results-queue manager process
        for child in multiprocessing.active_children():
            child.terminate()
    template = lambda: scenario.scenario(ldc, rank, wanted, random=True, flat=False)  # noqa: E731
    ours = ldc.load(template(), path, cast="any")["sd_key_unflat"]
    return {"refused": _refusal(lambda: ldc.load(template(), path)), "theirs_dtype": str(theirs.dtype),
            "same": ours.dtype == theirs.dtype and torch.equal(ours, theirs)}


def _reshard(rank: int, world: int, root: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {"refused": {}, "loaded": {}}
    for saved in sorted({s for s, _ in scenario.RESHARDS}):
        ldc.save(scenario.scenario(ldc, rank, saved), os.path.join(root, "x".join(map(str, saved))))
    for saved, wanted in scenario.RESHARDS:
        path = os.path.join(root, "x".join(map(str, saved)))
        template = lambda: scenario.scenario(ldc, rank, wanted, random=True)  # noqa: E731
        expected = scenario.scenario(ldc, rank, wanted)
        out["refused"][_name(saved, wanted)] = _refusal(lambda: ldc.load(template(), path))
        for loader in LOADERS:
            got = ldc.load(template(), path, cast="any", loader=loader)
            out["loaded"][(_name(saved, wanted), loader)] = {
                key: scenario.loaded(got[key], expected[key].data) for key in sorted(got)}
    out["megatron"] = _megatron_side_by_side(rank, root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_reshard, scenario.WORLD, str(tmp_path_factory.mktemp("casts")), timeout_s=300)


def test_megatron_scenario_is_refused_without_cast(results):
    """On every rank, before anything is read: the key, both dtypes and both ways to allow it."""
    for rank, ours in enumerate(results):
        for name, refused in ours["refused"].items():
            assert refused is not None, f"rank {rank} {name}: loaded int64 into float32 without cast='any'"
            kind, message = refused
            assert kind == "ShardingError", message
            assert "stored as int64 but the template asks for float32" in message, message
            assert "pass cast='any' to load / set `cast: any` in the checkpoint config" in message, message


def test_megatron_scenario_with_cast_any_gets_what_megatron_core_got(results):
    with open(RECORDED) as f:
        recorded = json.load(f)["ranks"]
    for rank, (ours, theirs) in enumerate(zip(results, recorded)):
        for saved, wanted in scenario.RESHARDS:
            expected = theirs["reshard"][_name(saved, wanted)]
            assert all(v["dtype"] == "float32" and v["equal"] for v in expected.values())  # what Megatron did
            for loader in LOADERS:
                assert ours["loaded"][(_name(saved, wanted), loader)] == expected, f"rank {rank} {loader}"


def test_installed_megatron_core_converts_as_cast_any_does(results):
    for rank, ours in enumerate(results):
        side = ours["megatron"]
        assert side["theirs_dtype"] == "torch.float32" and side["same"], f"rank {rank}"
        assert side["refused"] is not None and side["refused"][0] == "ShardingError", f"rank {rank}"


# -- every conversion is Tensor.to's, on every read path ----------------------------------------------
def _sources() -> Dict[str, torch.Tensor]:
    """Stored tensors, (60, 10) each: integers with values floats cannot hold exactly (2**24 + 1,
    2**53 + 1, ...), floats with fractions, halves, signed zeros (all within int8's range, and
    non-negative where an unsigned target would otherwise be undefined), bools."""
    g = torch.Generator().manual_seed(0)
    ints = torch.tensor([2 ** 24 + 1, 2 ** 24 + 3, 2 ** 53 + 1, -(2 ** 31) - 1, 2 ** 40 + 12345, 65281, 65535, 255, 256,
                         -1, 0, 1, 2 ** 63 - 1, -(2 ** 63), 3 * 2 ** 24 + 1])
    i64 = torch.cat([ints, torch.randint(-2 ** 62, 2 ** 62, (585,), generator=g)]).view(60, 10)
    signed = torch.cat([torch.tensor([2.5, -2.5, 0.5, -0.5, 0.0, -0.0, 119.99, -119.99, 1e-30, 7.0]),
                        (torch.rand(590, generator=g) - 0.5) * 240]).view(60, 10)
    return {"i64": i64, "i32": torch.randint(-2 ** 31, 2 ** 31 - 1, (60, 10), generator=g, dtype=torch.int32),
            "u8": torch.randint(0, 256, (60, 10), generator=g, dtype=torch.uint8),
            "i16": torch.randint(-2 ** 15, 2 ** 15 - 1, (60, 10), generator=g, dtype=torch.int16),
            "bool": torch.rand(60, 10, generator=g) > 0.5, "f32": signed.float(), "f32_pos": signed.abs().float(),
            "bf16": signed.to(torch.bfloat16), "f16": signed.abs().to(torch.float16), "f64": signed.double()}


TARGETS = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "floating" if dtype.is_floating_point else "integer"


def _pairs():
    """(key, target dtype) for every conversion across kinds whose result torch defines (negative
    floats into uint8 are undefined in C++, and in torch)."""
    for key, t in _sources().items():
        for target in TARGETS:
            if _kind(target) != _kind(t.dtype) and not (target == torch.uint8 and key in ("f32", "bf16", "f64")):
                yield key, target


def _save(path, pack: bool) -> None:
    ldc.save({k: ldc.ShardedTensor.from_rank_offsets(k, v) for k, v in _sources().items()}, path,
             storage=ldc.StorageOptions(chunk_bytes=1024, pack_max_bytes=1 << 20 if pack else 0))


@pytest.mark.parametrize("path_kind", ["direct", "packed", "tensorstore"])
def test_every_cross_kind_cast_is_tensor_to(tmp_path, monkeypatch, path_kind):
    """Whole tensors and a row range cutting chunks, read directly (Tensor.copy_ from the scratch
    buffer), from a pack (copy_), or by tensorstore (arrays without our chunk checksums, as formats
    3-4 wrote them, direct reads off; read in the stored dtype, then copy_): each equals
    ``stored.to(target)``."""
    from lightning_distckpt.storage import tensorstore_io

    ck, sources = str(tmp_path / "ck"), _sources()
    if path_kind == "tensorstore":
        with monkeypatch.context() as mp:
            mp.setattr(tensorstore_io.TensorStoreIO, "own_checksums", lambda self, arr, chunk_bytes=None: False)
            _save(ck, pack=False)
        monkeypatch.setenv("LIGHTNING_DISTCKPT_DIRECT_READS", "0")
    else:
        _save(ck, pack=path_kind == "packed")
    casts = []  # conversions asked of tensorstore: none (they differ from Tensor.to on NaN payloads, float8)
    real_cast = tensorstore_io.ts.cast
    monkeypatch.setattr(tensorstore_io.ts, "cast", lambda *a, **k: casts.append(a[1]) or real_cast(*a, **k))
    pairs = list(_pairs())
    for rows in (slice(0, 60), slice(7, 45)):
        for target in TARGETS:
            keys = [k for k, t in pairs if t == target]
            template = lambda: {k: ldc.ShardedTensor.from_offsets(  # noqa: E731
                k, torch.zeros(rows.stop - rows.start, 10, dtype=target), (60, 10), (rows.start, 0)) for k in keys}
            with pytest.raises(ldc.ShardingError, match="pass cast='any' to load"):
                ldc.load(template(), ck)
            out = ldc.load(template(), ck, cast="any")
            for k in keys:
                want = sources[k][rows].to(target)
                assert out[k].dtype == target and torch.equal(out[k], want), f"{k} -> {target} rows {rows}"
    # torch (Tensor.copy_) converted them on every path, tensorstore's included
    assert casts == []


def test_files_of_other_formats_cast_as_tensor_to(tmp_path):
    """A safetensors file and a torch.save file: refused by default, converted with cast='any'."""
    from safetensors.torch import save_file

    sources = _sources()
    save_file({"i64": sources["i64"], "bool": sources["bool"]}, str(tmp_path / "m.safetensors"))
    torch.save({"f32": sources["f32"], "u8": sources["u8"]}, tmp_path / "m.pt")
    for path, key, target in ((tmp_path / "m.safetensors", "i64", torch.bfloat16),
                              (tmp_path / "m.safetensors", "bool", torch.float32),
                              (tmp_path / "m.pt", "f32", torch.int16), (tmp_path / "m.pt", "u8", torch.bool)):
        def template(key=key, target=target):
            return {key: ldc.ShardedTensor.from_rank_offsets(key, torch.zeros(60, 10, dtype=target))}
        with pytest.raises(ldc.ShardingError, match="cast='any'"):
            ldc.load(template(), path)
        got = ldc.load(template(), path, cast="any")[key]
        assert torch.equal(got, sources[key].to(target)), f"{path.name}: {key} -> {target}"


def test_cast_values_are_checked(tmp_path):
    from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError

    _save(str(tmp_path / "ck"), pack=False)
    template = {"i64": ldc.ShardedTensor.from_rank_offsets("i64", torch.zeros(60, 10))}
    with pytest.raises(ArgumentError, match=r"cast must be one of \['same_kind', 'any'\], got 'unsafe'"):
        ldc.load(template, tmp_path / "ck", cast="unsafe")
    with pytest.raises(ArgumentTypeError, match="cast must be one of"):
        ldc.load(template, tmp_path / "ck", cast=True)


def test_the_lightning_config_s_cast_key(tmp_path):
    """``cast: any`` in the checkpoint config (YAML / mapping) reaches the plugin's loads (and so the
    strategies', which load through it); the default refuses, naming the key to set."""
    from lightning_distckpt.lightning import DistCheckpointIO
    from lightning_distckpt.lightning.config import load_checkpoint_config

    _save(str(tmp_path / "ck"), pack=False)
    sources = _sources()
    template = lambda: {"w": ldc.ShardedTensor.from_rank_offsets("i64", torch.zeros(60, 10))}  # noqa: E731
    with pytest.raises(ldc.ShardingError, match="set `cast: any` in the checkpoint config"):
        DistCheckpointIO().load_sharded(template(), str(tmp_path / "ck"))
    (tmp_path / "c.yaml").write_text("cast: any\n")
    for config in ({"cast": "any"}, str(tmp_path / "c.yaml")):
        io = DistCheckpointIO(config)
        assert torch.equal(io.load_sharded(template(), str(tmp_path / "ck"))["w"], sources["i64"].float())
        source = io.open_source(str(tmp_path / "ck"))  # what the strategies pass: an opened source
        assert torch.equal(io.load_sharded(template(), source)["w"], sources["i64"].float())
    with pytest.raises(ConfigError, match="cast must be one of"):
        load_checkpoint_config({"cast": "unsafe"})


def _one_rank_asks_across_kinds(rank: int, world: int, path: str) -> Any:
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(8).view(world, 4)[rank].clone(),
                                                       (0, rank, world))}, path)
    out = {}
    for loader in LOADERS:  # rank 0 asks for float32, the others for int64 (allowed): all raise rank 0's error
        dtype = torch.float32 if rank == 0 else torch.int64
        out[loader] = _refusal(lambda: ldc.load({"w": ldc.ShardedTensor.from_rank_offsets(
            "w", torch.zeros(8, dtype=dtype))}, path, loader=loader))
    return out


def test_one_rank_s_template_refused_fails_every_rank(tmp_path):
    for rank, out in enumerate(run_distributed(_one_rank_asks_across_kinds, 2, str(tmp_path / "ck"))):
        for loader, refused in out.items():
            assert refused is not None and refused[0] == "ShardingError", f"rank {rank} {loader}"
            assert "rank 0" in refused[1] and "'w' is stored as int64" in refused[1], refused[1]
