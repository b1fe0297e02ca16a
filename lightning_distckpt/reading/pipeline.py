"""The stages every loader shares: open the checkpoint source and match the template's keys
(:func:`begin_load`), then, once the loader has read the tensors, read the objects and the common
state, put everything in the template's place and agree over the ranks (:func:`finish_load`).

A loader only decides how the tensors get from storage into their destinations (every rank
reading its own, or chunks read once and exchanged). The dtype rule (``load(..., cast=)``) is
checked here, for every requested tensor, before anything is read: the rule travels with the
checkpoint (:func:`with_cast`), so it reaches :func:`begin_load` through any loader. An error on
any rank, at any stage, is held until :func:`finish_load`, where every rank raises it, so no rank
waits in a collective the others never enter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from ..comm import Comm
from ..core.errors import CheckpointingError
from ..core.strict import StrictHandling
from ..planning.load_plan import SAME_KIND, check_dtype_conversion, check_global_shapes, parse_cast
from .checkpoint import CheckpointSource, SourceView, keeps_common, open_checkpoint
from .reads import read_objects
from .plain_tensors import fill_from_common, lacking_plain, request_stored, stored_places, with_filled
from .request import LoaderSetup, LoadRequest, assemble, make_request, match_keys
from .tied import tie_results, untie_reads
from .stats import LoadStats, format_load_times
from ..saving.stats import log_throughput

Result = Tuple[Dict[str, Any], Set[str], Set[str]]


@dataclass
class LoadContext:
    """A load in progress on this rank."""

    comm: Comm
    source: CheckpointSource
    request: LoadRequest
    absent: Set[str]  # keys some rank asks for that the checkpoint lacks: skipped by the reads
    missing: Set[str]  # what load returns under RETURN_* (core.strict.StrictHandling's meaning)
    unexpected: Set[str]
    error: Optional[BaseException] = None  # the first local failure, reported in finish_load
    started: float = field(default_factory=time.perf_counter)
    common: Any = None  # the common state, where begin_load read it already (``common_read``)
    common_read: bool = False
    filled: Dict[int, torch.Tensor] = field(default_factory=dict)  # positions filled from the common state

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error


Opener = Callable[[], CheckpointSource]


class CastingSource(SourceView):
    """``source`` read under the cast rule ``cast`` (``planning.load_plan.CAST_RULES``): how
    ``load(..., cast="any")`` reaches :func:`begin_load` through any loader, whose ``load``
    signature stays as it is. Every other attribute is the source's."""

    def __init__(self, source: CheckpointSource, cast: str) -> None:
        super().__init__(source)
        self.cast = cast


def located(opener: Opener, location: Optional[str]) -> Opener:
    """``opener``, saying where it opens (:func:`opener_location`): a load failing to open it on some rank names
    that place on every rank alike (the ranks that opened it said its path, the others "the checkpoint")."""
    def open_it() -> CheckpointSource:
        return opener()

    open_it.location = location  # type: ignore[attr-defined]
    return open_it


def opener_location(checkpoint: Union[str, CheckpointSource, Opener]) -> Optional[str]:
    """Where ``checkpoint`` (a path, a source, an opener) is, known before it is opened; None where not said."""
    if isinstance(checkpoint, str):
        return checkpoint
    if isinstance(checkpoint, CheckpointSource):
        return checkpoint.path
    for name in ("location", "path"):  # (a SharedCopy says its path)
        value = getattr(checkpoint, name, None)
        if isinstance(value, str):
            return value
    return None


def with_cast(checkpoint: Union[str, CheckpointSource, Opener],
              cast: str) -> Union[str, CheckpointSource, Opener]:
    """``checkpoint`` (a path, a source or an opener, as a loader takes it) to be read under the cast
    rule ``cast``; the default rule leaves it as it is. ArgumentError for an unknown rule."""
    cast = parse_cast(cast)
    if cast == SAME_KIND:
        return checkpoint
    if isinstance(checkpoint, str):
        path = checkpoint
        return located(lambda: CastingSource(open_checkpoint(path), cast), path)
    if isinstance(checkpoint, CheckpointSource):
        return CastingSource(checkpoint, cast)
    opener = checkpoint
    return located(lambda: CastingSource(opener(), cast), opener_location(opener))


def check_dtypes(request: LoadRequest, source: CheckpointSource, absent: Set[str]) -> None:
    """Every requested tensor's dtype against the stored one, under the source's cast rule
    (:func:`with_cast`); ShardingError naming the first one refused."""
    cast = source.cast if isinstance(source, CastingSource) else SAME_KIND
    for st in request.tensors:
        entry = source.index.tensors.get(st.key) if st.key not in absent else None
        if entry is not None:
            check_dtype_conversion(st, entry, source.path, cast)


