"""``ldc.load`` reads PyTorch DCP checkpoints written by ``torch.distributed.checkpoint.save``
itself: DTensors with Shard(0) / Shard(1) / Replicate placements and an FSDP2 ``fully_shard``
module on 2 gloo processes, a plain-tensor save from one process, and a Lightning Trainer's
``ModelParallelStrategy`` checkpoint. Each loads under another split on real gloo groups of 1, 2
and 4, bit-exact. Objects DCP stored as bytes (and Lightning's meta.pt) come back as common state.
A piece of a chunk reads about its own bytes. Crafted, truncated, damaged, escaping and Megatron
checkpoints are refused."""

import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import FormatError, UnsafeContentError
from script_ranks import run_ranks, script_env


def full_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(8, 12, generator=g),
        "b": torch.randn(12, 8, generator=g).to(torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
        "d": torch.randn(7, 4, generator=g),  # 7 rows over 2 ranks: uneven chunks (4, 3)
    }


COMMON = {"step": 7, "meta.lr": 0.5, "meta.names": ["x", "y"]}


def fsdp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))


def fsdp_full():
    return {f"model.{k}": v.detach() for k, v in fsdp_model().state_dict().items()}


def _save(rank, world, dtensor_dir, fsdp_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    placements = {"a": Shard(0), "b": Shard(1), "c": Replicate(), "d": Shard(0)}
    model = {k: distribute_tensor(t, mesh, [placements[k]]) for k, t in full.items()}
    dcp.save({"model": model, "step": 7, "meta": {"lr": 0.5, "names": ["x", "y"]}}, checkpoint_id=dtensor_dir)
    module = fsdp_model()
    for layer in (module[0], module[2], module):
        fully_shard(layer, mesh=mesh)
    state = module.state_dict()
    assert all(type(v).__name__ == "DTensor" for v in state.values())
    dcp.save({"model": state}, checkpoint_id=fsdp_dir)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    paths = {name: str(root / name) for name in ("dtensor", "fsdp", "plain")}
    run_distributed(_save, 2, paths["dtensor"], paths["fsdp"])
    dcp.save({k: v for k, v in full_tensors().items()}, checkpoint_id=paths["plain"], no_dist=True)
    return paths


def _sharded(key, full, axis, rank, world):
    if axis is None:
        return ldc.ShardedTensor.from_rank_offsets(key, torch.zeros_like(full), replica_id=rank)
    local = torch.zeros_like(full.chunk(world, axis)[rank])
    return ldc.ShardedTensor.from_rank_offsets(key, local, (axis, rank, world))


def _want(full, axis, rank, world):
    return full if axis is None else full.chunk(world, axis)[rank]


# each tensor loaded split along another axis than saved (or whole)
DTENSOR_AXES = {"a": 1, "b": 0, "c": None, "d": None}
FSDP_AXES = {"model.0.weight": 1, "model.0.bias": 0, "model.2.weight": 1, "model.2.bias": None}


def _load_all(rank, world, paths, loader=None):
    """Load each checkpoint under this group's split; returns {tensor: bit-exact?} and the common state."""
    full = full_tensors()
    template = {k: _sharded(f"model.{k}", full[k], axis, rank, world) for k, axis in DTENSOR_AXES.items()}
    out = ldc.load(template, paths["dtensor"], loader=loader)
    equal = {k: torch.equal(out[k], _want(full[k], axis, rank, world)) for k, axis in DTENSOR_AXES.items()}
    common = {k: out[k] for k in COMMON}

    fsdp = fsdp_full()
    template = {k: _sharded(k, fsdp[k], axis, rank, world) for k, axis in FSDP_AXES.items()}
    out = ldc.load(template, paths["fsdp"], loader=loader)
    equal.update({k: torch.equal(out[k], _want(fsdp[k], axis, rank, world)) for k, axis in FSDP_AXES.items()})

    template = {"A": _sharded("A", full["a"], 0, rank, world), "B": _sharded("B", full["b"], 1, rank, world)}
    out = ldc.load(template, paths["plain"], key_map={"a": "A", "b": "B"}, loader=loader)
    equal.update({"plain A": torch.equal(out["A"], _want(full["a"], 0, rank, world)),
                  "plain B": torch.equal(out["B"], _want(full["b"], 1, rank, world))})
    return equal, common


def test_load_in_one_process(saved):
    equal, common = _load_all(0, 1, saved)
    assert all(equal.values()), equal
    assert common == COMMON


@pytest.mark.parametrize("world", [2, 4])
def test_load_under_another_split(saved, world):
    for equal, common in run_distributed(_load_all, world, saved):
        assert all(equal.values()), equal
        assert common == COMMON


def _load_every_rank(rank, world, paths):
    return _load_all(rank, world, paths, loader="every_rank")


def test_every_rank_loader(saved):
    for equal, _ in run_distributed(_load_every_rank, 2, saved):
        assert all(equal.values()), equal


def test_metadata_plain_tensors_and_common(saved):
    meta = ldc.load_tensors_metadata(saved["dtensor"])
    full = full_tensors()
    assert {k: (st.global_shape, st.dtype) for k, st in meta.items()} == \
        {f"model.{k}": (tuple(t.shape), t.dtype) for k, t in full.items()}
    plain = ldc.load_plain_tensors(saved["dtensor"])
    assert all(torch.equal(plain[f"model.{k}"], t) for k, t in full.items())
    fsdp = ldc.load_plain_tensors(saved["fsdp"])
    assert fsdp.keys() == fsdp_full().keys() and all(torch.equal(fsdp[k], v) for k, v in fsdp_full().items())
    assert ldc.load_common_state_dict(saved["dtensor"]) == COMMON
    assert ldc.load_common_state_dict(saved["plain"]) == {}


def _bytes_read_by_process():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes read through /proc/self/io")
def test_a_piece_of_a_chunk_is_read_with_the_whole_record_and_checked(tmp_path, monkeypatch):
    """A template shard of 1/16 of a 4 MiB chunk's rows: the chunk's zip record is read whole (as DCP's
    own reader does) so that its CRC-32 is checked, and a flipped byte in rows the template does not
    ask for is found. With verification off, only about the rows asked for are read."""
    path = str(tmp_path / "big")
    full = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))
    dcp.save({"w": full}, checkpoint_id=path, no_dist=True)
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64, 1024), (0, 5, 16))}
    before = _bytes_read_by_process()
    out = ldc.load(template, path, loader="every_rank")
    read = _bytes_read_by_process() - before
    assert torch.equal(out["w"], full[5 * 64:6 * 64])
    assert 1024 * 1024 * 4 <= read < 2 * 1024 * 1024 * 4, f"read {read} bytes of a 4 MiB chunk"
    (data,) = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
    raw = bytearray(open(data, "rb").read())
    at = bytes(raw).index(full[900].numpy().tobytes())  # row 900: not among the rows read
    raw[at] ^= 0x10
    open(data, "wb").write(bytes(raw))
    with pytest.raises(ldc.CheckpointingError, match="CRC-32"):
        ldc.load(template, path, loader="every_rank")
    monkeypatch.setenv("LIGHTNING_DISTCKPT_VERIFY", "0")  # unverified: only the span that holds the rows
    before = _bytes_read_by_process()
    out = ldc.load(template, path, loader="every_rank")
    read = _bytes_read_by_process() - before
    assert torch.equal(out["w"], full[5 * 64:6 * 64])
    assert read < 2 * 64 * 1024 * 4, f"read {read} bytes for a 256 KiB piece of a 4 MiB chunk"


