"""GPU paths: device tensors saved and loaded in place, async save staging device tensors in pinned
host memory, the two-stage loader delivering into device tensors, collectives on NCCL, and a
Lightning Trainer on the GPU. Skipped where no CUDA device is present (CI has none); run on a GPU
machine with ``python -m pytest -q tests/lightning/test_gpu.py`` (see docs/loaders.md for the last run)."""

import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FULL = {
    "w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) / 7,
    "emb": (torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16) - 100).to(torch.bfloat16),
    "idx": torch.arange(40, dtype=torch.int64) * 3,
}


def sharded(tensors, rank=0, world=1, device="cuda", axis=0, replica_id=0):
    """TP-style split of every tensor along ``axis`` (0 for 1-D) over ``world`` ranks, on ``device``."""
    out = {}
    for k, full in tensors.items():
        a = axis if full.dim() > 1 else 0
        part = full.chunk(world, dim=a)[rank].contiguous().to(device)
        splits = [(a, rank, world)] if world > 1 else []
        out[k] = ldc.ShardedTensor.from_rank_offsets(k, part, *splits, replica_id=replica_id)
    return out


def test_device_tensors_round_trip_into_the_templates_own_tensors(tmp_path):
    ldc.save(sharded(FULL), tmp_path / "ck")
    template = sharded({k: torch.zeros_like(v) for k, v in FULL.items()})
    ptrs = {k: st.data.data_ptr() for k, st in template.items()}
    out = ldc.load(template, tmp_path / "ck")
    for k, v in FULL.items():
        assert out[k].device.type == "cuda" and out[k].data_ptr() == ptrs[k], k
        assert torch.equal(out[k].cpu(), v), k
    # resharded: column half 1 of w (saved whole) straight into a device tensor
    half = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(64, 24, device="cuda"), (1, 1, 2))}
    assert torch.equal(ldc.load(half, tmp_path / "ck")["w"].cpu(), FULL["w"][:, 24:])
    assert torch.equal(ldc.load_plain_tensors(tmp_path / "ck")["emb"], FULL["emb"])


def test_async_save_snapshots_device_tensors_into_pinned_buffers(tmp_path):
    state = sharded(FULL)
    saver = ldc.AsyncSaver()
    req = saver.save(state, tmp_path / "ck")
    assert saver.staging_buffers() and all(b.is_pinned() and b.device.type == "cpu"
                                         for b in saver.staging_buffers().values())
    for st in state.values():  # training goes on: the checkpoint must hold the values at save()
        st.data.add_(1)
    req.finalize()
    plain = ldc.load_plain_tensors(tmp_path / "ck")
    for k, v in FULL.items():
        assert torch.equal(plain[k], v), k
    # the next save of the same layout reuses the pinned buffers
    before = {k: b.data_ptr() for k, b in saver.staging_buffers().items()}
    saver.save(state, tmp_path / "ck2").finalize()
    assert {k: b.data_ptr() for k, b in saver.staging_buffers().items()} == before
    assert torch.equal(ldc.load_plain_tensors(tmp_path / "ck2")["idx"], FULL["idx"] + 1)


def _two_stage_into_device(rank, world, path):
    torch.cuda.set_device(0)  # both ranks share the one GPU; collectives run over gloo on the CPU
    ldc.save(sharded(FULL, rank, world, axis=1), path)  # TP 2 along the columns, from device tensors
    # replicated: both ranks want everything
    template = sharded({k: torch.zeros_like(v) for k, v in FULL.items()}, replica_id=rank)
    out = ldc.load(template, path, loader="two_stage")
    return all(torch.equal(out[k].cpu(), v) and out[k].device.type == "cuda" for k, v in FULL.items())


def test_two_stage_loader_delivers_into_device_tensors(tmp_path):
    assert all(run_distributed(_two_stage_into_device, 2, str(tmp_path / "ck")))


def _nccl_one_rank(rank, world, path, port):
    import datetime

    import torch.distributed as dist

    from lightning_distckpt.comm import comm_device

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    try:
        group = dist.new_group([0], backend="nccl")
        assert comm_device(group).type == "cuda"
        ldc.save(sharded(FULL), path, process_group=group)
        out = ldc.load(sharded({k: torch.zeros_like(v) for k, v in FULL.items()}), path, process_group=group)
        return all(torch.equal(out[k].cpu(), v) for k, v in FULL.items())
    finally:
        dist.destroy_process_group()


def test_save_and_load_over_an_nccl_group(tmp_path):
    import torch.multiprocessing as mp

    from dist_utils import free_port

    # One process in a spawned child (NCCL refuses two ranks on one GPU; the pytest process keeps
    # no process group).

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(_nccl_one_rank, (0, 1, str(tmp_path / "ck"), free_port()))


def test_trainer_on_the_gpu_saves_and_resumes(tmp_path, isolated_process_group):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning_helpers import TPMLP

    from lightning_distckpt.lightning import DistCheckpointStrategy

    devices = set()

    class RecordDevice(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            devices.add(next(pl_module.parameters()).device.type)

    def fit(steps, ckpt_path=None, async_save=False):
        cb = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
        trainer = Trainer(accelerator="gpu", devices=1, strategy=DistCheckpointStrategy(
            checkpoint={"async_save": async_save}), max_steps=steps, callbacks=[cb, RecordDevice()], logger=False,
            enable_progress_bar=False, enable_model_summary=False)
        model = TPMLP(total_steps=6)
        trainer.fit(model, ckpt_path=ckpt_path)
        return trainer, model

    trainer, model = fit(4, async_save=True)
    assert devices == {"cuda"}  # trained on the GPU (Lightning moves the module back to the CPU at teardown)
    assert str(trainer.strategy.root_device).startswith("cuda")
    saved = ldc.lightning.DistCheckpointIO().load_checkpoint(tmp_path / "step=4.ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(saved["state_dict"][k], v.cpu()), k
    trainer2, model2 = fit(6, ckpt_path=str(tmp_path / "step=4.ckpt"))
    assert trainer2.global_step == 6 and os.path.isdir(tmp_path / "step=6.ckpt")
