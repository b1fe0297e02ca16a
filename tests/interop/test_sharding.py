"""Rank-0 broadcast and shard (lightning_distckpt.ingest): every shard kind, bit-exact, on 1, 2 and
4 gloo processes, from real torch and safetensors files; the errors every rank must share."""

import pytest
import safetensors.torch
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import ArgumentError, ArgumentTypeError, FormatError, MissingKeysError, ShardingError
from lightning_distckpt.ingest import broadcast_and_shard_state_dict, load_state_dict, shard_broadcasted_state_dict

META = torch.device("meta")


def full_state():
    """The source tensors (sizes divisible by 1, 2 and 4)."""
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(8, 6, generator=g),
        "cols": torch.randn(6, 12, generator=g),
        "grid": torch.randn(8, 4, generator=g),
        "norm": torch.randn(6, generator=g),
        "uneven": torch.randn(11, 3, generator=g),
        "experts": torch.randn(4, 3, 2, generator=g),
        "flat": torch.randn(12, 5, generator=g),
        "to_bf16": torch.randn(16, 4, generator=g),
        "ints": torch.arange(40, dtype=torch.int64).view(8, 5),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "big": torch.randn(64, 256, generator=g),  # 64 KiB: over the small bucket size below
        "unused": torch.randn(3, generator=g),
    }


def _meta(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device=META)


def uneven_bounds(world):
    cuts = [0, 5, 7, 10, 11] if world == 4 else [0, 4, 11] if world == 2 else [0, 11]
    return cuts[:world + 1]


