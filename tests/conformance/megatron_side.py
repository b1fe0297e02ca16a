"""Running megatron-core beside lightning_distckpt in the tests' worker processes: the fixture
checkpoints, a template built with either library's classes, and the outcome of a load (raised,
returned key sets, key sets logged) in a form the two libraries' outcomes compare by."""

from __future__ import annotations

import ast
import logging
import os
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import torch

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "megatron")
# Written by megatron-core 0.16.1, the release the test extra installs: its own load reads it.
CURRENT = os.path.join(FIXTURES, "0.16.1")
STORED = ("w", "b", "r", "layers.w", "obj")  # the keys build.py saves


def versions() -> List[str]:
    """The megatron-core releases that wrote a fixture, oldest first."""
    found = [n for n in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, n))]
    return sorted(found, key=lambda v: tuple(int(p) for p in v.split(".")))


def cpu_only_megatron() -> None:
    """megatron-core calls CUDA on a CPU-only torch (see tests/fixtures/megatron/build.py); in the
    worker process only."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self


def template(mod: Any, keys: Tuple[str, ...], rank: int, world: int,
             replica: Callable[[str], int] = lambda key: 0) -> Dict[str, Any]:
    """Whole tensors (replica id ``replica(key)``) for ``keys`` with ``mod``'s classes; ``obj``
    asks for the next rank's element; any other key is a float tensor of 3 (absent from the
    fixture)."""
    shapes = {"w": ((8, 6), torch.float32), "b": ((6, 10), torch.bfloat16), "r": ((5,), torch.int64),
              "layers.w": ((3, 4, 4), torch.float32)}
    out: Dict[str, Any] = {}
    for key in keys:
        if key == "obj":
            out[key] = mod.ShardedObject("obj", None, (world,), ((rank + 1) % world,), replica_id=0)
            continue
        shape, dtype = shapes.get(key, ((3,), torch.float32))
        out[key] = mod.ShardedTensor.from_rank_offsets(key, torch.full(shape, 7).to(dtype), replica_id=replica(key))
    return out


class Outcome(NamedTuple):
    """What a load did, comparable between the libraries: ``raised`` (the error's message, or None),
    the key sets it returned (None when it returns only the state dict), the key sets named in its
    WARNING lines about keys, and the result's keys."""

    raised: Optional[str]
    returned: Optional[Tuple[Set[str], Set[str]]]
    logged_missing: Optional[Set[str]]
    logged_unexpected: Optional[Set[str]]
    result_keys: Optional[Set[str]]


class Records(logging.Handler):
    """Collects the WARNING records of a logger while attached."""

    def __init__(self, logger_name: str) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []
        self._logger = logging.getLogger(logger_name)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "Records":
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)


def _named(messages: List[str], title: str) -> Optional[Set[str]]:
    """The keys a message lists after ``title`` (Megatron prints a set, we print a sorted list)."""
    for message in messages:
        found = re.search(re.escape(title) + r" \([^)]*\): (set\(\)|\{[^}]*\}|\[[^\]]*\])", message)
        if found:
            text = found.group(1)
            return set() if text == "set()" else set(ast.literal_eval(text))
    return None


def outcome(load: Any, logger_name: str) -> Outcome:
    """Run ``load()`` and describe what it did."""
    with Records(logger_name) as records:
        try:
            out = load()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # either library's error (DCP's CheckpointException is a BaseException)
            return Outcome(f"{type(e).__name__}: {e}", None, None, None, None)
    returned = None
    if isinstance(out, tuple):
        out, missing, unexpected = out
        returned = (set(missing), set(unexpected))
    return Outcome(None, returned, _named(records.messages, "Missing keys"),
                   _named(records.messages, "Unexpected keys"), set(out))


def normal(text: str) -> str:
    """``text`` with each set or list literal as a sorted list and whitespace collapsed: Megatron
    prints sets (in any order), we print sorted lists."""
    def as_list(found: "re.Match[str]") -> str:
        inner = found.group(0)
        return repr(sorted(ast.literal_eval(inner))) if inner != "set()" else "[]"

    return " ".join(re.sub(r"set\(\)|\{[^{}]*\}|\[[^\[\]]*\]", as_list, text).split())
