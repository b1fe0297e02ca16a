"""Differential fuzz of resharding: random global tensors saved under one random split must load
back, under another random split, as exactly the slices of the tensors that were saved.

A case (:class:`Case`, drawn by :func:`make_case` from ``(seed, index)`` alone, so it replays) has
1-4 keys, each a global tensor of 1-3 axes (small, uneven sizes, 1 included, now and then an empty
one) of float32, bfloat16, int64 or bool, and small ShardedObjects (replicated on save, any subset
asked for on load), beside common state. Its SAVE layout over ``w_save`` ranks and its LOAD layout
over ``w_load`` ranks (1-4 each) are drawn alike: a grid cut along 0-2 axes, evenly (built with
``from_rank_offsets``, or ``from_rank_offsets_flat`` when flattened) or unevenly with empty tiles
(``from_offsets`` / the constructor), optionally one layer per prepended axis
(``prepend_axis_num=1``); the tiles are held whole by ranks (several per rank when there are more
tiles than ranks, with data-parallel replicas of replica_id > 0), or cut into flat ranges over the
ranks (distributed-optimizer style, ranges crossing rows, empty ranges left out, replicated ranges
too), or every rank holds the whole tensor. A load may ask for a piece twice, or into a
non-contiguous tensor (every other element of a buffer), and for another dtype (same kind, or across
kinds under ``cast="any"``). Every case goes through one loader (named, a tight two-stage bound,
no buckets, or per-rank data-parallel groups) and one storage layout (OCDBT or zarr, with small
chunks so arrays span several, packed or not), with direct reads or through tensorstore. Each
template tensor starts different from what it should receive everywhere, so nothing left unread
passes.

Processes start slowly, so a whole batch runs in one ``run_distributed`` world of 4 ranks: save
over the first ``w_save`` ranks and load over the first ``w_load`` (subgroups made once), the other
ranks waiting at a barrier. After each case every rank reports its outcome to all, so all stop at
the first failure; a rank that hangs or dies is found by the process group's timeout (60 s) and
the case it was in. The message shows the case and how to replay it:
``LDC_RESHARD_FUZZ_CASE=seed:index pytest tests/distributed/test_reshard_fuzz.py -m long -k replay``.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import shutil
import traceback
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed

WORLD = 4
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64, "bool": torch.bool,
          "i32": torch.int32}
# saved dtype -> (load dtype, cast rule it needs); Tensor.to gives the expected values.
CASTS = {"f32": [("bf16", "same_kind"), ("i64", "any")], "bf16": [("f32", "same_kind")],
         "i64": [("i32", "same_kind"), ("f32", "any")], "bool": [("i64", "any"), ("f32", "any")]}
STORAGE = {
    "ocdbt": dict(),
    "ocdbt_small_unpacked": dict(chunk_bytes=1024, pack_max_bytes=0),
    "zarr_small": dict(layout="zarr", chunk_bytes=1024),
    "zarr_small_unpacked": dict(layout="zarr", chunk_bytes=1024, pack_max_bytes=0),
}
LOADERS = ("every_rank", "parallel", "two_stage", "two_stage_tight", "parallel_nobucket", "two_stage_dp")
# data-parallel groups partitioning the first w ranks, for "two_stage_dp"
DP_PARTITIONS = {1: [[0]], 2: [[0], [1]], 3: [[0, 2], [1]], 4: [[0, 2], [1, 3]]}
# small and uneven, 1 included; the larger ones make shards of several 1 KiB zarr chunks
SIZES = {1: [1, 2, 3, 5, 7, 8, 13, 64, 150, 300, 700], 2: [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 40, 64],
         3: [1, 2, 3, 4, 5, 6, 8, 12, 16]}


@dataclass
class Piece:
    """One ShardedTensor of a rank: the box it covers in global axes (prepended ones included)."""
    name: str  # the state dict entry
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    replica: object = 0  # int or tuple
    prepend: int = 0
    flat: Optional[Tuple[int, int]] = None
    rank_offsets: Optional[Tuple[Tuple[int, int, int], ...]] = None  # even grid: from_rank_offsets(_flat)
    strided: bool = False  # load only: the template's tensor is a non-contiguous view


@dataclass
class TensorCase:
    key: str
    shape: Tuple[int, ...]
    dtype: str
    load_dtype: str
    values_seed: int
    save: Dict[int, List[Piece]]
    load: Dict[int, List[Piece]]
    save_kind: str = ""
    load_kind: str = ""


@dataclass
class ObjectCase:
    key: str
    n: int
    save: Dict[int, List[Tuple[int, int]]]  # rank -> [(element, replica_id)]
    load: Dict[int, List[int]]


@dataclass
class Case:
    ident: str  # "seed:index"
    w_save: int
    w_load: int
    storage: str
    loader: str
    cast: str
    direct_reads: bool
    tensors: List[TensorCase] = field(default_factory=list)
    objects: List[ObjectCase] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"case {self.ident}: w_save={self.w_save} w_load={self.w_load} storage={self.storage} "
                 f"loader={self.loader} cast={self.cast} direct_reads={self.direct_reads}"]
        for t in self.tensors:
            lines.append(f"  tensor {t.key!r} shape={t.shape} {t.dtype}->{t.load_dtype} values_seed={t.values_seed}"
                         f" save={t.save_kind} load={t.load_kind}")
            for side, layout in (("save", t.save), ("load", t.load)):
                for rank, pieces in sorted(layout.items()):
                    for p in pieces:
                        lines.append(f"    {side} rank {rank}: {p}")
        for o in self.objects:
            lines.append(f"  object {o.key!r} n={o.n} save={o.save} load={o.load}")
        return "\n".join(lines)


# -- drawing cases -----------------------------------------------------------------------------
def _cuts(rng: random.Random, n: int, parts: int, even: bool) -> List[int]:
    if even:
        return [n * i // parts for i in range(parts + 1)]
    return [0] + sorted(rng.randint(0, n) for _ in range(parts - 1)) + [n]  # repeats: empty tiles


def _grid(rng: random.Random, shape: Tuple[int, ...], prepend: int, whole: bool):
    """Tiles ``(offset, shape, rank_offsets or None)`` covering ``shape`` once."""
    while True:
        nd, even, cuts = len(shape), True, []
        free = list(range(prepend, nd))
        split = [] if whole else rng.sample(free, k=min(len(free), rng.choice([0, 1, 1, 2])))
        for a in range(nd):
            if a < prepend:
                cuts.append(list(range(shape[a] + 1)))
            elif a in split:
                parts = rng.randint(2, 4)
                ok = shape[a] % parts == 0 and rng.random() < 0.6
                even &= ok
                cuts.append(_cuts(rng, shape[a], parts, ok))
            else:
                cuts.append([0, shape[a]])
        if math.prod(len(c) - 1 for c in cuts) <= 12:
            break
    tiles = []
    for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
        off = tuple(cuts[a][i] for a, i in enumerate(idx))
        box = tuple(cuts[a][i + 1] - cuts[a][i] for a, i in enumerate(idx))
        ro = tuple((a, i, len(cuts[a]) - 1) for a, i in enumerate(idx) if len(cuts[a]) > 2) if even else None
        tiles.append((off, box, ro))
    return tiles


def _layout(rng: random.Random, shape: Tuple[int, ...], w: int, tag: str) -> Tuple[str, Dict[int, List[Piece]]]:
    """A random split of a tensor of ``shape`` over ``w`` ranks: rank -> its pieces."""
    prepend = 1 if len(shape) >= 2 and 1 <= shape[0] <= 4 and rng.random() < 0.25 else 0
    mode = rng.choice(["tiles", "tiles", "flat", "whole"])
    tiles = _grid(rng, shape, prepend, whole=mode == "whole")
    p_rep = 1.0 if mode == "whole" else rng.choice([0.0, 0.0, 0.3, 1.0])
    tuple_ids = rng.random() < 0.2
    out: Dict[int, List[Piece]] = {r: [] for r in range(w)}
    counter = itertools.count()

    def add(rank, off, box, replica, flat, ro):
        rid = (0, replica) if tuple_ids else replica
        out[rank].append(Piece(f"{tag}{next(counter)}", off, box, rid, prepend, flat, ro))

    first = rng.randrange(w)
    for t, (off, box, ro) in enumerate(tiles):
        owner = (first + t) % w
        n = math.prod(box)
        if mode == "flat" and n and rng.random() < 0.9:
            holders = rng.sample(range(w), rng.randint(1, w))
            cuts = _cuts(rng, n, len(holders), False)
            for h, a, b in zip(holders, cuts, cuts[1:]):
                if a == b:
                    continue  # an empty range: that rank holds nothing of this tile
                add(h, off, box, 0, (a, b), ro)
                if w > 1 and rng.random() < p_rep:  # a replica of the range (a second DP dimension)
                    add(rng.choice([r for r in range(w) if r != h]), off, box, 1, (a, b), ro)
            continue
        add(owner, off, box, 0, None, ro)
        replica = 1
        for r in range(w):
            if r != owner and rng.random() < p_rep:
                add(r, off, box, replica, None, ro)
                replica += 1
    if tag == "l":  # a load may ask for a piece twice, or into a non-contiguous tensor
        for r, pieces in out.items():
            if pieces and rng.random() < 0.15:
                pieces.append(replace(rng.choice(pieces), name=f"{tag}{next(counter)}"))
            for p in pieces:
                p.strided = rng.random() < 0.15
    kind = f"{mode}{'+prepend' if prepend else ''}{'' if tiles[0][2] is not None else '+uneven'}[{len(tiles)} tiles]"
    return kind, out


def _objects(rng: random.Random, k: int, w_save: int, w_load: int) -> ObjectCase:
    n = rng.randint(1, 4)
    save: Dict[int, List[Tuple[int, int]]] = {r: [] for r in range(w_save)}
    for i in range(n):
        owner = i % w_save
        save[owner].append((i, 0))
        for r in range(w_save):
            if r != owner and rng.random() < 0.3:
                save[r].append((i, len([1 for e in itertools.chain(*save.values()) if e[0] == i])))
    load = {r: sorted(rng.sample(range(n), rng.randint(0, n))) for r in range(w_load)}
    return ObjectCase(f"state.obj{k}", n, save, load)


def make_case(seed: int, index: int) -> Case:
    rng = random.Random(f"{seed}:{index}")
    w_save, w_load = rng.randint(1, WORLD), rng.randint(1, WORLD)
    case = Case(f"{seed}:{index}", w_save, w_load, rng.choice(sorted(STORAGE)), rng.choice(LOADERS),
                "same_kind", rng.random() < 0.8)
    for k in range(rng.randint(1, 4)):
        nd = rng.choice([1, 2, 2, 3])
        shape = tuple(rng.choice(SIZES[nd]) for _ in range(nd))
        if rng.random() < 0.05:  # an empty global tensor
            shape = (0,) + shape[1:]
        dtype = rng.choice(["f32", "f32", "bf16", "i64", "bool"])
        load_dtype = dtype
        if rng.random() < 0.2:
            load_dtype, rule = rng.choice(CASTS[dtype])
            if rule == "any":
                case.cast = "any"
        key = rng.choice([f"decoder.layers.{k}.weight", f"optimizer.state.exp_avg.w{k}", f"emb/t{k}"])
        save_kind, save = _layout(rng, shape, w_save, "s")
        load_kind, load = _layout(rng, shape, w_load, "l")
        case.tensors.append(TensorCase(key, shape, dtype, load_dtype, rng.randrange(1 << 30), save, load,
                                       save_kind, load_kind))
    case.objects = [_objects(rng, k, w_save, w_load) for k in range(rng.choice([0, 1, 1, 2]))]
    return case


# -- running them ------------------------------------------------------------------------------
def global_tensor(t: TensorCase) -> torch.Tensor:
    g = torch.Generator().manual_seed(t.values_seed)
    if t.dtype == "bool":
        return torch.rand(t.shape, generator=g) < 0.5
    if t.dtype == "i64":
        return torch.randint(-(1 << 40), 1 << 40, t.shape, generator=g) // (1 if t.load_dtype != "i32" else 1 << 20)
    return (torch.randn(t.shape, generator=g) * 10).to(DTYPES[t.dtype])


def _block(full: torch.Tensor, p: Piece) -> torch.Tensor:
    """What piece ``p`` holds of ``full``: its box (local shape, without prepended axes), or the range."""
    block = full[tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape))].reshape(p.shape[p.prepend:])
    return block.reshape(-1)[p.flat[0]:p.flat[1]] if p.flat else block


def _sharded(key: str, gshape: Tuple[int, ...], p: Piece, data: torch.Tensor) -> ldc.ShardedTensor:
    local_shape = p.shape[p.prepend:]
    if p.rank_offsets is not None and p.flat:
        return ldc.ShardedTensor.from_rank_offsets_flat(key, data, local_shape, *p.rank_offsets,
                                                        flattened_range=slice(*p.flat), replica_id=p.replica,
                                                        prepend_axis_num=p.prepend)
    if p.rank_offsets is not None:
        return ldc.ShardedTensor.from_rank_offsets(key, data, *p.rank_offsets, replica_id=p.replica,
                                                   prepend_axis_num=p.prepend)
    if p.flat:
        return ldc.ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=local_shape, global_shape=gshape,
                                 global_offset=p.offset, replica_id=p.replica, prepend_axis_num=p.prepend,
                                 flattened_range=slice(*p.flat))
    return ldc.ShardedTensor.from_offsets(key, data, gshape, p.offset, replica_id=p.replica,
                                          prepend_axis_num=p.prepend)


def _object_value(o: ObjectCase, i: int) -> dict:
    return {"key": o.key, "i": i, "t": torch.arange(i + 1) * 7 - 3}


def _template_data(want: torch.Tensor, strided: bool) -> torch.Tensor:
    """A tensor to load ``want`` into: differs from it everywhere, so an element left unwritten
    shows; ``strided``: a non-contiguous view (every other element of a buffer)."""
    x = ~want if want.dtype == torch.bool else (want + 1).to(want.dtype)
    if not strided:
        return x.contiguous()
    view = torch.empty(want.shape + (2,), dtype=want.dtype)[..., 0]
    return view.copy_(x)


def _loader(name: str, rank: int, w: int, dp_groups: dict):
    if name == "two_stage_tight":
        return ldc.TwoStageDataParallelLoader(max_inflight_bytes=512, bucket_bytes=64, read_batch_bytes=256)
    if name == "parallel_nobucket":
        return ldc.FullyParallelLoader(bucket_bytes=0)
    if name == "two_stage_dp":
        return ldc.TwoStageDataParallelLoader(dp_groups[(w, rank)])
    return name


def _run_case(rank: int, case: Case, root: str, groups: dict, dp_groups: dict) -> None:
    path = os.path.join(root, case.ident.replace(":", "_"))
    fulls = [global_tensor(t) for t in case.tensors]
    if rank < case.w_save:
        sd: dict = {"tensors": {}, "objects": {}, "step": case.ident}
        for t, full in zip(case.tensors, fulls):
            for p in t.save[rank]:
                sd["tensors"][p.name + t.key] = _sharded(t.key, t.shape, p, _block(full, p).clone())
        for o in case.objects:
            for i, rid in o.save[rank]:
                sd["objects"][f"{o.key}.{i}"] = ldc.ShardedObject(o.key, _object_value(o, i), (o.n,), (i,), rid)
        ldc.save(sd, path, process_group=groups[case.w_save], storage=ldc.StorageOptions(**STORAGE[case.storage]))
    dist.barrier()
    if rank >= case.w_load:
        return
    template: dict = {"tensors": {}, "objects": {}}
    expected = {}
    for t, full in zip(case.tensors, fulls):
        for p in t.load[rank]:
            want = _block(full, p).to(DTYPES[t.load_dtype])
            expected[p.name + t.key] = want
            template["tensors"][p.name + t.key] = _sharded(t.key, t.shape, p, _template_data(want, p.strided))
    for o in case.objects:
        for i in o.load[rank]:
            template["objects"][f"{o.key}.{i}"] = ldc.ShardedObject(o.key, None, (o.n,), (i,))
    out = ldc.load(template, path, process_group=groups[case.w_load], cast=case.cast,
                   loader=_loader(case.loader, rank, case.w_load, dp_groups),
                   storage=None if case.direct_reads else ldc.StorageOptions(direct_reads=False))
    assert out["step"] == case.ident, out["step"]
    for name, want in expected.items():
        got = out["tensors"][name]
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
        if not torch.equal(got, want):
            bad = (got != want).nonzero().tolist()
            raise AssertionError(f"rank {rank} entry {name}: {len(bad)} elements differ, first at {bad[:8]}\n"
                                 f"got {got}\nwant {want}")
    for o in case.objects:
        for i in o.load[rank]:
            got = out["objects"][f"{o.key}.{i}"]
            want = _object_value(o, i)
            assert got.keys() == want.keys() and got["i"] == i and torch.equal(got["t"], want["t"]), (o.key, i, got)


def _worker(rank: int, world: int, root: str, cases: List[Case]) -> List[str]:
    groups = {w: (dist.new_group(list(range(w))) if w < world else None) for w in range(1, world + 1)}
    dp_groups = {}
    for w, parts in DP_PARTITIONS.items():
        for members in parts:
            g = dist.new_group(members)
            dp_groups.update({(w, r): g for r in members})
    ran = 0
    for case in cases:
        with open(os.path.join(root, f"progress.rank{rank}"), "w") as f:
            f.write(case.ident)  # for the parent, should this case hang or kill the rank
        try:
            _run_case(rank, case, root, groups, dp_groups)
            error = None
        except Exception:
            error = f"rank {rank}: {traceback.format_exc()}"
        errors: List[Optional[str]] = [None] * world
        dist.all_gather_object(errors, error)  # everyone stops at the first failure, with its case
        if rank == 0:
            shutil.rmtree(os.path.join(root, case.ident.replace(":", "_")), ignore_errors=True)
        if any(errors):
            return [f"FAILED {case.describe()}\nreplay: LDC_RESHARD_FUZZ_CASE={case.ident} pytest "
                    f"tests/distributed/test_reshard_fuzz.py -m long -k replay\n" + "\n".join(e for e in errors if e)]
        ran += 1
    return [f"ok {ran}"]


def run_cases(cases: List[Case], root: str, timeout_s: float = 60.0) -> int:
    """Run ``cases`` in one world; fail showing the first failing case. ``timeout_s``: the process
    group's timeout (a case takes well under a second: one waiting longer is a hang)."""
    try:
        result = run_distributed(_worker, WORLD, root, cases, timeout_s=timeout_s)[0]
    except AssertionError as e:  # a rank died or a collective timed out: name the case it was in
        by_ident = {c.ident: c for c in cases}
        idents = set()
        for r in range(WORLD):
            with open(os.path.join(root, f"progress.rank{r}")) as f:
                idents.add(f.read())
        shown = "\n".join(by_ident[i].describe() for i in sorted(idents))
        pytest.fail(f"FAILED (ranks were in cases {sorted(idents)}):\n{shown}\n{e}", pytrace=False)
    if not result[0].startswith("ok"):
        pytest.fail(result[0], pytrace=False)
    return int(result[0].split()[1])


