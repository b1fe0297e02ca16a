"""A hostile checkpoint's common (non-tensor) state, once handed to Lightning, Fabric or the user:
what a red-team probe found.

* omegaconf containers are allow-listed (Lightning keeps hparams in them) and kept their
  interpolations live: a stored ``${oc.env:SECRET}`` read the loading process's environment into the
  loaded value, and ``${<resolver>:...}`` ran whatever function the application registered under that
  name (Hydra codebases register ``eval``), the first time anything read the value. Loading ran code
  after all. Such a value is now refused at load (UnsafeContentError naming it; every loader reads
  common state through one function), unless ``LIGHTNING_DISTCKPT_ALLOW_RESOLVERS=1``. An interpolation
  naming another value of the config (``${lr}``) is data and is kept.
* An omegaconf node that is its own parent loaded, then every read of it raised RecursionError; it
  is a FormatError at load.
* A stored optimizer's ``param_groups`` that are no list of dicts with lists of parameters, or that
  name a parameter index out of range, raised AttributeError / TypeError / IndexError from deep in
  the restore; they are a CheckpointingError naming the checkpoint.
"""

import hashlib
import io
import json
import os
import shutil
import sys
import warnings

import pytest
import torch
from omegaconf import OmegaConf

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError, FormatError, UnsafeContentError
from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy, load_lightning_module
from lightning_distckpt.storage.omegaconf_check import ALLOW_RESOLVERS_ENV

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from lightning_helpers import TPMLP, quiet_trainer  # noqa: E402

SECRET_ENV = "LDC_REDTEAM_FAKE_SECRET"


@pytest.fixture
def resolver_calls(monkeypatch):
    """A resolver the application registered (as Hydra codebases register ``eval``): the arguments
    it was called with. A fake secret in the environment."""
    calls = []
    monkeypatch.setenv(SECRET_ENV, "hunter2")
    monkeypatch.delenv(ALLOW_RESOLVERS_ENV, raising=False)
    with warnings.catch_warnings():  # omegaconf 2.4 renamed it; the old name works everywhere
        warnings.simplefilter("ignore")
        OmegaConf.register_new_resolver("redteam_run", lambda arg: calls.append(arg) or f"ran {arg}")
    yield calls
    OmegaConf.clear_resolver("redteam_run")


def _save_with_hparams(tmp_path, conf):
    """A real Trainer run under the plugin whose module keeps ``conf`` as a hyper-parameter."""
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, enable_checkpointing=False,
                            plugins=[DistCheckpointIO()])
    trainer.fit(TPMLP(total_steps=1, conf=conf))
    path = str(tmp_path / "hostile.ckpt")
    trainer.save_checkpoint(path)
    return path


HOSTILE = [("env", {"lr": 0.1, "key": "${oc.env:" + SECRET_ENV + "}"}, "key", "oc.env"),
           ("resolver", {"lr": 0.1, "deep": {"x": ["ok", "pre-${redteam_run:payload}"]}}, "deep.x[1]", "redteam_run"),
           ("nested_in_a_node_key", {"a": {"hunter2": 1}, "v": "${a.${oc.env:" + SECRET_ENV + "}}"}, "v", "oc.env")]


@pytest.mark.parametrize("name,conf,where,resolver", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_resolver_interpolation_in_hparams_is_refused_by_every_loader(tmp_path, isolated_process_group,
                                                                        resolver_calls, name, conf, where, resolver):
    path = _save_with_hparams(tmp_path, OmegaConf.create(conf))
    loaders = {
        "load_common_state_dict": lambda: ldc.load_common_state_dict(path),
        "DistCheckpointIO.load_checkpoint": lambda: DistCheckpointIO().load_checkpoint(path),
        "load_lightning_module": lambda: load_lightning_module(TPMLP, path),
        "Trainer.fit": lambda: quiet_trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False,
                                             plugins=[DistCheckpointIO()]).fit(TPMLP(total_steps=2), ckpt_path=path),
    }
    for loader, load in loaders.items():
        with pytest.raises(UnsafeContentError) as e:
            load()
        message = str(e.value)
        assert f"at {where!r}" in message and f"the resolver {resolver!r}" in message, (loader, message)
        assert ALLOW_RESOLVERS_ENV in message and "hunter2" not in message, loader
    assert resolver_calls == []  # nothing ran, nothing was read from the environment