def test_non_contiguous_chunk_is_read_whole(tmp_path):
    """DCP keeps a transposed tensor's strides: that chunk is loaded whole, then sliced."""
    path = str(tmp_path / "strided")
    base = torch.arange(48.0).reshape(6, 8)
    dcp.save({"t": base.t(), "v": base[2:5]}, checkpoint_id=path, no_dist=True)
    template = {"t": ldc.ShardedTensor.from_rank_offsets("t", torch.zeros(4, 6), (0, 1, 2)),
                "v": ldc.ShardedTensor.from_rank_offsets("v", torch.zeros(3, 4), (1, 1, 2))}
    out = ldc.load(template, path)
    assert torch.equal(out["t"], base.t()[4:]) and torch.equal(out["v"], base[2:5, 4:])


# ---------------------------------------------------------------- Lightning ModelParallelStrategy

LIGHTNING_SCRIPT = """
import sys, torch
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.save_hyperparameters({"width": 8})
        self.l1, self.l2 = torch.nn.Linear(8, 12), torch.nn.Linear(12, 4)

    def configure_model(self):
        for layer in (self.l1, self.l2, self):
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        return self.l2(torch.relu(self.l1(batch))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=4)


if __name__ == "__main__":
    out = sys.argv[1]
    torch.manual_seed(0)
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    trainer.fit(model)
    trainer.save_checkpoint(out + "/ckpt")  # DCP files and meta.pt
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(full, out + "/full.pt")
    # Tear the gloo group down before exit: left to interpreter shutdown, its threads were
    # destroyed while joinable now and then ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    script = root / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    env = script_env()
    code, output = run_ranks(str(script), [str(root)], env, 2, timeout=600)  # forked, as torchrun starts ranks
    assert code == 0, output[-6000:]
    return str(root / "ckpt"), torch.load(root / "full.pt", weights_only=True)


def module_weights(key):
    return key.removeprefix("state_dict.") if key.startswith("state_dict.") else None


def _load_lightning(rank, world, path):
    meta = ldc.load_tensors_metadata(path)
    template = {k: ldc.ShardedTensor.from_rank_offsets(
        k, torch.zeros(meta[f"state_dict.{k}"].global_shape).chunk(world, -1)[rank].contiguous(),
        (len(meta[f"state_dict.{k}"].global_shape) - 1, rank, world)) for k in ("l1.weight", "l2.weight", "l1.bias")}
    out = ldc.load(template, path, key_map=module_weights)
    return {k: out[k] for k in template}, out["global_step"], out["hyper_parameters"]


def test_lightning_model_parallel_checkpoint(lightning_ckpt):
    """Lightning's sharded checkpoint: DCP files (module weights under ``state_dict.``, optimizer
    state under ``optimizer_0.``) and meta.pt (the rest), loaded under a column split."""
    path, full = lightning_ckpt
    for rank, (tensors, step, hparams) in enumerate(run_distributed(_load_lightning, 2, path)):
        assert step == 2 and hparams == {"width": 8}
        for k, t in tensors.items():
            assert torch.equal(t, full[k].chunk(2, -1)[rank]), k
    plain = ldc.load_plain_tensors(path)
    assert all(torch.equal(plain[f"state_dict.{k}"], v) for k, v in full.items())
    assert "optimizer_0.state.l1.weight.exp_avg" in plain
    assert ldc.load_common_state_dict(path)["epoch"] == 1


# ---------------------------------------------------------------- refused checkpoints


def _copy(src, dst):
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return dst


def _edit_metadata(path, edit):
    """Rewrite .metadata after ``edit(metadata)`` (the test's own trusted pickle)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def test_crafted_metadata_runs_no_code(saved, tmp_path):
    path = _copy(saved["plain"], str(tmp_path / "ckpt"))
    marker = str(tmp_path / "code_ran")
    _edit_metadata(path, lambda m: setattr(m, "planner_data", _RunsCode(marker)))
    with pytest.raises(UnsafeContentError, match="os|posix"):
        ldc.load_plain_tensors(path)
    assert not os.path.exists(marker)


def test_truncated_distcp(saved, tmp_path):
    path = _copy(saved["dtensor"], str(tmp_path / "ckpt"))
    name = max((n for n in os.listdir(path) if n.endswith(".distcp")),
               key=lambda n: os.path.getsize(os.path.join(path, n)))
    full = os.path.join(path, name)
    os.truncate(full, os.path.getsize(full) - 100)
    with pytest.raises(FormatError, match=f"{name}.*truncated"):
        ldc.load_plain_tensors(path)


def test_damaged_chunk(saved, tmp_path):
    path = _copy(saved["plain"], str(tmp_path / "ckpt"))
    name = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    with open(os.path.join(path, name), "r+b") as f:
        f.write(b"\0" * 64)  # the first chunk's zip header
    with pytest.raises(FormatError, match=r"\.distcp: tensor '\w+' chunk at .*: zip record .*damaged local header"):
        ldc.load_plain_tensors(path)


def _point_first_item_at(rel):
    def edit(meta):
        first = next(iter(meta.storage_data))
        meta.storage_data[first].relative_path = rel
    return edit


def test_escaping_and_symlinked_files(saved, tmp_path):
    path = _copy(saved["plain"], str(tmp_path / "escape"))
    _edit_metadata(path, _point_first_item_at("../outside.distcp"))
    with pytest.raises(FormatError, match="not inside the checkpoint"):
        ldc.load_tensors_metadata(path)

    path = _copy(saved["plain"], str(tmp_path / "link"))
    name = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    os.symlink(os.path.join(path, name), os.path.join(path, "link.distcp"))  # inside: followed
    _edit_metadata(path, _point_first_item_at("link.distcp"))
    ldc.load_tensors_metadata(path)
    shutil.copy(os.path.join(path, name), tmp_path / "outside.distcp")  # out of the directory: refused
    os.remove(os.path.join(path, "link.distcp"))
    os.symlink(tmp_path / "outside.distcp", os.path.join(path, "link.distcp"))
    with pytest.raises(FormatError, match="link.distcp .*symbolic link to .*outside"):
        ldc.load_tensors_metadata(path)


def test_megatron_torch_dist_refused(saved, tmp_path):
    """DCP files with Megatron-Core's metadata.json are read as Megatron-Core's torch_dist (never as
    plain DCP, which would lose its common state): without its common.pt that is refused as
    incomplete. Real Megatron-Core checkpoints: tests/interop/test_megatron.py."""
    path = _copy(saved["plain"], str(tmp_path / "megatron"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    with pytest.raises(FormatError, match="Megatron-Core checkpoint without common.pt"):
        ldc.load_tensors_metadata(path)


def test_unsupported_dtype_names_key(tmp_path):
    path = str(tmp_path / "complex")
    # complex32: a dtype metadata.json cannot name (complex64 is stored now: test_dtypes_extended.py)
    dcp.save({"z": torch.zeros(3, dtype=torch.complex32)}, checkpoint_id=path, no_dist=True)
    with pytest.raises(FormatError, match="'z'.*complex32"):
        ldc.load_tensors_metadata(path)
