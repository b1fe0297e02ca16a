"""PyTorch DCP conformance at depth, DCP's own behaviour the judge.

Written by torch's ``dcp.save`` / ``dcp.async_save`` with the variety torch offers (nested dicts and
lists, DTensors: Shard, Replicate, uneven shards, a 2-D mesh on 4 gloo processes; plain tensors of
every dtype we store, 0-d, empty, non-contiguous and offset views; objects; replicated tensors
deduplicated across ranks; ``DefaultSavePlanner(flatten_state_dict=True, flatten_sharded_tensors=True)``)
and read by ``ldc.load`` on 1 and 2 processes, bit-exact. Written by ``ldc.export.to_dcp`` and read by
torch: ``dcp.load`` / ``state_dict_loader.load`` on 1, 2 and 3 processes, ``_load_state_dict_from_keys``
and ``format_utils.dcp_to_torch_save``. What we refuse (DCP's stream-transform extensions, its
SAFETENSORS serialization format) is refused with a FormatError naming the key and why.
"""

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import FormatError

GEN = torch.Generator().manual_seed(60)
BASE = torch.randn(6, 10, generator=GEN)

# each dtype DCP saves that we store (complex32, float8_e8m0fnu are refused: tests/unit/test_dtypes_extended.py)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
          torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def _dtype_tensor(dtype):
    raw = torch.randint(0, 120, (3, 4), generator=torch.Generator().manual_seed(len(str(dtype))), dtype=torch.uint8)
    if dtype.is_floating_point and dtype.itemsize == 1:
        return raw.view(dtype)  # float8: every bit pattern but NaNs of odd payload, kept bit-exact
    return raw.to(dtype)


def plain_state():
    """A single-process DCP state: nested containers, views, 0-d, empty, every dtype, objects."""
    return {"nested": {"list": [BASE[0], {"deep": torch.arange(4)}], "zero_d": torch.tensor(3.5),
                       "empty": torch.empty(0, 5), "empty1": torch.empty(0, dtype=torch.int32)},
            "view": BASE[1:4, 2:7], "offset": BASE.view(-1)[7:19], "t": BASE.t(),
            "dtypes": {str(d).removeprefix("torch."): _dtype_tensor(d) for d in DTYPES},
            "step": 5, "obj": {"a": [1, 2.5, "x"]}, "none": None, "s": "str", "raw": b"\x00\x01"}


def _flat_tensors():
    """plain_state()'s tensors by DCP's fully qualified name, contiguous."""
    out = {"nested.list.0": BASE[0], "nested.list.1.deep": torch.arange(4), "nested.zero_d": torch.tensor(3.5),
           "nested.empty": torch.empty(0, 5), "nested.empty1": torch.empty(0, dtype=torch.int32),
           "view": BASE[1:4, 2:7], "offset": BASE.view(-1)[7:19], "t": BASE.t()}
    out.update({f"dtypes.{str(d).removeprefix('torch.')}": _dtype_tensor(d) for d in DTYPES})
    return {k: v.contiguous() for k, v in out.items()}


OBJECTS = {"step": 5, "obj.a": [1, 2.5, "x"], "none": None, "s": "str", "raw": b"\x00\x01"}


def _same(a, b):
    """Bit-exact: the same dtype, shape and bytes."""
    a, b = a.contiguous(), b.contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                      b.view(-1).view(torch.uint8) if b.numel() else b)


def check_variety_loads(path, want):
    """``ldc.load`` into a template of ``want`` (and OBJECTS), ``load_plain_tensors`` and
    ``load_common_state_dict`` of ``path`` give ``want`` and OBJECTS bit-exact; returns the load's state."""
    template = {k: torch.zeros_like(v) for k, v in want.items()}
    template.update({k: 0 for k in OBJECTS})
    out = ldc.load(template, path)
    assert [k for k, v in want.items() if not _same(out[k], v)] == []
    assert {k: out[k] for k in OBJECTS} == OBJECTS
    plain = ldc.load_plain_tensors(path)
    assert plain.keys() == want.keys() and all(_same(plain[k], v) for k, v in want.items())
    assert ldc.load_common_state_dict(path) == OBJECTS
    return out


def test_plain_variety_written_by_dcp_loads_bit_exact(tmp_path):
    path = str(tmp_path / "plain")
    dcp.save(plain_state(), checkpoint_id=path, no_dist=True)
    check_variety_loads(path, _flat_tensors())


# ---------------------------------------------------------------- DTensors written by 4 ranks, read by 1 and 2

