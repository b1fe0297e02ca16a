"""The pieces of lightning/stock.py and lightning/tree.py that move optimizer state across layouts."""

import pytest
import torch

from lightning_distckpt import CheckpointingError

from lightning_distckpt.lightning.stock import restore_param_keys
from lightning_distckpt.lightning.tree import torch_optimizer_states


def test_stored_optimizer_state_by_index_comes_back_by_key():
    stored = {"state": {0: {"step": torch.tensor(3.0)}, "a.weight": {"exp_avg": torch.ones(2), "step": torch.tensor(0.0)},
                        "b.weight": {"exp_avg": torch.zeros(2)}},
              "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]}
    out = restore_param_keys(stored, ["a.weight", "b.weight"], "ckpt")
    assert out["param_groups"] == [{"lr": 0.1, "params": ["a.weight"]}, {"lr": 0.2, "params": ["b.weight"]}]
    assert float(out["state"]["a.weight"]["step"]) == 3.0  # the stored scalar wins over a fresh one
    assert torch.equal(out["state"]["a.weight"]["exp_avg"], torch.ones(2))
    assert out["param_keys"] == ["a.weight", "b.weight"]


def test_param_count_mismatch_is_named():
    stored = {"state": {}, "param_groups": [{"params": [0, 1, 2]}]}
    with pytest.raises(CheckpointingError, match=r"x.ckpt: the stored optimizer has 3 parameters, this optimizer 1"):
        restore_param_keys(stored, ["a"], "x.ckpt")


def test_keyed_optimizer_state_in_torch_layout():
    tree = {"optimizer_states": [{"state": {"b": {"exp_avg": torch.ones(1)}, "a": {"exp_avg": torch.zeros(1)}},
                                  "param_groups": [{"lr": 1.0, "params": ["a", "b"]}]}],
            "hyper_parameters": {"param_groups": "not an optimizer"}}
    out = torch_optimizer_states(tree)
    opt = out["optimizer_states"][0]
    assert opt["param_groups"] == [{"lr": 1.0, "params": [0, 1]}]
    assert torch.equal(opt["state"][1]["exp_avg"], torch.ones(1)) and torch.equal(opt["state"][0]["exp_avg"], torch.zeros(1))
    assert out["hyper_parameters"] == {"param_groups": "not an optimizer"}
