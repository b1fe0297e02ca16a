"""Red team of the readers of DCP's two variants (``FileSystemWriter(_extensions=[ZStandard()])``: each item one
zstd frame; ``serialization_format=SAFETENSORS``: a safetensors file appended to each ``.distcp``), attacked as a
hostile checkpoint author would, through ``ldc.load`` (2 gloo ranks, every loader), ``load_common_state_dict``,
``ldc.validate`` and the CLI. What torch writes loads bit-exactly (empty tensors in a SAFETENSORS-format file
included, files of both variants in one directory); a forged item is a FormatError (or UnsafeContentError) naming
the file and the key, the same on every rank, within bounded memory; no code from the checkpoint runs."""

import io
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard  # the test extra installs it

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import lightning_distckpt as ldc  # noqa: E402
from dcp_variant_writers import save_variant, variant_writer  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from lightning_distckpt.core.errors import CheckpointingError, FormatError, UnsafeContentError  # noqa: E402
from trust.hostile import edit_dcp_metadata  # noqa: E402

STATE = {"w": torch.randn(16, 8, generator=torch.Generator().manual_seed(3)), "ids": torch.arange(50), "step": 4,
         "note": {"text": "hello", "n": [1, 2]}}


def _info(path, fqn):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return next(v for k, v in pickle.load(f).storage_data.items() if k.fqn == fqn)


def _set_item(path, fqn, **fields):
    def edit(meta):
        for k, v in meta.storage_data.items():
            if k.fqn == fqn:
                for name, value in fields.items():
                    setattr(v, name, value)
    edit_dcp_metadata(path, edit)


