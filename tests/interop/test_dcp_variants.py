"""PyTorch DCP checkpoints in the variants torch 2.13 writes besides its default: zstd-compressed items
(``FileSystemWriter(_extensions=[ZStandard()])``) and ``serialization_format=SAFETENSORS`` (a safetensors
file appended to each ``.distcp``); and ``HuggingFaceStorageWriter``'s directory. Real saves (one process,
and DTensors saved by 2 gloo ranks) load bit-exactly through ``ldc.load``, whole and under another split,
as torch's own ``dcp.load`` reads them (torch's ``FileSystemReader`` cannot read the SAFETENSORS format:
those are compared with the saved values). Forged variants (decompression bombs, cut or flipped frames,
unknown transforms, safetensors headers that contradict ``.metadata``) are FormatErrors naming the file
and the key, never values."""

import io
import json
import os
import pickle
import sys
import tracemalloc
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard  # the test extra installs it (not a runtime dependency)

import lightning_distckpt as ldc
from dcp_variant_writers import save_variant, variant_writer
from dist_utils import run_distributed
from lightning_distckpt.core.errors import CheckpointingError, FormatError
from test_dcp_conformance_depth import _flat_tensors, _same, check_variety_loads, plain_state


def _contiguous(value):
    """``value`` with every tensor contiguous and of a dtype safetensors stores (torch's SAFETENSORS
    writer refuses a view and complex128)."""
    if isinstance(value, dict):
        return {k: _contiguous(v) for k, v in value.items()
                if not (isinstance(v, torch.Tensor) and v.dtype == torch.complex128)}
    if isinstance(value, list):
        return [_contiguous(v) for v in value]
    return value.contiguous() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("kind", ["zstd", "safetensors"])
def test_every_dtype_shape_and_object_loads_bit_exact(tmp_path, kind):
    """Nested containers, views, 0-d and empty tensors, every dtype and objects, saved in the variant,
    load bit-exactly (``load``, ``load_plain_tensors``, ``load_common_state_dict``); for zstd the values
    are torch's own ``dcp.load``'s too."""
    path = str(tmp_path / kind)
    save_variant(plain_state() if kind == "zstd" else _contiguous(plain_state()), path, kind)
    want = {k: v for k, v in _flat_tensors().items() if kind == "zstd" or v.dtype != torch.complex128}
    out = check_variety_loads(path, want)
    if kind == "zstd":
        theirs = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        assert [k for k, v in theirs.items() if not _same(out[k], v)] == []


# ------------------------------------------------------------------ DTensors saved by 2 ranks

def _full():
    g = torch.Generator().manual_seed(92)
    return {"rows": torch.randn(9, 6, generator=g),  # Shard(0): 5 + 4 rows
            "cols": torch.randn(4, 7, generator=g).to(torch.bfloat16),  # Shard(1): 4 + 3 columns
            "rep": torch.arange(10, dtype=torch.int64)}  # Replicate: stored once


