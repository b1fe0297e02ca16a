"""Interop with Megatron-Core's ``torch_dist`` format, both ways, against the real megatron-core
(test extra): a checkpoint written by ``megatron.core.dist_checkpointing.save`` on 2 gloo processes
loads with ``ldc.load`` under another split (and with ``load_plain_tensors`` /
``load_tensors_metadata`` / ``load_common_state_dict`` in one process); one written by ``ldc.save``
and exported with ``convert --to megatron`` loads with ``dist_checkpointing.load`` under another
split. Tensors bit-exact (float32, bfloat16, int64; a prepended layer axis), ShardedObjects and the
common state equal. Megatron-Core's own sharded state dicts save and load with ``ldc`` as they are.

megatron-core on CPU calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()`` in its
save path; the worker processes stub these two (:func:`_cpu_only_megatron`), nothing else.
"""

import functools
import json
import os
import pickle

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import FormatError, UnsafeContentError

pytest.importorskip("megatron.core.dist_checkpointing")

LAYERS = 3


def full():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, 10, generator=g).to(torch.bfloat16),
            "layers.w": torch.randn(LAYERS, 4, 4, generator=g), "r": torch.arange(5),
            "fac": torch.randn(4, 6, generator=g)}  # saved through a factory, as two halves


COMMON = {"iteration": 11, "nested": {"lr": 0.5, "names": ["x", "y"]}}


def _cpu_only_megatron():
    """megatron-core's torch_dist save synchronizes CUDA and puts a failure flag on the current CUDA
    device; on a CPU-only torch both raise. In this worker process only: no-op / the CPU."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _halves(mod, key, data, replica_id, flattened_range):
    """A factory's build function: the tensor saved as two row halves, with ``mod``'s classes."""
    return {part: mod.ShardedTensor.from_rank_offsets(f"{key}.{part}", rows, replica_id=replica_id)
            for part, rows in (("top", data[:2]), ("bottom", data[2:]))}


def _join(loaded):
    return torch.cat([loaded["top"], loaded["bottom"]])


def sharded(mod, rank, world, split, with_data=True):
    """A sharded state dict of ``full()`` built with ``mod``'s classes (Megatron-Core's or ours).
    Split "save": w by rows, b by columns, layer i on rank i % world; split "load": the other axes,
    layer i on rank (i + 1) % world, each rank asking for the other rank's object element."""
    f = full()
    st, so = mod.ShardedTensor, mod.ShardedObject

    def part(t, axis):
        return t.chunk(world, axis)[rank].clone() if with_data else torch.empty_like(t.chunk(world, axis)[rank])

    w_axis, b_axis, shift = (0, 1, 0) if split == "save" else (1, 0, 1)
    obj_at = rank if split == "save" else (rank + 1) % world
    return {
        "w": st.from_rank_offsets("w", part(f["w"], w_axis), (w_axis, rank, world)),
        "b": st.from_rank_offsets("b", part(f["b"], b_axis), (b_axis, rank, world)),
        "r": st.from_rank_offsets("r", f["r"].clone() if with_data else torch.empty(5, dtype=torch.int64),
                                  replica_id=rank),
        "layers": [st.from_rank_offsets("layers.w", f["layers.w"][i].clone() if with_data else torch.empty(4, 4),
                                        (0, i, LAYERS), prepend_axis_num=1)
                   for i in range(LAYERS) if (i + shift) % world == rank],
        "obj": so("obj", {"rank": obj_at} if with_data else None, (world,), (obj_at,), replica_id=0),
        "fac": mod.ShardedTensorFactory("fac", f["fac"].clone() if with_data else torch.empty(4, 6),
                                        functools.partial(_halves, mod), _join, replica_id=rank),
        "local": mod.LocalNonpersistentObject(f"rank {rank}"),
        **({"iteration": COMMON["iteration"], "nested": COMMON["nested"]} if with_data else {}),
    }


def check_loaded(loaded, rank, world):
    """The "load" split of ``full()``, bit-exact, the object element and the common state."""
    expect = sharded(ldc, rank, world, "load")
    for key in ("w", "b", "r"):
        assert loaded[key].dtype == expect[key].data.dtype and torch.equal(loaded[key], expect[key].data), key
    assert len(loaded["layers"]) == len(expect["layers"])
    for got, want in zip(loaded["layers"], expect["layers"]):
        assert torch.equal(got, want.data)
    assert loaded["obj"] == {"rank": (rank + 1) % world}
    assert torch.equal(loaded["fac"], full()["fac"]) and loaded["local"] == f"rank {rank}"
    assert loaded["iteration"] == COMMON["iteration"] and loaded["nested"] == COMMON["nested"]


