"""Differential fuzz of the foreign formats, judged by the peers' own libraries (hypothesis, seeded).

Peer -> ours: random state dicts (every dtype the format stores, 0-d scalars, empty tensors, odd
shapes, long / unicode / dotted key names, nested dicts; in ``torch.save`` files also
non-contiguous tensors, zero-stride views and views sharing one storage at offsets, in the zip and
the legacy format) are written by the peer: ``torch.save``, ``safetensors.torch.save_file``,
``huggingface_hub.save_torch_state_dict`` (a sharded Hugging Face directory with its index, of
safetensors or of ``.bin`` files), ``torch.distributed.checkpoint.save`` in one process and on 2
gloo ranks as DTensors of random placements. The peer writes under torch.save's own options too
(no CRC-32s, storage alignments 1 and 4096) and DCP's writer options (a file per rank or per item,
1-3 threads). Every reader entry point of ours then reads them: ``load_plain_tensors``,
``load_tensors_metadata``, ``load_common_state_dict``, ``validate`` (DCP), ``ldc.load`` of random
boxes, flattened ranges and non-contiguous destinations (a different split, every loader, on 1 and
2 ranks; some into another dtype of the same kind, some under a ``key_map`` that rotates the names;
with and without ``LIGHTNING_DISTCKPT_VERIFY``), ``ingest.load_state_dict`` with the rank-0
broadcast and shard, and the exports out of a foreign source. The expected values are what the peer
reads back (``torch.load(weights_only=True)``, ``load_file``, ``dcp.load``), compared bit for bit
(NaN payloads, signalling NaNs and -0.0 must survive; a cast: what ``Tensor.to`` gives).

Ours -> peer: random sharded state (several tiles per tensor, ShardedObjects, common state) saved
by ``ldc.save`` (one process in each storage layout, or 2 gloo ranks with replicas), exported by
``export.to_safetensors`` (also from 2 ranks) / ``to_dcp`` / ``to_megatron`` / ``to_torch_file``,
read by ``load_file`` (and the index), ``dcp.load`` (plain, DCP's bytes entries, Megatron-Core's
ShardedObject entries, and into DTensors of another split on 2 ranks), ``torch.load`` of
``common.pt`` / the file, ``validate``, and our own readers.

The dtypes beyond the ten of the first formats (uint16/32/64, float8, complex64/128) are stored and
read like the others wherever the peer's format holds them. A dtype our format does not store
(complex32) must be refused with a FormatError naming the key and its dtype, and a ``key_map``
leaving those keys out must load the rest exactly: never wrong values.

CI runs a fixed (derandomized) set; ``-m long`` runs many more examples, seeded by
``LDC_FOREIGN_FUZZ_SEED`` (default 0): ``LDC_FOREIGN_FUZZ_SEED=7 pytest -m long -k long
tests/interop/test_foreign_differential_fuzz.py`` replays seed 7 exactly (no example database);
``LDC_FOREIGN_FUZZ_EXAMPLES`` sets the examples per test of the long set. A hypothesis failure
prints the case and a ``@reproduce_failure`` blob; a 2-rank batch that fails prints its cases.
The regressions at the end each failed before the fix they name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import lightning_distckpt as ldc
from dist_utils import run_distributed

# -- dtypes, values, bit-exact comparison --------------------------------------------------------
SUPPORTED = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
             "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8,
             "bool": torch.bool}
# stored by ours too (planning/dtypes.py), drawn only for the formats that hold them
NEWER = {"u16": torch.uint16, "u32": torch.uint32, "u64": torch.uint64, "f8e4m3": torch.float8_e4m3fn,
         "f8e5m2": torch.float8_e5m2, "f8e4m3fnuz": torch.float8_e4m3fnuz, "f8e5m2fnuz": torch.float8_e5m2fnuz,
         "c64": torch.complex64, "c128": torch.complex128}
# legal in the peer's format, not stored by ours: a FormatError naming the key and the dtype
REFUSED = {"c32": torch.complex32}
EXTRA = {**NEWER, **REFUSED}
ALL = {**SUPPORTED, **EXTRA}
EXTRA_BY_FORMAT = {"torch": list(EXTRA), "dcp": list(EXTRA), "safetensors": ["u16", "u32", "u64", "f8e4m3", "f8e5m2"],
                   # torch's legacy format has no typed storage for uint16/32/64 and float8: torch.load fails
                   "legacy": ["c64", "c128"]}
NO_SAFETENSORS = {"c128", "c32"}  # safetensors has no dtype for these: our export refuses them
# bit patterns that a conversion anywhere would change: quiet and signalling NaNs with payloads, of
# both signs, -0.0, infinities, the smallest subnormal
SPECIALS = {
    torch.float64: [0x7FF8000000000001, 0x7FF0000000000001, 0xFFF4000000000123 - (1 << 64), -(1 << 63),
                    0x7FF0000000000000, 0xFFF0000000000000 - (1 << 64), 1],
    torch.float32: [0x7FC00001, 0x7F800001, 0xFFA12345 - (1 << 32), -(1 << 31), 0x7F800000, 0xFF800000 - (1 << 32), 1],
    torch.float16: [0x7E01, 0x7C01, 0xFE55 - (1 << 16), -(1 << 15), 0x7C00, 0xFC00 - (1 << 16), 1],
    torch.bfloat16: [0x7FC1, 0x7F81, 0xFFA5 - (1 << 16), -(1 << 15), 0x7F80, 0xFF80 - (1 << 16), 1],
}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def values(dtype: torch.dtype, shape: Tuple[int, ...], value_seed: int) -> torch.Tensor:
    """Random bytes as ``dtype`` (every bit pattern, NaNs of all kinds included), with the special
    patterns above at random places; bool 0 or 1."""
    g = torch.Generator().manual_seed(value_seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.randint(0, 2, (n,), generator=g) == 1).reshape(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)
    if dtype in SPECIALS and n:
        ints = t.view(_INT_OF_SIZE[dtype.itemsize])
        where = torch.randint(0, n, (len(SPECIALS[dtype]),), generator=g)
        for i, pattern in zip(where.tolist(), SPECIALS[dtype]):
            ints[i] = pattern
    return t.reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element size: equal bits, equal tensors."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    return t.view(_INT_OF_SIZE[t.element_size()])


def check_same(where: str, got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor), f"{where}: got a {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
        f"{where}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    b, w = bits(got), bits(want)
    if not torch.equal(b, w):
        bad = (b != w).nonzero().tolist()
        raise AssertionError(f"{where}: {len(bad)} element(s) differ in their bits, first at {bad[:6]}: "
                             f"got {b.reshape(-1)[:8].tolist()} want {w.reshape(-1)[:8].tolist()}")


def unlike(want: torch.Tensor, strided: bool) -> torch.Tensor:
    """A destination that differs from ``want`` in every element (an element left unwritten shows),
    contiguous or a non-contiguous view (every other element of a buffer)."""
    # (a complex tensor's bits have a last axis of 2 values: back to the tensor's own shape)
    x = ~want if want.dtype == torch.bool else (~bits(want)).view(want.dtype).reshape(want.shape) if want.numel() \
        else want.clone()
    if not strided:
        return x.contiguous()
    return torch.empty(tuple(want.shape) + (2,), dtype=want.dtype)[..., 0].copy_(x)


# -- what a case holds ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Req:
    """A piece a template asks for: a box of the global tensor, optionally a flat range of it."""

    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    flat: Optional[Tuple[int, int]] = None
    strided: bool = False
    cast: Optional[str] = None  # load into this dtype (of the same kind): expected as Tensor.to gives it

    def of(self, full: torch.Tensor) -> torch.Tensor:
        block = full[tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))]
        return block.reshape(-1)[self.flat[0]:self.flat[1]] if self.flat else block

    def wanted(self, full: torch.Tensor) -> torch.Tensor:
        """What a load of this piece gives: the piece, converted to ``cast`` where asked."""
        piece = self.of(full)
        return piece.to(ALL[self.cast]) if self.cast else piece

    def sharded(self, key: str, gshape: Tuple[int, ...], data: torch.Tensor) -> ldc.ShardedTensor:
        if self.flat:
            return ldc.ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=self.shape,
                                     global_shape=gshape, global_offset=self.offset, flattened_range=slice(*self.flat))
        return ldc.ShardedTensor.from_offsets(key, data, gshape, self.offset)


@dataclass(frozen=True)
class Leaf:
    path: Tuple[str, ...]  # nested dict keys (flat formats: one)
    dtype: str
    shape: Tuple[int, ...]
    layout: str  # contiguous | transposed | strided | shared | expand | parameter
    value_seed: int
    reqs: Tuple[Req, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return ALL[self.dtype]

    @property
    def supported(self) -> bool:
        return self.dtype not in REFUSED


@dataclass(frozen=True)
class Case:
    fmt: str  # torch | legacy | safetensors | hf | hf_bin | dcp
    leaves: Tuple[Leaf, ...]
    loader: str = "two_stage"
    export: str = "none"  # the export out of the foreign source: none | safetensors | dcp | megatron
    shard_bytes: int = 1 << 20
    common: Tuple[Tuple[str, Any], ...] = ()
    verify: bool = True  # False: LIGHTNING_DISTCKPT_VERIFY=0, the readers' unchecked partial reads
    rename: bool = False  # ldc.load's key_map gives each tensor the name of another (a rotation)
    # torch.save's options (torch.utils.serialization.config.save): compute_crc32, storage_alignment
    torch_save: Tuple[bool, int] = (True, 64)

    @property
    def supported(self) -> bool:
        return all(leaf.supported for leaf in self.leaves)


# -- strategies ------------------------------------------------------------------------------------
_NAME_CHARS = st.characters(categories=("Lu", "Ll", "Nd", "Lo", "Mn", "Pd", "Zs", "So"), include_characters="._-:",
                            exclude_characters="/")
# short names, names with dots (DCP joins with '.'), unicode, long names (HF names run to 100+ chars)
_segment = st.one_of(st.sampled_from(["weight", "bias", "layers", "0", "1", "embed.tokens", "ü", "ß.λ", "🙂"]),
                     st.text(_NAME_CHARS, min_size=1, max_size=12),
                     st.text(_NAME_CHARS, min_size=100, max_size=180)).filter(lambda s: s.strip() == s)
SIZES = [0, 1, 1, 2, 2, 3, 3, 4, 5, 7, 8, 13]
LOADERS = ["every_rank", "parallel", "parallel_nobucket", "two_stage", "two_stage_tight"]


@st.composite
def shapes(draw) -> Tuple[int, ...]:
    nd = draw(st.sampled_from([0, 1, 1, 2, 2, 2, 3]))
    shape = tuple(draw(st.sampled_from(SIZES)) for _ in range(nd))
    if nd == 1 and draw(st.integers(0, 9)) == 0:
        shape = (draw(st.integers(50, 700)),)  # a longer run of values
    elif nd == 2 and draw(st.integers(0, 24)) == 0:  # up to 1 MB: several reads, buckets and chunks
        shape = (draw(st.integers(64, 400)), draw(st.integers(64, 300)))
    return shape


@st.composite
def reqs(draw, shape: Tuple[int, ...]) -> Tuple[Req, ...]:
    """0-3 pieces to ask for: random boxes (a split the file was not written with), flat ranges."""
    out = []
    for _ in range(draw(st.integers(0 if shape else 1, 3))):
        offset, box = [], []
        for n in shape:
            lo = draw(st.integers(0, max(n - 1, 0)))
            offset.append(lo)
            box.append(draw(st.integers(min(1, n - lo), n - lo)))
        numel = math.prod(box)
        flat = None
        if numel > 1 and draw(st.booleans()):
            a = draw(st.integers(0, numel - 1))
            flat = (a, draw(st.integers(a + 1, numel)))
        out.append(Req(tuple(offset), tuple(box), flat, draw(st.integers(0, 4)) == 0))
    return tuple(out)


SAME_KIND = {"float": ["f64", "f32", "f16", "bf16", "f8e4m3", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz"],
             "int": ["i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"], "complex": ["c64", "c128"]}


def with_casts(draw: Any, dtype: str, pieces: Tuple[Req, ...]) -> Tuple[Req, ...]:
    """Some pieces loaded into another dtype of the same kind (the default cast rule)."""
    kind = [k for k, names in SAME_KIND.items() if dtype in names]
    if not kind:
        return pieces
    return tuple(replace(r, cast=draw(st.sampled_from(SAME_KIND[kind[0]]))) if draw(st.integers(0, 4)) == 0 else r
                 for r in pieces)


LAYOUTS = {"torch": ["contiguous", "contiguous", "transposed", "strided", "shared", "shared", "expand", "parameter"],
           "dcp": ["contiguous", "contiguous", "transposed", "strided", "shared"],
           "flat": ["contiguous"]}


@st.composite
def leaves(draw, fmt: str, nested: bool, extra_p: int = 12) -> Tuple[Leaf, ...]:
    family = "torch" if fmt in ("torch", "legacy") else "dcp" if fmt == "dcp" else "safetensors"
    extras = EXTRA_BY_FORMAT["legacy" if fmt == "legacy" else family]
    n = draw(st.integers(1, 6))
    paths = draw(st.lists(st.lists(_segment, min_size=1, max_size=3 if nested else 1).map(tuple), min_size=n,
                          max_size=n, unique_by=(lambda p: "/".join(p), lambda p: ".".join(p))))
    # no path may be a prefix of another (a dict cannot be a leaf too)
    paths = [p for p in paths if not any(q != p and q[:len(p)] == p for q in paths)]
    out = []
    for path in paths:
        extra = draw(st.integers(0, 99)) < extra_p
        dtype = draw(st.sampled_from(extras if extra else list(SUPPORTED)))
        shape = draw(shapes())
        layout = draw(st.sampled_from(LAYOUTS.get(family, LAYOUTS["flat"])))
        out.append(Leaf(path, dtype, shape, layout, draw(st.integers(0, 1 << 30)),
                        with_casts(draw, dtype, draw(reqs(shape)))))
    return tuple(out)


TORCH_SAVE_OPTIONS = st.tuples(st.integers(0, 2).map(bool), st.sampled_from([64, 64, 1, 4096]))
COMMON_VALUES = st.one_of(st.integers(-(1 << 40), 1 << 40), st.text(max_size=20), st.floats(allow_nan=False),
                          st.lists(st.integers(0, 9), max_size=3), st.none())


@st.composite
def cases(draw, fmt: str, extra_p: int = 12) -> Case:
    nested = fmt in ("torch", "legacy", "dcp")
    lv = draw(leaves(fmt, nested, extra_p))
    common: Tuple[Tuple[str, Any], ...] = ()
    if fmt in ("torch", "legacy", "dcp"):
        names = draw(st.lists(st.sampled_from(["epoch", "global_step", "note", "lr", "hparams"]), unique=True,
                              max_size=3))
        taken = {leaf.path[0] for leaf in lv}
        common = tuple((k, draw(COMMON_VALUES)) for k in names if k not in taken)
    exports = ["none", "none", "safetensors", "dcp", "megatron"] + (["torch_file"] if fmt != "dcp" else [])
    return Case(fmt, lv, draw(st.sampled_from(LOADERS)), draw(st.sampled_from(exports)),
                draw(st.sampled_from([64, 300, 4096, 1 << 20])), common, draw(st.integers(0, 2)) > 0,
                draw(st.booleans()), draw(TORCH_SAVE_OPTIONS))


# -- building the peer's files ---------------------------------------------------------------------
def torch_save_options(options: Tuple[bool, int]) -> Any:
    """torch.save's own options while the peer writes (DCP's chunks are torch.save archives too):
    without CRC-32s (each record's is 0 then) and other storage alignments."""
    import torch.utils.serialization.config as serialization_config

    crc, alignment = options
    return serialization_config.patch({"save.compute_crc32": crc, "save.storage_alignment": alignment})


def leaf_tensor(leaf: Leaf, shared: Dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """The leaf's tensor in its layout (a view of ``shared[dtype]`` for the shared layout)."""
    dtype, shape = leaf.torch_dtype, leaf.shape
    if leaf.layout == "shared":
        base = shared[dtype]
        start = leaf.value_seed % max(1, base.numel() - math.prod(shape) + 1)
        return base[start:start + math.prod(shape)].view(shape)
    if leaf.layout == "transposed" and len(shape) >= 2:
        return values(dtype, shape[::-1], leaf.value_seed).permute(*reversed(range(len(shape))))
    if leaf.layout == "strided" and shape:
        wide = values(dtype, shape[:-1] + (shape[-1] * 2 + 1,), leaf.value_seed)
        return wide[..., 1::2]
    if leaf.layout == "expand" and shape and math.prod(shape):
        return values(dtype, (1,) + shape[1:], leaf.value_seed).expand(shape)
    t = values(dtype, shape, leaf.value_seed)
    if leaf.layout == "parameter" and dtype.is_floating_point:
        return torch.nn.Parameter(t, requires_grad=False)
    return t


def shared_buffers(case: Case) -> Dict[torch.dtype, torch.Tensor]:
    need: Dict[torch.dtype, int] = {}
    for leaf in case.leaves:
        if leaf.layout == "shared":
            need[leaf.torch_dtype] = max(need.get(leaf.torch_dtype, 0), math.prod(leaf.shape) + 5)
    return {dt: values(dt, (n,), n * 7919 + 1) for dt, n in need.items()}


def tree(case: Case) -> Dict[str, Any]:
    shared = shared_buffers(case)
    out: Dict[str, Any] = dict(case.common)
    for leaf in case.leaves:
        node = out
        for step in leaf.path[:-1]:
            node = node.setdefault(step, {})
        node[leaf.path[-1]] = leaf_tensor(leaf, shared)
    return out


def flat_contiguous(case: Case) -> Dict[str, torch.Tensor]:
    return {leaf.path[0]: values(leaf.torch_dtype, leaf.shape, leaf.value_seed) for leaf in case.leaves}


def write_peer(case: Case, root: str) -> Tuple[str, Dict[str, torch.Tensor], Dict[str, Leaf]]:
    """Write the case with the peer; returns (path, {our key: the peer's own reading}, {our key: leaf})."""
    if case.fmt in ("torch", "legacy"):
        path = os.path.join(root, "state.pt")
        with torch_save_options(case.torch_save):
            torch.save(tree(case), path, _use_new_zipfile_serialization=case.fmt == "torch")
        back = torch.load(path, weights_only=True)  # the judge
        return path, {"/".join(leaf.path): _at(back, leaf.path) for leaf in case.leaves}, \
            {"/".join(leaf.path): leaf for leaf in case.leaves}
    if case.fmt == "safetensors":
        from safetensors.torch import load_file, save_file

        path = os.path.join(root, "model.safetensors")
        save_file(flat_contiguous(case), path, metadata={"format": "pt"})
        return path, load_file(path), {leaf.path[0]: leaf for leaf in case.leaves}
    if case.fmt in ("hf", "hf_bin"):
        from huggingface_hub import save_torch_state_dict

        path = os.path.join(root, "hf")
        os.makedirs(path)
        with torch_save_options(case.torch_save):
            save_torch_state_dict(flat_contiguous(case), path, max_shard_size=case.shard_bytes,
                                  safe_serialization=case.fmt == "hf")
        return path, _read_hf_as_peer(path), {leaf.path[0]: leaf for leaf in case.leaves}
    return _write_dcp(case, root)


def _at(node: Any, path: Tuple[str, ...]) -> Any:
    for step in path:
        node = node[step]
    return node


def _read_hf_as_peer(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory as the peer's readers give them: each file the index
    names (or the single file) read by ``load_file`` / ``torch.load(weights_only=True)``."""
    from safetensors.torch import load_file

    names = [n for n in os.listdir(path) if n.endswith(".index.json")]
    files = sorted(set(json.load(open(os.path.join(path, names[0])))["weight_map"].values())) if names else \
        [n for n in os.listdir(path) if n.endswith((".safetensors", ".bin"))]
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        full = os.path.join(path, f)
        out.update(load_file(full) if f.endswith(".safetensors") else torch.load(full, weights_only=True))
    return out


def _write_dcp(case: Case, root: str) -> Tuple[str, Dict[str, torch.Tensor], Dict[str, Leaf]]:
    import torch.distributed.checkpoint as dcp

    path = os.path.join(root, "dcp")
    with warnings.catch_warnings(), torch_save_options(case.torch_save):
        warnings.simplefilter("ignore")
        dcp.save(tree(case), checkpoint_id=path, no_dist=True)
        # the judge: DCP's own load, into zeros of each tensor's saved shape and dtype
        want = {".".join(leaf.path): torch.zeros(leaf.shape, dtype=leaf.torch_dtype) for leaf in case.leaves}
        dcp.load(want, checkpoint_id=path, no_dist=True)
    return path, want, {".".join(leaf.path): leaf for leaf in case.leaves}


# -- reading them with ours ------------------------------------------------------------------------
def loader_of(name: str) -> Any:
    if name == "two_stage_tight":
        return ldc.TwoStageDataParallelLoader(max_inflight_bytes=512, bucket_bytes=64, read_batch_bytes=256)
    if name == "parallel_nobucket":
        return ldc.FullyParallelLoader(bucket_bytes=0)
    return name


@contextlib.contextmanager
def verifying(on: bool) -> Iterator[None]:
    """Off: ``LIGHTNING_DISTCKPT_VERIFY=0``, under which the foreign readers read only the bytes of
    the pieces asked for (a DCP chunk's span, a safetensors slice), unchecked: another code path."""
    saved = os.environ.get("LIGHTNING_DISTCKPT_VERIFY")
    if not on:
        os.environ["LIGHTNING_DISTCKPT_VERIFY"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LIGHTNING_DISTCKPT_VERIFY", None)
        else:
            os.environ["LIGHTNING_DISTCKPT_VERIFY"] = saved


def check_refused(what: str, e: BaseException, bad: Dict[str, Leaf]) -> None:
    """A refusal of dtypes we do not store: a FormatError that names one of those keys and its dtype."""
    msg = str(e)
    assert isinstance(e, ldc.FormatError), f"{what}: {type(e).__name__} instead of a FormatError: {msg}"
    named = [k for k in bad if repr(k)[:40] in msg or k[:40] in msg]
    assert named, f"{what}: the refusal names none of the keys {sorted(bad)[:3]}: {msg}"
    # the dtype as torch names it or as the file's header does
    assert any(str(bad[k].torch_dtype).replace("torch.", "") in msg or "dtype" in msg for k in named), msg


def read_with_ours(case: Case, path: str, peer: Dict[str, torch.Tensor], leaves_by_key: Dict[str, Leaf],
                   scratch: str) -> None:
    """Every entry point of ours on the peer's file(s), bit for bit against ``peer``."""
    bad = {k: leaf for k, leaf in leaves_by_key.items() if not leaf.supported}
    good = {k: v for k, v in peer.items() if k not in bad}
    names = sorted(good)
    # a rotation of the names: a reader that confused a key with its mapped name would give wrong values
    rotated = {k: names[(i + 1) % len(names)] for i, k in enumerate(names)} if case.rename else {}
    key_map = (lambda k: None if k in bad else rotated.get(k, k)) if bad or rotated else None
    if bad:  # refused, naming a key and why; then the rest through a key_map that leaves those out
        for what, call in (("load_plain_tensors", lambda: ldc.load_plain_tensors(path)),
                           ("load_tensors_metadata", lambda: ldc.load_tensors_metadata(path)),
                           ("load_common_state_dict", lambda: ldc.load_common_state_dict(path)),
                           ("load", lambda: ldc.load({}, path))):
            with pytest.raises(ldc.CheckpointingError) as info:
                call()
            check_refused(what, info.value, bad)
    else:
        plain = ldc.load_plain_tensors(path)
        assert sorted(plain) == sorted(good), (sorted(plain), sorted(good))
        for k, want in good.items():
            check_same(f"load_plain_tensors[{k!r}]", plain[k], want)
        meta = ldc.load_tensors_metadata(path)
        for k, want in good.items():
            assert meta[k].dtype == want.dtype and tuple(meta[k].global_shape) == tuple(want.shape), (k, meta[k])
        if case.fmt == "dcp":  # every record read whole, the index checked: a peer's checkpoint is sound
            report = ldc.validate(path)
            assert report.ok, report.problems
    if case.common:
        common = ldc.load({}, path, key_map=key_map) if bad else ldc.load_common_state_dict(path, plain_tensors=False)
        for k, v in case.common:
            assert common[k] == v, (k, common.get(k), v)
    _load_boxes(case, path, good, leaves_by_key, key_map, rotated)
    if case.fmt in ("safetensors", "hf", "hf_bin", "torch", "legacy"):
        _ingest(case, path, peer, leaves_by_key)
    if case.export != "none" and not bad:
        export_foreign(case, path, good, scratch, common=dict(case.common) if case.fmt != "dcp" else None)


def _load_boxes(case: Case, path: str, good: Dict[str, torch.Tensor], leaves_by_key: Dict[str, Leaf],
                key_map: Any, rotated: Dict[str, str]) -> None:
    """``ldc.load`` of each leaf's requested pieces (a split the peer did not write, some into
    another dtype of the same kind), under the names ``key_map`` gives them, into destinations that
    differ from the values everywhere, some non-contiguous."""
    template: Dict[str, Any] = {}
    expected: Dict[str, torch.Tensor] = {}
    for k, full in good.items():
        for i, r in enumerate(leaves_by_key[k].reqs):
            want = r.wanted(full)
            expected[f"{k}#{i}"] = want
            template[f"{k}#{i}"] = r.sharded(rotated.get(k, k), tuple(full.shape), unlike(want, r.strided))
    if not template:
        return
    out = ldc.load(template, path, loader=loader_of(case.loader), key_map=key_map)
    for name, want in expected.items():
        check_same(f"load[{name!r}] (loader {case.loader})", out[name], want)


def _ingest(case: Case, path: str, peer: Dict[str, torch.Tensor], leaves_by_key: Dict[str, Leaf]) -> None:
    """``ingest.load_state_dict`` (any dtype: it only moves bytes) and the rank-0 shard of each piece."""
    from lightning_distckpt.ingest import load_state_dict
    from lightning_distckpt.ingest.api import ShardOptions, shard_from_rank0
    from lightning_distckpt.comm import get_comm

    nested = any(len(leaf.path) > 1 for leaf in leaves_by_key.values()) or case.common
    if nested:  # a training checkpoint: refused by the rank-0 API, which takes a flat state dict
        with pytest.raises(ldc.FormatError, match="not a flat state dict"):
            load_state_dict(path)
        return
    sd = load_state_dict(path)
    assert sorted(sd) == sorted(peer), (sorted(sd), sorted(peer))
    for k, want in peer.items():
        check_same(f"ingest.load_state_dict[{k!r}]", sd[k], want)
    meta, expected = {}, {}
    for k, full in peer.items():
        for i, r in enumerate(leaves_by_key[k].reqs):
            want = r.wanted(full)
            meta[f"{k}#{i}"] = r.sharded(k, tuple(full.shape), torch.empty(want.shape, dtype=want.dtype, device="meta"))
            expected[f"{k}#{i}"] = want
    out: Dict[str, torch.Tensor] = {}
    shard_from_rank0(get_comm(), sd, meta, out, ShardOptions(max_inflight_bytes=4096, bucket_bytes=256))
    for name, want in expected.items():
        check_same(f"ingest shard[{name!r}]", out[name], want)


# -- exports, read by the peer ---------------------------------------------------------------------
def export_foreign(case: Case, source: str, want: Dict[str, torch.Tensor], scratch: str,
                   common: Optional[Dict[str, Any]] = None,
                   objects: Optional[Dict[str, Dict[Any, Any]]] = None) -> None:
    """Export ``source`` (any checkpoint ours reads) to the case's foreign format; the peer reads it
    (and ours reads it back). ``common`` / ``objects`` (key -> {offset: value}): what the export
    carries of them, where the format does (DCP's bytes entries, Megatron's, the torch file's)."""
    out = os.path.join(scratch, f"export_{case.export}")
    if case.export == "safetensors" and any(leaf.dtype in NO_SAFETENSORS for leaf in case.leaves):
        with pytest.raises(ldc.ArgumentError, match="safetensors has no dtype for"):
            ldc.export.to_safetensors(source, out, max_shard_size=case.shard_bytes)
        return
    if case.export == "safetensors":
        ldc.export.to_safetensors(source, out, max_shard_size=case.shard_bytes)
        got = _read_hf_as_peer(out)
        index = os.path.join(out, "model.safetensors.index.json")
        if os.path.exists(index):
            meta = json.load(open(index))
            assert sorted(meta["weight_map"]) == sorted(want)
            assert meta["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    elif case.export in ("dcp", "megatron"):
        got = _export_dcp(case, source, out, want, common, objects or {})
    else:
        out += ".pt"
        ldc.export.to_torch_file(source, out)
        payload = torch.load(out, weights_only=True)
        got = payload["tensors"]
        if common is not None:
            assert payload["common"] == common, (payload["common"], common)
        if objects is not None:
            same_value("objects of the torch file export", payload["objects"], objects)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k, t in want.items():
        check_same(f"export to {case.export}, read by the peer: {k!r}", got[k], t)
    if case.export != "torch_file":  # and our reader of that format reads our export back
        back = ldc.load_plain_tensors(out)
        for k, t in want.items():
            check_same(f"export to {case.export}, read back by ours: {k!r}", back[k], t)


def _export_dcp(case: Case, source: str, out: str, want: Dict[str, torch.Tensor], common: Optional[Dict[str, Any]],
                objects: Dict[str, Dict[Any, Any]]) -> Dict[str, Any]:
    """``to_dcp`` / ``to_megatron``, read by ``dcp.load``: the tensors, DCP's bytes entries (the common
    state's items; Megatron's ShardedObject elements, ``[value]`` under Megatron-Core's
    ``ShardedObject.unique_key``) and Megatron's ``common.pt``."""
    import torch.distributed.checkpoint as dcp

    (ldc.export.to_dcp if case.export == "dcp" else ldc.export.to_megatron)(source, out)
    report = ldc.validate(out)
    assert report.ok, report.problems
    got: Dict[str, Any] = {k: unlike(t, False) for k, t in want.items()}
    entries: Dict[str, Any] = {}
    if case.export == "dcp" and common:
        entries = {k: v for k, v in common.items() if k not in got}
    elif case.export == "megatron":
        entries = {f"{key}/shard_{'.'.join(map(str, off))}_{len(elements)}": [value]
                   for key, elements in objects.items() for off, value in elements.items()}
    got.update({k: None for k in entries})
    planner = DefaultLoadPlanner(flatten_state_dict=case.export == "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=out, no_dist=True, planner=planner)
    # dcp.load puts a bytes entry into the state dict its planner holds (a copy of ``got``'s top level)
    loaded = planner.original_state_dict if case.export == "dcp" else planner.state_dict
    for k, v in entries.items():
        same_value(f"{case.export} bytes entry {k!r}", loaded[k], v)
        del got[k]
    if case.export == "megatron" and common is not None:
        assert torch.load(os.path.join(out, "common.pt"), weights_only=True) == common
    return got


def same_value(where: str, got: Any, want: Any) -> None:
    """Equal values, tensors bit for bit."""
    if isinstance(want, torch.Tensor):
        check_same(where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(repr, got)) == sorted(map(repr, want)), (where, got, want)
        for k in want:
            same_value(f"{where}[{k!r}]", got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            same_value(f"{where}[{i}]", g, w)
    else:
        assert got == want, (where, got, want)


def DefaultLoadPlanner(**kw: Any) -> Any:  # noqa: N802 (DCP's class, imported late)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner as planner

    return planner(**kw)


# -- ours -> peer (one process) ---------------------------------------------------------------------
@dataclass(frozen=True)
class SaveCase:
    leaves: Tuple[Leaf, ...]
    cuts: Tuple[Tuple[Tuple[int, ...], ...], ...]  # per leaf, per axis: where the saved tiles split it
    storage: str
    export: str
    shard_bytes: int
    common: Tuple[Tuple[str, Any], ...]
    objects: Tuple[Tuple[str, int, int], ...] = ()  # ShardedObjects: key, elements, value seed


STORAGES = {"ocdbt": {}, "ocdbt_small": dict(chunk_bytes=1024, pack_max_bytes=0),
            "zarr_small": dict(layout="zarr", chunk_bytes=1024)}


@st.composite
def save_cases(draw) -> SaveCase:
    # our format refuses the keys "." and ".." (storage/layout.py: they would be path components)
    lv = [leaf for leaf in draw(leaves("safetensors", False, extra_p=0)) if leaf.path[0] not in (".", "..")]
    cuts = []
    for leaf in lv:
        axes = []
        for n in leaf.shape:
            k = draw(st.integers(0, 2)) if n > 1 else 0
            axes.append(tuple(sorted(set(draw(st.lists(st.integers(1, n - 1), min_size=k, max_size=k))))) if k else ())
        cuts.append(tuple(axes))
    names = draw(st.lists(st.sampled_from(["step", "epoch", "note"]), unique=True, max_size=2))
    taken = {leaf.path[0] for leaf in lv}
    return SaveCase(tuple(lv), tuple(cuts), draw(st.sampled_from(sorted(STORAGES))),
                    draw(st.sampled_from(["safetensors", "dcp", "megatron", "torch_file"])),
                    draw(st.sampled_from([64, 500, 1 << 20])),
                    tuple((k, draw(COMMON_VALUES)) for k in names if k not in taken),
                    tuple((f"optimizer.{k}", draw(st.integers(1, 3)), draw(st.integers(0, 99)))
                          for k in draw(st.lists(_segment, unique=True, max_size=2))
                          if f"optimizer.{k}" not in taken))


def object_value(key: str, i: int, value_seed: int) -> Dict[str, Any]:
    return {"key": key, "i": i, "t": values(torch.float32, (i + 1,), value_seed + i), "s": "ü" * i}


def saved_objects(case: SaveCase) -> Dict[str, Dict[Tuple[int, ...], Any]]:
    return {key: {(i,): object_value(key, i, value_seed) for i in range(n)} for key, n, value_seed in case.objects}


def tiles(shape: Tuple[int, ...], cuts: Tuple[Tuple[int, ...], ...]) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """(offset, shape) of each tile of the grid ``cuts`` makes of ``shape``."""
    import itertools

    bounds = [(0,) + c + (n,) for c, n in zip(cuts, shape)]
    out = []
    for idx in itertools.product(*(range(len(b) - 1) for b in bounds)):
        out.append((tuple(bounds[a][i] for a, i in enumerate(idx)),
                    tuple(bounds[a][i + 1] - bounds[a][i] for a, i in enumerate(idx))))
    return out


def save_ours(case: SaveCase, path: str) -> Dict[str, torch.Tensor]:
    """``ldc.save`` from one process, each tensor as several tiles; returns key -> global tensor."""
    state: Dict[str, Any] = {"tensors": {}, **dict(case.common)}
    full = {}
    for leaf, cuts in zip(case.leaves, case.cuts):
        key = leaf.path[0]
        full[key] = values(leaf.torch_dtype, leaf.shape, leaf.value_seed)
        for i, (off, shape) in enumerate(tiles(leaf.shape, cuts)):
            data = full[key][tuple(slice(o, o + s) for o, s in zip(off, shape))].clone()
            state["tensors"][f"{i}:{key}"] = ldc.ShardedTensor.from_offsets(key, data, leaf.shape, off)
    objects = {f"{key}#{off}": ldc.ShardedObject(key, value, (len(elements),), off)
               for key, elements in saved_objects(case).items() for off, value in elements.items()}
    if objects:  # (an empty dict would be common state)
        state["objects"] = objects
    ldc.save(state, path, storage=ldc.StorageOptions(**STORAGES[case.storage]))
    return full


# -- 2 gloo ranks: DCP saved by DTensors, our 2-rank save exported, files read and sharded ------------
@dataclass(frozen=True)
class DistTensor:
    path: Tuple[str, ...]
    dtype: str
    shape: Tuple[int, ...]
    placement: str  # how the save holds it: "S<d>" (DTensor Shard(d)), "R" (Replicate), "plain" (a tensor)
    value_seed: int
    reqs: Tuple[Tuple[Req, ...], Tuple[Req, ...]]  # what rank 0 and rank 1 ask for (a split of their own)
    cuts: Tuple[Tuple[int, ...], ...] = ()  # our save: the tiles, dealt to the ranks in turn
    replicate: bool = False  # our save: each tile held by both ranks (replica ids 0 and 1)
    read_placement: str = "R"  # the peer's DCP load of our export: into DTensors of this placement

    @property
    def fqn(self) -> str:
        return ".".join(self.path)

    def full(self) -> torch.Tensor:
        return values(ALL[self.dtype], self.shape, self.value_seed)


@dataclass(frozen=True)
class DistCase:
    kind: str  # dcp2 (peer DCP on 2 ranks -> ours) | export2 (ours on 2 ranks -> peer) | file2 (peer file -> ours)
    tensors: Tuple[DistTensor, ...]
    loader: str = "two_stage"
    writer: Tuple[bool, int] = (True, 1)  # DCP's FileSystemWriter: single_file_per_rank, thread_count
    export: str = "dcp"  # export2: dcp | megatron | safetensors
    file_fmt: str = "torch"  # file2: torch | safetensors | hf
    shard_bytes: int = 1 << 20
    common: Tuple[Tuple[str, Any], ...] = ()
    verify: bool = True
    torch_save: Tuple[bool, int] = (True, 64)


def _placements(shape: Tuple[int, ...]) -> List[str]:
    return [f"S{d}" for d in range(len(shape))] + ["R", "plain"]


@st.composite
def dist_cases(draw) -> DistCase:
    kind = draw(st.sampled_from(["dcp2", "export2", "file2"]))
    n = draw(st.integers(1, 4))
    nested = kind == "dcp2"
    paths = draw(st.lists(st.lists(_segment, min_size=1, max_size=2 if nested else 1).map(tuple), min_size=n,
                          max_size=n, unique_by=(lambda p: "/".join(p), lambda p: ".".join(p))))
    paths = [p for p in paths if not any(q != p and q[:len(p)] == p for q in paths)]
    tensors = []
    for path in paths:
        shape = draw(shapes())
        cuts = tuple(tuple(sorted(set(draw(st.lists(st.integers(1, d - 1), max_size=2))))) if d > 1 else ()
                     for d in shape)
        tensors.append(DistTensor(path, draw(st.sampled_from(list(SUPPORTED))), shape,
                                  draw(st.sampled_from(_placements(shape))), draw(st.integers(0, 1 << 30)),
                                  (draw(reqs(shape)), draw(reqs(shape))), cuts, draw(st.booleans()),
                                  draw(st.sampled_from(_placements(shape)[:-1]))))
    common = tuple((k, draw(COMMON_VALUES)) for k in ["step", "note"] if draw(st.booleans())
                   and k not in {t.path[0] for t in tensors})
    return DistCase(kind, tuple(tensors), draw(st.sampled_from(LOADERS)),
                    (draw(st.booleans()), draw(st.integers(1, 3))),
                    draw(st.sampled_from(["dcp", "megatron", "safetensors"])),
                    draw(st.sampled_from(["torch", "safetensors", "hf"])), draw(st.sampled_from([64, 500, 1 << 20])),
                    common, draw(st.integers(0, 2)) > 0, draw(TORCH_SAVE_OPTIONS))


def _dtensor(t: DistTensor, mesh: Any, placement: str, data: torch.Tensor) -> Any:
    """``data`` (the global tensor) as this rank's DTensor of ``placement``, built from its local piece."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = [Replicate() if placement == "R" else Shard(int(placement[1:]))]
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    local = data[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(t.shape),
                              stride=data.stride()), local_shape, offset


def _ask(rank: int, case: DistCase, path: str, keys: Dict[str, DistTensor]) -> None:
    """``ldc.load`` on both ranks of each rank's own pieces, into destinations unlike the values."""
    template, expected = {}, {}
    for key, t in keys.items():
        full = t.full()
        for i, r in enumerate(t.reqs[rank]):
            expected[f"{key}#{i}"] = r.of(full)
            template[f"{key}#{i}"] = r.sharded(key, t.shape, unlike(r.of(full), r.strided))
    out = ldc.load(template, path, loader=loader_of(case.loader))
    for name, want in expected.items():
        check_same(f"rank {rank}: load[{name!r}] (loader {case.loader})", out[name], want)


def _dcp2(rank: int, case: DistCase, path: str, mesh: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state: Dict[str, Any] = dict(case.common)
    for t in case.tensors:
        node = state
        for step in t.path[:-1]:
            node = node.setdefault(step, {})
        node[t.path[-1]] = t.full() if t.placement == "plain" else _dtensor(t, mesh, t.placement, t.full())[0]
    single, threads = case.writer
    with warnings.catch_warnings(), torch_save_options(case.torch_save):
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=single, thread_count=threads))
    dist.barrier()
    keys = {t.fqn: t for t in case.tensors}
    _ask(rank, case, path, keys)
    if rank == 0:
        plain = ldc.load_plain_tensors(path)
        assert sorted(plain) == sorted(keys), (sorted(plain), sorted(keys))
        for k, t in keys.items():
            check_same(f"load_plain_tensors[{k!r}]", plain[k], t.full())
        common = ldc.load_common_state_dict(path)
        assert all(common[k] == v for k, v in case.common), (common, case.common)
        report = ldc.validate(path)
        assert report.ok, report.problems


def _export2(rank: int, case: DistCase, root: str, mesh: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state: Dict[str, Any] = {"t": {}, **dict(case.common)}
    for t in case.tensors:
        key = t.path[0]
        for i, (off, shape) in enumerate(tiles(t.shape, t.cuts)):
            holders = [(i % 2, 0)] + ([(1 - i % 2, 1)] if t.replicate else [])
            for holder, replica in holders:
                if holder == rank:
                    data = t.full()[tuple(slice(o, o + s) for o, s in zip(off, shape))].clone()
                    state["t"][f"{i}:{replica}:{key}"] = ldc.ShardedTensor.from_offsets(key, data, t.shape, off,
                                                                                        replica_id=replica)
    ckpt, out = os.path.join(root, "ours"), os.path.join(root, f"export_{case.export}")
    ldc.save(state, ckpt)
    full = {t.path[0]: t.full() for t in case.tensors}
    if case.export == "safetensors":  # collective: each rank writes its own files
        ldc.export.to_safetensors(ckpt, out, max_shard_size=case.shard_bytes)
        if rank == 0:
            got = _read_hf_as_peer(out)
            assert sorted(got) == sorted(full), (sorted(got), sorted(full))
            for k, v in full.items():
                check_same(f"export to safetensors from 2 ranks, read by load_file: {k!r}", got[k], v)
        return
    if rank == 0:
        (ldc.export.to_dcp if case.export == "dcp" else ldc.export.to_megatron)(ckpt, out)
    dist.barrier()
    template, expected = {}, {}
    for t in case.tensors:
        key = t.path[0]
        if t.read_placement != "R" and not t.shape:
            continue
        dt, local_shape, offset = _dtensor(t, mesh, t.read_placement, unlike(full[key], False))
        template[key] = dt
        expected[key] = full[key][tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, checkpoint_id=out)
    for key, want in expected.items():
        check_same(f"rank {rank}: export to {case.export}, dcp.load into {case.tensors}", template[key].to_local(),
                   want)


def _file2(rank: int, case: DistCase, path: str) -> None:
    from lightning_distckpt.ingest import broadcast_and_shard_state_dict, load_state_dict, shard_broadcasted_state_dict

    keys = {t.path[0]: t for t in case.tensors}
    _ask(rank, case, path, keys)
    sd = load_state_dict(path)  # collective: rank 0 reads, the others get {}
    meta, expected, out = {}, {}, {}
    for key, t in keys.items():
        for i, r in enumerate(t.reqs[rank]):
            want = r.of(t.full())
            meta[f"{key}#{i}"] = r.sharded(key, t.shape, torch.empty(want.shape, dtype=want.dtype, device="meta"))
            expected[f"{key}#{i}"] = want
    if rank == 0:
        broadcast_and_shard_state_dict(sd, meta, out, max_inflight_bytes=1024, bucket_bytes=128)
    else:
        shard_broadcasted_state_dict(meta, out, max_inflight_bytes=1024, bucket_bytes=128)
    for name, want in expected.items():
        check_same(f"rank {rank}: ingest shard[{name!r}]", out[name], want)


def write_dist_files(cases_: List[DistCase], root: str) -> List[str]:
    """The peer's files of the file2 cases, written here (checked against the spec by the peer's reader)."""
    paths = []
    for i, case in enumerate(cases_):
        where = os.path.join(root, f"case{i}")
        os.makedirs(where)
        if case.kind != "file2":
            paths.append(where)
            continue
        leaves_ = tuple(Leaf(t.path, t.dtype, t.shape, "contiguous", t.value_seed) for t in case.tensors)
        path, peer, _ = write_peer(Case(case.file_fmt, leaves_, shard_bytes=case.shard_bytes,
                                        torch_save=case.torch_save), where)
        for t in case.tensors:
            check_same(f"the peer's own reading of {t.path[0]!r}", peer[t.path[0]], t.full())
        paths.append(path)
    return paths


def _dist_worker(rank: int, world: int, cases_: List[DistCase], paths: List[str], root: str) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for i, (case, path) in enumerate(zip(cases_, paths)):
        with open(os.path.join(root, f"progress.rank{rank}"), "w") as f:
            f.write(str(i))  # for the parent, should this case hang or kill the rank
        try:
            with verifying(case.verify):
                if case.kind == "dcp2":
                    _dcp2(rank, case, os.path.join(path, "dcp"), mesh)
                elif case.kind == "export2":
                    _export2(rank, case, path, mesh)
                else:
                    _file2(rank, case, path)
            error = None
        except Exception:
            error = f"rank {rank}: {traceback.format_exc()}"
        errors: List[Optional[str]] = [None] * world
        dist.all_gather_object(errors, error)  # every rank stops at the first failure, with its case
        if any(errors):
            return f"FAILED case {i}: {case}\n" + "\n".join(e for e in errors if e)
    return "ok"


def run_dist_cases(cases_: List[DistCase]) -> None:
    with Scratch() as root:
        paths = write_dist_files(cases_, root)
        try:
            result = run_distributed(_dist_worker, 2, cases_, paths, root, timeout_s=60.0)[0]
        except Exception as e:  # a rank died, or a collective timed out: name the case the ranks were in
            at = set()
            for r in range(2):
                progress = os.path.join(root, f"progress.rank{r}")
                if os.path.exists(progress):
                    at.add(int(open(progress).read()))
            pytest.fail(f"FAILED (ranks were in cases {sorted(at)}): {[cases_[i] for i in sorted(at)]}\n{e}",
                        pytrace=False)
    if result != "ok":
        pytest.fail(result, pytrace=False)


# -- settings --------------------------------------------------------------------------------------
LONG_EXAMPLES = int(os.environ.get("LDC_FOREIGN_FUZZ_EXAMPLES", "150"))
FUZZ_SEED = int(os.environ.get("LDC_FOREIGN_FUZZ_SEED", "0"))
_COMMON_SETTINGS = dict(deadline=None, database=None, print_blob=True,
                        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                               HealthCheck.data_too_large, HealthCheck.filter_too_much])
CI = settings(max_examples=25, derandomize=True, **_COMMON_SETTINGS)
LONG = settings(max_examples=LONG_EXAMPLES, derandomize=False, **_COMMON_SETTINGS)
# a 2-rank world per example, each batch reported whole: no shrinking (it would start world after world)
DIST_CI = settings(max_examples=2, derandomize=True, phases=[Phase.generate], **_COMMON_SETTINGS)
DIST_LONG = settings(max_examples=max(2, LONG_EXAMPLES // 10), derandomize=False, phases=[Phase.generate],
                     **_COMMON_SETTINGS)
FORMATS = ["torch", "legacy", "safetensors", "hf", "hf_bin", "dcp"]


class Scratch:
    """A fresh directory per example (hypothesis runs many in one test call)."""

    def __enter__(self) -> str:
        self.dir = tempfile.mkdtemp(prefix="ldc-foreign-fuzz-")
        return self.dir

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def run_peer_case(case: Case) -> None:
    with Scratch() as root:
        path, peer, by_key = write_peer(case, root)
        with verifying(case.verify):
            read_with_ours(case, path, peer, by_key, root)


def run_save_case(case: SaveCase) -> None:
    with Scratch() as root:
        ckpt = os.path.join(root, "ours")
        full = save_ours(case, ckpt)
        plain = ldc.load_plain_tensors(ckpt)
        for k, t in full.items():
            check_same(f"ours load_plain_tensors[{k!r}]", plain[k], t)
        c = Case("ours", case.leaves, export=case.export, shard_bytes=case.shard_bytes)
        export_foreign(c, ckpt, full, root, common=dict(case.common), objects=saved_objects(case))


def _peer_test(fmt: str, s: settings, extra_p: int = 12):
    @s
    @given(cases(fmt, extra_p))
    def run(case: Case) -> None:
        run_peer_case(case)

    return run


# -- CI entry points (a fixed set) -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_peer_files_read_by_every_entry_point(fmt):
    _peer_test(fmt, CI)()


def test_ours_exported_read_by_the_peers():
    CI(given(save_cases())(run_save_case))()


def test_two_ranks_dcp_dtensors_exports_and_files():
    """Batches of 8 cases, each batch in one 2-rank world (2 worlds; the first is hypothesis's simplest batch)."""
    DIST_CI(given(st.lists(dist_cases(), min_size=8, max_size=8))(run_dist_cases))()


# -- the long set (seeded: LDC_FOREIGN_FUZZ_SEED replays) --------------------------------------------
@pytest.mark.long
@pytest.mark.parametrize("fmt", FORMATS)
def test_long_peer_files_read_by_every_entry_point(fmt):
    seed(FUZZ_SEED)(_peer_test(fmt, LONG))()


@pytest.mark.long
def test_long_ours_exported_read_by_the_peers():
    seed(FUZZ_SEED)(LONG(given(save_cases())(run_save_case)))()


@pytest.mark.long
def test_long_two_ranks_dcp_dtensors_exports_and_files():
    seed(FUZZ_SEED)(DIST_LONG(given(st.lists(dist_cases(), min_size=10, max_size=10))(run_dist_cases)))()


# -- regressions: each failed before its fix --------------------------------------------------------
def _empty_shards(rank: int, world: int, path: str) -> Dict[str, Tuple[int, ...]]:
    from lightning_distckpt.ingest import broadcast_and_shard_state_dict, load_state_dict, shard_broadcasted_state_dict

    meta = torch.device("meta")
    entries = {  # torch.chunk's split of 1 row over 2 ranks leaves rank 1 an empty one; an empty buffer
        "row": ldc.ShardedTensor.from_offsets("row", torch.empty((1 - rank, 4), device=meta), (1, 4), (rank, 0)),
        "empty": torch.empty((0, 3), device=meta),
        "cols": ldc.ShardedTensor.from_rank_offsets("cols", torch.empty((2, 1), device=meta), (1, rank, world)),
    }
    sd = load_state_dict(path)
    out: Dict[str, torch.Tensor] = {}
    if rank == 0:
        broadcast_and_shard_state_dict(sd, entries, out)
    else:
        shard_broadcasted_state_dict(entries, out)
    return {k: tuple(v.shape) for k, v in out.items()}


def test_ingest_gives_every_rank_its_empty_shards(tmp_path):
    """Before: a rank other than 0 got no entry for a shard of no elements (an empty buffer, its
    empty part of an uneven split), so ``module.load_state_dict(..., assign=True)`` failed there alone."""
    from safetensors.torch import save_file

    path = str(tmp_path / "model.safetensors")
    save_file({"row": torch.randn(1, 4), "empty": torch.zeros(0, 3), "cols": torch.randn(2, 2)}, path)
    got = run_distributed(_empty_shards, 2, path)
    assert got[0] == {"row": (1, 4), "empty": (0, 3), "cols": (2, 1)}
    assert got[1] == {"row": (0, 4), "empty": (0, 3), "cols": (2, 1)}


@pytest.mark.parametrize("tensors", [1, 2])
def test_dcp_safetensors_serialization_loads(tmp_path, tensors):
    """DCP's ``serialization_format=SAFETENSORS`` records every tensor of a file at one offset: read
    through the appended safetensors header, one tensor or two. Before: refused as ".metadata forged
    or damaged" (two tensors) or as a bad zip (one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    path = str(tmp_path / "dcp")
    state = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3), "step": 3}
    if tensors == 1:
        del state["layer.bias"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS),
                 no_dist=True)
    out = ldc.load_plain_tensors(path)
    assert out.keys() == {k for k in state if k != "step"}
    assert all(torch.equal(out[k], state[k]) for k in out)
    assert ldc.validate(path).ok


@pytest.mark.parametrize("kind", ["safetensors", "torch", "hf"])
def test_to_torch_file_from_a_file_or_hugging_face_directory(tmp_path, kind):
    """``export.to_torch_file`` takes anything ``ldc.load`` reads but DCP. Before: a ``.safetensors``
    / ``torch.save`` file or a Hugging Face directory was "no such directory" (it exists)."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    sd = {"a.weight": values(torch.bfloat16, (3, 4), 1), "b": values(torch.int16, (5,), 2)}
    path = str(tmp_path / {"safetensors": "w.safetensors", "torch": "w.pt", "hf": "hf"}[kind])
    if kind == "safetensors":
        save_file(sd, path)
    elif kind == "torch":
        torch.save({"model": sd, "epoch": 4}, path)
        sd = {f"model/{k}": v for k, v in sd.items()}
    else:
        os.makedirs(path)
        save_torch_state_dict(sd, path, max_shard_size=40)
    out = str(tmp_path / "out.pt")
    ldc.export.to_torch_file(path, out)
    payload = torch.load(out, weights_only=True)
    assert sorted(payload["tensors"]) == sorted(sd) and payload["objects"] == {}
    assert payload["common"] == ({"epoch": 4} if kind == "torch" else {})
    for k, v in sd.items():
        check_same(k, payload["tensors"][k], v)


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_torch_save_without_crc32s_is_read(tmp_path, fmt):
    """``torch.utils.serialization.config.save.compute_crc32 = False`` (a faster save) records a CRC-32
    of 0 for every zip record; ``torch.load`` and ``dcp.load`` read such files. Before: refused as
    "not a readable torch.save archive: BadZipFile: Bad CRC-32" (zipfile's reader checks what we
    read of the archive, data.pkl, a DCP chunk's byteorder), by every reader."""
    import torch.distributed.checkpoint as dcp

    w, b = values(torch.float32, (4, 3), 5), values(torch.bfloat16, (7,), 6)
    path = str(tmp_path / ("state.pt" if fmt == "torch" else "dcp"))
    with torch_save_options((False, 64)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fmt == "torch":
            torch.save({"w": w, "b": b, "step": 3}, path)
        else:
            dcp.save({"w": w, "b": b, "step": 3}, checkpoint_id=path, no_dist=True)
    plain = ldc.load_plain_tensors(path)
    check_same("w", plain["w"], w)
    check_same("b", plain["b"], b)
    out = ldc.load({"rows": ldc.ShardedTensor.from_offsets("w", torch.zeros(2, 3), (4, 3), (2, 0))}, path)
    check_same("rows", out["rows"], w[2:])
    assert out["step"] == 3 and ldc.load_common_state_dict(path)["step"] == 3
    if fmt == "dcp":
        assert ldc.validate(path).ok


_UNALIGNED = """
import torch, torch.utils.serialization.config as sc
from lightning_distckpt.ingest import load_state_dict
x = torch.complex(torch.arange(3.0, dtype=torch.float64), -torch.arange(3.0, dtype=torch.float64))
with sc.patch({"save.storage_alignment": 1}):  # each storage's data right after its zip header: any byte
    torch.save({"pad": torch.ones(1, dtype=torch.uint8), "x": x, "s": x[1]}, PATH)
sd = load_state_dict(PATH)
assert torch.equal(sd["x"].clone(), x) and torch.equal(sd["s"].clone(), x[1]), sd
print("ok")
"""


def test_a_torch_file_saved_unaligned_is_read_without_crashing(tmp_path):
    """``torch.save`` under ``storage_alignment=1`` (torch.utils.serialization.config) puts a storage's
    data at any byte of the file. Memory-mapped, as our readers load torch files, a complex128 tensor
    then sits at an address its copy kernel cannot read. Before: the process died of SIGSEGV when the
    rank-0 API's tensors were copied (``torch.load`` without ``mmap``, the peer's default, reads it).
    In a child process: the crash would take pytest with it."""
    import subprocess
    import sys

    path = str(tmp_path / "unaligned.pt")
    done = subprocess.run([sys.executable, "-c", f"PATH = {path!r}\n" + _UNALIGNED], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])