def meta_entries(rank, world):
    """(sharded entries, expected shard of each name from the full state)."""
    ST = ldc.ShardedTensor
    full = full_state()
    lo, hi = uneven_bounds(world)[rank], uneven_bounds(world)[rank + 1]
    gr, gc = (rank // 2, rank % 2) if world == 4 else (rank, 0)
    grid_parts = (2, 2) if world == 4 else (world, 1)
    n = 12 // world
    flat_lo, flat_hi = 3, n * 5 - 2  # a middle range of the flattened local shard
    entries = {
        "rows": ST.from_rank_offsets("rows", _meta((8 // world, 6)), (0, rank, world)),
        "cols": ST.from_rank_offsets("cols", _meta((6, 12 // world)), (1, rank, world)),
        "grid": ST.from_rank_offsets("grid", _meta((8 // grid_parts[0], 4 // grid_parts[1])),
                                     (0, gr, grid_parts[0]), (1, gc, grid_parts[1])),
        "norm": ST.from_rank_offsets("norm", _meta((6,)), replica_id=rank),
        "uneven": ST.from_offsets("uneven", _meta((hi - lo, 3)), (11, 3), (lo, 0)),
        # One expert per rank out of 4: the local tensor lacks the expert axis.
        "experts": ST.from_offsets("experts", _meta((3, 2)), (4, 3, 2), (rank, 0, 0), prepend_axis_num=1),
        "flat": ST.from_rank_offsets_flat("flat", _meta((flat_hi - flat_lo,)), (n, 5), (0, rank, world),
                                          flattened_range=slice(flat_lo, flat_hi)),
        "bf16": ST.from_rank_offsets("to_bf16", _meta((16 // world, 4), torch.bfloat16), (0, rank, world)),
        "ints32": ST.from_rank_offsets("ints", _meta((8 // world, 5), torch.int32), (0, rank, world)),
        "scalar": ST.from_rank_offsets("scalar", _meta((), torch.float64), replica_id=rank),
        "mask": _meta((9,), torch.bool),  # a plain tensor: loaded whole under its own name
        "big": ST.from_rank_offsets("big", _meta((64, 256 // world)), (1, rank, world)),
        "tied": ST.from_rank_offsets("rows", _meta((8 // world, 6)), (0, rank, world)),
    }
    b = 8 // grid_parts[0], 4 // grid_parts[1]
    expected = {
        "rows": full["rows"].chunk(world, 0)[rank],
        "cols": full["cols"].chunk(world, 1)[rank],
        "grid": full["grid"][gr * b[0]:(gr + 1) * b[0], gc * b[1]:(gc + 1) * b[1]],
        "norm": full["norm"],
        "uneven": full["uneven"][lo:hi],
        "experts": full["experts"][rank],
        "flat": full["flat"].chunk(world, 0)[rank].reshape(-1)[flat_lo:flat_hi],
        "bf16": full["to_bf16"].chunk(world, 0)[rank].to(torch.bfloat16),
        "ints32": full["ints"].chunk(world, 0)[rank].to(torch.int32),
        "scalar": full["scalar"],
        "mask": full["mask"],
        "big": full["big"].chunk(world, 1)[rank],
        "tied": full["rows"].chunk(world, 0)[rank],
    }
    return entries, expected


def _shard(rank, world, path, **options):
    entries, expected = meta_entries(rank, world)
    sd = load_state_dict(path)
    assert (len(sd) > 0) == (rank == 0)
    out = {}
    if rank == 0:
        broadcast_and_shard_state_dict(sd, entries, out, **options)
    else:
        shard_broadcasted_state_dict(entries, out, **options)
    assert sorted(out) == sorted(expected)
    for name, want in expected.items():
        got = out[name]
        assert got.dtype == want.dtype and got.device.type == "cpu", name
        assert got.is_contiguous(), name
        assert torch.equal(got, want), name
    return True


def _shard_all_ways(rank, world, paths):
    for path in paths:
        _shard(rank, world, path)
        # Tiny buckets and in-flight bound: every broadcast waits for the one before.
        _shard(rank, world, path, bucket_bytes=256, max_inflight_bytes=1024)
    return True


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding")
    state = full_state()
    torch.save(state, root / "state.pt")
    safetensors.torch.save_file(state, str(root / "state.safetensors"))
    return str(root / "state.pt"), str(root / "state.safetensors")


def test_single_process(files):
    assert _shard_all_ways(0, 1, files)


def test_two_processes(files):
    assert run_distributed(_shard_all_ways, 2, files) == [True, True]


def test_four_processes(files):
    assert run_distributed(_shard_all_ways, 4, files[:1]) == [True] * 4


def _bounded(rank, world, path):
    from lightning_distckpt.comm import get_comm
    from lightning_distckpt.ingest.api import ShardOptions, shard_from_rank0

    entries, expected = meta_entries(rank, world)
    sd = load_state_dict(path)  # collective: every rank calls it
    out = {}
    result = shard_from_rank0(get_comm(), sd if rank == 0 else None, entries, out,
                              ShardOptions(max_inflight_bytes=8192, bucket_bytes=1024))
    assert all(torch.equal(out[k], v) for k, v in expected.items())
    return result


def test_memory_bound_and_bytes_sent(files):
    """At most max_inflight_bytes posted at once, or one larger box alone ('big': 32 KiB per
    half); buffers within that; half of each split tensor is not sent at all at 2 ranks."""
    results = run_distributed(_bounded, 2, files[1])
    for r in results:
        assert 0 < r.stats.peak_inflight_bytes <= 32 << 10
        assert r.stats.peak_extra_bytes <= r.stats.peak_inflight_bytes
        assert r.unexpected == ("unused",) and r.missing == ()
        assert r.sent_bytes < r.whole_bytes
    # Rank 1's shards of the two big row/column splits are exactly the boxes sent: received in place.
    assert results[1].stats.peak_extra_bytes < results[1].stats.peak_inflight_bytes


def test_bucketing_sends_union_of_slices():
    """The manifest sends each tensor once, as the box the other ranks need, small ones bucketed."""
    from lightning_distckpt.ingest.plan import build_manifest, collect_needs

    state = full_state()
    needs = [n for r in range(4) for n in collect_needs(meta_entries(r, 4)[0], r)]
    m = build_manifest(state, needs, bucket_bytes=1024)
    assert m.error is None and m.unexpected == ("unused",)
    sent = {i.key: i for op in m.ops for i in op.items}
    assert set(sent) == set(state) - {"unused"}
    assert sent["rows"].offset == (2, 0) and sent["rows"].shape == (6, 6)  # rank 0's quarter is not sent
    assert sent["cols"].offset == (0, 3) and sent["cols"].shape == (6, 9)
    assert sent["norm"].shape == (6,)
    assert any(len(op.items) > 1 for op in m.ops) and all(op.nbytes <= 1024 or len(op.items) == 1 for op in m.ops)
    assert m.sent_bytes < m.whole_bytes
    for op in m.ops:
        for item in op.items:
            assert item.start % 64 == 0 and item.start + item.nbytes <= op.nbytes
    strict = build_manifest(state, needs, bucket_bytes=1024, unexpected_ok=False)
    assert strict.error[0] == "MissingKeysError" and "'unused'" in strict.error[1] and not strict.ops


# -- errors: every rank raises the same one, nobody hangs ---------------------------------------
def _expect(exc_type, fn, *words):
    with pytest.raises(exc_type) as info:
        fn()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    return str(info.value)


def _both_sides(rank, sd, entries):
    out = {}
    if rank == 0:
        return lambda: broadcast_and_shard_state_dict(sd, entries, out)
    return lambda: shard_broadcasted_state_dict(entries, out)


def _errors(rank, world, path, truncated):
    ST = ldc.ShardedTensor
    messages = []
    wrong = (lambda: shard_broadcasted_state_dict({}, {})) if rank == 0 else (
        lambda: broadcast_and_shard_state_dict({}, {}, {}))
    _expect(ArgumentError, wrong, "rank 0" if rank else "ranks other than 0")
    assert issubclass(ArgumentError, ValueError)
    sd = load_state_dict(path)
    missing = {"w": ST.from_rank_offsets("nope", _meta((4, 6)), (0, rank, world))}
    messages.append(_expect(MissingKeysError, _both_sides(rank, sd, missing), path, "'nope'"))
    shape = {"rows": ST.from_rank_offsets("rows", _meta((5, 6)), (0, rank, world))}
    messages.append(_expect(ShardingError, _both_sides(rank, sd, shape), path, "'rows'", "(8, 6)", "(10, 6)"))
    kind = {"rows": ST.from_rank_offsets("rows", _meta((4, 6), torch.int64), (0, rank, world))}
    messages.append(_expect(ShardingError, _both_sides(rank, sd, kind), path, "'rows'", "float32", "int64"))
    bad_entry = {"obj": ldc.ShardedObject("obj", None, (world,), (rank,))} if rank == 1 else {}
    messages.append(_expect(ArgumentTypeError, _both_sides(rank, sd, bad_entry), "rank 1", "'obj'"))
    messages.append(_expect(FormatError, lambda: load_state_dict(path + ".missing"), path + ".missing"))
    messages.append(_expect(FormatError, lambda: load_state_dict(truncated), truncated))
    # Still in step after all that: a good transfer.
    _shard(rank, world, path)
    return messages


def test_errors_on_every_rank(files, tmp_path):
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(open(files[0], "rb").read()[:2000])
    per_rank = run_distributed(_errors, 2, files[0], str(truncated))
    assert per_rank[0] == per_rank[1]  # the same messages on both ranks


def test_options_are_checked():
    with pytest.raises(ArgumentError, match="max_inflight_bytes"):
        broadcast_and_shard_state_dict({}, {}, {}, max_inflight_bytes=0)
    with pytest.raises(ArgumentTypeError, match="sharded_state_dict must be a dict"):
        broadcast_and_shard_state_dict({}, {}, None)  # type: ignore[arg-type]


def test_dtype_rule_reuses_load_plan():
    from lightning_distckpt.planning import load_plan
    from lightning_distckpt.ingest import plan

    assert plan.dtype_kind is load_plan.dtype_kind
