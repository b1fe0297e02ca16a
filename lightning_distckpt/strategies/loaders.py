"""Choosing how ``load`` reads: by name (for configs) or as a loader object.

* ``"every_rank"``: each rank reads exactly what it needs; no communication beyond metadata.
  Replicated state is read once per replica.
* ``"parallel"``: :class:`FullyParallelLoader` over the load's group: each unique chunk read once.
* ``"two_stage"``: :class:`TwoStageDataParallelLoader` with the load's whole group as the
  data-parallel group: each unique chunk read once, pipelined with bounded memory.
"""

from __future__ import annotations

from typing import Any, Dict, Protocol, Sequence, Set, Tuple, Union, runtime_checkable

from ..comm import Comm
from ..core.strict import StrictHandling
from .load import load_every_rank_reads
from .parallel_load import FullyParallelLoader
from .two_stage import TwoStageDataParallelLoader

LOADER_NAMES = ("every_rank", "parallel", "two_stage")
# The default reads every chunk once per group, never more than every-rank reads and DP times
# less with data-parallel replicas, with memory bounded by max_inflight_bytes; a state with no
# replication costs one extra metadata exchange. Measured in benchmarks/bench_parallel.py.
DEFAULT_LOADER = "two_stage"


@runtime_checkable
class Loader(Protocol):
    """What ``load(..., loader=...)`` accepts besides a name."""

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: str, comm: Comm, strict: StrictHandling,
             extra_safe_globals: Sequence[Any] = ()) -> Tuple[Dict[str, Any], Set[str], Set[str]]: ...


class EveryRankLoader:
    """Each rank reads the pieces its own shards need."""

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: str, comm: Comm, strict: StrictHandling,
             extra_safe_globals: Sequence[Any] = ()) -> Tuple[Dict[str, Any], Set[str], Set[str]]:
        return load_every_rank_reads(sharded_state_dict, checkpoint_dir, comm, strict, extra_safe_globals)


def resolve_loader(loader: Union[str, Loader, None]) -> Loader:
    """A loader object for a name (see :data:`LOADER_NAMES`), ``None`` (the default) or a loader."""
    if loader is None:
        loader = DEFAULT_LOADER
    if isinstance(loader, str):
        if loader == "every_rank":
            return EveryRankLoader()
        if loader == "parallel":
            return FullyParallelLoader()
        if loader == "two_stage":
            return TwoStageDataParallelLoader()
        raise ValueError(f"unknown loader {loader!r}; choose one of {LOADER_NAMES} or pass a loader object")
    if isinstance(loader, Loader):
        return loader
    raise TypeError(f"loader must be a name {LOADER_NAMES} or an object with a load() method, got {type(loader).__name__}")