def _save_2(rank, world, paths):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    state = {"model": {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                       "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                       "rep": distribute_tensor(full["rep"], mesh, [Replicate()])}, "step": 3}
    for kind, path in paths.items():
        dcp.save(state, storage_writer=variant_writer(path, kind))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def saved_by_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp_variants_2")
    paths = {k: str(root / k) for k in ("zstd", "safetensors")}
    run_distributed(_save_2, 2, paths)
    return paths


READ_AXES = {"rows": 1, "cols": 0, "rep": 0}  # not the save's split


def _read(rank, world, path):
    full, template = _full(), {"step": 0}
    for k, axis in READ_AXES.items():
        pieces = full[k].tensor_split(world, axis)
        offset = [0] * full[k].dim()
        offset[axis] = sum(p.shape[axis] for p in pieces[:rank])
        template[k] = ldc.ShardedTensor.from_offsets(f"model.{k}", torch.zeros_like(pieces[rank]), full[k].shape,
                                                     offset, replica_id=0)
    out = ldc.load(template, path)
    return {k: _same(out[k], full[k].tensor_split(world, a)[rank]) for k, a in READ_AXES.items()}, out["step"]


@pytest.mark.parametrize("kind", ["zstd", "safetensors"])
def test_dtensors_saved_by_2_ranks_load_whole_and_resharded(saved_by_2, kind):
    """A 2-rank DTensor save (uneven Shard(0), Shard(1), Replicate) in the variant loads whole in one
    process and on 2 gloo ranks split along the other axis, bit-exactly."""
    equal, step = _read(0, 1, saved_by_2[kind])
    assert all(equal.values()) and step == 3, equal
    for equal, step in run_distributed(_read, 2, saved_by_2[kind]):
        assert all(equal.values()) and step == 3, equal


def test_zstd_dtensors_load_as_torch_loads_them(saved_by_2):
    """What ``ldc.load_plain_tensors`` reads of the 2-rank zstd save is what torch's own ``dcp.load``
    (FileSystemReader, one process) reads."""
    ours = ldc.load_plain_tensors(saved_by_2["zstd"])
    theirs = {f"model.{k}": torch.zeros_like(v) for k, v in _full().items()}
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(saved_by_2["zstd"]), no_dist=True)
    assert ours.keys() == theirs.keys() and all(_same(ours[k], v) for k, v in theirs.items())


def test_hugging_face_storage_writer_output_loads(tmp_path):
    """``HuggingFaceStorageWriter``'s directory (sharded safetensors + index json) is a Hugging Face
    directory to ``ldc.load``: the values torch's ``HuggingFaceStorageReader`` reads."""
    state = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.randn(5).to(torch.bfloat16)}
    path = str(tmp_path / "hf")
    _quiet_save(state, dcp.HuggingFaceStorageWriter(path, fqn_to_index_mapping={"a": 1, "b": 2}))
    theirs = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(theirs, storage_reader=dcp.HuggingFaceStorageReader(path), no_dist=True)
    ours = ldc.load({k: torch.zeros_like(v) for k, v in state.items()}, path)
    assert all(_same(ours[k], theirs[k]) and _same(ours[k], v) for k, v in state.items())