def test_fabric_load_refuses_a_resolver_interpolation(tmp_path, isolated_process_group, resolver_calls):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[DistCheckpointIO()])
    path = str(tmp_path / "fabric.ckpt")
    # Written directly: fabric.save itself resolves a DictConfig's interpolations (Fabric's
    # apply_to_collection rebuilds it from its resolved items), a hostile writer need not.
    manifest = {"version": 1, "kind": "plain", "tensor_paths": []}  # what the plugin writes beside
    ldc.save({"step": 3, "cfg": OmegaConf.create({"run": "${redteam_run:boom}"}), "__distckpt__": manifest}, path)
    with pytest.raises(UnsafeContentError, match="'redteam_run'"):
        fabric.load(path)
    assert resolver_calls == []


def test_node_interpolations_and_escaped_text_stay_data(tmp_path, isolated_process_group, resolver_calls):
    conf = OmegaConf.create({"lr": 0.1, "ref": "${lr}", "up": {"down": "${..lr}"},
                             "text": "\\${oc.env:" + SECRET_ENV + "}", "port": "http://${up.down}:80"})
    path = _save_with_hparams(tmp_path, conf)
    loaded = DistCheckpointIO().load_checkpoint(path)["hyper_parameters"]["conf"]
    assert OmegaConf.is_config(loaded) and loaded.ref == 0.1 and loaded.up.down == 0.1
    assert loaded.text == "${oc.env:" + SECRET_ENV + "}" and loaded.port == "http://0.1:80"  # text, not the secret
    model = load_lightning_module(TPMLP, path)
    assert model.hparams.conf.ref == 0.1
    assert resolver_calls == []


def test_the_opt_in_keeps_resolver_interpolations(tmp_path, isolated_process_group, resolver_calls, monkeypatch):
    path = _save_with_hparams(tmp_path, OmegaConf.create({"key": "${oc.env:" + SECRET_ENV + "}",
                                                          "run": "${redteam_run:x}"}))
    monkeypatch.setenv(ALLOW_RESOLVERS_ENV, "1")  # the user trusts this checkpoint
    loaded = ldc.load_common_state_dict(path)["hyper_parameters"]["conf"]
    assert loaded.key == "hunter2" and loaded.run == "ran x" and resolver_calls == ["x"]


def test_a_child_config_whose_parent_holds_a_resolver_is_refused(tmp_path, resolver_calls):
    """``save_hyperparameters(cfg.model)`` pickles the child with its parents: an absolute
    interpolation in the child reaches the root, so the whole chain is checked."""
    root = OmegaConf.create({"secret": "${oc.env:" + SECRET_ENV + "}", "model": {"dim": 4, "leak": "${secret}"}})
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "hp": root.model},
             str(tmp_path / "ck"))
    with pytest.raises(UnsafeContentError, match="at 'secret'"):
        ldc.load_common_state_dict(str(tmp_path / "ck"))
    assert resolver_calls == []


def test_an_omegaconf_node_that_is_its_own_parent_is_a_format_error_at_load(tmp_path):
    conf = OmegaConf.create({"a": 1})
    conf.__dict__["_parent"] = conf  # what a hostile pickle can say: every read would recurse forever
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "hp": conf}, str(tmp_path / "ck"))
    with pytest.raises(FormatError, match="parents that form a cycle"):
        ldc.load_common_state_dict(str(tmp_path / "ck"))


# ------------------------------------------------------------------ optimizer param_groups

