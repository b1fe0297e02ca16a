"""Contracts of the fast paths of opening a load (issue 29): each gives what the plain path gave.

* ``json_bounds._widths`` looks for ``\\u`` only in a text holding a backslash: the same answers.
* ``CheckpointIndex.from_json`` takes the fast entries whole when every entry is one: the same index,
  in the same order; one entry the fast pass leaves out still goes through the full checks.
* ``tie_groups`` answers [] at once when no tensor is held under two keys; ties are still found.
* ``make_request``'s slot skips the overlap check of a one-element tensor only: an expanded view is
  still refused, a meta tensor still read into a fresh one.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_distckpt import ShardedTensor
from lightning_distckpt.core.errors import FormatError, ShardingError
from lightning_distckpt.planning.metadata import CheckpointIndex
from lightning_distckpt.reading.request import make_request
from lightning_distckpt.reading.tied import tie_groups
from lightning_distckpt.storage.json_bounds import _widths


def _widths_plain(raw: bytes) -> tuple:
    """The rule as first written: every search made."""
    width, _, _ = _widths(raw)
    strings = width
    if b"\\u" in raw:
        strings = 4 if re.search(rb"\\u[dD][89abAB]", raw) else max(strings, 2)
    return width, strings, raw.isascii() and b"\\u" not in raw


@pytest.mark.parametrize("text", [
    '{"a": 1}', '{"a\\\\b": 1}', '{"a\\"b": 1}', '{"\\u00e9": 1}', '{"\\ud83d\\ude00": 1}', '{"\u00e9": 1}',
    '{"\u0101\\\\": 1}', '{"\U0001F600": "\\n"}', '{"x": "\\\\u0041"}',
])
def test_widths_same_with_and_without_backslash(text: str) -> None:
    raw = text.encode("utf-8")
    assert _widths(raw) == _widths_plain(raw)


def _index_json(entries: dict) -> dict:
    return {"format_version": 7, "world_size": 2, "save_token": "0123456789abcdef", "tensors": entries,
            "objects": {}}


def _listed(writer: int, packed: int) -> dict:
    return {"global_shape": [4], "dtype": "float32",
            "shards": [{"offset": [0], "shape": [4], "flat": None, "writer": writer, "index": 0, "packed": packed}]}


def test_from_json_all_fast_keeps_order_and_records() -> None:
    entries = {"b": _listed(0, 0), "a": _listed(1, 0), "c": _listed(0, 4),
               "e": {"global_shape": [8, 2], "dtype": "bfloat16", "even": {"over": 2, "packed_from": 0}}}
    index = CheckpointIndex.from_json(_index_json(entries), "here", 2)
    assert list(index.tensors) == ["b", "a", "c", "e"]
    assert [s.packed for s in index.tensors["c"].shards] == [4]
    even = index.tensors["e"].even
    assert even is not None and even.packed.tolist() == [0, 0]  # each chunk first in its writer's pack


def test_from_json_one_slow_entry_still_checked() -> None:
    entries = {"a": _listed(0, 0), "b": _listed(0, 4)}
    entries["b"]["shards"][0]["offset"] = [1]  # 1 + 4 > 4: outside the tensor
    with pytest.raises(FormatError, match=r"tensors\['b'\]"):
        CheckpointIndex.from_json(_index_json(entries), "here", 2)
    even = {"global_shape": [8, 2], "dtype": "bfloat16", "even": {"over": 2, "packed_from": 0}}
    entries = {"a": _listed(0, 0), "b": _listed(0, 5), "e": even}  # a place the packing rule does not give
    with pytest.raises(FormatError, match="packing rule"):
        CheckpointIndex.from_json(_index_json(entries), "here", 2)
    flat = json.loads(json.dumps(_listed(0, 0)))
    flat["shards"][0].update(flat=[0, 4], packed=None)  # left to the full parse: built there
    index = CheckpointIndex.from_json(_index_json({"a": _listed(0, 0), "f": flat}), "here", 2)
    assert list(index.tensors) == ["a", "f"]


def test_tie_groups_none_and_some() -> None:
    base = torch.zeros(4)
    sts = [ShardedTensor.from_rank_offsets(f"k{i}", t) for i, t in enumerate([torch.zeros(4), torch.zeros(4)])]
    assert tie_groups(sts) == []
    tied = [ShardedTensor.from_rank_offsets("x", base), ShardedTensor.from_rank_offsets("y", base),
            ShardedTensor.from_rank_offsets("z", torch.zeros(4))]
    assert tie_groups(tied) == [[0, 1]]
    # ids past the tensors given are not positions
    assert tie_groups(sts[:1], [7, 7]) == []


def test_make_request_checks_kept() -> None:
    one = torch.zeros(1).expand(1)
    req = make_request({"one": ShardedTensor.from_rank_offsets("one", one)})
    assert [t.key for t in req.tensors] == ["one"]
    with pytest.raises(ShardingError, match="share memory"):
        make_request({"w": ShardedTensor.from_rank_offsets("w", torch.empty(1, 4).expand(3, 4))})
    meta = make_request({"m": ShardedTensor.from_rank_offsets("m", torch.empty(3, device="meta"))})
    assert meta.tensors[0].data is None and meta.tensors[0].dtype == torch.float32
    shared = torch.zeros(3)
    both = make_request({"a": ShardedTensor.from_rank_offsets("a", shared),
                         "b": ShardedTensor.from_rank_offsets("b", shared)})
    assert both.tied == [[0, 1]]
