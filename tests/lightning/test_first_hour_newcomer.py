"""More mistakes of a user's first hour (beside ``test_first_hour_hints.py``), each refused saying
what is wrong, where, and what to do instead: ``load_lightning_module`` given an instance, a plain
module class or its arguments swapped; the weights loaders on a ``fabric.save`` checkpoint and on a
plain state-dict file; a layer renamed between save and resume under ``DistCheckpointStrategy``;
``strict: false`` in a checkpoint YAML; a path inside a checkpoint (its ``data/`` folder, its
``metadata.json``) instead of the checkpoint. Trainer and Fabric run for real, one CPU process each."""

import textwrap

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import ArgumentTypeError, CheckpointingError, ConfigError

from script_ranks import script_results

RESUME_RENAMED = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_distckpt.lightning import DistCheckpointStrategy

    class Renamed(BoringModel):  # BoringModel's `layer` renamed `head`
        def __init__(self):
            super().__init__()
            del self.layer
            self.head = torch.nn.Linear(32, 2)

        def forward(self, x):
            return self.head(x)

    class Lenient(Renamed):
        strict_loading = False

    root = sys.argv[1]
    for model, ckpt in ((BoringModel(), None), (Renamed(), "ck"), (Lenient(), "ck")):
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                          strategy=DistCheckpointStrategy())
        try:
            trainer.fit(model, ckpt_path=ckpt and f"{root}/{ckpt}")
            out = {"type": None, "message": "", "step": trainer.global_step}
        except Exception as e:
            out = {"type": type(e).__name__, "message": str(e)}
        if ckpt is None:
            trainer.save_checkpoint(f"{root}/ck")
        print("RESULT " + json.dumps(out), flush=True)
""")

FABRIC_WEIGHTS = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from lightning.fabric import Fabric
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_distckpt.lightning import FabricDistCheckpointStrategy, load_lightning_module, load_module_weights

    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    model = fabric.setup(torch.nn.Linear(32, 2))
    fabric.save(sys.argv[1], {"model": model, "step": 3})
    for call in (lambda: load_lightning_module(BoringModel, sys.argv[1]),
                 lambda: load_module_weights(torch.nn.Linear(32, 2), sys.argv[1])):
        try:
            call()
            out = {"type": None, "message": ""}
        except Exception as e:
            out = {"type": type(e).__name__, "message": str(e)}
        print("RESULT " + json.dumps(out), flush=True)
""")


_run = script_results


def _trainer_checkpoint(tmp_path):
    """A Trainer checkpoint as the plugin writes it (the dict Lightning hands its CheckpointIO)."""
    from lightning_distckpt.lightning import DistCheckpointIO

    path = tmp_path / "last.ckpt"
    DistCheckpointIO().save_checkpoint({"state_dict": BoringModel().state_dict(), "global_step": 0,
                                        "pytorch-lightning_version": "2.0.0"}, str(path))
    return path


def test_load_lightning_module_given_an_instance_a_plain_module_or_swapped_arguments(tmp_path):
    """Before: an instance fell through to Lightning's ``IndexError: list index out of range``; the
    swapped arguments said only "path must be a path ..., got type"."""
    from lightning_distckpt.lightning import load_lightning_module, load_module_weights

    path = _trainer_checkpoint(tmp_path)
    with pytest.raises(ArgumentTypeError) as e:
        load_lightning_module(BoringModel(), path)
    assert "cls must be a LightningModule class, got an instance of BoringModel" in str(e.value)
    assert "load_lightning_module(BoringModel, path)" in str(e.value)
    assert "load_module_weights(module, path)" in str(e.value)
    with pytest.raises(ArgumentTypeError) as e:
        load_lightning_module(str(path), BoringModel)
    assert f"got str {str(path)!r}; the class comes first: load_lightning_module(MyModule, path)" in str(e.value)
    with pytest.raises(ArgumentTypeError, match="got the class Linear; for a plain nn.Module, build it and call "
                                                r"load_module_weights\(module, path\)"):
        load_lightning_module(torch.nn.Linear, path)
    with pytest.raises(ArgumentTypeError, match=r"module must be an nn.Module instance, got str .*\(the arguments "
                                                r"are swapped\?\); call load_module_weights\(module, path\)"):
        load_module_weights(str(path), torch.nn.Linear(32, 2))
    assert load_lightning_module(BoringModel, path).training is False  # the right call still works


