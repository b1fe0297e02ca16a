"""The loaders: how the tensors of a load get from storage into their destinations.

* :class:`EveryRankLoader` (``"every_rank"``): each rank reads exactly what it needs; no
  communication beyond metadata. Replicated state is read once per replica.
* :class:`FullyParallelLoader` (``"parallel"``): over the load's group, each unique chunk read
  once, all of a rank's reads first, then the exchange (no memory bound).
* :class:`TwoStageDataParallelLoader` (``"two_stage"``, the default): within each data-parallel
  group, each unique chunk read once and broadcast, pipelined with bounded memory.

All three run the same pipeline (:mod:`lightning_distckpt.reading.pipeline`); the last two share
one exchange engine (:mod:`lightning_distckpt.reading.exchange`) with a different schedule.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch
import torch.distributed as dist

from ..comm import Comm, comm_device, get_comm
from ..core.errors import ArgumentError, ArgumentTypeError
from ..core.strict import StrictHandling
from ..planning.exchange_plan import ChunkId, chunk_id, plan_exchange
from .checkpoint import CheckpointSource
from .exchange import ChunkExchange
from .exchange_guard import prepare
from ..core.gc_pause import gc_paused
from .pipeline import LoadContext, Opener, Result, begin_load, combine_errors, finish_load
from .reads import read_tensors
from .request import LoaderSetup, Requester
from .stats import LoadStats, format_load_times

logger = logging.getLogger(__name__)

Checkpoint = Union[str, CheckpointSource, Opener]  # a path, a source opened by the caller, or its opener

LOADER_NAMES = ("every_rank", "parallel", "two_stage")
# The default reads every chunk once per group, never more than every-rank reads and DP times
# less with data-parallel replicas, with memory bounded by max_inflight_bytes.
DEFAULT_LOADER = "two_stage"


@runtime_checkable
class Loader(Protocol):
    """What ``load(..., loader=...)`` accepts besides a name."""

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint: Checkpoint, comm: Comm, strict: StrictHandling,
             extra_safe_globals: Sequence[Any] = ()) -> Result: ...


class _GCPausedLoader:
    """A loader whose ``_load`` runs with the cyclic garbage collector paused: a load allocates
    many small objects and pays for collections that find nothing (docs/benchmarks.md)."""

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint: Checkpoint, comm: Comm, strict: StrictHandling,
             extra_safe_globals: Sequence[Any] = ()) -> Result:
        """Collective over ``comm`` (the load's group)."""
        with gc_paused():
            return self._load(sharded_state_dict, checkpoint, comm, strict, extra_safe_globals)

    def _load(self, sharded_state_dict: Dict[str, Any], checkpoint: Checkpoint, comm: Comm, strict: StrictHandling,
              extra_safe_globals: Sequence[Any]) -> Result:
        raise NotImplementedError


class EveryRankLoader(_GCPausedLoader):
    """Each rank reads the pieces its own shards need; ``last_stats`` holds every rank's
    :class:`LoadStats` of the last load, as :class:`ExchangeLoader`'s does."""

    def __init__(self) -> None:
        self.last_stats: List[LoadStats] = []

    def _load(self, sharded_state_dict: Dict[str, Any], checkpoint: Checkpoint, comm: Comm, strict: StrictHandling,
              extra_safe_globals: Sequence[Any]) -> Result:
        ctx = begin_load(sharded_state_dict, checkpoint, comm, strict, extra_safe_globals,
                         LoaderSetup("every_rank"))
        stats = LoadStats(rank=comm.rank)
        tensors: List[Optional[torch.Tensor]] = []
        if ctx.error is None:
            try:
                t0 = time.perf_counter()
                tensors, stats.bytes_read = read_tensors(ctx.source, ctx.request.tensors, ctx.absent)
                stats.read_s = time.perf_counter() - t0
            except Exception as e:  # reported on every rank in finish_load
                ctx.fail(e)
        result, self.last_stats = finish_load(ctx, tensors, stats, extra_safe_globals, "load")
        return result


class ExchangeLoader(_GCPausedLoader):
    """Chunks deduplicated over a group (the load's group, or each rank's data-parallel group):
    each read once by one of the ranks needing it and delivered to the others.

    ``load`` is collective over the load's group; the exchange runs within ``group``.

    Args:
        group: the ranks that share reads (``None``: the group ``load`` runs over). Every rank of
            the load's group passes its own group; the groups must partition the load's group.
        max_inflight_bytes: ``None`` reads everything first and then exchanges (no bound);
            otherwise the pipelined schedule, with at most this many bytes of chunks admitted at
            once on a rank (a single chunk larger than the bound is admitted alone).
        bucket_bytes: chunks smaller than this travel together, up to this many bytes per message.
        read_batch_bytes: pipelined schedule: bytes of queued chunks read in one storage batch.
        device: device for communication buffers (default: from the group's backend).
    """

    op_name = "load (exchange)"

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, max_inflight_bytes: Optional[int] = None,
                 bucket_bytes: int = 256 << 10, read_batch_bytes: int = 16 << 20,
                 device: Optional[torch.device] = None) -> None:
        if max_inflight_bytes is not None and max_inflight_bytes < 1:
            raise ArgumentError(f"max_inflight_bytes must be >= 1, got {max_inflight_bytes}")
        if bucket_bytes < 0:
            raise ArgumentError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
        if read_batch_bytes < 1:
            raise ArgumentError(f"read_batch_bytes must be >= 1, got {read_batch_bytes}")
        self.group = group
        self.max_inflight_bytes = max_inflight_bytes
        self.bucket_bytes = bucket_bytes
        self.read_batch_bytes = read_batch_bytes
        self.device = device
        self.last_stats: List[LoadStats] = []

    def _load(self, sharded_state_dict: Dict[str, Any], checkpoint: Checkpoint, comm: Comm, strict: StrictHandling,
              extra_safe_globals: Sequence[Any]) -> Result:
        exchange_comm = get_comm(self.group) if self.group is not None else comm
        # the plan's messages depend on bucket_bytes and the group: ranks must agree (the schedule may differ)
        setup = LoaderSetup(f"exchange (bucket_bytes={self.bucket_bytes})", _group_token(exchange_comm))
        ctx = begin_load(sharded_state_dict, checkpoint, comm, strict, extra_safe_globals, setup)
        local, empty = _group_requests(ctx)
        device = self.device or comm_device(exchange_comm.group)
        # What can fail on this rank alone fails before the exchange (destinations, buffers: exchange_guard),
        # told to the group with the requests: its ranks all skip the exchange, and finish_load fails them all
        dest, unready = prepare(local, device, self.bucket_bytes)
        if unready is not None:
            ctx.fail(unready)
        # (chunk, nbytes) pairs of plain tuples travel and are planned as they come (pickling a dataclass per
        # chunk cost ~4 µs: thousands of small tensors); a chunk as a plain tuple equals its ChunkId
        gathered = exchange_comm.all_gather_object(
            (unready is None, [(tuple(c), r[0].tensor.local_nbytes()) for c, r in local.items()]))
        stats = LoadStats(rank=comm.rank)
        results: Dict[int, torch.Tensor] = {}
        if all(ready for ready, _ in gathered):
            plan = plan_exchange([requests for _, requests in gathered], bucket_bytes=self.bucket_bytes)
            engine = ChunkExchange(ctx.source, exchange_comm, plan, local, device, dest)
            engine.run(self.max_inflight_bytes, self.read_batch_bytes)
            read_error = combine_errors(engine.errors)
            if read_error is not None:
                ctx.fail(read_error)
            stats, results = engine.stats, engine.results
        tensors: List[Optional[torch.Tensor]] = [results.get(i) for i in range(len(ctx.request.tensors))]
        if ctx.error is None and empty:
            try:
                for r, value in zip(empty, read_tensors(ctx.source, [r.tensor for r in empty], set())[0]):
                    tensors[r.position] = value
            except Exception as e:  # reported on every rank in finish_load
                ctx.fail(e)
        result, self.last_stats = finish_load(ctx, tensors, stats, extra_safe_globals, self.op_name)
        return result

    def summarize_load_times(self) -> str:
        """Per-rank read / wait / copy / communication / total seconds and bytes of the last load
        (every rank has every rank's numbers); also logged at INFO."""
        text = format_load_times(self.last_stats) if self.last_stats else "no load yet"
        logger.info("%s times:\n%s", self.op_name, text)
        return text


