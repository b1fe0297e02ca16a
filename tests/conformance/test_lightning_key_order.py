"""A Lightning checkpoint read back keeps the key order of each of its dicts, as ``torch.load`` of a stock one does.

Was: the tensors, stored apart from the common state, were merged back after their common siblings, so
``list(ckpt)`` of a checkpoint read whole (``DistCheckpointIO.load_checkpoint``, ``convert`` to a torch file)
put ``"state_dict"`` after ``"loops"`` and ``"callbacks"``, and a callback's ``{"best": ..., "t": tensor,
"name": ...}`` came back as ``best, name, t``. The manifest now records the order of each dict a read would
change (``key_orders``), written by the plugin and the strategies, and checked on read like the rest of it.
(Resumes handing ``set_extra_state`` its dict in order, for every saver and reader: test_extra_state_containers.)
"""

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.lightning.key_order import ORDERS_KEY, common_first, key_orders, restore_key_orders
from lightning_distckpt.lightning.tree import stored_as_tensor


def _checkpoint():
    """A Lightning-like checkpoint dict whose tensors sit before other values at several depths."""
    return {
        "epoch": 1, "global_step": 5, "pytorch-lightning_version": "2.6.0",
        "state_dict": {"w": torch.arange(3.0), "b": torch.zeros(2)},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {"ModelCheckpoint": {"best": torch.tensor(0.5), "t": torch.ones(2), "name": "a", 3: "int key"}},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "extra": {"a": torch.ones(2), "b": 1, "nested": [{"t": torch.ones(1), "after": "x"}], "d": "y"},
        "scalars": {"zero_d": torch.tensor(2.0), "v": 1},
    }


def _orders(tree, path=()):
    """path -> the dict's keys, for every dict of ``tree``."""
    out = {}
    if isinstance(tree, dict):
        out[path] = list(tree)
        for k, v in tree.items():
            out.update(_orders(v, path + (k,)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.update(_orders(v, path + (i,)))
    return out


def test_a_checkpoint_read_whole_keeps_every_dicts_order_as_torch_load(tmp_path):
    ck = _checkpoint()
    torch.save(ck, tmp_path / "stock.ckpt")
    want = _orders(torch.load(tmp_path / "stock.ckpt", weights_only=True))
    io = DistCheckpointIO()
    io.save_checkpoint(ck, str(tmp_path / "ours"))
    got = io.load_checkpoint(str(tmp_path / "ours"))
    assert _orders(got) == want
    assert torch.equal(got["extra"]["nested"][0]["t"], torch.ones(1))
    assert got["callbacks"]["ModelCheckpoint"][3] == "int key"
    ldc.export.to_torch_file(str(tmp_path / "ours"), str(tmp_path / "out.ckpt"))  # what `convert` writes
    assert _orders(torch.load(tmp_path / "out.ckpt", weights_only=True)) == want


def test_a_trainer_checkpoint_of_the_strategy_read_whole_keeps_lightnings_order(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_distckpt.lightning import DistCheckpointStrategy

    class Model(BoringModel):
        def on_save_checkpoint(self, checkpoint):
            self.saved_order = list(checkpoint)

    model = Model()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DistCheckpointStrategy(), max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(model)
    path = str(tmp_path / "ck")
    trainer.save_checkpoint(path)
    got = DistCheckpointIO().load_checkpoint(path)
    assert list(got) == model.saved_order
    assert model.saved_order.index("state_dict") < model.saved_order.index("loops")  # the case that moved


def test_dicts_the_merge_keeps_in_order_are_not_recorded():
    """Only the dicts a read would reorder cost the manifest bytes: not a state dict of tensors alone, not an
    optimizer's per-parameter state (its step first), not a dict of plain values."""
    sharded = ldc.ShardedTensor.from_rank_offsets
    tree = {"state_dict": {"w": sharded("w", torch.ones(2))},
            "optimizer_states": [{"state": {"w": {"step": torch.tensor(1.0), "exp_avg": sharded("m", torch.ones(2))}}}],
            "loops": {"a": 1}}
    assert key_orders(tree, stored_as_tensor) == [[[], ["state_dict", "optimizer_states", "loops"]]]
    assert key_orders({"loops": {"a": 1}, "state_dict": {"w": sharded("w", torch.ones(2))}}, stored_as_tensor) == []
    # a tensor no save can key by its path (inside a tuple, under a float key) stays in the common state
    assert key_orders({"t": (torch.ones(1),), 0.5: torch.ones(1), "x": 1}, stored_as_tensor) == []


@pytest.mark.parametrize("orders, match", [
    ("no list", "must be a list"),
    ([[["d", "x"], ["k"]]], r"must be \[steps, keys\]"),  # steps not a list of steps
    ([[[["d", "a"]], [["unhashable"]]]], r"must be \[steps, keys\]"),  # a key of no pickled-key type
    ([[[["x", "a"]], ["k"]]], "steps must be"),  # an unknown step kind
    ([[[["l", -1]], ["k"]]], "steps must be"),
    ([[[], [(1, [2])]]], "cannot be one"),  # a tuple key holding a list
    ([[[], ["k"]]] * ((1 << 16) + 1), "at most"),
])
def test_a_malformed_key_order_record_is_a_format_error_naming_the_checkpoint(tmp_path, orders, match):
    path = str(tmp_path / "ck")
    man = {"version": 1, "kind": "plain", "tensor_paths": [[[["d", "w"]], "w"]], ORDERS_KEY: orders}
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "x": 1, "__distckpt__": man}, path)
    with pytest.raises(FormatError, match=f"{path}: manifest {ORDERS_KEY}.*{match}"):
        DistCheckpointIO().load_checkpoint(path)


def test_a_record_for_dicts_not_there_or_keys_not_there_changes_no_value(tmp_path):
    path = str(tmp_path / "ck")
    orders = [[[["d", "gone"], ["d", "deeper"]], ["a"]], [[["d", "x"]], ["z"]], [[], ["nope", "w", "x"]]]
    man = {"version": 1, "kind": "plain", "tensor_paths": [[[["d", "w"]], "w"]], ORDERS_KEY: orders}
    ldc.save({"x": 1, "w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "__distckpt__": man}, path)
    got = DistCheckpointIO().load_checkpoint(path)
    assert list(got) == ["w", "x"] and got["x"] == 1 and got["w"].tolist() == [0, 1, 2, 3]


def test_a_checkpoint_without_the_record_reads_in_the_merges_order(tmp_path):
    """Checkpoints written before the record: read as they were (tensors after their common siblings)."""
    path = str(tmp_path / "ck")
    man = {"version": 1, "kind": "plain", "tensor_paths": [[[["d", "w"]], "w"]]}
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.arange(2.0)), "x": 1, "__distckpt__": man}, path)
    assert list(DistCheckpointIO().load_checkpoint(path)) == ["x", "w"]


def test_reordering_walks_a_shared_subtree_once():
    """A pickle can share one list at every level: 2**40 places from 40 containers. The reorder after a merge
    visits each pair of containers once, as the merge does."""
    shared = [{"b": 1, "a": torch.ones(1)}]
    for _ in range(40):
        shared = [shared, shared]
    merged = {"t": torch.ones(1), "k": shared}
    common_first(merged, {"k": shared})
    assert list(merged) == ["k", "t"]
    state = {"k": shared}
    restore_key_orders(state, [[[["d", "k"]] + [["l", 0]] * 41, ["a", "b"]]], "x")
    inner = state["k"]
    for _ in range(41):
        inner = inner[0]
    assert list(inner) == ["a", "b"]
