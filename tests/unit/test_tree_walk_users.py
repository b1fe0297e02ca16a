"""The Lightning tree conversions walk through the one bounded walker (``core/tree_walk.py``) and
the one path module (``core/tree_paths.py``): a tree nested deeper than Python recurses, or holding
itself, is a FormatError naming the place, never a RecursionError; a manifest read from a
checkpoint's common state is checked before anything is placed or allocated by it."""

import pytest
import torch

from lightning_distckpt.core.errors import CheckpointingError, FormatError, ShardingError
from lightning_distckpt.core.mapping import ShardedTensor
from lightning_distckpt.lightning.model_parallel import shard_tree
from lightning_distckpt.lightning.tree import (KIND_PLAIN, MANIFEST_VERSION, iter_tensor_leaves, key_of, manifest,
                                               manifest_paths, plain_to_sharded, template_from_manifest)


def _deep(depth, leaf):
    tree = leaf
    for _ in range(depth):
        tree = {"a": tree}
    return tree


def _cyclic():
    inner = [torch.ones(2)]
    inner.append(inner)
    return {"opt": inner}


@pytest.mark.parametrize("convert", [
    lambda tree: shard_tree(tree, ("state_dict",), 0, {}),
    plain_to_sharded,
    lambda tree: list(iter_tensor_leaves(tree)),
], ids=["shard_tree", "plain_to_sharded", "iter_tensor_leaves"])
def test_deep_and_cyclic_trees_are_checkpointing_errors_not_recursion_errors(convert):
    with pytest.raises(FormatError, match=r"nested more than 100 containers deep") as deep:
        convert(_deep(5000, torch.ones(2)))
    assert isinstance(deep.value, CheckpointingError) and "/".join(["a"] * 5) in str(deep.value)
    with pytest.raises(FormatError, match=r"the container at opt/1 contains itself \(a reference cycle\)"):
        convert(_cyclic())


def test_shard_tree_keys_tensors_by_path_and_copies_dicts_and_lists():
    shared = {"w": torch.arange(3.0)}
    tree = {"m": shared, "n": shared, "l": [torch.zeros(2), 5], "t": (torch.ones(1),), "s": torch.tensor(1.0)}
    out = shard_tree(tree, ("state_dict",), 1, {})
    assert out is not tree and out["l"] is not tree["l"]
    assert [(out[k]["w"].key, out[k]["w"].replica_id) for k in ("m", "n")] == [("state_dict/m/w", 1),
                                                                               ("state_dict/n/w", 1)]
    assert isinstance(out["l"][0], ShardedTensor) and out["l"][0].key == "state_dict/l/0" and out["l"][1] == 5
    assert out["t"] is tree["t"] and out["s"] is tree["s"]  # a tuple is common state whole; 0-d stays common


def test_plain_to_sharded_refuses_two_leaves_under_one_key_and_copies_every_container():
    with pytest.raises(ShardingError, match=r"the tensors at \[0\] and \['0'\] would both be stored as '0'"):
        plain_to_sharded({0: torch.ones(2), "0": torch.ones(2)})
    tree = {"a": {"b": 1}, "c": [2], "w": torch.ones(2)}
    out = plain_to_sharded(tree)
    assert out["a"] is not tree["a"] and out["c"] is not tree["c"] and out["w"].key == "w"
    assert key_of(()) == "" and key_of((("d", "a"), ("l", 0))) == "a/0"


def test_a_manifest_round_trips_and_forged_ones_are_format_errors():
    tree = plain_to_sharded({"state_dict": {"w": torch.ones(2, 3)}, "loops": [{"x": torch.zeros(4)}]})
    man = manifest(tree, KIND_PLAIN)
    metadata = {st.key: st for st in (tree["state_dict"]["w"], tree["loops"][0]["x"])}
    template = template_from_manifest(man, metadata, "ck")
    assert template["state_dict"]["w"].global_shape == (2, 3) and template["loops"][0]["x"].key == "loops/0/x"

    def forged(paths):
        return {"version": MANIFEST_VERSION, "kind": KIND_PLAIN, "tensor_paths": paths}

    x = {"x": metadata["loops/0/x"]}
    cases = [
        (forged([([("d", "loops"), ("l", 10**12)], "x")]), r"must be the path of 'x'"),  # would pad 10**12 slots
        (forged([([("q", "a")], "x")]), r"must be the path of 'x'"),
        (forged([([("d", "a")] * 101, "x")]), r"must be the path of 'x'"),
        (forged([([("d", "a")], "x"), ([("d", "a"), ("d", "b")], "x2")]), r"lists tensor 'x2' that metadata"),
        (forged("nope"), r"tensor_paths must be a list"),
        (forged([("just a key",)]), r"entry must be \[steps, key\]"),
        ({"version": 99}, r"unknown __distckpt__ manifest"),
    ]
    for man_, message in cases:
        with pytest.raises(FormatError, match=message):
            template_from_manifest(man_, x, "ck")
    two = {"x": metadata["loops/0/x"], "y": metadata["loops/0/x"]}
    with pytest.raises(FormatError, match=r"manifest path \[\['d', 'a'\], \['d', 'b'\]\] of 'y' does not fit"):
        template_from_manifest(forged([([("d", "a")], "x"), ([("d", "a"), ("d", "b")], "y")]), two, "ck")
    assert manifest_paths(forged([([("d", "a"), ("l", 2)], "k")]), "ck") == {"k": (("d", "a"), ("l", 2))}


class _FakeMegatronLeaf:
    """Stands for megatron-core's LocalNonpersistentObject: leaves are told by their type's module."""

    def __init__(self, obj):
        self.obj = obj


_FakeMegatronLeaf.__module__ = "megatron.core.dist_checkpointing.mapping"
_FakeMegatronLeaf.__name__ = "LocalNonpersistentObject"


def test_megatron_leaves_are_looked_for_only_once_megatron_core_is_imported(monkeypatch):
    import sys
    import types

    from lightning_distckpt.core.mapping import LocalNonpersistentObject
    from lightning_distckpt.core.megatron_leaves import from_megatron_leaves
    from lightning_distckpt.core.plain_tensors import shard_tensors

    package = "megatron.core.dist_checkpointing"
    tree = {"a": [_FakeMegatronLeaf(5)], "w": torch.ones(2)}
    monkeypatch.delitem(sys.modules, package, raising=False)
    assert from_megatron_leaves(tree) is tree  # not walked: no object can be of its types
    with pytest.raises(FormatError, match=r"contains itself"):  # the save's next walk still bounds the tree
        shard_tensors(from_megatron_leaves(_cyclic()), 0)
    monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    out = from_megatron_leaves(tree)
    assert type(out["a"][0]) is LocalNonpersistentObject and out["a"][0].obj == 5
    assert out["w"] is tree["w"] and type(tree["a"][0]) is _FakeMegatronLeaf  # the input is left as it was