def full_dtensors():
    g = torch.Generator().manual_seed(61)
    return {"w2d": torch.randn(10, 7, generator=g),  # (Shard(0), Shard(1)) on a 2x2 mesh: uneven both ways
            "sr": torch.randn(9, 4, generator=g).to(torch.bfloat16),  # (Shard(0), Replicate()): 9 rows over 2
            "rep": torch.arange(6, dtype=torch.int64),  # Replicate everywhere: deduplicated to one copy
            "tiny": torch.randn(3, 2, generator=g),  # Shard(0) over 4 ranks: the last rank holds no rows
            "zero_d": torch.tensor(2.25)}


def _save_4(rank, world, paths):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    flat = init_device_mesh("cpu", (4,))
    full = full_dtensors()
    model = {"w2d": distribute_tensor(full["w2d"], mesh, [Shard(0), Shard(1)]),
             "sr": distribute_tensor(full["sr"], mesh, [Shard(0), Replicate()]),
             "rep": distribute_tensor(full["rep"], mesh, [Replicate(), Replicate()]),
             "tiny": distribute_tensor(full["tiny"], flat, [Shard(0)]),
             "zero_d": full["zero_d"]}  # a plain tensor on every rank: DCP keeps one (dedup_save_plans)
    state = {"model": model, "extra": {"list": [torch.full((2,), float(7))], "step": 11}}
    dcp.save(state, checkpoint_id=paths["sync"])
    planner = DefaultSavePlanner(flatten_state_dict=True, flatten_sharded_tensors=True, dedup_save_to_lowest_rank=True)
    dcp.save(state, checkpoint_id=paths["planner"], planner=planner)
    dcp.async_save(state, checkpoint_id=paths["async"]).result()
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def dtensor_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp4")
    paths = {k: str(root / k) for k in ("sync", "planner", "async")}
    run_distributed(_save_4, 4, paths)
    return paths


# how each rank of the reading group asks for each tensor: split along this axis, or whole (None)
READ_AXES = {"w2d": 1, "sr": 0, "rep": None, "tiny": 0, "zero_d": None}


def _read(rank, world, path):
    full = full_dtensors()
    template = {}
    for k, axis in READ_AXES.items():
        if axis is None:
            template[k] = ldc.ShardedTensor.from_rank_offsets(f"model.{k}", torch.zeros_like(full[k]), replica_id=rank)
        else:
            pieces = full[k].tensor_split(world, axis)  # uneven: 7 columns as 4 + 3, 9 rows as 5 + 4
            offset = [0] * full[k].dim()
            offset[axis] = sum(p.shape[axis] for p in pieces[:rank])
            template[k] = ldc.ShardedTensor.from_offsets(f"model.{k}", torch.zeros_like(pieces[rank]),
                                                         full[k].shape, offset, replica_id=0)
    template["list0"] = ldc.ShardedTensor.from_rank_offsets("extra.list.0", torch.zeros(2), replica_id=rank)
    template["extra.step"] = 0
    out = ldc.load(template, path)
    equal = {k: _same(out[k], full[k] if a is None else full[k].tensor_split(world, a)[rank])
             for k, a in READ_AXES.items()}
    equal["list0"] = torch.equal(out["list0"], torch.full((2,), 7.0))
    return equal, out["extra.step"]


@pytest.mark.parametrize("kind", ["sync", "planner", "async"])
def test_dtensors_of_a_2d_mesh_load_on_one_process(dtensor_ckpts, kind):
    equal, step = _read(0, 1, dtensor_ckpts[kind])
    assert all(equal.values()) and step == 11, equal


def test_dtensors_of_a_2d_mesh_load_on_two_processes(dtensor_ckpts):
    for kind in ("sync", "planner", "async"):
        for equal, step in run_distributed(_read, 2, dtensor_ckpts[kind]):
            assert all(equal.values()) and step == 11, (kind, equal)


def test_replicated_tensors_are_stored_once_and_indexed_as_dcp_has_them(dtensor_ckpts):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(dtensor_ckpts["sync"]).read_metadata().state_dict_metadata
    ours = ldc.load_tensors_metadata(dtensor_ckpts["sync"])
    assert {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")} == \
        {k: v.global_shape for k, v in ours.items()}
    assert len(md["model.rep"].chunks) == 1 and len(md["model.zero_d"].chunks) == 1


# ---------------------------------------------------------------- our DCP export, read by torch

def _dtensor_piece(full, rank, world):
    """What Shard(0) gives ``rank``: torch.chunk's split (10 rows over 3: 4 + 4 + 2), empty past the last."""
    rows = -(-full.shape[0] // world)
    return full[rows * rank:rows * (rank + 1)]


def _torch_load_3(rank, world, path, shapes):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(0)]) for k, (shape, dtype) in
             shapes.items()}
    state["extra.step"] = 0
    dcp.load(state, checkpoint_id=path)  # 10 rows over 3 ranks: 4 + 4 + 2
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()}