def _save_hf_distributed(rank, world, root):
    """Each rank writes its shards of two DTensors through ``HuggingFaceStorageWriter(save_distributed=True)``,
    once without and once with consolidation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)]),
             "b": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
    for name, consolidate in (("shards", False), ("consolidated", True)):
        writer = dcp.HuggingFaceStorageWriter(os.path.join(root, name), save_distributed=True,
                                              enable_consolidation=consolidate)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer)


def test_hugging_face_storage_writer_distributed_shards(tmp_path):
    """``HuggingFaceStorageWriter(save_distributed=True)`` on 2 ranks: with ``enable_consolidation=True`` its
    model files load as a Hugging Face directory; without, its directory holds only each rank's pieces of the
    tensors (``shard-...safetensors``), refused with what to do (consolidate), never read as whole tensors."""
    run_distributed(_save_hf_distributed, 2, str(tmp_path))
    out = ldc.load_plain_tensors(str(tmp_path / "consolidated"))
    assert torch.equal(out["w"], torch.arange(32.0).reshape(8, 4)) and torch.equal(out["b"], torch.arange(4.0))
    with pytest.raises(CheckpointingError, match=r"unconsolidated shards of torch's HuggingFaceStorageWriter"
                                                 r"\(save_distributed=True\).*enable_consolidation=True"):
        ldc.load_plain_tensors(str(tmp_path / "shards"))


def _quiet_save(state, writer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)


# ------------------------------------------------------------------ forged zstd items

STATE = {"w": torch.randn(64, 32, generator=torch.Generator().manual_seed(7)), "ids": torch.arange(100), "step": 4}


def _edit_metadata(path, fqn, **fields):
    """Rewrite ``.metadata`` (our own test's file) with ``fields`` set on ``fqn``'s storage record."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    for name, value in fields.items():
        setattr(info, name, value)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    return info


def _append_item(path, fqn, blob):
    """Append ``blob`` to ``fqn``'s data file and point its storage record at it."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        info = next(v for k, v in pickle.load(f).storage_data.items() if k.fqn == fqn)
    data_file = os.path.join(path, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(blob)
    _edit_metadata(path, fqn, offset=offset, length=len(blob))


def _zeros_frame(nbytes, declared):
    """A zstd frame of ``nbytes`` zero bytes, its content size recorded in its header or not."""
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor().stream_writer(out, size=nbytes if declared else -1, closefd=False)
    block = bytes(16 << 20)
    for start in range(0, nbytes, len(block)):
        writer.write(block[:min(len(block), nbytes - start)])
    writer.flush(zstandard.FLUSH_FRAME)
    return out.getvalue()


def _saved(tmp_path, kind="zstd"):
    path = str(tmp_path / kind)
    save_variant(STATE, path, kind)
    return path


def _load(path):
    return ldc.load({"w": torch.zeros(64, 32), "ids": torch.zeros(100, dtype=torch.int64), "step": 0}, path)


@pytest.mark.parametrize("declared", [True, False])
def test_a_decompression_bomb_is_refused_within_the_items_bound(tmp_path, declared):
    """A 256 MiB frame of zeros (a few kB) in place of an 800-byte chunk: with its size in the frame
    header, refused before decompressing; without, refused having produced at most the chunk's bound
    plus the slack (memory peak measured), naming the file and the key."""
    path = _saved(tmp_path)
    _append_item(path, "ids", _zeros_frame(256 << 20, declared))
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r"__0_0\.distcp: tensor 'ids' chunk at \[0\].*more than the \d+ "):
            _load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak


def test_a_cut_frame_is_refused(tmp_path):
    """A compressed chunk whose record stops short of its frame's end: refused, naming the key."""
    path = _saved(tmp_path)
    info = _edit_metadata(path, "w")
    _edit_metadata(path, "w", length=info.length - 6)
    with pytest.raises(FormatError, match=r"tensor 'w' chunk at \[0, 0\].*(ends inside its zstd frame|damaged)"):
        _load(path)


def test_bytes_after_the_frame_are_refused(tmp_path):
    """An item holding its frame and more bytes (DCP writes exactly one frame): refused."""
    path = _saved(tmp_path)
    with open(os.path.join(path, "__0_0.distcp"), "rb") as f:
        info = _edit_metadata(path, "ids")
        f.seek(info.offset)
        frame = f.read(info.length)
    _append_item(path, "ids", frame + b"\x28\xb5\x2f\xfd trailing")
    with pytest.raises(FormatError, match=r"tensor 'ids' chunk at \[0\].*(bytes follow|damaged zstd)"):
        _load(path)


def test_a_flipped_compressed_byte_never_loads_other_values(tmp_path):
    """Each byte of the compressed chunk flipped in turn: the load either refuses it (zstd's frame or
    the archive's CRC-32) or reads exactly the saved values; most flips are refused."""
    path = _saved(tmp_path)
    data_file = os.path.join(path, "__0_0.distcp")
    info = _edit_metadata(path, "w")
    with open(data_file, "rb") as f:
        original = f.read()
    refused = same = 0
    for pos in range(info.offset, info.offset + info.length, 5):
        damaged = bytearray(original)
        damaged[pos] ^= 0x41
        with open(data_file, "wb") as f:
            f.write(damaged)
        try:
            out = _load(path)
        except FormatError:
            refused += 1
        else:
            assert torch.equal(out["w"], STATE["w"]), pos
            same += 1
    assert refused > 10 * same, (refused, same)


@pytest.mark.parametrize("descriptors", [["stream.lz4/1"], ["stream.zstd/2"], ["stream.zstd/1", "stream.zstd/1"],
                                         "stream.zstd/1"])
def test_transforms_other_than_zstd_are_refused_naming_the_key(tmp_path, descriptors):
    """A transform name we do not know, another zstd version, two layers or a malformed list: refused
    when the checkpoint is opened, naming the key (no extension code is looked up)."""
    path = _saved(tmp_path)
    _edit_metadata(path, "w", transform_descriptors=descriptors)
    with pytest.raises(FormatError, match=r"'w' chunk at \[0, 0\].*(stored through transforms|malformed transform)"):
        ldc.load_plain_tensors(path)


def test_without_zstandard_installed_the_error_says_what_to_install(tmp_path, monkeypatch):
    """With the ``zstandard`` package not importable, a compressed checkpoint's load says to install it."""
    path = _saved(tmp_path)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(CheckpointingError, match=r"tensor '(w|ids)'.*pip install zstandard"):
        _load(path)


# ------------------------------------------------------------------ forged SAFETENSORS-format headers

def _edit_header(path, edit):
    """Rewrite the safetensors header appended to ``__0_0.distcp`` with ``edit(header)`` (data unchanged)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        start = next(v for k, v in pickle.load(f).storage_data.items() if k.fqn == "w").offset
    data_file = os.path.join(path, "__0_0.distcp")
    with open(data_file, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[start:start + 8], "little")
    header = json.loads(raw[start + 8:start + 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(data_file, "wb") as f:
        f.write(raw[:start] + len(text).to_bytes(8, "little") + text + raw[start + 8 + n:])


def _sharding(header, fqn, offsets):
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    info[fqn]["saved_offsets"] = offsets
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)


EDITS = {
    "dtype": (lambda h: h["w"].update(dtype="I32"), r"'w' chunk at \[0, 0\].*stores it as torch.int32"),
    "shape": (lambda h: h["w"].update(shape=[32, 64]), r"'w' chunk at \[0, 0\].*stores it as torch.float32 \[32, 64\]"),
    "saved_offsets": (lambda h: _sharding(h, "w", [1, 0]), r"'w' chunk at \[0, 0\].*offsets \[1, 0\]"),
    "past the end": (lambda h: h["ids"].update(data_offsets=[o + 10**6 for o in h["ids"]["data_offsets"]]),
                     r"'ids'.*past the end"),
    "extra entry": (lambda h: h.update(extra=dict(dtype="U8", shape=[0], data_offsets=[0, 0])),
                    r"holds \['extra'\], which \.metadata does not place"),
    "no sharding info": (lambda h: h["__metadata__"].pop("DCP_SHARDING_INFO"), r"holds no DCP_SHARDING_INFO"),
    "entry missing": (lambda h: h.update(ids2=h.pop("ids")), r"'ids' chunk at \[0\].*has no entry 'ids'"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_safetensors_header_contradicting_the_metadata_is_refused(tmp_path, edit):
    """The safetensors header of a SAFETENSORS-format file lying about a chunk's dtype, shape, saved
    offsets or bytes, naming a tensor .metadata does not, or missing one: refused naming the file and key."""
    path = _saved(tmp_path, "safetensors")
    change, message = EDITS[edit]
    _edit_header(path, change)
    with pytest.raises(FormatError, match=r"__0_0\.distcp.*" + message):
        _load(path)


def test_safetensors_format_metadata_lying_about_a_chunks_bytes_is_refused(tmp_path):
    """``.metadata`` giving a SAFETENSORS-format chunk another byte count than the header's: refused."""
    path = _saved(tmp_path, "safetensors")
    _edit_metadata(path, "w", length=64 * 32 * 4 + 4)
    with pytest.raises(FormatError, match=r"'w' chunk at \[0, 0\].*\(8192 bytes\).*\(8196 bytes\)"):
        _load(path)
