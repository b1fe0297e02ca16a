"""``convert``: re-layout (ocdbt <-> zarr), export to one torch.save file, import from one. Sources are
real checkpoints: a 2-process gloo save (TP 2, flattened optimizer state, objects, bf16, common
state) and a Lightning Trainer run with DistCheckpointStrategy."""

import json
import os

import pytest
import tensorstore as ts
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.cli import main
from lightning_distckpt.planning.metadata import CheckpointIndex
from lightning_distckpt.storage.layout import read_metadata
from lightning_distckpt.storage.safe_pickle import load_file

FULL = torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6)
NORM = torch.linspace(0, 1, 6).to(torch.bfloat16)
COMMON = {"step": 17, "hparams": {"lr": 0.1, "name": "gpt"}, "cfg": OmegaConf.create({"layers": 2})}


def _save_tp2(rank, world, path):
    rows, flat = FULL.shape[0] // world, FULL.reshape(-1)
    n = flat.numel() // world
    sd = {
        "layer.weight": ldc.ShardedTensor.from_rank_offsets(
            "layer.weight", FULL[rank * rows:(rank + 1) * rows].clone(), (0, rank, world)),
        "layer.norm": ldc.ShardedTensor.from_rank_offsets("layer.norm", NORM.clone(), replica_id=rank),
        "optim.exp_avg": ldc.ShardedTensor.from_rank_offsets_flat(
            "optim.exp_avg", flat[rank * n:(rank + 1) * n].clone() * 2, (16, 6),
            flattened_range=slice(rank * n, (rank + 1) * n)),
        "rng": ldc.ShardedObject("rng", {"rank": rank}, (world,), (rank,)),
        **COMMON,
    }
    ldc.save(sd, path, storage=ldc.StorageOptions(chunk_bytes=1024))
    return True


@pytest.fixture(scope="module")
def core_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("convert") / "ck")
    run_distributed(_save_tp2, 2, path)
    return path


def expected_tensors():
    return {"layer.weight": FULL, "layer.norm": NORM, "optim.exp_avg": FULL * 2}


def assert_same_tensors(got):
    want = expected_tensors()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def load_objects(path):
    template = {f"rng{r}": ldc.ShardedObject("rng", None, (2,), (r,)) for r in range(2)}
    out = ldc.load(template, path)
    return [out[f"rng{r}"] for r in range(2)]


def run_cli(capsys, *args):
    code = main(["convert", *map(str, args), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_relayout_to_zarr_and_back_keeps_every_shard(core_ckpt, tmp_path, capsys):
    zarr_dir = tmp_path / "zarr"
    report = run_cli(capsys, core_ckpt, zarr_dir, "--to", "distckpt", "--layout", "zarr")
    assert report["kind"] == "relayout" and report["tensors"] == 3 and report["objects"] == 2
    src, dst = read_metadata(core_ckpt), read_metadata(str(zarr_dir))
    assert dst["storage"]["layout"] == "zarr" and src["storage"]["layout"] == "ocdbt"
    assert dst["tensors"] == src["tensors"] and dst["objects"] == src["objects"]  # same shards, same writers
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left, no owner notes inside
    assert ".writing" not in os.listdir(zarr_dir)
    assert main(["validate", str(zarr_dir)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    assert_same_tensors(ldc.load_plain_tensors(zarr_dir))
    assert load_objects(zarr_dir) == [{"rank": 0}, {"rank": 1}]
    assert ldc.load_common_state_dict(zarr_dir) == COMMON
    # plain zarr v3: a stored shard opens with tensorstore alone; this small one is a range of its
    # writer's float32 pack array, at the element offset metadata.json gives
    stored = CheckpointIndex.from_json(dst, "zarr").tensors["layer.weight"].shards  # format 4: an even split's rule
    shard = next({"packed": s.packed, "flat": s.flat, "writer": s.writer, "shape": list(s.shape)}
                 for s in stored if s.offset == (8, 0))
    assert shard["packed"] is not None and shard["flat"] is None
    pack = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(
        zarr_dir / "data" / f"rank_{shard['writer']:05d}" / "p" / "float32")}}).result()
    numel = shard["shape"][0] * shard["shape"][1]
    got = pack[shard["packed"]:shard["packed"] + numel].read().result().reshape(shard["shape"])
    assert torch.equal(torch.from_numpy(got), FULL[8:])
    back = tmp_path / "back"
    run_cli(capsys, zarr_dir, back, "--to", "distckpt", "--layout", "ocdbt")
    assert_same_tensors(ldc.load_plain_tensors(back))


def test_export_and_import_round_trip(core_ckpt, tmp_path, capsys):
    pt = tmp_path / "ck.pt"
    report = run_cli(capsys, core_ckpt, pt)
    assert report["kind"] == "tensors" and report["bytes"] == os.path.getsize(pt)
    exported = load_file(str(pt))  # torch.load(weights_only=True) with omegaconf allowed
    assert set(exported) == {"tensors", "objects", "common"}
    assert_same_tensors(exported["tensors"])
    assert exported["objects"] == {"rng": {(0,): {"rank": 0}, (1,): {"rank": 1}}}
    assert exported["common"]["step"] == 17 and exported["common"]["hparams"] == COMMON["hparams"]
    imported = tmp_path / "imported"
    report = run_cli(capsys, pt, imported)
    assert report["kind"] == "tensors" and report["tensors"] == 3 and report["objects"] == 2
    assert_same_tensors(ldc.load_plain_tensors(imported))
    assert ldc.load_common_state_dict(imported) == COMMON  # the same common state, nothing added
    assert load_objects(imported) == [{"rank": 0}, {"rank": 1}]
    # and it loads resharded, as any checkpoint does: rows 8: of the weight into a TP-2 template
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("layer.weight", torch.zeros(8, 6), (0, 1, 2))}, imported)
    assert torch.equal(out["w"], FULL[8:])


