"""A new user's first mistakes with the Trainer, followed from README.md: a ``ckpt_path`` with nothing at it
says what is wrong, where, and what to pass (under the plugin and under ``DistCheckpointStrategy``); a stock
Lightning ``.ckpt`` given to the plugin is no mistake at all. Real Trainer runs, one CPU process each (the
other first-hour mistakes: tests/lightning/test_first_hour_hints.py, tests/docs/test_first_hour.py)."""

from __future__ import annotations

import textwrap

import torch

import lightning_distckpt as ldc

from script_ranks import script_results

ADVICE = 'check the path (a Trainer: ckpt_path="last" resumes from the newest in ModelCheckpoint\'s dirpath)'

FIT = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import lightning_distckpt
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy

    mode, paths = sys.argv[1], sys.argv[2:]

    def trainer(steps, **kind):
        return Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, **kind)

    if mode == "stock":  # a stock Trainer's .ckpt, then the README's one change: the plugin, resuming it
        first = trainer(2)
        first.fit(BoringModel())
        first.save_checkpoint(paths[0])
        mode = "plugin"
    for path in paths:  # the plugin (single device) runs no process group: one fit after another
        kind = {"plugins": [DistCheckpointIO()]} if mode == "plugin" else {"strategy": DistCheckpointStrategy()}
        t = trainer(4, **kind)
        try:
            t.fit(BoringModel(), ckpt_path=path)
            out = {"path": path, "type": None, "message": "", "step": t.global_step}
        except Exception as e:
            out = {"path": path, "type": type(e).__name__, "message": str(e)}
        out["package"] = lightning_distckpt.__file__  # which copy ran: the tree's, or an old one on PYTHONPATH
        print("RESULT " + json.dumps(out), flush=True)
""")


def _committed_pair(tmp_path):
    """ModelCheckpoint's dirpath as the core sees it: two committed checkpoints."""
    ckpts = tmp_path / "ckpts"
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, str(ckpts / name))
    return ckpts


def test_a_missing_ckpt_path_says_what_to_pass_under_the_plugin(tmp_path):
    """Before: "Checkpoint file not found: PATH; checkpoint ...: no such directory (directory ... does not
    exist)" and nothing on what to do when no committed checkpoint sits beside the path; now every such
    message ends with what to pass, the committed ones beside it named first when there are any."""
    _committed_pair(tmp_path)
    results = script_results(FIT, "plugin", "nowhere/last.ckpt", "ckpts/epoch=0-step=9.ckpt", cwd=tmp_path)
    by_path = {r["path"]: r for r in results}
    print("lightning_distckpt from", results[0]["package"])

    r = by_path["nowhere/last.ckpt"]
    assert r["type"] == "CheckpointNotFoundError", r
    assert r["message"].startswith("Checkpoint file not found: nowhere/last.ckpt; "), r  # Lightning's words first
    assert f"{tmp_path / 'nowhere' / 'last.ckpt'} does not exist" in r["message"]  # where, made absolute
    assert r["message"].endswith(ADVICE), r["message"]

    r = by_path["ckpts/epoch=0-step=9.ckpt"]
    assert r["type"] == "CheckpointNotFoundError", r
    beside = f"committed checkpoints in {tmp_path / 'ckpts'}, newest first: last.ckpt, epoch=0-step=2.ckpt"
    assert beside in r["message"], r["message"]
    assert r["message"].endswith(ADVICE), r["message"]
    assert r["message"].count("Checkpoint file not found") == 1


def test_a_missing_ckpt_path_says_what_to_pass_under_the_strategy(tmp_path):
    """The same under DistCheckpointStrategy (its collective load_checkpoint): the advice once."""
    (r,) = script_results(FIT, "strategy", "nowhere.ckpt", cwd=tmp_path)
    assert r["type"] == "CheckpointNotFoundError", r
    assert r["message"].startswith("Checkpoint file not found: nowhere.ckpt; "), r
    assert r["message"].endswith(ADVICE) and r["message"].count(ADVICE) == 1, r["message"]


def test_a_stock_ckpt_with_the_plugin_resumes(tmp_path):
    """Sound before: a newcomer adds the plugin to a run that has stock `.ckpt` files and resumes one; it
    resumes (step 2 -> 4), as docs/lightning.md says, rather than failing on a file that is no directory."""
    (r,) = script_results(FIT, "stock", "stock.ckpt", cwd=tmp_path)
    assert r["type"] is None and r["step"] == 4, r