def _megatron_save(rank, world, path):
    import multiprocessing

    _cpu_only_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    try:  # one writer thread: no forked writer processes
        dist_checkpointing.save(sharded(dist_checkpointing.mapping, rank, world, "save"), path,
                                sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    finally:  # megatron-core's results-queue manager process: end it with the worker
        for child in multiprocessing.active_children():
            child.terminate()


def _ldc_load(rank, world, path):
    check_loaded(ldc.load(sharded(ldc, rank, world, "load", with_data=False), path), rank, world)


def _ldc_save_megatron_leaves(rank, world, path):
    """Megatron-Core's own sharded state dict (its classes, a factory, a non-persistent object),
    saved and loaded by ldc as it is."""
    from megatron.core import dist_checkpointing

    ldc.save(sharded(dist_checkpointing.mapping, rank, world, "save"), path)
    template = sharded(dist_checkpointing.mapping, rank, world, "load", with_data=False)
    check_loaded(ldc.load(template, path), rank, world)


def _megatron_load(rank, world, path):
    _cpu_only_megatron()
    from megatron.core import dist_checkpointing

    template = sharded(dist_checkpointing.mapping, rank, world, "load", with_data=False)
    check_loaded(dist_checkpointing.load(template, path), rank, world)


@pytest.fixture(scope="module")
def megatron_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mcore") / "ckpt")
    os.makedirs(path)
    run_distributed(_megatron_save, 2, path)
    return path


def test_ldc_reads_megatron_under_another_split(megatron_ckpt):
    with open(os.path.join(megatron_ckpt, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    run_distributed(_ldc_load, 2, megatron_ckpt)
    plain = ldc.load_plain_tensors(megatron_ckpt)
    expect = {k: t for k, t in full().items() if k != "fac"}
    expect.update({"fac.top": full()["fac"][:2], "fac.bottom": full()["fac"][2:]})
    assert set(plain) == set(expect)
    for key, tensor in expect.items():
        assert plain[key].dtype == tensor.dtype and torch.equal(plain[key], tensor), key
    meta = ldc.load_tensors_metadata(megatron_ckpt)
    assert {k: (st.global_shape, st.dtype) for k, st in meta.items()} == \
        {k: (tuple(t.shape), t.dtype) for k, t in expect.items()}
    assert ldc.load_common_state_dict(megatron_ckpt) == COMMON


def _ldc_load_on_4(rank, world, path):
    """Saved by Megatron-Core on 2 ranks, read on 4: w by rows, one layer per rank (none on rank 3),
    r replicated, the object element of saving rank ``rank % 2``."""
    f = full()
    template = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.empty(2, 6), (0, rank, world)),
                "r": ldc.ShardedTensor.from_rank_offsets("r", torch.empty(5, dtype=torch.int64), replica_id=rank),
                "obj": ldc.ShardedObject("obj", None, (2,), (rank % 2,), replica_id=0)}
    if rank < LAYERS:
        template["layer"] = ldc.ShardedTensor.from_rank_offsets("layers.w", torch.empty(4, 4), (0, rank, LAYERS),
                                                                prepend_axis_num=1)
    out = ldc.load(template, path)
    assert torch.equal(out["w"], f["w"][2 * rank:2 * rank + 2]) and torch.equal(out["r"], f["r"])
    assert out["obj"] == {"rank": rank % 2}
    assert rank >= LAYERS or torch.equal(out["layer"], f["layers.w"][rank])


def test_ldc_reads_megatron_on_4_ranks(megatron_ckpt):
    run_distributed(_ldc_load_on_4, 4, megatron_ckpt)


def test_megatron_leaves_saved_by_ldc_then_converted_and_read_by_megatron(tmp_path):
    from lightning_distckpt.cli.main import main

    ours, out = str(tmp_path / "ours"), str(tmp_path / "mcore")
    run_distributed(_ldc_save_megatron_leaves, 2, ours)
    assert main(["convert", ours, out, "--to", "megatron"]) == 0
    assert sorted(n for n in os.listdir(out) if not n.endswith(".distcp")) == [".metadata", "common.pt",
                                                                               "metadata.json"]
    run_distributed(_megatron_load, 2, out)
    # and back: our reader gives the same tensors
    plain = ldc.load_plain_tensors(out)
    assert all(torch.equal(plain[k], t) for k, t in full().items() if k != "fac")
    assert torch.equal(plain["fac.top"], full()["fac"][:2]) and torch.equal(plain["fac.bottom"], full()["fac"][2:])


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_refusals(megatron_ckpt, tmp_path):
    zarr = _copy(megatron_ckpt, str(tmp_path / "zarr"))
    with open(os.path.join(zarr, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "zarr", "sharded_backend_version": 1}, f)
    with pytest.raises(FormatError, match="sharded_backend 'zarr'.*only 'torch_dist'"):
        ldc.load_tensors_metadata(zarr)

    no_common = _copy(megatron_ckpt, str(tmp_path / "no_common"))
    os.remove(os.path.join(no_common, "common.pt"))
    with pytest.raises(FormatError, match="without common.pt"):
        ldc.load_plain_tensors(no_common)

    # Megatron-Core <= 0.13 stored distributed-optimizer state N-D reformulated (flattened):
    # refused, naming the tensor and the form. The test edits its own trusted file with pickle.
    flat = _copy(megatron_ckpt, str(tmp_path / "flat"))
    with open(os.path.join(flat, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    meta.mcore_data = {"w": {"nd_reformulated_orig_global_shape": (8, 6)}}
    with open(os.path.join(flat, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(FormatError, match="'w'.*N-D reformulated.*fully_reshardable"):
        ldc.load_tensors_metadata(flat)

    # common.pt is read with weights_only: a type nobody allowed is refused, not run. (Not
    # argparse.Namespace, Megatron-LM's args: importing megatron-core allows it in torch globally.)
    unsafe = _copy(megatron_ckpt, str(tmp_path / "unsafe"))
    torch.save({"args": Opaque(1.0)}, os.path.join(unsafe, "common.pt"))
    with pytest.raises(UnsafeContentError, match="common.pt: refused to deserialize"):
        ldc.load_common_state_dict(unsafe)
    assert ldc.load_common_state_dict(unsafe, extra_safe_globals=[Opaque])["args"].lr == 1.0


class Opaque:
    def __init__(self, lr):
        self.lr = lr


def test_inspect_and_validate_cli(megatron_ckpt, tmp_path, capsys):
    """``inspect`` / ``validate`` on a Megatron-Core directory and on a plain DCP one; a damaged
    chunk is a problem naming the tensor (exit 1)."""
    import torch.distributed.checkpoint as dcp

    from lightning_distckpt.cli.main import main
    from lightning_distckpt.reading.formats.dcp_metadata import read_metadata

    assert main(["inspect", megatron_ckpt, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "Megatron-Core torch_dist"
    assert {t["key"]: t["shape"] for t in summary["tensors"]}["layers.w"] == [LAYERS, 4, 4]
    assert [(o["key"], o["elements"]) for o in summary["objects"]] == [("obj", 2)]
    assert main(["validate", megatron_ckpt]) == 0
    assert "OK:" in capsys.readouterr().out

    plain = str(tmp_path / "plain")
    dcp.save({"a": torch.arange(6.0).reshape(2, 3), "step": 3}, checkpoint_id=plain, no_dist=True)
    assert main(["inspect", plain]) == 0
    assert "PyTorch DCP" in capsys.readouterr().out
    assert main(["validate", plain]) == 0
    capsys.readouterr()

    damaged = _copy(megatron_ckpt, str(tmp_path / "damaged"))
    chunk = read_metadata(os.path.join(damaged, ".metadata")).tensors["w"].chunks[0].item
    with open(os.path.join(damaged, chunk.file), "r+b") as f:
        f.seek(chunk.offset)
        f.write(bytes(chunk.length))
    assert main(["validate", damaged]) == 1
    assert "PROBLEM  'w' chunk at [0, 0]" in capsys.readouterr().out


def test_lightning_module_returning_megatron_sharded_state_dict():
    """A LightningModule whose sharded_state_dict() is a Megatron-Core model's, unchanged: the
    strategies see our ShardedTensors (so optimizer state maps onto them), bound to the parameters."""
    from megatron.core.dist_checkpointing import mapping as mc

    from lightning_distckpt.lightning.parallel import ParallelState
    from lightning_distckpt.lightning.sharded import model_sharded_state_dict

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 6)

        def sharded_state_dict(self, prefix=""):
            return {f"{prefix}fc.{n}": mc.ShardedTensor.from_rank_offsets(f"{prefix}fc.{n}", p, replica_id=0)
                    for n, p in self.fc.named_parameters()}

    module = Module()
    ssd = model_sharded_state_dict(module, ParallelState.single())
    assert set(ssd) == {"fc.weight", "fc.bias"}
    for name, leaf in ssd.items():
        assert isinstance(leaf, ldc.ShardedTensor) and leaf.key == name
        assert leaf.data is module.get_parameter(name)
        assert leaf.global_shape == tuple(module.get_parameter(name).shape)