def test_our_export_is_read_by_torch_at_other_world_sizes(dtensor_ckpts, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    out = str(tmp_path / "exported")
    ldc.export.to_dcp(dtensor_ckpts["planner"], out)  # DCP written by 4 ranks -> ours -> DCP by one process
    full = {f"model.{k}": v for k, v in full_dtensors().items()}
    full["extra.list.0"] = torch.full((2,), 7.0)
    sharded = {k: (tuple(v.shape), v.dtype) for k, v in full.items() if v.dim() and k != "model.zero_d"}
    for rank, got in enumerate(run_distributed(_torch_load_3, 3, out, sharded)):
        assert got["extra.step"] == 11
        assert [k for k in sharded if not _same(got[k], _dtensor_piece(full[k], rank, 3))] == []
    whole = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.state_dict_loader.load(whole, checkpoint_id=out, no_dist=True)
    assert [k for k, v in full.items() if not _same(whole[k], v)] == []
    some = _load_state_dict_from_keys({"model.w2d", "extra.step"}, checkpoint_id=out)
    # our keys are flat names (DCP's nesting is not kept): torch rebuilds no nesting from them
    assert _same(some["model.w2d"], full["model.w2d"]) and some["extra.step"] == 11
    dcp_to_torch_save(out, str(tmp_path / "one.pt"))
    saved = torch.load(tmp_path / "one.pt", weights_only=True)
    assert [k for k, v in full.items() if not _same(saved[k], v)] == [] and saved["extra.step"] == 11


def test_every_dtype_and_shape_we_export_is_read_back_by_torch(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    dcp.save(plain_state(), checkpoint_id=src, no_dist=True)
    ldc.export.to_dcp(src, out)
    want = _flat_tensors()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    got.update({k: 0 for k in OBJECTS})
    dcp.load(got, checkpoint_id=out, no_dist=True)
    assert [k for k, v in want.items() if not _same(got[k], v)] == []
    assert {k: got[k] for k in OBJECTS} == OBJECTS


# ---------------------------------------------------------------- what we refuse, and why it is named

class _Xor(torch.distributed.checkpoint._extension.StreamTransformExtension):
    """A stream transform of DCP's extension registry (as its ZStandard one is), each byte xor 0x5A."""

    @staticmethod
    def registry_name():
        return "test.xor"

    @staticmethod
    def from_descriptor(version):
        return _Xor()

    def get_descriptor(self):
        return "test.xor/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                return output.write(bytes(x ^ 0x5A for x in bytes(b)))
        return Writer()

    def transform_from(self, input):
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def test_stream_transform_extensions_are_refused_naming_the_key_and_transform(tmp_path):
    """Reading them runs the extension's code by its registry name (and ZStandard needs a package
    we do not depend on), and a transformed stream has no zip CRC left to check: refused."""
    path = str(tmp_path / "ext")
    dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(path, _extensions=[_Xor()]), no_dist=True)
    with pytest.raises(FormatError, match=r"'w' chunk at \[0\] is stored through transforms \['test.xor/1'\]"):
        ldc.load_plain_tensors(path)


def test_safetensors_serialization_format_loads_though_dcp_itself_cannot_read_it(tmp_path):
    """DCP's FileSystemReader cannot read its own SAFETENSORS format (its ``.metadata`` offsets all
    point at the blob's start); we read it through the blob's header (tests/interop/test_dcp_variants.py)."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    path = str(tmp_path / "st")
    writer = dcp.FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"w": torch.arange(6.0), "v": torch.ones(2)}, storage_writer=writer, no_dist=True)
    with pytest.raises(dcp.CheckpointException):  # DCP's own reader: an unpickling error
        dcp.load({"w": torch.zeros(6), "v": torch.zeros(2)}, checkpoint_id=path, no_dist=True)
    out = ldc.load_plain_tensors(path)
    assert torch.equal(out["w"], torch.arange(6.0)) and torch.equal(out["v"], torch.ones(2))
