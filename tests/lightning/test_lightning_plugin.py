"""DistCheckpointIO as a plain CheckpointIO plugin: Lightning's stock DDP strategy (which saves from
rank 0 only) and strategy="auto", plus the plugin's API on its own."""

import os

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage.layout import read_metadata
from lightning_helpers import run_script

EXACT = {k: True for k in ("weights", "opt", "lr", "sched", "global_step", "epoch")}


@pytest.fixture(scope="module")
def stock_ddp(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin_ddp")
    return run_script("trainer_scenarios.py", ["exact_resume", "topk_last", "link_last", "--mode", "plugin",
                                               "--dir", str(d), "--devices", "2"], str(d / "out"), world_size=2)


def test_stock_ddp_exact_resume(stock_ddp):
    for res in stock_ddp:
        assert res["exact"] == EXACT
        assert res["losses_c"] == {k: v for k, v in res["losses_a"].items() if int(k) >= 3}
        assert res["callback_count"] == 6
        assert res["hparams_conf"][0] == "DictConfig"
        assert res["test_loss"] == [pytest.approx(res["losses_a"]["3"], rel=1e-6)]  # Trainer.test(ckpt_path=...)
    # Stock DDP calls save_checkpoint on rank 0 only: the plugin saved as a group of one (no
    # collective, else rank 1 would have left it waiting), loaded on every rank alone.
    assert stock_ddp[0]["rank_dirs"] == ["rank_00000"]
    assert stock_ddp[0]["ckpt_world_size"] == 1


def test_stock_ddp_model_checkpoint(stock_ddp):
    for res in stock_ddp:
        assert res["topk_listing"] == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]
        assert res["topk_all_committed"] is True
        assert res["last_resumed_from"] == "last.ckpt" and res["last_first_step"] == 6
        assert res["link_is_symlink"] is True and res["link_target"] == "step=4.ckpt"
        assert res["link_first_step"] == 4 and res["link_target_after"] == "step=6.ckpt"


def test_strategy_auto_single_device(tmp_path):
    res = run_script("trainer_scenarios.py", ["exact_resume", "topk_last", "--mode", "plugin", "--dir", str(tmp_path),
                                              "--devices", "1"], str(tmp_path / "out"), world_size=1)[0]
    assert res["exact"] == EXACT
    assert res["topk_listing"] == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]
    assert res["last_resumed_from"] == "last.ckpt"


def test_roundtrip_keeps_structure_and_types(tmp_path):
    ckpt = {
        "state_dict": {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3), "bf": torch.randn(5).bfloat16()},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2}}}},
        "tuple": (1, torch.ones(2)),
        "epoch": 1,
    }
    io = DistCheckpointIO()
    io.save_checkpoint(ckpt, tmp_path / "c")
    back = io.load_checkpoint(tmp_path / "c")
    assert back.keys() == ckpt.keys()
    for k in ("a.weight", "a.bias", "bf"):
        assert torch.equal(back["state_dict"][k], ckpt["state_dict"][k]) and back["state_dict"][k].dtype == ckpt["state_dict"][k].dtype
    st = back["optimizer_states"][0]["state"]
    assert list(st) == [0] and torch.equal(st[0]["exp_avg"], ckpt["optimizer_states"][0]["state"][0]["exp_avg"])
    assert st[0]["step"].item() == 3.0
    assert back["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert back["loops"] == ckpt["loops"] and back["epoch"] == 1 and torch.equal(back["tuple"][1], torch.ones(2))
    # Tensors are stored as arrays (readable whole by key), not pickled into the common state.
    assert set(ldc.load_tensors_metadata(tmp_path / "c")) == {
        "state_dict/a.weight", "state_dict/a.bias", "state_dict/bf", "optimizer_states/0/state/0/exp_avg"}


def test_storage_options_per_save_and_remove(tmp_path):
    io = DistCheckpointIO.from_config({"storage": {"layout": "ocdbt"}})
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, tmp_path / "z", storage_options={"layout": "zarr"})
    assert read_metadata(str(tmp_path / "z"))["storage"]["layout"] == "zarr"
    os.symlink("z", tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "last.ckpt")  # removes the link, not its target
    assert not os.path.lexists(tmp_path / "last.ckpt") and os.path.isdir(tmp_path / "z")
    io.remove_checkpoint(tmp_path / "z")
    assert not os.path.exists(tmp_path / "z")
    with pytest.raises(TypeError, match="storage_options"):  # an ArgumentTypeError
        io.save_checkpoint({"x": 1}, tmp_path / "y", storage_options=3)


