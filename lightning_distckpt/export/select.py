"""Which tensors of a checkpoint an export writes: ``only="model"`` (the weights, without optimizer
state) and ``include`` (name prefixes, any of which a tensor's name must start with).

Optimizer state is recognized the way torch lays it out, not by naming conventions alone: a tensor
is optimizer state when its path in the saved tree (the Lightning manifest's, else its stored key
cut at ``.`` and ``/``) passes through a dict that holds ``param_groups`` in the common state (a
``torch.optim.Optimizer.state_dict()``: the Trainer's ``optimizer_states[i]``, a ``fabric.save``'d
optimizer, ``optimizer_sharded_state_dict``'s ``optimizer``), or when its stored key starts with
``optimizer.`` / ``optimizer/`` (Megatron-Core's and our sharded optimizer's keys).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping, Optional, Sequence, Set, Tuple

from ..core.errors import ArgumentError, ArgumentTypeError

ONLY_CHOICES = ("model",)
_KEY_STEP = re.compile(r"[./]")
_OPTIMIZER_PREFIXES = ("optimizer.", "optimizer/")


@dataclass(frozen=True)
class Selection:
    """``only``: None (everything the export writes by default) or ``"model"`` (no optimizer state);
    ``include``: name prefixes (empty: no filter)."""

    only: Optional[str] = None
    include: Tuple[str, ...] = ()

    @property
    def everything(self) -> bool:
        return self.only is None and not self.include

    def describe(self) -> str:
        parts = [f"only={self.only!r}"] if self.only else []
        return ", ".join(parts + ([f"include={list(self.include)}"] if self.include else []))

    def keeps(self, names: Collection[str], optimizer_state: bool) -> bool:
        """Whether a tensor known by ``names`` (its stored key, its export name) is written."""
        if self.only == "model" and optimizer_state:
            return False
        return not self.include or any(n.startswith(p) for n in names for p in self.include)


def selection(only: Any = None, include: Any = ()) -> Selection:
    """The arguments ``only`` and ``include`` checked (ArgumentTypeError / ArgumentError naming them)."""
    if only is not None and not isinstance(only, str):
        raise ArgumentTypeError(f"only must be None or one of {list(ONLY_CHOICES)}, got {type(only).__name__}")
    if only is not None and only not in ONLY_CHOICES:
        raise ArgumentError(f"only={only!r}: choose one of {list(ONLY_CHOICES)} (or None: every tensor)")
    if isinstance(include, str) or not isinstance(include, (list, tuple)):
        raise ArgumentTypeError(f"include must be a list of name prefixes (str), got {type(include).__name__}")
    for p in include:
        if not isinstance(p, str) or not p:
            raise ArgumentTypeError(f"include: each prefix must be a non-empty str, got {p!r}")
    return Selection(only, tuple(include))


def _child(node: Any, step: Any) -> Tuple[bool, Any]:
    """``node[step]`` where it exists (a list index may come as text, from a stored key)."""
    if isinstance(node, Mapping):
        return (True, node[step]) if step in node else (False, None)
    if isinstance(node, (list, tuple)):
        try:
            i = int(step)
        except (TypeError, ValueError):
            return False, None
        return (True, node[i]) if 0 <= i < len(node) else (False, None)
    return False, None


def _under_optimizer(common: Any, steps: Sequence[Any]) -> bool:
    node = common
    for step in steps:
        if isinstance(node, Mapping) and "param_groups" in node:
            return True
        found, node = _child(node, step)
        if not found:
            return False
    return False


def optimizer_state_keys(keys: Iterable[str], common: Any, paths: Mapping[str, Sequence[Any]]) -> Set[str]:
    """The stored ``keys`` that are optimizer state (module docstring); ``paths``: a key's steps in
    the saved tree where a manifest records them."""
    out = set()
    for key in keys:
        steps = paths.get(key) or _KEY_STEP.split(key)
        if key.startswith(_OPTIMIZER_PREFIXES) or _under_optimizer(common, steps):
            out.add(key)
    return out