class FullyParallelLoader(ExchangeLoader):
    """Total storage reads equal the unique bytes the group needs; reads first, then the exchange,
    with no bound on bytes in flight (a rank may hold extra buffers for its whole share).

    Args:
        process_group: the ranks that share reads (default ``None``: the group ``load`` runs over).
        bucket_bytes: chunks smaller than this travel together, up to this many bytes per message
            (default 256 KiB; a negative value is an ArgumentError).
        device: device for communication buffers (default: from the group's backend).
    """

    op_name = "load (fully parallel)"

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, bucket_bytes: int = 256 << 10,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(process_group, bucket_bytes=bucket_bytes, device=device)


class TwoStageDataParallelLoader(ExchangeLoader):
    """Read each chunk once per data-parallel group and broadcast it within the group, reads
    overlapping the broadcasts, under ``max_inflight_bytes``. The default loader of :func:`load`.

    Args:
        data_parallel_group: this rank's data-parallel group (default ``None``: the group ``load``
            runs over); every rank passes its own, and the groups must partition the load's group.
        max_inflight_bytes: at most this many bytes of chunks admitted at once on a rank (default
            256 MiB; a single larger chunk is admitted alone; below 1 is an ArgumentError).
        bucket_bytes: chunks smaller than this travel together, up to this many bytes per message
            (default 256 KiB; negative is an ArgumentError).
        read_batch_bytes: bytes of queued chunks read in one storage batch (default 16 MiB; below 1
            is an ArgumentError).
        device: device for communication buffers (default: from the group's backend).
    """

    op_name = "load (two-stage)"

    def __init__(self, data_parallel_group: Optional[dist.ProcessGroup] = None, *,
                 max_inflight_bytes: int = 256 << 20, bucket_bytes: int = 256 << 10,
                 read_batch_bytes: int = 16 << 20, device: Optional[torch.device] = None) -> None:
        super().__init__(data_parallel_group, max_inflight_bytes=max_inflight_bytes, bucket_bytes=bucket_bytes,
                         read_batch_bytes=read_batch_bytes, device=device)

    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.group