def test_storage_options_dict_keeps_the_configured_fields(tmp_path):
    """A per-save dict overrides only the fields it names: the plugin's configured pack_max_bytes and
    data_file_bytes stay (they used to fall back to the defaults)."""
    io = DistCheckpointIO.from_config({"storage": {"pack_max_bytes": 0, "data_file_bytes": 4096}})
    ckpt = {"state_dict": {"small": torch.ones(8), "big": torch.randn(64, 64)}}
    io.save_checkpoint(ckpt, tmp_path / "a", storage_options={"chunk_bytes": 4096})
    meta = read_metadata(str(tmp_path / "a"))
    assert meta["storage"]["chunk_bytes"] == 4096
    shards = [s for key in ("state_dict/small", "state_dict/big") for s in meta["tensors"][key]["shards"]]
    assert all(s.get("packed") is None for s in shards)  # pack_max_bytes=0: nothing packed
    data = [f for _, _, fs in os.walk(tmp_path / "a" / "data") for f in fs]
    assert len(data) > 4  # 16 KiB of weights in data files of about 4 KiB (the default would make one)
    with pytest.raises(ArgumentError, match="pack_max"):
        io.save_checkpoint(ckpt, tmp_path / "b", storage_options={"pack_max": 1})


def test_async_local_save_snapshots_and_surfaces_errors(tmp_path):
    io = DistCheckpointIO.from_config({"async_save": True})
    w = torch.zeros(1000)
    io.save_checkpoint({"state_dict": {"w": w}}, tmp_path / "a")
    w.add_(1)  # training goes on: the background save must hold the snapshot
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "a")["state_dict"]["w"], torch.zeros(1000))
    (tmp_path / "file").write_text("not a checkpoint")
    with pytest.raises(ldc.CheckpointingError, match="not a directory"):
        io.save_checkpoint({"state_dict": {"w": w}}, tmp_path / "file")  # refused before anything is written
    io.save_checkpoint({"state_dict": {"w": w}}, tmp_path / "b")
    assert os.listdir(tmp_path / "b") == []  # the name is held (an empty directory) while the save is in flight
    (tmp_path / "b" / "mine").write_text("in the way of the commit")  # a file appears there meanwhile...
    with pytest.raises(ldc.SaveFailedError, match="is not empty"):
        io.teardown()  # ...and the error surfaces at the next wait
    assert os.listdir(tmp_path / "b") == ["mine"]  # never removed
    io.save_checkpoint({"state_dict": {"w": w}}, tmp_path / "c")  # the plugin goes on saving
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "c")["state_dict"]["w"], torch.ones(1000))


def test_async_removal_waits_for_the_new_checkpoint(tmp_path):
    # ModelCheckpoint removes the old top-k right after asking for the new save: with async save the
    # old one must survive until the new one is committed, and survive for good if the new one fails.
    io = DistCheckpointIO.from_config({"async_save": True})
    io.save_checkpoint({"state_dict": {"w": torch.zeros(10)}}, tmp_path / "old")
    io.teardown()
    io.save_checkpoint({"state_dict": {"w": torch.ones(10)}}, tmp_path / "new")
    io.remove_checkpoint(tmp_path / "old")
    assert (tmp_path / "old" / "COMMITTED").is_file()  # still there while "new" may be in flight
    io.teardown()
    assert not (tmp_path / "old").exists() and (tmp_path / "new" / "COMMITTED").is_file()
    io.save_checkpoint({"state_dict": {"w": torch.ones(10)}}, tmp_path / "blocker")
    (tmp_path / "blocker" / "x").write_text("a file where the checkpoint should go")  # the commit will fail
    io.remove_checkpoint(tmp_path / "new")
    with pytest.raises(ldc.SaveFailedError):
        io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "new")["state_dict"]["w"], torch.ones(10))  # kept


def test_load_rejects_incomplete_and_foreign_directories(tmp_path):
    io = DistCheckpointIO()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ldc.IncompleteCheckpointError, match="empty"):
        io.load_checkpoint(tmp_path / "empty")
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "raw")
    with pytest.raises(ldc.CheckpointingError, match="not a Lightning checkpoint"):
        io.load_checkpoint(tmp_path / "raw")


def test_strategies_refuse_a_foreign_checkpoint_io():
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_distckpt.lightning import DistCheckpointStrategy, FabricDistCheckpointStrategy

    for cls in (DistCheckpointStrategy, FabricDistCheckpointStrategy):
        with pytest.raises(TypeError, match="DistCheckpointIO"):
            cls(checkpoint_io=TorchCheckpointIO()).checkpoint_io
        assert isinstance(cls().checkpoint_io, DistCheckpointIO)
        with pytest.raises(ValueError, match="process_group"):
            cls(process_group=object())
