"""One checkpoint opened once for every load of it (:class:`SharedCopy`).

A restore (say, of a local tier's copy) loads one point in parts (Lightning: the module, then the
optimizer state). Each load of a path would open the copy again (parse its ``metadata.json``, derive
the readers' index) and unpickle its common state again (tens of ms for an optimizer's many small
step tensors), on every rank. A :class:`SharedCopy` is the opener the loads of one checkpoint share:
the first load opens it, inside its first collective step (a rank that cannot open it fails every
rank, as a load of a path does), and later loads take the same opened source and the same unpickled
common state. Its owner drops it once the checkpoint may have changed (the tiers: a copy found
damaged and completed again).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checkpoint import CheckpointSource, open_checkpoint


class _SharedSource:
    """``source`` whose common state is unpickled once per set of ``extra_safe_globals``. Each load
    gets its own dicts and lists of it (a load merges its values into them): what one load or its
    caller does to them never shows in another's. Every other attribute is the source's."""

    def __init__(self, source: CheckpointSource) -> None:
        self.source = source
        self.path: str = source.path
        self.index = source.index
        self._common: Dict[Tuple[Any, ...], Any] = {}

    def reader(self) -> Any:
        return self.source.reader()

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        key = tuple(extra_safe_globals)
        if key not in self._common:
            self._common[key] = self.source.load_common(extra_safe_globals)
        return own_containers(self._common[key])

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)


def own_containers(tree: Any) -> Any:
    """``tree`` with each dict and list reachable through dicts and lists copied (of the same type,
    shared and cyclic ones copied once), every other value shared: the containers a load's merge
    changes. Iterative (any depth); a loop, not ``torch.utils._pytree.tree_map``, which costs several
    times more on an optimizer's common state (an object per leaf: thousands of parameter ids)."""
    if not isinstance(tree, (dict, list)):
        return tree
    copies: Dict[int, Any] = {}

    def copied(node: Any) -> Any:
        if id(node) not in copies:
            copies[id(node)] = node.copy() if type(node) in (dict, list) else copy.copy(node)
            pending.append(copies[id(node)])
        return copies[id(node)]

    pending: List[Any] = []
    root = copied(tree)
    while pending:
        node = pending.pop()
        for k, v in (list(node.items()) if isinstance(node, dict) else enumerate(node)):
            if isinstance(v, (dict, list)):
                node[k] = copied(v)
    return root


class SharedCopy:
    """The opener every load of the checkpoint at ``path`` shares (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._opened: Optional[_SharedSource] = None

    def __call__(self) -> CheckpointSource:
        """The opened copy: opened by the first call (its errors raised to that call's load)."""
        if self._opened is None:
            self._opened = _SharedSource(open_checkpoint(self.path))
        return self._opened  # type: ignore[return-value]