def _group_token(comm: Comm) -> Tuple[str, int]:
    """``comm``'s group as a :class:`LoaderSetup` names it: a digest of its global ranks, its size."""
    if not (dist.is_available() and dist.is_initialized()):
        return ("", 0)
    ranks = dist.get_process_group_ranks(comm.group or dist.group.WORLD)
    return hashlib.blake2b(repr(sorted(ranks)).encode(), digest_size=16).hexdigest(), comm.size


def _group_requests(ctx: LoadContext) -> Tuple[Dict[ChunkId, List[Requester]], List[Requester]]:
    """(chunk -> its requesters, zero-size requests read locally), skipping keys the checkpoint lacks."""
    local: Dict[ChunkId, List[Requester]] = {}
    empty: List[Requester] = []
    for i, st in enumerate(ctx.request.tensors):
        if st.key in ctx.absent:
            continue
        if st.local_nbytes() == 0:
            empty.append(Requester(i, st))
        else:
            local.setdefault(chunk_id(st), []).append(Requester(i, st))
    return local, empty


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
        raise ArgumentError(f"unknown loader {loader!r}; choose one of {LOADER_NAMES} or pass a loader object")
    if isinstance(loader, Loader):
        return loader
    raise ArgumentTypeError(
        f"loader must be a name {LOADER_NAMES} or an object with a load() method, got {type(loader).__name__}")