# -- regression cases (explicit) ----------------------------------------------------------------
def _one_element_strided(loader: str, flat: bool) -> Case:
    """Two ranks of three want the same one element; one into a view with stride 2 (torch calls it
    contiguous). The exchange's byte view of it (``core.tensor_bytes.byte_view``) raised on that rank alone, outside
    the exchange's error reporting, which left the others waiting. Fixed: byte_view no longer reshapes."""
    whole = {0: [Piece("s0", (0, 0), (3, 1))]}
    want = dict(offset=(0, 0), shape=(1, 1), flat=(0, 1) if flat else None)
    load = {0: [], 1: [Piece("l1", replica=1, **want)], 2: [Piece("l0", strided=True, **want)]}
    return Case(f"regression:{loader}:{'flat' if flat else 'box'}", 1, 3, "ocdbt", loader, "same_kind", True,
                [TensorCase("optimizer.state.exp_avg.w0", (3, 1), "bf16", "f32", 193304209, whole, load)])


def _one_element_direct_read() -> Case:
    """The same view as the destination of a whole zarr chunk (a flattened shard: an array of its
    own): the direct read (``storage/chunk_reads._run_one``) raised instead of loading."""
    save = {0: [Piece("s0", (0,), (1,), flat=(0, 1))]}
    load = {0: [Piece("l0", (0,), (1,), flat=(0, 1), strided=True)]}
    return Case("regression:every_rank:zarr", 1, 1, "zarr_small", "every_rank", "same_kind", True,
                [TensorCase("emb/t0", (1,), "bf16", "bf16", 809218943, save, load)])


