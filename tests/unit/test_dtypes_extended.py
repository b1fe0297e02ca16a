"""The dtypes beyond the first ten: float8 (e4m3fn, e5m2, e4m3fnuz, e5m2fnuz), uint16/32/64 and
complex64/128, stored natively (zarr v3 data types of the same names) and read like the others.

Before: ``save`` refused each of them ("dtype torch.float8_e4m3fn is not supported", a
ShardingError), DCP / torch / safetensors files holding them were refused on read, a plain
complex or float8 tensor stayed common state, and an index naming a dtype the reader does not know
said only "must be one of [...]". Bits are compared, not values: NaN payloads (every float8 bit
pattern is stored), -0.0 in complex parts and the top bit of uint64 must survive; a cast must give
what ``Tensor.to`` gives, whichever way the chunks are read (tensorstore's own conversions differ
from torch's on NaN payloads and float8 overflow).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import uuid

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed

NEW = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.uint16,
       torch.uint32, torch.uint64, torch.complex64, torch.complex128]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def values(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bits as ``dtype``, the first elements the patterns a conversion would change: every
    float8 bit pattern (all its NaNs, -0.0), complex parts -0.0 / NaN with a payload / -inf, the
    largest unsigned values."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    parts = torch.view_as_real(t) if dtype.is_complex else t  # a complex value: two floats
    ints = parts.view(_INT[parts.element_size()]).reshape(-1)  # a view: writing it writes t
    if dtype.itemsize == 1:
        specials = list(range(256))
    elif dtype.is_complex and dtype.itemsize == 8:  # float32 parts
        specials = [-(1 << 31), 0x7FC00001, 0x7F800001, 0xFF800000 - (1 << 32), -(1 << 31), -(1 << 31)]
    elif dtype.is_complex:
        specials = [-(1 << 63), 0x7FF8000000000001, 0x7FF0000000000001, 0xFFF0000000000000 - (1 << 64), -(1 << 63)]
    else:  # unsigned (and float32 / float16 here): all ones and the top bit alone, as signed integers
        specials = [-1, -(1 << (8 * dtype.itemsize - 1)), -1]
    k = min(len(specials), ints.numel())
    ints[:k] = torch.tensor(specials[:k], dtype=ints.dtype)
    return t.reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    return t.view(_INT[t.element_size()])


def same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    assert torch.equal(bits(got), bits(want)), f"{what}: the bits differ"


def unlike(t: torch.Tensor) -> torch.Tensor:
    """A destination differing from ``t`` in every bit (an element left unwritten shows)."""
    return (~bits(t)).view(t.dtype).reshape(t.shape) if t.numel() else t.clone()


def st(key: str, data: torch.Tensor) -> ldc.ShardedTensor:
    return ldc.ShardedTensor.from_rank_offsets(key, data)


def state(seed: int = 0):
    """Per dtype: an array of its own in several chunks, a packed small shard, a 0-d and an empty tensor."""
    out = {}
    for i, dtype in enumerate(NEW):
        n = name(dtype)
        out[f"{n}/big"] = values(dtype, (300, 40), seed + i)
        out[f"{n}/small"] = values(dtype, (5, 3), seed + 100 + i)
        out[f"{n}/scalar"] = values(dtype, (), seed + 200 + i)
        out[f"{n}/empty"] = torch.empty(0, 4, dtype=dtype)
    return out


@contextlib.contextmanager
def environ(var: str, value: str):
    saved = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved


# -- save and load, one process ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_every_new_dtype_round_trips_bit_exact_through_every_loader(tmp_path, layout):
    want = state()
    path = str(tmp_path / "ck")
    ldc.save({k: st(k, v.clone()) for k, v in want.items()}, path,
             storage=ldc.StorageOptions(layout=layout, chunk_bytes=4096, pack_max_bytes=1024))  # several chunks
    stored = json.load(open(os.path.join(path, "metadata.json")))["tensors"]
    assert "packed" not in stored["float8_e4m3fn/big"]["shards"][0]  # an array of its own
    stored = json.load(open(os.path.join(path, "metadata.json")))["tensors"]
    assert {k: e["dtype"] for k, e in stored.items()} == {k: name(v.dtype) for k, v in want.items()}
    assert any("packed" in s for s in stored["float8_e4m3fn/small"]["shards"])  # through the pack array
    for loader in ("every_rank", "parallel", "two_stage"):
        out = ldc.load({k: st(k, unlike(v)) for k, v in want.items()}, path, loader=loader)
        for k, v in want.items():
            same(out[k], v, f"{loader} {k}")
    with environ("LIGHTNING_DISTCKPT_DIRECT_READS", "0"):  # everything through tensorstore
        out = ldc.load({k: st(k, unlike(v)) for k, v in want.items()}, path)
    for k, v in want.items():
        same(out[k], v, f"tensorstore reads {k}")
    plain = ldc.load_plain_tensors(path)
    for k, v in want.items():
        same(plain[k], v, f"load_plain_tensors {k}")
    meta = ldc.load_tensors_metadata(path)
    assert {k: m.dtype for k, m in meta.items()} == {k: v.dtype for k, v in want.items()}
    report = ldc.validate(path)
    assert report.ok, report.problems


def test_conjugate_and_negative_views_are_saved_as_their_values(tmp_path):
    z = values(torch.complex64, (64, 64), 1)
    small = values(torch.complex128, (3,), 2)
    sd = {"conj": z.conj(), "neg": z.conj().imag, "small_conj": small.conj(), "plain_conj": small.conj()}
    assert sd["conj"].is_conj() and sd["neg"].is_neg()
    ldc.save({**{k: st(k, v) for k, v in sd.items() if k != "plain_conj"}, "plain_conj": sd["plain_conj"]},
             str(tmp_path / "ck"))
    plain = ldc.load_plain_tensors(str(tmp_path / "ck"))
    for k, v in sd.items():
        same(plain[k], v.resolve_conj().resolve_neg(), k)


def test_plain_tensors_of_new_dtypes_are_stored_as_tensors(tmp_path):
    sd = {"scale": values(torch.float8_e4m3fn, (4,), 3), "phase": values(torch.complex64, (2, 2), 4),
          "counter": values(torch.uint64, (), 5), "step": 7}
    ldc.save(sd, str(tmp_path / "ck"))
    assert set(ldc.load_tensors_metadata(str(tmp_path / "ck"))) == {"scale", "phase", "counter"}
    out = ldc.load({}, str(tmp_path / "ck"))
    assert out["step"] == 7
    for k in ("scale", "phase", "counter"):
        same(out[k], sd[k], k)


# -- two processes: resharded, flattened, async --------------------------------------------------------
_ROWS, _COLS = 8, 6


def _full(dtype: torch.dtype, i: int) -> torch.Tensor:
    return values(dtype, (_ROWS, _COLS), 40 + i)


def _two_rank_save_and_resharded_loads(rank: int, world: int, path: str):
    sd = {}
    for i, dtype in enumerate(NEW):
        n, full = name(dtype), _full(dtype, i)
        half = _ROWS // world
        sd[f"{n}/rows"] = ldc.ShardedTensor.from_rank_offsets(f"{n}/rows", full[rank * half:(rank + 1) * half].clone(),
                                                              (0, rank, world))
        lo, hi = (0, 20) if rank == 0 else (20, _ROWS * _COLS)  # distributed-optimizer slices of the whole tensor
        sd[f"{n}/flat"] = ldc.ShardedTensor.from_rank_offsets_flat(f"{n}/flat", full.reshape(-1)[lo:hi].clone(),
                                                                   (_ROWS, _COLS), flattened_range=slice(lo, hi))
    # some shards packed (float8: 24 bytes), some arrays of their own (complex128: 384 bytes)
    ldc.save(sd, path, async_save=True, storage=ldc.StorageOptions(pack_max_bytes=100)).finalize()
    for loader in ("two_stage", "parallel", "every_rank"):
        tmpl = {}
        for i, dtype in enumerate(NEW):  # another split: columns; flat ranges with other bounds
            n, full = name(dtype), _full(dtype, i)
            cols = _COLS // world
            tmpl[f"{n}/rows"] = ldc.ShardedTensor.from_rank_offsets(
                f"{n}/rows", unlike(full[:, rank * cols:(rank + 1) * cols]), (1, rank, world))
            lo, hi = (0, 31) if rank == 0 else (31, _ROWS * _COLS)
            tmpl[f"{n}/flat"] = ldc.ShardedTensor.from_rank_offsets_flat(
                f"{n}/flat", unlike(full.reshape(-1)[lo:hi]), (_ROWS, _COLS), flattened_range=slice(lo, hi))
        out = ldc.load(tmpl, path, loader=loader)
        for i, dtype in enumerate(NEW):
            n, full = name(dtype), _full(dtype, i)
            cols = _COLS // world
            same(out[f"{n}/rows"], full[:, rank * cols:(rank + 1) * cols], f"rank {rank} {loader} {n}/rows")
            lo, hi = (0, 31) if rank == 0 else (31, _ROWS * _COLS)
            same(out[f"{n}/flat"], full.reshape(-1)[lo:hi], f"rank {rank} {loader} {n}/flat")
    # casts on two ranks (the two-stage loader sends the stored bytes; the receiver converts)
    f8, c64 = _full(torch.float8_e5m2, 1), _full(torch.complex64, 7)
    into = {"a": ("float8_e5m2/rows", torch.float32), "b": ("complex64/rows", torch.complex128)}
    out = ldc.load({k: ldc.ShardedTensor.from_rank_offsets(key, torch.zeros(_ROWS, 3, dtype=dt), (1, rank, 2))
                    for k, (key, dt) in into.items()}, path, loader="two_stage")
    same(out["a"], f8[:, rank * 3:(rank + 1) * 3].to(torch.float32), "float8_e5m2 -> float32")
    same(out["b"], c64[:, rank * 3:(rank + 1) * 3].to(torch.complex128), "complex64 -> complex128")
    return True


def test_two_ranks_async_save_loads_resharded_flattened_and_on_one_process(tmp_path):
    path = str(tmp_path / "ck")
    assert run_distributed(_two_rank_save_and_resharded_loads, 2, path) == [True, True]
    for i, dtype in enumerate(NEW):  # one process: another world size, the flat pieces as one N-D tensor
        n, full = name(dtype), _full(dtype, i)
        out = ldc.load({"r": st(f"{n}/rows", unlike(full)), "f": st(f"{n}/flat", unlike(full))}, path)
        same(out["r"], full, f"{n}/rows on one process")
        same(out["f"], full, f"{n}/flat on one process")


# -- casts -----------------------------------------------------------------------------------------
def _float_sources() -> torch.Tensor:
    """float32 values whose conversion to float8 / bfloat16 is where converters differ: NaN
    payloads of both signs, overflow, subnormals, ties."""
    x = values(torch.float32, (64, 64), 9).reshape(-1)
    x[:12] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e6, -1e6, 449.0, 464.0,
                           57344.0, 61440.0, 1e-9, -0.0])
    x.view(torch.int32)[12:15] = torch.tensor([0x7FC00001, 0x7F800001, -0x005ABCDE], dtype=torch.int32)
    return x.reshape(64, 64)


CASTS = [  # stored, wanted (each value as Tensor.to converts it)
    (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2), (torch.float32, torch.float8_e4m3fnuz),
    (torch.float32, torch.bfloat16), (torch.float8_e4m3fn, torch.float32), (torch.float8_e5m2, torch.bfloat16),
    (torch.float8_e4m3fnuz, torch.float16), (torch.complex64, torch.complex128), (torch.uint64, torch.int64),
    (torch.uint16, torch.int32), (torch.int64, torch.uint32),
]


@pytest.fixture
def memory_store():
    from lightning_distckpt.storage.stores import register_store, unregister_store
    from memory_store import MemoryStore

    register_store(MemoryStore)
    yield f"memory://dtypes-{uuid.uuid4().hex[:8]}"
    unregister_store(MemoryStore)


@pytest.mark.parametrize("where", ["local", "memory"])  # memory: chunks checksummed by the codec, read by tensorstore
def test_casts_on_load_give_what_tensor_to_gives(tmp_path, memory_store, where):
    path = str(tmp_path / "ck") if where == "local" else memory_store
    src = {}
    for i, (stored, _) in enumerate(CASTS):
        full = _float_sources().to(stored) if stored == torch.float32 else values(stored, (64, 64), 60 + i)
        src[f"{i}/big"], src[f"{i}/small"] = full, full[:3, :5].clone()  # its own array; packed
    ldc.save({k: st(k, v) for k, v in src.items()}, path, storage=ldc.StorageOptions(pack_max_bytes=1024))
    for loader in ("every_rank", "two_stage"):
        whole, part = {}, {}
        for i, (_, wanted) in enumerate(CASTS):
            whole[f"{i}/big"] = st(f"{i}/big", torch.zeros(64, 64, dtype=wanted))
            whole[f"{i}/small"] = st(f"{i}/small", torch.zeros(3, 5, dtype=wanted))
            part[f"{i}/big"] = ldc.ShardedTensor.from_offsets(f"{i}/big", torch.zeros(20, 7, dtype=wanted),
                                                              (64, 64), (3, 50))
        out, piece = ldc.load(whole, path, loader=loader), ldc.load(part, path, loader=loader)
        for i, (stored, wanted) in enumerate(CASTS):
            what = f"{name(stored)} -> {name(wanted)} ({where}, {loader})"
            same(out[f"{i}/big"], src[f"{i}/big"].to(wanted), what)
            same(out[f"{i}/small"], src[f"{i}/small"].to(wanted), what + " packed")
            same(piece[f"{i}/big"], src[f"{i}/big"][3:23, 50:57].to(wanted), what + " part")


def test_tensorstore_reads_convert_the_ten_dtypes_as_tensor_to_does_too(memory_store):
    """The old dtypes through the same path (an object store's chunks, read by tensorstore): before, a
    float32 NaN payload into bfloat16 or a float16 one into float32 came back with other bits than
    ``Tensor.to`` gives (``ts.cast``)."""
    x, h = _float_sources(), values(torch.float16, (64, 64), 11)
    ldc.save({"x": st("x", x), "h": st("h", h)}, memory_store, storage=ldc.StorageOptions(pack_max_bytes=0))
    out = ldc.load({"x": st("x", torch.zeros(64, 64, dtype=torch.bfloat16)), "h": st("h", torch.zeros(64, 64))},
                   memory_store, loader="every_rank")  # (two_stage reads the stored dtype and converts later)
    same(out["x"], x.to(torch.bfloat16), "float32 -> bfloat16")
    same(out["h"], h.to(torch.float32), "float16 -> float32")


def test_complex_never_loads_into_a_real_dtype_and_kinds_stay_apart(tmp_path):
    path = str(tmp_path / "ck")
    z, u, f = values(torch.complex64, (4,), 1), values(torch.uint16, (4,), 2), torch.randn(4)
    ldc.save({"z": st("z", z), "u": st("u", u), "f": st("f", f)}, path)
    for wrong in (torch.float32, torch.float64, torch.int64, torch.bool):
        for cast in ("same_kind", "any"):  # dropping the imaginary parts is refused even under cast="any"
            with pytest.raises(ldc.ShardingError, match=rf"'z' is stored as complex64 .* {name(wrong)}.*never loaded "
                                                        r"into a real dtype.*\.real"):
                ldc.load({"z": st("z", torch.zeros(4, dtype=wrong))}, path, cast=cast)
    for key, wrong in (("u", torch.float32), ("f", torch.complex64), ("f", torch.uint64), ("u", torch.bool)):
        with pytest.raises(ldc.ShardingError, match=rf"'{key}' is stored as .* {name(wrong)}.*cast='any'"):
            ldc.load({key: st(key, torch.zeros(4, dtype=wrong))}, path)
    out = ldc.load({"u": st("u", torch.zeros(4)), "f": st("f", torch.zeros(4, dtype=torch.complex64))}, path,
                   cast="any")  # asked for: as Tensor.to
    same(out["u"], u.to(torch.float32))
    same(out["f"], f.to(torch.complex64))


# -- foreign files, exports, the command line, older readers -------------------------------------------------
def _peer_state():
    return {name(d): values(d, (6, 4), 80 + i) for i, d in enumerate(NEW)}


def _safetensors_dtypes() -> set:
    """The torch dtypes the installed safetensors names (its floor, 0.4, has no float8, unsigned or complex)."""
    import safetensors.torch

    return set(safetensors.torch._TYPES.values())


def test_files_of_the_peers_holding_them_are_read(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    want = _peer_state()
    torch.save(want, str(tmp_path / "state.pt"))
    no_c128 = {k: v for k, v in want.items() if v.dtype in _safetensors_dtypes()}  # never complex128
    save_file(no_c128, str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning):  # DCP in one process says it assumes so
        dcp.save(want, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for source, tensors in (("state.pt", want), ("model.safetensors", no_c128), ("dcp", want)):
        path = str(tmp_path / source)
        plain = ldc.load_plain_tensors(path)
        for k, v in tensors.items():
            same(plain[k], v, f"{source} {k}")
        out = ldc.load({k: ldc.ShardedTensor.from_offsets(k, unlike(v[2:5, 1:3]), (6, 4), (2, 1))
                        for k, v in tensors.items()}, path)
        for k, v in tensors.items():
            same(out[k], v[2:5, 1:3], f"{source} {k} slice")


def test_exports_write_them_where_the_format_has_them(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file

    want = _peer_state()
    path = str(tmp_path / "ck")
    ldc.save({k: st(k, v) for k, v in want.items()}, path)
    known = _safetensors_dtypes()  # the installed release's (0.4 has no float8 or unsigned ones; none complex128)
    with pytest.raises(ldc.ArgumentError, match=r"safetensors has no dtype for 'complex128' \(complex128\)"):
        ldc.export.to_safetensors(path, str(tmp_path / "st"))
    assert not os.path.exists(tmp_path / "st" / "model.safetensors")
    kept = sorted(k for k in want if want[k].dtype in known)
    if not kept:  # safetensors 0.4 names none of them
        with pytest.raises(ldc.CheckpointingError, match="no tensors to export"):
            ldc.export.to_safetensors(path, str(tmp_path / "st"), key_map=lambda k: None)
    else:
        ldc.export.to_safetensors(path, str(tmp_path / "st"), key_map=lambda k: k if k in kept else None)
        got = load_file(str(tmp_path / "st" / "model.safetensors"))
        assert sorted(got) == kept
        for k, v in got.items():
            same(v, want[k], f"safetensors {k}")
    if torch.float8_e4m3fn in known and torch.uint64 in known:
        with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as f:  # the format's own names
            assert f.get_slice("float8_e4m3fn").get_dtype() == "F8_E4M3" and f.get_slice("uint64").get_dtype() == "U64"
    ldc.export.to_dcp(path, str(tmp_path / "dcp"))
    back = {k: unlike(v) for k, v in want.items()}
    with pytest.warns(UserWarning):
        dcp.load(back, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    ldc.export.to_torch_file(path, str(tmp_path / "t.pt"))
    tensors = torch.load(str(tmp_path / "t.pt"), weights_only=True)["tensors"]
    for k, v in want.items():
        same(back[k], v, f"dcp {k}")
        same(tensors[k], v, f"torch file {k}")


def test_inspect_shows_them(tmp_path, capsys):
    from lightning_distckpt.cli.main import main

    want = _peer_state()
    ldc.save({k: st(k, v) for k, v in want.items()}, str(tmp_path / "ck"))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    for k in want:
        assert f"{k}  " in text and text.count(k) >= 2, (k, text)  # key column and dtype column
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    assert set(json.dumps(json.loads(capsys.readouterr().out)).split('"')) >= set(want)


def test_an_unknown_dtype_name_is_a_format_error_saying_so(tmp_path):
    """What an older reader does with these names, and this one with a name from a newer release."""
    path = tmp_path / "ck"
    ldc.save({"w": st("w", torch.zeros(4))}, str(path))
    meta = json.loads((path / "metadata.json").read_text())
    meta["tensors"]["w"]["dtype"] = "float4_e2m1fn_x2"  # a dtype this release does not store
    raw = json.dumps(meta).encode()
    (path / "metadata.json").write_bytes(raw)
    marker = json.loads((path / "COMMITTED").read_text())
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    (path / "COMMITTED").write_text(json.dumps(marker))
    for call in (lambda: ldc.load_tensors_metadata(str(path)), lambda: ldc.load({}, str(path))):
        with pytest.raises(ldc.FormatError, match=r"tensors\['w'\]\.dtype .*unknown dtype.*newer release.*upgrade.*"
                                                  r"'float4_e2m1fn_x2'"):
            call()


def test_still_refused_dtypes_name_the_key(tmp_path):
    with pytest.raises(ldc.ShardingError, match=r"'w': dtype torch.complex32 is not supported"):
        ldc.save({"w": st("w", torch.zeros(2, dtype=torch.complex32))}, str(tmp_path / "ck"))
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2, dtype=torch.complex32)}, buf)
    (tmp_path / "f.pt").write_bytes(buf.getvalue())
    with pytest.raises(ldc.FormatError, match=r"'w'.*complex32"):
        ldc.load_plain_tensors(str(tmp_path / "f.pt"))
