"""A checkpoint's manifest may name any list position for a tensor nested in a module's extra state: the
template grows the module's list to reach it, but never past MAX_PADDING empty slots (a crafted manifest
asking for a list of 2**40 slots is refused, naming the checkpoint and the key, before any memory is taken)."""

import pytest
import torch

from lightning_distckpt.core.errors import FormatError
from lightning_distckpt.core.mapping import ShardedTensor
from lightning_distckpt.lightning.stock import ModuleEntry, with_nested_tensors
from lightning_distckpt.reading.plain_tensors import MAX_PADDING

ENTRY = ModuleEntry(file_prefix="state_dict/", key_prefix="")
NAME = "sub._extra_state"


def _stored(key):
    return {key: ShardedTensor.from_rank_offsets(key, torch.empty(3))}


def _paths(key, index):
    return {key: (("d", "state_dict"), ("d", NAME), ("d", "hist"), ("l", index))}


def test_a_grown_list_is_padded_to_the_stored_position():
    """A stored per-step list longer than the module's fresh one: the template asks for the tensor at its place,
    the slots before it padded with None, the module's own list untouched."""
    key = f"state_dict/{NAME}/hist/4"
    fresh = {"hist": [torch.zeros(3)]}
    out = with_nested_tensors({NAME: fresh}, ENTRY, _stored(key), _paths(key, 4), "ckpt")
    hist = out[NAME]["hist"]
    assert len(hist) == 5 and hist[1:4] == [None, None, None]
    assert isinstance(hist[4], ShardedTensor) and hist[4].key == key
    assert len(fresh["hist"]) == 1


def test_a_position_past_the_padding_bound_is_refused():
    """A manifest naming list position 2**40: refused with a FormatError naming the checkpoint and the key."""
    key = f"state_dict/{NAME}/hist/{1 << 40}"
    with pytest.raises(FormatError, match=r"checkpoint ckpt:.*empty slots") as e:
        with_nested_tensors({NAME: {"hist": []}}, ENTRY, _stored(key), _paths(key, 1 << 40), "ckpt")
    assert key in str(e.value)
    assert MAX_PADDING < (1 << 40)
