"""A checkpoint opened once for one restore (:class:`RestoreSource`): what the strategies check
before a load (who wrote it, what it holds) and the load itself share one parse of its metadata and
one read of its common state."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..reading.checkpoint import CheckpointSource
from .stock import TreePaths


class RestoreSource:
    """A :class:`CheckpointSource` opened once for one restore: its ``metadata.json`` was parsed
    when it was opened, and its common state is read and unpickled on the first ask only, so the
    checks a strategy makes before the load (who wrote it, what it holds) and the load itself share
    them. Any other attribute is the opened source's. ``tree_paths``: a ``torch.save`` file's tensors
    by typed path in its tree (:func:`~.stock.open_torch_file`), and ``key_orders`` the key order of its dicts
    a restore would change (:mod:`.key_order`); None for a directory (its manifest has them)."""

    def __init__(self, source: CheckpointSource, tree_paths: Optional[TreePaths] = None,
                 key_orders: Optional[List[List[Any]]] = None) -> None:
        self.source = source
        self.path: str = source.path
        self.index = source.index
        self.tree_paths = tree_paths
        self.key_orders = key_orders
        self._common: Dict[Tuple[Any, ...], Any] = {}

    def reader(self) -> Any:
        """A reader of the stored shards (one per load)."""
        return self.source.reader()

    def load_common(self, extra_safe_globals: Sequence[Any] = ()) -> Any:
        """The common state, read once per set of ``extra_safe_globals``. The load merges its
        tensors into this very dict: ask before the load, not after."""
        key = tuple(extra_safe_globals)
        if key not in self._common:
            self._common[key] = self.source.load_common(extra_safe_globals)
        return self._common[key]

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)
