"""Differential fuzz of DCP's compressed and SAFETENSORS variants against torch (hypothesis, seeded).

Random state dicts (every dtype both torch DCP and ours store, float8 / uint16-64 / complex included;
0-d, empty and large tensors; contiguous, transposed, strided, expanded, storage-sharing and
Parameter sources; nested names with dots, slashes and unicode; objects: ints, strings, floats,
bytes, tuples, lists and nested dicts) are saved by torch's ``dcp.save(..., no_dist=True)`` through
``FileSystemWriter(_extensions=[ZStandard()])`` or ``FileSystemWriter(serialization_format=SAFETENSORS)``
under random writer options (``single_file_per_rank``, ``thread_count`` 1-3, torch.save's CRC-32 and
alignment options). Then ours reads them: ``load_plain_tensors``, ``load_tensors_metadata``,
``validate``, ``load_common_state_dict`` and ``ldc.load`` of whole-tensor templates, random boxes and
flattened ranges (some cast, some into non-contiguous destinations), ``ShardedTensor.from_rank_offsets``
pieces of a random even split along a random axis (replica ids 0-2), and the objects, with every
loader, verification on and off. The judge: torch's own ``dcp.load`` of the directory for the zstd
variant; for SAFETENSORS, which torch's ``FileSystemReader`` cannot read, the saved values (bit for
bit). Objects are judged by torch's ``_load_state_dict_from_keys`` in both variants (torch reads a
SAFETENSORS save's objects: they are ``torch.save`` bytes).

Where torch itself refuses to write a state (its SAFETENSORS writer refuses a non-contiguous tensor
and complex128), the example is skipped (``assume``); only those refusals are expected.

A 2-rank case saves DTensors of random placements (the foreign fuzz's ``dist_cases``) with each
variant collectively and loads them resharded on both ranks.

CI runs a fixed (derandomized) set; ``-m long`` runs ``LDC_FOREIGN_FUZZ_EXAMPLES`` (default 150)
examples per variant, seeded by ``LDC_FOREIGN_FUZZ_SEED`` (as the foreign fuzz).
"""

from __future__ import annotations

import os
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import assume, given, seed, settings
from hypothesis import strategies as st

import lightning_distckpt as ldc
from dist_utils import run_distributed
from test_foreign_differential_fuzz import (CI, COMMON_VALUES, DIST_CI, DIST_LONG, FUZZ_SEED, LONG, LOADERS,
                                            TORCH_SAVE_OPTIONS, Case, DistCase, Leaf, Scratch, _at, _ask, _dtensor,
                                            check_same, dist_cases, leaves, loader_of, same_value, torch_save_options,
                                            tree, unlike, verifying)

VARIANTS = ["zstd", "safetensors"]
# torch's SAFETENSORS writer (safetensors.torch) has no dtype for these: dcp.save raises
NO_SAFETENSORS_DTYPE = {"c128", "c32"}
LAYOUTS = ["contiguous", "contiguous", "transposed", "strided", "shared", "expand", "parameter"]
OBJECT_VALUES = st.one_of(
    COMMON_VALUES, st.binary(max_size=24), st.tuples(st.integers(-9, 9), st.text(max_size=4)),
    st.dictionaries(st.sampled_from(["lr", "betas", "name", "b", "0", "ü"]),
                    st.one_of(COMMON_VALUES, st.binary(max_size=8)), max_size=3))
OBJECT_NAMES = ["epoch", "global_step", "note", "hparams", "a.b", "x/y", "blob", "0"]
# torch's writer threads report a refusal as an unhandled thread exception (the save itself returns)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@dataclass(frozen=True)
class Split:
    """A ``from_rank_offsets`` piece: part ``index`` of ``parts`` even parts along ``axis``."""

    axis: int
    parts: int
    index: int
    replica: int


@dataclass(frozen=True)
class VariantCase:
    variant: str  # zstd | safetensors
    leaves: Tuple[Leaf, ...]
    splits: Tuple[Optional[Split], ...]  # per leaf
    objects: Tuple[Tuple[str, Any], ...]
    writer: Tuple[bool, int]  # FileSystemWriter's single_file_per_rank, thread_count
    loader: str
    verify: bool
    torch_save: Tuple[bool, int]

    def torch_refuses(self, state: Dict[str, Any], leaf: Optional[Leaf] = None) -> bool:
        """Whether torch's writer refuses ``state`` (or its ``leaf``): its SAFETENSORS format refuses
        non-contiguous tensors and complex128."""
        return self.variant == "safetensors" and any(
            lf.dtype in NO_SAFETENSORS_DTYPE or not as_dcp_writes(_at(state, lf.path)).is_contiguous()
            for lf in ((leaf,) if leaf else self.leaves))