REGRESSIONS: List[Case] = [_one_element_strided("parallel", True), _one_element_strided("two_stage", False),
                           _one_element_direct_read()]


def test_byte_views_of_one_element_views():
    """torch calls a one-element view of stride 2 contiguous; its bytes are still its one element."""
    from lightning_distckpt.core.tensor_bytes import byte_view
    from lightning_distckpt.storage.safetensors_crcs import tensor_crc

    t = torch.arange(6.0).reshape(2, 3)[0:1, 1]
    assert t.is_contiguous() and t.stride() == (3,)
    assert byte_view(t).tolist() == byte_view(torch.tensor([1.0])).tolist() and byte_view(t).data_ptr() == t.data_ptr()
    assert tensor_crc(t) == tensor_crc(torch.tensor([1.0]))


# -- entry points ------------------------------------------------------------------------------
def test_reshard_fuzz_short(tmp_path):
    """CI: the regressions and 60 cases of a fixed seed in one 4-rank world (about 10 s)."""
    cases = REGRESSIONS + [make_case(0, i) for i in range(int(os.environ.get("LDC_RESHARD_FUZZ_SHORT", "60")))]
    assert run_cases(cases, str(tmp_path)) == len(cases)


@pytest.mark.long
@pytest.mark.parametrize("seed", range(1, 9))
def test_reshard_fuzz_long(tmp_path, seed):
    """1200 cases: 8 seeds of 150 (``LDC_RESHARD_FUZZ_LONG`` cases per seed), about 1 minute."""
    cases = [make_case(seed, i) for i in range(int(os.environ.get("LDC_RESHARD_FUZZ_LONG", "150")))]
    assert run_cases(cases, str(tmp_path)) == len(cases)


@pytest.mark.long  # a tool to replay one case, not a test CI runs: -m long with LDC_RESHARD_FUZZ_CASE set
@pytest.mark.skipif("LDC_RESHARD_FUZZ_CASE" not in os.environ, reason="set LDC_RESHARD_FUZZ_CASE=seed:index")
def test_reshard_fuzz_replay(tmp_path):
    seed, index = (int(v) for v in os.environ["LDC_RESHARD_FUZZ_CASE"].split(":"))
    case = make_case(seed, index)
    print(case.describe())
    assert run_cases([case], str(tmp_path)) == 1


def test_generator_draws_valid_layouts():
    """The generator's save layouts tile each tensor once with main replicas (what save validates),
    and its cases are the same when drawn again."""
    for i in range(200):
        case = make_case(0, i)
        assert case.describe() == make_case(0, i).describe()
        for t in case.tensors:
            cover = torch.zeros(t.shape, dtype=torch.int64).reshape(-1)
            index = torch.arange(math.prod(t.shape)).reshape(t.shape)
            for pieces in t.save.values():
                for p in pieces:
                    if p.replica in (0, (0, 0)):
                        cover[_block(index, p).reshape(-1)] += 1
            assert bool((cover == 1).all()), case.describe()