def _append_item(path, fqn, blob):
    """Append ``blob`` to ``fqn``'s data file and point its storage record at it."""
    data_file = os.path.join(path, _info(path, fqn).relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(blob)
    _set_item(path, fqn, offset=offset, length=len(blob))


def _frame(data):
    return zstandard.ZstdCompressor().compress(data)


def _raw_frame(window_log, payload=b"x" * 100):
    """A zstd frame by hand: no content size, a window of 2**window_log bytes, one raw block."""
    block_header = (len(payload) << 3) | 1  # last block, raw
    return b"\x28\xb5\x2f\xfd" + bytes([0, (window_log - 10) << 3]) + block_header.to_bytes(3, "little") + payload


def _template():
    return {"w": torch.zeros(16, 8), "ids": torch.zeros(50, dtype=torch.int64), "step": 0, "note": None}


# ------------------------------------------------------------------ SAFETENSORS format: what torch writes loads

def test_safetensors_format_with_several_empty_tensors_in_one_file_loads(tmp_path):
    """torch records every empty tensor of a SAFETENSORS-format file at the same (empty) byte range: that is no
    overlap of stored bytes; the checkpoint loads bit-exactly (it was refused as forged metadata)."""
    state = {"a": torch.zeros(0), "b": torch.zeros(0, 3), "w": torch.arange(6.0),
             "c": torch.ones(2, 0, dtype=torch.int32)}
    path = save_variant(state, str(tmp_path / "st"), "safetensors")
    plain = ldc.load_plain_tensors(path)
    assert plain.keys() == state.keys()
    assert all(plain[k].dtype == v.dtype and torch.equal(plain[k], v) for k, v in state.items())
    out = ldc.load({k: torch.full_like(v, 7) for k, v in state.items()}, path)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert ldc.validate(path).ok


def _edit_header(path, edit):
    """Rewrite the safetensors header appended to ``__0_0.distcp`` with ``edit(raw_json_text)``."""
    start = _info(path, "w").offset
    data_file = os.path.join(path, "__0_0.distcp")
    with open(data_file, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[start:start + 8], "little")
    text = edit(raw[start + 8:start + 8 + n].decode())
    text += " " * (-len(text) % 8)
    with open(data_file, "wb") as f:
        f.write(raw[:start] + len(text).to_bytes(8, "little") + text.encode() + raw[start + 8 + n:])


def _sharding_twice(text):
    """``DCP_SHARDING_INFO`` naming ``w`` twice: first at another offset, last at its own."""
    header = json.loads(text)
    info = header["__metadata__"]["DCP_SHARDING_INFO"]
    lie = '{"w": {"saved_offsets": [8, 0]}, '
    header["__metadata__"]["DCP_SHARDING_INFO"] = lie + info[1:]
    return json.dumps(header)


def test_sharding_info_naming_a_tensor_twice_is_refused(tmp_path):
    """``DCP_SHARDING_INFO`` naming a tensor twice (readers disagree on which one counts: the first or the last):
    refused naming the file and the key, as a duplicate in the safetensors header itself is."""
    path = save_variant(STATE, str(tmp_path / "st"), "safetensors")
    _edit_header(path, _sharding_twice)
    with pytest.raises(FormatError, match=r"__0_0\.distcp: DCP_SHARDING_INFO.*'w'"):
        ldc.load_plain_tensors(path)


def test_a_header_length_past_the_file_is_refused(tmp_path):
    """A SAFETENSORS-format file whose header length points past the file's end: refused naming file and key."""
    path = save_variant(STATE, str(tmp_path / "st"), "safetensors")
    start = _info(path, "w").offset
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.seek(start)
        f.write((1 << 40).to_bytes(8, "little"))
    with pytest.raises(FormatError, match=r"__0_0\.distcp: tensor '(w|ids)' chunk"):
        ldc.load_plain_tensors(path)


def test_a_default_format_chunk_beginning_like_a_safetensors_file_is_refused_naming_the_key(tmp_path):
    """A default-format (torch.save) file whose one tensor chunk's first bytes were overwritten to begin a
    safetensors header: refused naming the file and the tensor (it named the file alone, as a safetensors
    header: no key), by ``load_plain_tensors``, ``ldc.validate`` and the CLI's ``inspect``."""
    path = str(tmp_path / "plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(12.0), "step": 3}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.seek(_info(path, "w").offset)
        f.write((20).to_bytes(8, "little") + b'{"')
    message = r"__0_0\.distcp: tensor 'w' chunk at \[0\]: .*safetensors"
    for read in (ldc.load_plain_tensors, ldc.validate):
        with pytest.raises(FormatError, match=message):
            read(path)
    cli = subprocess.run([sys.executable, "-m", "lightning_distckpt", "inspect", path], capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode != 0 and "tensor 'w' chunk at [0]" in cli.stderr + cli.stdout, cli.stderr + cli.stdout


# ------------------------------------------------------------------ zstd frames torch never writes

def test_a_huge_zstd_window_is_refused_with_bounded_memory(tmp_path):
    """A frame asking for a 2 GiB window (and no content size) in place of a chunk: a FormatError naming the file
    and key, the process's peak RSS growing by far less than the window (measured in a fresh process)."""
    path = save_variant(STATE, str(tmp_path / "z"), "zstd")
    _append_item(path, "ids", _raw_frame(31))
    script = textwrap.dedent(f"""
        import resource, torch, lightning_distckpt as ldc
        ldc.load_plain_tensors  # imports done before the baseline
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            ldc.load({{"ids": torch.zeros(50, dtype=torch.int64)}}, {path!r}, strict=False)
            print("LOADED")
        except Exception as e:
            print(type(e).__name__, e)
        print("GREW_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "FormatError" in out.stdout and "tensor 'ids' chunk at [0]" in out.stdout, out.stdout + out.stderr
    assert "__0_0.distcp" in out.stdout
    grew = int(out.stdout.split("GREW_KIB")[1])
    assert grew < 256 << 10, grew  # KiB: under 256 MiB, not 2 GiB


OBJECT_FRAMES = {
    "skippable frame alone": b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd",
    "skippable frame, then the frame": b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd" + b"FRAME",
    "two frames": b"FRAME" + b"FRAME",
    "a frame needing a dictionary": b"DICT",
    "a 256 MiB window": b"WINDOW",
}


def _object_blob(name, original):
    blob = OBJECT_FRAMES[name]
    if blob == b"DICT":
        d = zstandard.ZstdCompressionDict(original * 3)
        return zstandard.ZstdCompressor(dict_data=d).compress(original)
    if blob == b"WINDOW":
        return _raw_frame(28, original)
    return blob.replace(b"FRAME", _frame(original))


def _object_bytes(path, fqn):
    info = _info(path, fqn)
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return zstandard.ZstdDecompressor().decompressobj().decompress(f.read(info.length))


@pytest.mark.parametrize("name", sorted(OBJECT_FRAMES))
def test_odd_zstd_frames_in_an_object_are_refused_everywhere(tmp_path, name):
    """An object item holding zstd frames torch's writer never makes (a skippable frame, two frames, a frame
    needing a dictionary, a window past zstd's default bound): ``load_common_state_dict`` refuses it naming the
    file and the object, ``ldc.validate`` reports it, the CLI's ``validate`` fails naming it."""
    path = save_variant(STATE, str(tmp_path / "z"), "zstd")
    _append_item(path, "step", _object_blob(name, _object_bytes(path, "step")))
    with pytest.raises(FormatError, match=r"__0_0\.distcp: object 'step'"):
        ldc.load_common_state_dict(path)
    report = ldc.validate(path)
    assert not report.ok and any("object 'step'" in p or "common state" in p for p in report.problems), \
        report.problems
    cli = subprocess.run([sys.executable, "-m", "lightning_distckpt", "validate", path], capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode != 0 and "'step'" in cli.stdout + cli.stderr, cli.stdout + cli.stderr


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def test_a_compressed_object_with_code_runs_no_code(tmp_path):
    """A compressed object item whose pickle calls ``os.makedirs``: refused as unsafe, naming the object;
    the directory it names is not made."""
    path = save_variant(STATE, str(tmp_path / "z"), "zstd")
    marker = str(tmp_path / "code_ran")
    buf = io.BytesIO()
    torch.save(_RunsCode(marker), buf)
    _append_item(path, "step", _frame(buf.getvalue()))
    with pytest.raises(UnsafeContentError, match=r"object 'step'.*(os|posix)"):
        ldc.load_common_state_dict(path)
    with pytest.raises(UnsafeContentError):
        ldc.load(_template(), path)
    assert not os.path.exists(marker)


def test_a_compressed_object_bomb_stays_within_the_pickle_cap(tmp_path, monkeypatch):
    """A 256 MiB zstd frame of zeros (no content size) as an object: refused under the pickle cap
    (``LIGHTNING_DISTCKPT_MAX_COMMON_BYTES``, set to 4 MiB here) naming the object, the process's peak RSS
    growing by far less than the frame's content."""
    path = save_variant(STATE, str(tmp_path / "z"), "zstd")
    zeros = io.BytesIO()
    writer = zstandard.ZstdCompressor().stream_writer(zeros, size=-1, closefd=False)
    for _ in range(16):
        writer.write(bytes(16 << 20))
    writer.flush(zstandard.FLUSH_FRAME)
    _append_item(path, "step", zeros.getvalue())
    monkeypatch.setenv("LIGHTNING_DISTCKPT_MAX_COMMON_BYTES", str(4 << 20))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(FormatError, match=r"__0_0\.distcp: object 'step'.*more than the 4194304 bytes"):
        ldc.load_common_state_dict(path)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grew < 128 << 10, grew  # KiB


@pytest.mark.parametrize("stored", ["float64", "shape 8x16", "a dict"])
def test_a_compressed_chunk_holding_another_tensor_is_refused(tmp_path, stored):
    """A compressed chunk whose archive (well formed, its frame valid) holds another dtype, another shape or no
    tensor at all: refused naming the file and key, never converted or reshaped into the destination."""
    path = save_variant(STATE, str(tmp_path / "z"), "zstd")
    value = {"float64": STATE["w"].double(), "shape 8x16": STATE["w"].reshape(8, 16), "a dict": {"w": 1}}[stored]
    buf = io.BytesIO()
    torch.save(value, buf)
    _append_item(path, "w", _frame(buf.getvalue()))
    with pytest.raises(FormatError, match=r"__0_0\.distcp: tensor 'w' chunk at \[0, 0\].*(float64|8, 16|dict)"):
        ldc.load(_template(), path)


def test_one_compressed_item_named_by_two_chunks_is_refused(tmp_path):
    """Two chunks of a tensor pointing at the same compressed item (one stored chunk loaded as both): refused."""
    state = {"m": torch.arange(32.0).reshape(4, 8)}
    path = save_variant(state, str(tmp_path / "z"), "zstd")

    def split(meta):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        info = meta.state_dict_metadata["m"]
        info.chunks[:] = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 8])),
                          ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 8]))]
        record = next(iter(meta.storage_data.values()))
        meta.storage_data = {MetadataIndex("m", torch.Size([0, 0])): record,
                             MetadataIndex("m", torch.Size([2, 0])): record}
    edit_dcp_metadata(path, split)
    with pytest.raises(FormatError, match=r"__0_0\.distcp: tensor 'm' chunk at \[(0|2), 0\].*overlap"):
        ldc.load_plain_tensors(path)