def as_dcp_writes(t: torch.Tensor) -> torch.Tensor:
    """The tensor DCP's writer hands on: cloned (memory format kept) where its storage holds more or
    fewer bytes than its elements (a view, an expanded tensor), else as it is (a transposed tensor
    stays non-contiguous)."""
    t = t.detach()
    return t.clone() if t.untyped_storage().size() != t.numel() * t.itemsize else t


def split_of(draw: Any, shape: Tuple[int, ...]) -> Optional[Split]:
    if not shape or not draw(st.booleans()):
        return None
    axis = draw(st.integers(0, len(shape) - 1))
    n = shape[axis]
    parts = draw(st.sampled_from([p for p in range(1, n + 1) if n % p == 0] if n else [1, 2]))
    return Split(axis, parts, draw(st.integers(0, parts - 1)), draw(st.integers(0, 2)))


@st.composite
def variant_cases(draw: Any, variant: str) -> VariantCase:
    # contiguous sources mostly for SAFETENSORS (torch refuses views there): the rest exercises the skip
    layouts = LAYOUTS if variant == "zstd" else ["contiguous"] * 8 + LAYOUTS
    # DCP joins a path with ".": some dots of a name become slashes, which look alike and are not
    lv = tuple(replace(leaf, dtype="c64" if leaf.dtype == "c32" else leaf.dtype,  # c32: neither stores it
                       layout=draw(st.sampled_from(layouts)),
                       path=tuple(s.replace(".", "/") if draw(st.integers(0, 3)) == 0 else s for s in leaf.path))
               for leaf in draw(leaves("dcp", True, extra_p=30)))
    assume(len({leaf.path for leaf in lv}) == len(lv))
    taken = {leaf.path[0] for leaf in lv}
    names = draw(st.lists(st.sampled_from(OBJECT_NAMES), unique=True, max_size=4))
    objects = tuple((k, draw(OBJECT_VALUES)) for k in names if k not in taken)
    return VariantCase(variant, lv, tuple(split_of(draw, leaf.shape) for leaf in lv), objects,
                       (draw(st.booleans()), draw(st.integers(1, 3))), draw(st.sampled_from(LOADERS)),
                       draw(st.integers(0, 2)) > 0, draw(TORCH_SAVE_OPTIONS))


# -- torch's side ------------------------------------------------------------------------------------
def writer(path: str, variant: str, single_file: bool = True, threads: int = 1) -> Any:
    import torch.distributed.checkpoint as dcp

    if variant == "zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        return dcp.FileSystemWriter(path, single_file_per_rank=single_file, thread_count=threads,
                                    _extensions=[ZStandard()])
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    return dcp.FileSystemWriter(path, single_file_per_rank=single_file, thread_count=threads,
                                serialization_format=SerializationFormat.SAFETENSORS)


def flat_keys(state: Dict[str, Any]) -> List[str]:
    """DCP's fully qualified names of ``state`` (its own flattening), duplicates kept."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    keys: List[str] = []
    for k, v in state.items():  # one top-level entry at a time: flatten_state_dict's dict would merge twins
        keys += list(flatten_state_dict({k: v})[0])
    return keys


def save_with_torch(case: VariantCase, path: str) -> Dict[str, Any]:
    """``dcp.save`` of the case's state; skips (``assume``) a state torch refuses as expected and one
    whose names DCP's flattening makes ambiguous. Returns the saved state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = tree(Case("dcp", case.leaves, common=case.objects))
    keys = flat_keys(state)
    assume(len(keys) == len(set(keys)))  # two entries of one name: torch's own ambiguity
    try:
        with warnings.catch_warnings(), torch_save_options(case.torch_save):
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer(path, case.variant, *case.writer), no_dist=True)
    except (Exception, CheckpointException):
        assume(not case.torch_refuses(state))  # a refusal we expect: skip the example
        raise
    if case.torch_refuses(state):
        # With thread_count > 1 torch's writer often loses the refusal (raised in a writer thread, at
        # random): dcp.save returns, its .metadata naming a tensor no file stores. Ours must refuse
        # that, naming it; unless every tensor lost is empty (nothing to store: ours loads it as torch would).
        if any(_at(state, leaf.path).numel() for leaf in case.leaves if case.torch_refuses(state, leaf)):
            with pytest.raises(ldc.FormatError, match="has no storage record"):
                ldc.load_plain_tensors(path)
        assume(False)
    return state


