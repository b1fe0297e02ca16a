"""Plain ``torch.Tensor`` leaves are replicated tensors (issue 27, item 3), as in PyTorch DCP: stored
once under their tree path, read straight into the template's tensor, resharded like any other,
and put back where they were when the template holds none there. Checkpoints that kept them in
their common state (written before) still load into plain-tensor templates."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.comm import Comm
from lightning_distckpt.core.errors import FormatError, MissingKeysError, ShardingError
from lightning_distckpt.lightning import DistCheckpointStrategy
from lightning_distckpt.saving.save import finalize_save, prepare_save, write_local
from lightning_helpers import TPMLP, full_weights

W = torch.arange(300 * 300, dtype=torch.float32).reshape(300, 300) / 7
B = torch.linspace(-1, 1, 300).to(torch.bfloat16)
LAYERS = [torch.arange(6, dtype=torch.int64), torch.tensor([True, False, True])]


def _state() -> dict:
    """What every rank saves: the same plain tensors (a scalar, bf16, int64, bool) beside common values."""
    return {"model": {"w": W.clone(), "b": B.clone()}, "step": torch.tensor(7.5), "layers": [t.clone() for t in LAYERS],
            "opt": {"state": {0: {"count": torch.tensor(3)}}}, "epoch": 3, "pair": (torch.ones(2), "x")}


def _save(rank, world, path):
    ldc.save(_state(), path)
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plain") / "ck")
    run_distributed(_save, 2, path)
    return path


PLAIN_KEYS = {"model/w", "model/b", "step", "layers/0", "layers/1", "opt/state/0/count"}


def test_stored_once_as_tensors_and_not_in_the_common_state(saved):
    meta = json.loads(open(os.path.join(saved, "metadata.json")).read())
    assert set(meta["tensors"]) == PLAIN_KEYS
    assert all(len(e["shards"]) == 1 for e in meta["tensors"].values())  # one copy each
    assert {e["shards"][0]["writer"] for e in meta["tensors"].values()} == {0, 1}  # spread over the replicas
    assert meta["plain_tensors"]["opt/state/0/count"] == [["d", "opt"], ["d", "state"], ["d", 0], ["d", "count"]]
    assert meta["plain_tensors"]["layers/1"] == [["d", "layers"], ["l", 1]]
    common = ldc.load_common_state_dict(saved, plain_tensors=False)
    assert common == {"epoch": 3, "pair": common["pair"]}  # the tuple stays common as a whole
    assert torch.equal(common["pair"][0], torch.ones(2))
    metadata = ldc.load_tensors_metadata(saved)
    assert metadata["model/b"].dtype == torch.bfloat16 and metadata["step"].global_shape == ()


def _check_values(out: dict) -> None:
    assert torch.equal(out["model"]["w"], W) and torch.equal(out["model"]["b"], B)
    assert out["step"].dtype == torch.float32 and out["step"].shape == () and out["step"].item() == 7.5
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(out["layers"], LAYERS))
    assert torch.equal(out["opt"]["state"][0]["count"], torch.tensor(3)) and out["epoch"] == 3


def test_loads_in_one_process_into_plain_tensors_in_place(saved):
    template = {"model": {"w": torch.zeros(300, 300), "b": torch.zeros(300, dtype=torch.bfloat16)},
                "step": torch.tensor(0.0),
                "layers": [torch.zeros(6, dtype=torch.int64), torch.zeros(3, dtype=torch.bool)]}
    leaves = [template["model"]["w"], template["model"]["b"], template["step"], *template["layers"]]
    out = ldc.load(template, saved, strict="raise_unexpected")
    _check_values(out)
    assert all(a is b for a, b in zip([out["model"]["w"], out["model"]["b"], out["step"], *out["layers"]], leaves))


def test_without_template_leaves_they_come_back_where_they_were(saved):
    """A load that asks for nothing (a Trainer's restore reads its common state so) gets every plain
    tensor at its place: an int dict key stays an int, a list position a list position."""
    out = ldc.load({}, saved, strict="raise_all")
    _check_values(out)
    assert list(out["opt"]["state"]) == [0] and out["pair"][1] == "x"
    common = ldc.load_common_state_dict(saved)
    _check_values(common)


def test_a_place_held_by_the_template_is_not_read_whole(saved):
    out = ldc.load({"model": {"w": ldc.LocalNonpersistentObject("mine")}}, saved)
    assert out["model"]["w"] == "mine" and torch.equal(out["model"]["b"], B)
    rows = torch.zeros(3, 300)
    out = ldc.load({"model": {"w": ldc.ShardedTensor.from_offsets("model/w", rows, (300, 300), (6, 0))}}, saved)
    assert out["model"]["w"] is rows and torch.equal(rows, W[6:9])


def test_inspect_lists_the_plain_tensors(saved):
    r = subprocess.run([sys.executable, "-m", "lightning_distckpt", "inspect", saved, "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    by_key = {t["key"]: t for t in json.loads(r.stdout)["tensors"]}
    assert set(by_key) == PLAIN_KEYS and by_key["model/w"]["shape"] == [300, 300]


def _load3(rank, world, path):
    """3 ranks: model/w into thirds of its rows and layers/0 into thirds (ShardedTensor templates,
    layers/0 at another place), model/b into a plain tensor; everything else without a template."""
    rows = 300 // world
    local = torch.zeros(rows, 300)
    template = {"model": {"w": ldc.ShardedTensor.from_rank_offsets("model/w", local, (0, rank, world)),
                          "b": torch.zeros(300, dtype=torch.bfloat16)},
                "cols": ldc.ShardedTensor.from_rank_offsets("layers/0", torch.zeros(2, dtype=torch.int64),
                                                            (0, rank, world))}
    out = ldc.load(template, path, strict="raise_all")
    assert out["model"]["w"] is local and torch.equal(local, W[rank * rows:(rank + 1) * rows])
    assert torch.equal(out["model"]["b"], B)
    assert torch.equal(out["cols"], LAYERS[0][2 * rank:2 * rank + 2])
    _check_values({**out, "model": {"w": W, "b": out["model"]["b"]}})
    return True


def test_loads_under_three_processes_resharded(saved):
    assert run_distributed(_load3, 3, saved) == [True] * 3


def _load3_plain(rank, world, path, loader):
    template = {"model": {"w": torch.zeros(300, 300), "b": torch.zeros(300, dtype=torch.bfloat16)},
                "step": torch.tensor(0.0)}
    out = ldc.load(template, path, loader=loader)
    _check_values(out)
    return out["model"]["w"] is template["model"]["w"] and out["step"] is template["step"]


@pytest.mark.parametrize("loader", ["every_rank", "parallel"])
def test_loads_under_three_processes_into_plain_tensors(saved, loader):
    assert run_distributed(_load3_plain, 3, saved, loader) == [True] * 3


def test_parameter_and_non_contiguous_templates_are_filled(tmp_path):
    ldc.save({"p": torch.arange(6.0).reshape(2, 3), "t": torch.arange(6.0).reshape(3, 2)}, str(tmp_path / "ck"))
    param = torch.nn.Parameter(torch.zeros(2, 3))
    transposed = torch.zeros(2, 3).T  # a non-contiguous view: read through a buffer, copied in
    out = ldc.load({"p": param, "t": transposed}, str(tmp_path / "ck"))
    assert out["p"] is param and param.requires_grad and torch.equal(param.detach(), torch.arange(6.0).reshape(2, 3))
    assert out["t"] is transposed and torch.equal(transposed, torch.arange(6.0).reshape(3, 2))


def test_what_cannot_be_stored_stays_common_state(tmp_path):
    # complex32: a dtype metadata.json cannot name (complex64 and float8 are stored: test_dtypes_extended.py)
    sd = {"c": torch.ones(2, dtype=torch.complex32), "in_tuple": (torch.ones(1),), "keyed": {(1, 2): torch.ones(3)},
          "sparse": torch.eye(2).to_sparse(), ".": torch.ones(1), "w": torch.ones(4)}
    ldc.save(sd, str(tmp_path / "ck"))
    assert set(ldc.load_tensors_metadata(str(tmp_path / "ck"))) == {"w"}
    out = ldc.load({}, str(tmp_path / "ck"))
    assert out["c"].dtype == torch.complex32 and torch.equal(out["c"].view(torch.int32), sd["c"].view(torch.int32))
    assert torch.equal(out["keyed"][(1, 2)], torch.ones(3))
    assert torch.equal(out["sparse"].to_dense(), torch.eye(2)) and torch.equal(out["w"], torch.ones(4))


def test_async_save_snapshots_plain_tensors(tmp_path):
    w = torch.arange(4.0)
    request = ldc.save({"w": w, "s": torch.tensor(1)}, str(tmp_path / "ck"), async_save=True)
    w.add_(100)  # after the snapshot: not in the checkpoint
    request.finalize()
    out = ldc.load({}, str(tmp_path / "ck"))
    assert torch.equal(out["w"], torch.arange(4.0)) and out["s"].item() == 1


def _only_on_rank_1(rank, world, path):
    with pytest.raises(ldc.ValidationError, match=r"'x'.*held by ranks \[1\]"):
        ldc.save({"step": 1, **({"x": torch.ones(3)} if rank == 1 else {})}, path)
    return True


def test_a_plain_tensor_rank_0_lacks_fails_the_save(tmp_path):
    assert run_distributed(_only_on_rank_1, 2, str(tmp_path / "ck")) == [True, True]
    assert not os.path.exists(tmp_path / "ck")


def test_two_leaves_with_one_key_are_refused_naming_both(tmp_path):
    with pytest.raises(ShardingError, match=r"\['a/b'\] and \['a'\]\['b'\].*'a/b'"):
        ldc.save({"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}}, str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck")


# -- checkpoints that keep plain tensors in their common state ----------------------------------------
def _old_style(path: str) -> None:
    """A checkpoint as saves wrote it before: the save steps without the entry's conversion keep
    plain tensors in common.pt (as the DistCheckpointIO plugin still does for scalars)."""
    tree = {"w": W[:5, :3].clone(), "s": torch.tensor(2.5), "l": [torch.ones(2)], "k": 1}
    prep = prepare_save(tree, path, Comm(None, 0, 1))
    finalize_save(prep, write_local(prep))


def test_old_style_checkpoint_fills_plain_tensor_templates(tmp_path):
    path = str(tmp_path / "old")
    _old_style(path)
    assert ldc.load_tensors_metadata(path) == {}
    template = {"w": torch.zeros(5, 3, dtype=torch.float64), "s": torch.tensor(0.0), "l": [torch.zeros(2)]}
    state, missing, unexpected = ldc.load(template, path, strict="return_all")
    assert (missing, unexpected) == (set(), set())
    assert state["w"] is template["w"] and torch.equal(template["w"], W[:5, :3].double())
    assert state["s"] is template["s"] and template["s"].item() == 2.5 and state["k"] == 1
    assert torch.equal(state["l"][0], torch.ones(2))
    ldc.load({"s": torch.tensor(0.0)}, path, strict="raise_all", loader="every_rank")


def test_old_style_checkpoint_mismatch_is_named(tmp_path):
    path = str(tmp_path / "old")
    _old_style(path)
    with pytest.raises(ShardingError, match=r"'w'.*tensor of shape \(5, 3\) at \['w'\].*shape \(4, 3\)"):
        ldc.load({"w": torch.zeros(4, 3)}, path)
    with pytest.raises(ShardingError, match=r"'k'.*a value of type int at \['k'\]"):
        ldc.load({"k": torch.zeros(1)}, path)
    with pytest.raises(ShardingError, match="cast='any'"):
        ldc.load({"w": torch.zeros(5, 3, dtype=torch.int64)}, path)
    with pytest.raises(MissingKeysError, match="'q'"):
        ldc.load({"q": torch.zeros(1)}, path)


# -- a torch.save file as the source ---------------------------------------------------------------
def test_torch_file_source_fills_the_plain_template(tmp_path):
    weight = torch.randn(32, 8)
    torch.save({"state_dict": {"net.0.weight": weight, "net.0.bias": torch.ones(32)}, "epoch": 1},
               tmp_path / "file.pt")
    template = {"state_dict/net.0.weight": torch.zeros(32, 8)}
    state, missing, unexpected = ldc.load(template, str(tmp_path / "file.pt"), strict="return_all")
    assert unexpected == set() and missing == {"state_dict/net.0.bias"}
    assert state["state_dict/net.0.weight"] is template["state_dict/net.0.weight"]
    assert torch.equal(template["state_dict/net.0.weight"], weight) and state["epoch"] == 1
    torch.save({"state_dict": {"net.0.weight": weight}}, tmp_path / "only.pt")
    nested = {"state_dict": {"net.0.weight": torch.zeros(32, 8)}}
    ldc.load(nested, str(tmp_path / "only.pt"), strict="raise_all")
    assert torch.equal(nested["state_dict"]["net.0.weight"], weight)


# -- a damaged plain_tensors field ---------------------------------------------------------------------
def _forge(ck, change) -> None:
    path = os.path.join(ck, "metadata.json")
    meta = json.loads(open(path).read())
    change(meta["plain_tensors"])
    raw = json.dumps(meta).encode()
    open(path, "wb").write(raw)
    marker_path = os.path.join(ck, "COMMITTED")
    marker = json.loads(open(marker_path).read())
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()  # self-consistent: the field is what is wrong
    open(marker_path, "w").write(json.dumps(marker))


@pytest.mark.parametrize("change, says", [
    (lambda p: p.update(ghost=[["d", "ghost"]]), "names a tensor its index does not list"),
    (lambda p: p.update(w=[["d", "v"]]), "must be the path of 'w'"),
    (lambda p: p.update(w=[["x", "w"]]), "must be the path of 'w'"),
    (lambda p: p.update(w="w"), "must be the path of 'w'"),
    (lambda p: p.__setitem__("l/0", [["d", "l"], ["l", 1 << 40]]), "index < "),
])
def test_damaged_field_is_a_format_error(tmp_path, change, says):
    ck = str(tmp_path / "ck")
    ldc.save({"w": torch.ones(2), "l": [torch.ones(1)]}, ck)
    _forge(ck, change)
    with pytest.raises(FormatError, match=says):
        ldc.load({}, ck)


# -- a Lightning Trainer's common state -----------------------------------------------------------------
class _Restored(Callback):
    """What the restored ModelCheckpoint holds when the resumed run starts."""

    def on_train_start(self, trainer, pl_module):
        self.score = trainer.checkpoint_callback.best_model_score
        self.best_k = dict(trainer.checkpoint_callback.best_k_models)


def _trainer(steps, **kwargs):
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(strategy=DistCheckpointStrategy(), max_steps=steps, **{**options, **kwargs})


def test_trainer_resume_is_exact_and_restores_best_model_score_as_a_tensor(tmp_path, isolated_process_group):
    whole = TPMLP(total_steps=4)
    _trainer(4, enable_checkpointing=False).fit(whole)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", monitor="train_loss", every_n_train_steps=2,
                            save_top_k=2)
    _trainer(2, callbacks=[saver]).fit(TPMLP(total_steps=4))
    saved_score = saver.best_model_score.clone()
    path = str(tmp_path / "step=2.ckpt")
    score_keys = [k for k in ldc.load_tensors_metadata(path) if k.endswith("/best_model_score")]
    assert len(score_keys) == 1  # stored as a tensor, not in common.pt
    restored = _Restored()
    resumed = TPMLP(total_steps=4)
    again = ModelCheckpoint(dirpath=tmp_path, filename="{step}", monitor="train_loss", every_n_train_steps=2,
                            save_top_k=2)
    _trainer(4, callbacks=[again, restored]).fit(resumed, ckpt_path=path)
    assert isinstance(restored.score, torch.Tensor) and restored.score.dtype == saved_score.dtype
    assert restored.score.shape == saved_score.shape and torch.equal(restored.score, saved_score)
    assert all(isinstance(v, torch.Tensor) for v in restored.best_k.values()) and restored.best_k
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k >= 2}
    assert all(torch.equal(a, b) for a, b in zip(full_weights(resumed).values(), full_weights(whole).values()))