def begin_load(sharded_state_dict: Dict[str, Any], checkpoint: Union[str, CheckpointSource, Opener], comm: Comm,
               strict: StrictHandling, extra_safe_globals: Sequence[Any] = (),
               loader: Optional[LoaderSetup] = None) -> LoadContext:
    """Collective: open the source (a path, an opener, or a source already open), split the
    template (:func:`plan_request`), match keys (raising on every rank alike when ``strict`` says
    so). A source that cannot be opened on some rank fails the load on every rank here; a bad
    template is held as the context's error until :func:`finish_load`. ``extra_safe_globals``: as
    :func:`finish_load` takes them, for a common state read here (:func:`plan_request`). ``loader``:
    what the loader's collectives depend on, which every rank must pass alike (checked with the keys)."""
    started = time.perf_counter()
    source: Optional[CheckpointSource] = None
    open_error: Optional[BaseException] = None
    try:
        if isinstance(checkpoint, str):
            source = open_checkpoint(checkpoint)
        elif isinstance(checkpoint, CheckpointSource):
            source = checkpoint
        else:
            source = checkpoint()
    except Exception as e:  # agreed in match_keys: a rank that cannot open it must not leave the others waiting
        open_error = e
    error: Optional[BaseException] = None
    read = _Planned(LoadRequest({}, [], []))
    try:
        read = plan_request(sharded_state_dict, source, extra_safe_globals)
    except Exception as e:  # keep taking part in the collectives; every rank raises it at the end
        error = e
    request = read.request
    filled_keys = {request.tensors[p].key for p in read.filled}
    keys = match_keys(source, request, comm, strict, open_error, filled_keys, loader, opener_location(checkpoint))
    assert source is not None  # match_keys raised on every rank otherwise
    if error is None:
        try:
            check_global_shapes(request.tensors, source.index.tensors, source.path)  # every mismatch named at once
            check_dtypes(request, source, keys.absent)
            untie_reads(request.tensors, request.tied, keys.absent)  # tied keys stored twice: compared at the end
        except Exception as e:  # reported on every rank in finish_load; nothing is read for this rank
            error, request = e, LoadRequest({}, [], [])
    return LoadContext(comm, source, request, keys.absent, keys.missing, keys.unexpected, error, started,
                       read.common, read.common_read, read.filled)


class _Planned(NamedTuple):
    """What :func:`plan_request` gives: the request, and the common state where it was read."""

    request: LoadRequest
    common: Any = None
    common_read: bool = False
    filled: Dict[int, torch.Tensor] = {}


def plan_request(sharded_state_dict: Dict[str, Any], source: Optional[CheckpointSource],
                 extra_safe_globals: Sequence[Any]) -> _Planned:
    """The template's request, with the plain tensors ``source`` stored by tree path that the
    template leaves out (read whole into their places) and, for a checkpoint that keeps the
    template's plain tensors in its common state, those filled from it (``reading/plain_tensors.py``;
    the common state is read here only then)."""
    request = make_request(sharded_state_dict)
    if source is None:
        return _Planned(request)
    if keeps_common(source):  # load(..., common=False): the template's leaves only
        request_stored(request, source, stored_places(source))
    lacking = lacking_plain(request, source)
    if not lacking:
        return _Planned(request)
    common = source.load_common(extra_safe_globals)
    cast = source.cast if isinstance(source, CastingSource) else SAME_KIND
    return _Planned(request, common, True, fill_from_common(request, source, lacking, common, cast))


def finish_load(ctx: LoadContext, tensors: Sequence[Optional[torch.Tensor]], stats: LoadStats,
                extra_safe_globals: Sequence[Any], op_name: str) -> Tuple[Result, List[LoadStats]]:
    """Collective: read objects and common state, assemble, agree; returns the result and every
    rank's stats. Raises on every rank when any rank failed, naming each failing rank."""
    state: Dict[str, Any] = {}
    if ctx.error is None:
        try:
            objects = read_objects(ctx.source, ctx.request.objects, ctx.absent, extra_safe_globals)
            common = ({} if not keeps_common(ctx.source) else ctx.common if ctx.common_read
                      else ctx.source.load_common(extra_safe_globals))
            values = with_filled(tensors, ctx.filled)
            tie_results(ctx.request.tensors, ctx.request.tied, values, ctx.absent, ctx.source.path)
            state = assemble(ctx.request, common, values, objects)
        except Exception as e:  # reported on every rank below
            ctx.fail(e)
    stats.total_s = time.perf_counter() - ctx.started
    gathered = ctx.comm.agree(f"load from {ctx.source.path} failed", ctx.error, stats)
    for rk, s in enumerate(gathered):
        s.rank = rk
    log_throughput(op_name, ctx.source.path, ctx.comm.rank, [(s.bytes_read, s.read_s) for s in gathered],
                   time.perf_counter() - ctx.started, detail=lambda: format_load_times(gathered))
    return (state, ctx.missing, ctx.unexpected), gathered


def combine_errors(errors: Sequence[BaseException]) -> Optional[BaseException]:
    """One error for a rank's several read failures: the only one as it is, else a summary."""
    if len(errors) <= 1:
        return errors[0] if errors else None
    more = len(errors) - 3
    text = "; ".join(f"{type(e).__name__}: {e}" for e in errors[:3])
    return CheckpointingError(text + (f"; and {more} more read errors" if more > 0 else ""))
