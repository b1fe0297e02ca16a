"""torch's process-wide allow-list of the weights-only unpickler, as Megatron-LM's test_safe_globals.py
relies on it (tools/peer_suites/megatron): types registered with ``torch.serialization.add_safe_globals``
(Megatron-Core registers ``argparse.Namespace`` and more when imported) let a plain ``torch.load`` read
them. Our loads allow their own types for the load only: what was registered before stays registered
(even when the same type is in ``extra_safe_globals`` or our defaults), what we added is gone after,
and loads in several threads do not take each other's types away."""

from __future__ import annotations

import argparse
import collections
import threading
from typing import Any, Iterator, List

import pytest
import torch

import lightning_distckpt as ldc


class Point:
    """A user type only a load given ``extra_safe_globals=[Point]`` may restore."""

    def __init__(self, x: int) -> None:
        self.x = x


@pytest.fixture(autouse=True)
def _registry() -> Iterator[None]:
    """The process-wide list as it was before the test, whatever the test registered."""
    before = torch.serialization.get_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def _registered() -> List[Any]:
    return torch.serialization.get_safe_globals()


def test_a_registration_outlives_our_load_of_the_same_type(tmp_path):
    torch.serialization.add_safe_globals([argparse.Namespace, collections.OrderedDict])  # as megatron.core does
    ldc.save({"args": argparse.Namespace(lr=0.1), "order": collections.OrderedDict(a=1),
              "w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))}, tmp_path / "ck")
    common = ldc.load_common_state_dict(tmp_path / "ck", extra_safe_globals=[argparse.Namespace])
    assert common["args"].lr == 0.1 and common["order"] == {"a": 1}
    # OrderedDict is one of our defaults, Namespace was passed as an extra: both stay registered
    assert argparse.Namespace in _registered() and collections.OrderedDict in _registered()
    torch.save(argparse.Namespace(dummy_value=0), tmp_path / "plain.pt")
    assert torch.load(tmp_path / "plain.pt").dummy_value == 0  # Megatron's test_safe_globals


def test_what_our_load_allowed_is_gone_after_it(tmp_path):
    ldc.save({"p": Point(3), "w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))}, tmp_path / "ck")
    assert ldc.load_common_state_dict(tmp_path / "ck", extra_safe_globals=[Point])["p"].x == 3
    assert Point not in _registered()
    torch.save(Point(4), tmp_path / "plain.pt")
    with pytest.raises(Exception, match="Unsupported global"):  # a plain torch.load still refuses it
        torch.load(tmp_path / "plain.pt")
    with pytest.raises(ldc.UnsafeContentError, match="Point"):  # and so does our load without it
        ldc.load_common_state_dict(tmp_path / "ck")


def test_loads_in_threads_keep_each_others_types(tmp_path):
    """Each thread's load needs Point for its whole read; another load finishing meanwhile must not
    take it away (it did: the first to finish removed it)."""
    ldc.save({"p": [Point(i) for i in range(200)], "w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(3))},
             tmp_path / "ck")
    torch.serialization.add_safe_globals([argparse.Namespace])
    errors: List[BaseException] = []
    start = threading.Barrier(3)

    def loads() -> None:
        start.wait(timeout=60)
        try:
            for _ in range(15):
                assert ldc.load_common_state_dict(tmp_path / "ck", extra_safe_globals=[Point])["p"][-1].x == 199
        except BaseException as e:  # reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=loads) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a load did not finish within 120 s"
    assert errors == []
    assert Point not in _registered() and argparse.Namespace in _registered()