def _rewrite_common(path, edit):
    """A hostile writer's checkpoint: the common state edited, the commit marker's hash matching."""
    common = ldc.load_common_state_dict(path, plain_tensors=False)
    edit(common)
    buf = io.BytesIO()
    torch.save(common, buf)
    raw = buf.getvalue()
    with open(os.path.join(path, "common.pt"), "wb") as f:
        f.write(raw)
    marker_path = os.path.join(path, "COMMITTED")
    with open(marker_path) as f:
        marker = json.load(f)
    marker["common_sha256"] = hashlib.sha256(raw).hexdigest()
    with open(marker_path, "w") as f:
        json.dump(marker, f)


def _groups_not_dicts(common):
    common["optimizer_states"][0]["param_groups"] = ["x"]


def _params_not_a_list(common):
    common["optimizer_states"][0]["param_groups"][0]["params"] = 5


def _index_out_of_range(common):
    common["optimizer_states"][0]["param_groups"][0]["params"] = [100, 101, 102, 103]


EDITS = [("plugin", _groups_not_dicts, "param_groups are malformed"),
         ("plugin", _params_not_a_list, "param_groups are malformed"),
         ("plugin", _index_out_of_range, "parameter index 100, outside 0..3"),
         ("strategy", _groups_not_dicts, "param_groups are malformed"),
         ("strategy", _params_not_a_list, "param_groups are malformed")]


@pytest.mark.parametrize("writer,edit,message", EDITS, ids=[f"{w}-{e.__name__.strip('_')}" for w, e, _ in EDITS])
def test_malformed_param_groups_are_a_checkpointing_error_on_resume(tmp_path, isolated_process_group,
                                                                    writer, edit, message):
    """Resumed under DistCheckpointStrategy, from a checkpoint the plugin (tensors by tree path) or
    the strategy (sharded) wrote; was AttributeError / TypeError / IndexError."""
    save_kwargs = {"plugins": [DistCheckpointIO()]} if writer == "plugin" else {"strategy": DistCheckpointStrategy()}
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, enable_checkpointing=False, **save_kwargs)
    trainer.fit(TPMLP(total_steps=2))
    path = str(tmp_path / "ck")
    trainer.save_checkpoint(path)
    good = str(tmp_path / "good")
    shutil.copytree(path, good)
    _rewrite_common(path, edit)
    resume = quiet_trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False,
                           strategy=DistCheckpointStrategy())
    with pytest.raises(CheckpointingError, match=message):
        resume.fit(TPMLP(total_steps=2), ckpt_path=path)
    resumed = quiet_trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False,
                            strategy=DistCheckpointStrategy())
    resumed.fit(TPMLP(total_steps=2), ckpt_path=good)  # the same checkpoint unedited resumes
    assert resumed.global_step == 2


def test_a_save_whose_common_state_a_load_would_refuse_warns_at_save(tmp_path, resolver_calls, caplog):
    """Said when saving (a Hydra config's ``${oc.env:...}`` kept unresolved in hparams), not first when a
    resume refuses it; a config of node references saves without a word; nothing is resolved by the check."""
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        ldc.save({"cfg": OmegaConf.create(HOSTILE[1][1]), "step": 1}, str(tmp_path / "hydra"))
    warned = [r.getMessage() for r in caplog.records if "A load will refuse it" in r.getMessage()]
    assert len(warned) == 1 and "deep.x[1]" in warned[0] and "'redteam_run'" in warned[0], warned
    assert "OmegaConf.to_container(cfg, resolve=True)" in warned[0] and ALLOW_RESOLVERS_ENV in warned[0]
    assert resolver_calls == []
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        ldc.save({"cfg": OmegaConf.create({"lr": 0.1, "copy": "${lr}"}), "step": 1}, str(tmp_path / "plain"))
    assert not [r for r in caplog.records if "A load will refuse it" in r.getMessage()]


def test_saves_into_one_folder_warn_once(tmp_path, resolver_calls, caplog):
    """A fit saving every N steps into its checkpoint folder says it once, not at every save."""
    with caplog.at_level("WARNING", logger="lightning_distckpt"):
        for step in range(3):
            ldc.save({"cfg": OmegaConf.create(HOSTILE[0][1]), "step": step}, str(tmp_path / f"step{step}"))
    assert len([r for r in caplog.records if "A load will refuse it" in r.getMessage()]) == 1