def torch_tensors(case: VariantCase, path: str, state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """fqn -> the tensor as torch gives it back: ``dcp.load`` (zstd) or the saved value (SAFETENSORS)."""
    import torch.distributed.checkpoint as dcp

    saved = {".".join(leaf.path): _at(state, leaf.path).detach().contiguous() for leaf in case.leaves}
    if case.variant == "safetensors":
        return saved
    want = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in saved.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(want, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return want


def torch_objects(case: VariantCase, path: str) -> Dict[str, Any]:
    """fqn -> each object as torch loads it (flattened by DCP's rule)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not case.objects:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = _load_state_dict_from_keys(keys={k for k, _ in case.objects}, checkpoint_id=path)
    return dict(flatten_state_dict(loaded)[0])


# -- ours --------------------------------------------------------------------------------------------
def check_ours(case: VariantCase, path: str, tensors: Dict[str, torch.Tensor], objects: Dict[str, Any]) -> None:
    """Every reader entry point of ours against torch's values, bit for bit."""
    plain = ldc.load_plain_tensors(path)
    assert sorted(plain) == sorted(tensors), (sorted(plain), sorted(tensors))
    for k, want in tensors.items():
        check_same(f"load_plain_tensors[{k!r}]", plain[k], want)
    meta = ldc.load_tensors_metadata(path)
    for k, want in tensors.items():
        assert meta[k].dtype == want.dtype and tuple(meta[k].global_shape) == tuple(want.shape), (k, meta[k])
    report = ldc.validate(path)
    assert report.ok, report.problems
    # b"" (pickled by protocol 2 as a call of bytes(), the one call of it a load allows) loads as it is
    same_value("load_common_state_dict", ldc.load_common_state_dict(path), objects)
    template: Dict[str, Any] = {k: 0 for k in objects}
    expected: Dict[str, Any] = dict(objects)
    for leaf, split in zip(case.leaves, case.splits):
        key = ".".join(leaf.path)
        full = tensors[key]
        expected[key], template[key] = full, unlike(full, False)  # the whole tensor, a plain template entry
        for i, r in enumerate(leaf.reqs):
            expected[f"{key}#{i}"] = r.wanted(full)
            template[f"{key}#{i}"] = r.sharded(key, tuple(full.shape), unlike(r.wanted(full), r.strided))
        if split is not None:
            piece = full.chunk(split.parts, split.axis)[split.index] if full.shape[split.axis] else full
            expected[f"{key}#split"] = piece
            template[f"{key}#split"] = ldc.ShardedTensor.from_rank_offsets(
                key, unlike(piece, False), (split.axis, split.index, split.parts), replica_id=split.replica)
    out = ldc.load(template, path, loader=loader_of(case.loader))
    for name, want in expected.items():
        same_value(f"load[{name!r}] (loader {case.loader})", out[name], want)


def run_variant_case(case: VariantCase) -> None:
    with Scratch() as root:
        path = os.path.join(root, "dcp")
        state = save_with_torch(case, path)
        tensors, objects = torch_tensors(case, path, state), torch_objects(case, path)
        with verifying(case.verify):
            check_ours(case, path, tensors, objects)


# -- 2 gloo ranks: DTensors saved with each variant, loaded resharded ---------------------------------
def _variant2(rank: int, variant: str, case: DistCase, path: str, mesh: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state: Dict[str, Any] = dict(case.common)
    for t in case.tensors:
        node = state
        for step in t.path[:-1]:
            node = node.setdefault(step, {})
        node[t.path[-1]] = t.full() if t.placement == "plain" else _dtensor(t, mesh, t.placement, t.full())[0]
    with warnings.catch_warnings(), torch_save_options(case.torch_save):
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer(path, variant, *case.writer))
    dist.barrier()
    keys = {t.fqn: t for t in case.tensors}
    _ask(rank, case, path, keys)  # each rank's own split, unlike the saved one
    if rank == 0:
        plain = ldc.load_plain_tensors(path)
        assert sorted(plain) == sorted(keys), (sorted(plain), sorted(keys))
        for k, t in keys.items():
            check_same(f"load_plain_tensors[{k!r}]", plain[k], t.full())
        assert ldc.load_common_state_dict(path) == dict(case.common), case.common
        report = ldc.validate(path)
        assert report.ok, report.problems


def _variants_worker(rank: int, world: int, cases_: List[DistCase], root: str) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for i, case in enumerate(cases_):
        for variant in VARIANTS:
            try:
                with verifying(case.verify):
                    _variant2(rank, variant, case, os.path.join(root, f"case{i}_{variant}"), mesh)
                error = None
            except Exception:
                error = f"rank {rank}: {traceback.format_exc()}"
            errors: List[Optional[str]] = [None] * world
            dist.all_gather_object(errors, error)  # every rank stops at the first failure, with its case
            if any(errors):
                return f"FAILED case {i} ({variant}): {case}\n" + "\n".join(e for e in errors if e)
    return "ok"


def run_variant_dist_cases(cases_: List[DistCase]) -> None:
    with Scratch() as root:
        result = run_distributed(_variants_worker, 2, cases_, root, timeout_s=60.0)[0]
    if result != "ok":
        pytest.fail(result, pytrace=False)


DCP2_CASES = dist_cases().map(lambda c: replace(c, kind="dcp2"))


# -- CI entry points (a fixed set) -------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_saves_read_as_torch_reads_them(variant):
    """Random states saved by torch in the variant load through every entry point of ours exactly
    as torch gives them back (values, dtype, shape, objects)."""
    settings(CI, max_examples=30)(given(variant_cases(variant))(run_variant_case))()


def test_two_ranks_dtensors_saved_in_each_variant_load_resharded():
    """DTensors of random placements saved by 2 ranks in each variant load on 2 ranks under another
    split, and whole (one batch of 4 cases, both variants)."""
    settings(DIST_CI, max_examples=1)(given(st.lists(DCP2_CASES, min_size=4, max_size=4))(
        run_variant_dist_cases))()


# -- the long set (seeded: LDC_FOREIGN_FUZZ_SEED replays) --------------------------------------------
@pytest.mark.long
@pytest.mark.parametrize("variant", VARIANTS)
def test_long_variant_saves_read_as_torch_reads_them(variant):
    """As the CI test, at length."""
    seed(FUZZ_SEED)(LONG(given(variant_cases(variant))(run_variant_case)))()


@pytest.mark.long
def test_long_two_ranks_dtensors_saved_in_each_variant_load_resharded():
    """As the CI test, at length (batches of 8)."""
    seed(FUZZ_SEED)(DIST_LONG(given(st.lists(DCP2_CASES, min_size=8, max_size=8))(run_variant_dist_cases)))()


# -- regressions: each failed before its fix --------------------------------------------------------
def test_safetensors_format_files_of_fewer_than_two_data_bytes_load(tmp_path):
    """``single_file_per_rank=False`` gives each tensor a file of its own: an empty tensor's is a
    safetensors header with no data bytes after it, a one-byte scalar's (bool, int8, float8) one byte.
    Before: neither was recognised as a safetensors file (the check wanted 2 bytes past the header),
    refused as "not a torch.save'd tensor (BadZipFile)". (Minimized by the fuzz above.)"""
    import torch.distributed.checkpoint as dcp

    import lightning_distckpt

    print("lightning_distckpt under test:", lightning_distckpt.__file__)
    path = str(tmp_path / "dcp")
    state = {"empty": torch.zeros(0, dtype=torch.uint16), "rows": torch.arange(6.0).reshape(2, 3),
             "flag": torch.tensor(True), "byte": torch.tensor([7], dtype=torch.int8),
             "f8": torch.tensor(0.5).to(torch.float8_e4m3fn)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer(path, "safetensors", single_file=False), no_dist=True)
    plain = ldc.load_plain_tensors(path)
    assert sorted(plain) == sorted(state)
    for k, v in state.items():
        check_same(k, plain[k], v)
    out = ldc.load({"empty": torch.ones(0, dtype=torch.uint16),
                    "r": ldc.ShardedTensor.from_rank_offsets("rows", torch.zeros(1, 3), (0, 1, 2))}, path)
    check_same("empty", out["empty"], state["empty"])
    check_same("r", out["r"], state["rows"][1:])
    assert ldc.validate(path).ok