def test_import_any_state_dict_and_refuse_code(tmp_path, capsys):
    sd = {"model": {"layer.weight": torch.randn(4, 3), "scale": torch.tensor(2.0)}, "epoch": 3}
    torch.save(sd, tmp_path / "plain.pt")
    run_cli(capsys, tmp_path / "plain.pt", tmp_path / "plain", "--layout", "zarr")
    back = ldc.lightning.DistCheckpointIO().load_checkpoint(tmp_path / "plain")
    assert torch.equal(back["model"]["layer.weight"], sd["model"]["layer.weight"]) and back["epoch"] == 3
    assert torch.equal(back["model"]["scale"], sd["model"]["scale"])
    assert "model/layer.weight" in ldc.load_tensors_metadata(tmp_path / "plain")

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    assert main(["convert", str(tmp_path / "evil.pt"), str(tmp_path / "evil")]) == 2
    assert "refused to deserialize" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "pwned") and not os.path.exists(tmp_path / "evil")


def test_bad_usage(core_ckpt, tmp_path, capsys):
    assert main(["convert", str(tmp_path / "absent"), str(tmp_path / "x")]) == 2
    assert main(["convert", core_ckpt, str(tmp_path / "x.pt"), "--layout", "zarr"]) == 2
    with pytest.raises(SystemExit) as exit_:  # refused by argparse, as any bad argument: exit status 2
        main(["convert", core_ckpt, str(tmp_path / "y"), "--to", "distckpt", "--chunk-mib", "0.0001"])
    assert exit_.value.code == 2 and "--chunk-mib" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    assert main(["convert", core_ckpt, str(tmp_path / "notes"), "--to", "distckpt"]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"
    assert main(["convert", core_ckpt, str(tmp_path / "notes"), "--to", "torch"]) == 2  # a directory, not a file


def test_lightning_checkpoint_exports_to_what_load_from_checkpoint_reads(tmp_path, capsys, isolated_process_group):
    from lightning_helpers import TPMLP

    from lightning_distckpt.lightning import DistCheckpointStrategy

    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="final", every_n_train_steps=3)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DistCheckpointStrategy(), max_steps=3, callbacks=[ckpt],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TPMLP(total_steps=3))
    source = tmp_path / "final.ckpt"
    assert os.path.isdir(source)
    report = run_cli(capsys, source, tmp_path / "final.pt")
    assert report["kind"] == "lightning"
    exported = torch.load(tmp_path / "final.pt", weights_only=False)  # Lightning's own checkpoint dict
    assert exported["global_step"] == 3 and "optimizer_states" in exported and "pytorch-lightning_version" in exported
    reference = ldc.lightning.load_lightning_module(TPMLP, source).state_dict()
    assert set(exported["state_dict"]) == set(reference)
    for k, v in reference.items():
        assert torch.equal(exported["state_dict"][k], v), k
    model = TPMLP.load_from_checkpoint(tmp_path / "final.pt")  # stock Lightning, no lightning_distckpt
    for k, v in reference.items():
        assert torch.equal(model.state_dict()[k], v), k