# ------------------------------------------------------------------ 2 ranks, every loader, both variants mixed

def _full():
    g = torch.Generator().manual_seed(96)
    return {"rows": torch.randn(9, 6, generator=g), "cols": torch.randn(4, 7, generator=g).to(torch.bfloat16)}


def _save_2(rank, world, paths):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    state = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
             "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]), "step": 3}
    for kind, path in paths.items():
        dcp.save(state, storage_writer=variant_writer(path, kind))
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A 2-rank save whose rank-0 file is zstd-compressed and whose rank-1 file is in the SAFETENSORS format
    (the two saves' files and records joined: each file as its writer made it)."""
    root = tmp_path_factory.mktemp("dcp_mixed")
    paths = {k: str(root / k) for k in ("zstd", "safetensors")}
    run_distributed(_save_2, 2, paths)
    out = str(root / "mixed")
    shutil.copytree(paths["zstd"], out)
    shutil.copy(os.path.join(paths["safetensors"], "__1_0.distcp"), os.path.join(out, "__1_0.distcp"))
    with open(os.path.join(paths["safetensors"], ".metadata"), "rb") as f:
        theirs = pickle.load(f).storage_data

    def join(meta):
        for k, v in meta.storage_data.items():
            if v.relative_path == "__1_0.distcp":
                meta.storage_data[k] = theirs[k]
    edit_dcp_metadata(out, join)
    return out


READ_AXES = {"rows": 1, "cols": 0}  # not the save's split


def _read(rank, world, path, loader):
    full, template = _full(), {"step": 0}
    for k, axis in READ_AXES.items():
        pieces = full[k].tensor_split(world, axis)
        offset = [0] * full[k].dim()
        offset[axis] = sum(p.shape[axis] for p in pieces[:rank])
        template[k] = ldc.ShardedTensor.from_offsets(k, torch.zeros_like(pieces[rank]), full[k].shape, offset,
                                                     replica_id=0)
    try:
        out = ldc.load(template, path, loader=loader)
    except CheckpointingError as e:
        return "error", type(e).__name__, str(e)
    return "ok", all(torch.equal(out[k], full[k].tensor_split(world, a)[rank]) for k, a in READ_AXES.items()), \
        out["step"]


LOADERS = ["every_rank", "parallel", "two_stage"]


@pytest.mark.parametrize("loader", LOADERS)
def test_files_of_both_variants_load_resharded_on_2_ranks(mixed, loader):
    """A directory holding one zstd-compressed and one SAFETENSORS-format file loads bit-exactly on 2 gloo ranks
    under the other split, with each loader, and in one process through ``load_plain_tensors``."""
    assert run_distributed(_read, 2, mixed, loader, timeout_s=60) == [("ok", True, 3)] * 2
    plain = ldc.load_plain_tensors(mixed)
    assert all(torch.equal(plain[k], v) for k, v in _full().items())


def _forge_rank1_header(path):
    """Rank 1's safetensors header claiming 'cols' as I16 (same bytes): a lie .metadata contradicts."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        start = next(v.offset for v in pickle.load(f).storage_data.values() if v.relative_path == "__1_0.distcp")
    data_file = os.path.join(path, "__1_0.distcp")
    with open(data_file, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[start:start + 8], "little")
    text = raw[start + 8:start + 8 + n].replace(b'"BF16"', b'"I16" ')
    with open(data_file, "wb") as f:
        f.write(raw[:start + 8] + text + raw[start + 8 + n:])


def _bomb_rank0_chunk(path):
    """Rank 0's compressed 'rows' chunk replaced by a 64 MiB frame of zeros (its size undeclared)."""
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor().stream_writer(out, size=-1, closefd=False)
    for _ in range(4):
        writer.write(bytes(16 << 20))
    writer.flush(zstandard.FLUSH_FRAME)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        key = next(k for k, v in pickle.load(f).storage_data.items()
                   if k.fqn == "rows" and v.relative_path == "__0_0.distcp")
    data_file = os.path.join(path, "__0_0.distcp")
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(out.getvalue())

    def point(meta):
        meta.storage_data[key].offset, meta.storage_data[key].length = offset, len(out.getvalue())
    edit_dcp_metadata(path, point)


FORGERIES = {"rank 1's header lies": (_forge_rank1_header, r"__1_0\.distcp: tensor 'cols' chunk at \[0, 4\]"),
             "rank 0's chunk a bomb": (_bomb_rank0_chunk, r"__0_0\.distcp: tensor 'rows' chunk at \[0, 0\]")}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_file_fails_both_ranks_alike(mixed, tmp_path, forgery, loader):
    """A forged file in the mixed directory (a lying safetensors header; a decompression bomb) makes both gloo
    ranks raise the same FormatError naming the file and the key, with each loader, within the group's timeout."""
    path = str(tmp_path / "forged")
    shutil.copytree(mixed, path)
    forge, message = FORGERIES[forgery]
    forge(path)
    results = run_distributed(_read, 2, path, loader, timeout_s=60)
    assert results[0] == results[1], results
    status, kind, text = results[0]
    assert status == "error" and kind == "FormatError", results
    assert __import__("re").search(message, text), text


# ------------------------------------------------------------------ Lightning read-through (ckpt_path)

LIGHTNING_SCRIPT = r'''
import datetime, json, os, shutil, sys, warnings, torch
import lightning.pytorch as pl
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import fully_shard
from lightning_distckpt.lightning import DistCheckpointModelParallelStrategy

T = datetime.timedelta(seconds=60)  # a rank's failure ends the other's wait


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 12), torch.nn.Linear(12, 4)

    def configure_model(self):
        for layer in (self.l1, self.l2, self):
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        return self.l2(torch.relu(self.l1(batch))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)),
                                           batch_size=4)


def fit(strategy, steps, resume=None):
    torch.manual_seed(5)  # another init than the saved run's: a resume that loaded nothing shows
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, strategy=strategy)
    try:
        trainer.fit(model, ckpt_path=resume)
    except Exception as e:
        torch.distributed.barrier()
        return trainer, None, f"{type(e).__name__}: {e}"
    return trainer, {k: v.full_tensor() for k, v in model.state_dict().items()}, trainer.global_step


if __name__ == "__main__":
    out, rank = sys.argv[1], int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    trainer, full, _ = fit(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=T), 2)
    trainer.save_checkpoint(out + "/stock")  # DCP files and meta.pt
    if rank == 0:  # the same checkpoint, its items zstd-compressed (meta.pt as Lightning wrote it)
        dcp_to_torch_save(out + "/stock", out + "/flat.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(torch.load(out + "/flat.pt", weights_only=False),
                     storage_writer=dcp.FileSystemWriter(out + "/zstd", _extensions=[ZStandard()]), no_dist=True)
        shutil.copy(out + "/stock/meta.pt", out + "/zstd/meta.pt")
        open(out + "/ready", "w").close()
    torch.distributed.barrier()
    res = {}
    for name in ("zstd", "forged"):
        if name == "forged":
            if rank == 0:
                shutil.copytree(out + "/zstd", out + "/forged")
                with open(out + "/forged/__0_0.distcp", "r+b") as f:  # the first item's frame header damaged
                    f.write(b"\0" * 8)
            torch.distributed.barrier()
        _, got, end = fit(DistCheckpointModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                              timeout=T), 2, resume=out + "/" + name)
        res[name] = {"end": end, "same": got is not None and all(torch.equal(got[k], v) for k, v in full.items())}
    with open(f"{out}/result{rank}.json", "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of a group a failed run may have left broken
'''


def test_a_compressed_lightning_checkpoint_resumes_and_a_forged_one_fails_both_ranks(tmp_path):
    """Lightning's ModelParallelStrategy checkpoint re-saved with zstd items (meta.pt beside it), given as
    ``ckpt_path`` to a Trainer with DistCheckpointModelParallelStrategy on 2 ranks: the weights are the saved
    ones, bit-exactly, at the saved step. The same directory with its first frame damaged: both ranks' fits end
    in the same FormatError naming the file (no hang: the group's 60 s timeout)."""
    from script_ranks import run_ranks, script_env

    script = tmp_path / "resume.py"
    script.write_text(LIGHTNING_SCRIPT)
    code, output = run_ranks(str(script), [str(tmp_path)], script_env(), 2, timeout=600)
    assert code == 0 and (tmp_path / "result1.json").is_file(), output[-8000:]
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        assert res["zstd"] == {"end": 2, "same": True}, res
        assert res["forged"]["end"].startswith("FormatError") and "__0_0.distcp" in res["forged"]["end"], res
        assert "zstd" in res["forged"]["end"], res
    assert results[0]["forged"] == results[1]["forged"]