def test_weights_loaders_name_the_entry_of_a_fabric_checkpoint_and_the_loader_of_a_state_dict(tmp_path):
    """Before: "no 'state_dict' (not a Lightning checkpoint)" with the path as given and nothing to do;
    load_module_weights' default entry on a fabric.save checkpoint named the entries, not ``entry=``."""
    from lightning_distckpt.lightning import load_lightning_module

    fab = tmp_path / "fabric_ckpt"
    as_module, as_weights = _run(FABRIC_WEIGHTS, fab, cwd=tmp_path)
    assert as_module["type"] == "CheckpointingError", as_module
    assert f"checkpoint {fab}: no 'state_dict' entry, so not a Trainer's checkpoint (it holds 'model', 'step')" \
        in as_module["message"]
    assert "load_module_weights(module, path, entry='model')" in as_module["message"]
    assert as_weights["type"] == "CheckpointingError", as_weights
    assert "name the module's entry: load_module_weights(module, path, entry='model')" in as_weights["message"]

    sd = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(32, 2).state_dict(), str(sd))
    with pytest.raises(CheckpointingError) as e:
        load_lightning_module(BoringModel, sd)
    assert f"checkpoint {sd}: no 'state_dict' entry" in str(e.value) and "(it holds 'bias', 'weight')" in str(e.value)
    assert "load_module_weights(module, path) (a state dict)" in str(e.value)


def test_a_layer_renamed_between_save_and_resume_says_how_to_skip_and_where_to_look(tmp_path):
    """Before: only the StrictHandling names, no word of the Trainer's ``strict_loading``, and nothing
    of what the checkpoint holds when no key is close to a template's."""
    saved, renamed, lenient = _run(RESUME_RENAMED, tmp_path, cwd=tmp_path)
    assert saved["type"] is None, saved
    assert renamed["type"] == "MissingKeysError", renamed
    text = renamed["message"]
    assert "Unexpected keys (of all ranks): ['head.bias', 'head.weight']" in text
    assert "a Trainer under our strategies: LightningModule.strict_loading = False, or the checkpoint config's " \
           "strict: log_all" in text
    assert f"The checkpoint's keys: python -m lightning_distckpt inspect {tmp_path / 'ck'}" in text
    assert lenient == {"type": None, "message": "", "step": 2}  # what the message says to do works


def test_yaml_strict_false_names_the_mode_lightning_means(tmp_path):
    from lightning_distckpt.lightning import DistCheckpointIO

    cfg = tmp_path / "checkpoint.yaml"
    for value, mode in (("false", "log_all"), ("True", "raise_all")):
        cfg.write_text(f"strict: {value}\n")
        with pytest.raises(ConfigError) as e:
            DistCheckpointIO.from_config(str(cfg))
        assert "unknown strict handling" in str(e.value)
        assert f"(Lightning's strict={value.capitalize()} is strict: {mode})" in str(e.value), e.value
    cfg.write_text("strict: log_all\n")
    assert DistCheckpointIO.from_config(str(cfg)).config.strict == "log_all"


def test_a_path_inside_a_checkpoint_names_the_checkpoint(tmp_path):
    """Its ``data/`` folder or its ``metadata.json`` given instead of the checkpoint directory."""
    from lightning_distckpt.lightning import load_module_weights

    ck = tmp_path / "ck"
    ldc.save({"weight": ldc.ShardedTensor.from_rank_offsets("weight", torch.ones(2, 3))}, str(ck))
    template = {"weight": ldc.ShardedTensor.from_rank_offsets("weight", torch.zeros(2, 3))}
    with pytest.raises(ldc.IncompleteCheckpointError) as e:
        ldc.load(template, str(ck / "data"))
    assert f"it lies inside the checkpoint {ck}: pass that directory" in str(e.value), e.value
    with pytest.raises(ldc.FormatError) as e:
        load_module_weights(torch.nn.Linear(3, 2), ck / "metadata.json")
    assert "is not a checkpoint" in str(e.value)
    assert f"it lies inside the checkpoint {ck}: pass that directory" in str(e.value), e.value
    other = tmp_path / "notes.txt"  # a file in no checkpoint: no such hint
    other.write_text("mine")
    with pytest.raises(ldc.FormatError) as e:
        ldc.load(template, str(other))
    assert "lies inside" not in str(e.value)
