"""Preparing a save (collective, metadata only): describe this rank's entries, tell the other
ranks in one exchange (the :class:`Handshake`), validate and plan (or reuse a cached plan), and
pick out this rank's writes. Nothing is written here."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from ..comm import Comm
from ..core.errors import ArgumentError, CheckpointingError, ShardingError, UnsafeContentError
from ..core.mapping import ShardedObject, ShardedTensor
from ..core.plain_tensors import PlainTensorFactory, RefusedState
from ..core.tree_paths import join_path, steps_to_json
from ..core.tree_walk import walk_paths
from ..core.state_dict import apply_factories, collect, split_common
from ..planning.common_check import common_digest
from ..planning.aliases import mark_ties
from ..planning.even import mark_even
from ..planning.groups import RankRecords, layout_digest
from ..planning.metadata import ObjectRecord, ShardRecord
from ..planning.save_plan import SavePlan
from ..storage.base import ObjectWrite, ShardWrite, ShardWriter
from ..storage.layout import encode_key
from ..storage.omegaconf_check import ALLOW_RESOLVERS_ENV, resolvers_allowed
from ..storage.safe_pickle import check_loaded_tree, dumps
from ..storage.store import CheckpointStore, called
from ..storage.stores import open_store
from ..storage.tensorstore_io import StorageOptions
from ..core.gc_pause import gc_paused
from .common_warning import warn_common_differs
from .load_check import LoadCheck, warn_unloadable
from .object_bytes import pickle_objects
from .save_coordinate import CoordinatorOptions, coordinate_plan
from .store_calls import agreed, discard_quietly, look_around_quietly, open_writer

logger = logging.getLogger(__name__)


class PlanningOptions(NamedTuple):
    """What the save plans with. Rank 0 plans with its own; a rank asking for others expects
    another plan, so they must be the same on every rank (a difference is refused)."""

    balance_writes: bool
    pack_max_bytes: int
    layout: str = "ocdbt"  # recorded by rank 0 for every rank's store (another one's: an unreadable checkpoint)

    def differences(self, reference: "PlanningOptions") -> List[str]:
        """``"name=mine (rank 0: theirs)"`` for each option that differs from ``reference``."""
        return [f"{name}={mine!r} (rank 0: {theirs!r})"
                for name, mine, theirs in zip(self._fields, self, reference) if mine != theirs]


class Handshake(NamedTuple):
    """What one rank tells every other before anything is written (one exchange, about 100
    bytes pickled, a NamedTuple for that: the records themselves go to the coordinator only,
    when there is no plan to reuse)."""

    layout: str  # digest of this rank's records (planning/groups.py): equal for replicas
    plan_token: Optional[str]  # the cached plan's token, when this rank's records match it
    staging: Optional[str]  # rank 0's: the staging directory every rank writes into
    common_digest: Optional[str]  # of the common state (planning/common_check.py), where it is checked
    planning: PlanningOptions


@dataclass
class LocalState:
    """This rank's state dict, split and described (no collectives)."""

    tensors: List[ShardedTensor] = field(default_factory=list)
    objects: List[ShardedObject] = field(default_factory=list)
    records: RankRecords = field(default_factory=lambda: RankRecords([], []))
    common: Any = None
    common_bytes: Optional[bytes] = None  # serialized where written (rank 0) or checked
    common_digest: Optional[str] = None
    plain_tensors: Dict[str, Any] = field(default_factory=dict)  # rank 0: key -> steps of each plain tensor leaf
    object_bytes: Dict[int, bytes] = field(default_factory=dict)  # position in ``objects`` -> pickled (object_bytes.py)


@dataclass
class PreparedSave:
    """Everything a rank needs to write its part, decided collectively."""

    target: str
    staging: str  # where every rank writes before the commit: named by rank 0's store
    comm: Comm
    plan: SavePlan  # rank 0: the whole plan (its index is metadata.json); other ranks: their own writes
    options: StorageOptions
    store: CheckpointStore  # the target's store: it stages, writes blobs, commits or discards
    writer: ShardWriter  # where this rank's shards go; its ``backend`` is recorded in metadata.json
    tensors: List[ShardWrite]  # this rank's stored shards: data in global-axes shape, pack offsets
    objects: List[ObjectWrite]
    common: Optional[bytes]  # rank 0 only
    started: float = field(default_factory=time.perf_counter)
    plan_reused: bool = False  # the plan came from a SavePlanCache (no records exchange, no validation)
    # rank 0: metadata.json's ``plain_tensors``, where a load puts each plain tensor back (core/plain_tensors.py)
    plain_tensors: Dict[str, Any] = field(default_factory=dict)
    metadata_text: Optional[str] = None  # rank 0: metadata.json as write_local wrote it (file-system stores)


class SavePlanCache:
    """Remembers the last validated save plan, for repeated saves of the same layout.

    Pass the same instance to every :func:`prepare_save` of a run (the :class:`AsyncSaver` keeps
    one). When no rank's shard metadata (nor the group, nor the planning options) changed since the
    save that made the plan, the records exchange, validation and planning are skipped: one
    round trip of tiny objects (the handshake, with a digest of each rank's records) decides it,
    and also carries rank 0's staging directory name. Any change on any rank plans (and
    validates) from scratch, as without a cache.

    ``hits`` / ``misses`` count reused and freshly made plans. ``load_safe_globals``: the types the run's
    loads allow beyond the defaults (``extra_safe_globals``), not warned about when the common state holds them.
    """

    def __init__(self, load_safe_globals: Sequence[Any] = ()) -> None:
        self._key: Optional[tuple] = None  # this rank's records + group + options of the cached plan
        self._token: Optional[str] = None  # same on every rank for the same plan (that save's staging name)
        self._plan: Optional[SavePlan] = None
        self.hits = 0
        self.misses = 0
        self.warned_common: Set[Tuple[str, ...]] = set()  # common-state differences said (saving/common_warning.py)
        # types a load (allowing ``load_safe_globals`` too) would refuse, said once (saving/load_check.py)
        self.load_check = LoadCheck(load_safe_globals)

    def lookup(self, key: tuple) -> Optional[str]:
        """The plan's token when ``key`` matches this rank's cached plan, else None (local)."""
        return self._token if self._plan is not None and self._key == key else None

    def store(self, key: tuple, token: str, plan: SavePlan) -> None:
        """Keep ``plan``, made for the layout ``key`` describes, and its metadata ``token``."""
        self._key, self._token, self._plan = key, token, plan
        self.misses += 1

    def reuse(self) -> SavePlan:
        """The plan :meth:`lookup` matched (CheckpointingError where none was)."""
        if self._plan is None:
            raise CheckpointingError("no save plan is cached: reuse() needs a plan that lookup() matched")
        self.hits += 1
        return self._plan

    def clear(self) -> None:
        """Forget the plan: the next save plans again."""
        self._key = self._token = self._plan = None


def prepare_save(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: Union[str, CheckpointStore],
    comm: Comm,
    *,
    validate_access_integrity: bool = True,
    balance_writes: bool = True,
    options: StorageOptions = StorageOptions(),
    plan_cache: Optional[SavePlanCache] = None,
) -> PreparedSave:
    """Collective: exchange shard metadata, validate, plan, and agree on a staging directory.

    With ``plan_cache`` (the same object on every save of a run), a plan validated by an earlier
    save is reused when no rank's metadata changed. Raises the same ValidationError on every rank
    when the shards are inconsistent, and an error of the same type on every rank (naming each
    failing rank, see ``failures``) when some rank could not describe its part.
    """
    with gc_paused():  # tens of thousands of records, entries and writes made: see gc_paused
        return _prepare(sharded_state_dict, checkpoint_dir, comm, validate_access_integrity, balance_writes,
                        options, plan_cache)


def _prepare(sharded_state_dict: Dict[str, Any], checkpoint_dir: Union[str, CheckpointStore], comm: Comm,
             validate_access_integrity: bool,
             balance_writes: bool, options: StorageOptions, plan_cache: Optional[SavePlanCache]) -> PreparedSave:
    """:func:`prepare_save`'s work."""
    store = (checkpoint_dir.with_options(options) if isinstance(checkpoint_dir, CheckpointStore)
             else open_store(checkpoint_dir, options))  # same on every rank: all refuse a URL alike
    target = store.location
    started = time.perf_counter()
    planning = PlanningOptions(balance_writes, options.pack_max_bytes, options.layout)
    error: Optional[Exception] = None
    try:
        # Every rank digests the common state when it is checked for consistency (only rank 0's
        # copy is serialized and written), so an unpicklable value fails on every rank.
        local = _describe(sharded_state_dict, store, comm, check_common=validate_access_integrity and comm.distributed)
    except BaseException as e:  # agreed below, so no rank is left waiting in the exchange
        local, error = LocalState(), agreed(e)
    cache_key = (local.records, _group_ranks(comm), validate_access_integrity, planning)
    token = plan_cache.lookup(cache_key) if plan_cache is not None and error is None else None
    named = None
    if comm.rank == 0 and error is None:
        try:  # an object store names its version with requests (s3.new_version): a failure is agreed
            named = called(store, "new_staging")
        except BaseException as e:  # a store's own BaseException (asyncio's CancelledError) too
            error = agreed(e)
    mine = Handshake(layout=layout_digest(local.records), plan_token=token, staging=named,
                     common_digest=local.common_digest, planning=planning)
    try:
        handshakes: List[Handshake] = comm.agree(f"save to {target} failed before writing", error, mine)
    except BaseException:
        if named is not None:  # what naming it made (an object store's claim and liveness marks)
            discard_quietly(store, named)
        raise
    staging = handshakes[0].staging
    assert staging is not None  # rank 0 always names one
    try:
        _look_around(comm, store, staging, local, handshakes, validate_access_integrity, plan_cache)
        reuse = token is not None and all(h.plan_token == token for h in handshakes)
        if plan_cache is not None and reuse:
            plan = plan_cache.reuse()
        else:
            plan = _plan(comm, target, local.records, handshakes, validate_access_integrity, plan_cache)
            if plan_cache is not None:
                plan_cache.store(cache_key, staging, plan)  # staging name: unique, identical on every rank
    except BaseException:
        if comm.rank == 0:  # what naming it left (an object store's claim of its version)
            discard_quietly(store, staging)
        raise
    tensors, objects = _local_writes(plan, local, comm.rank)
    logger.debug(
        "rank %d: save plan for %s (%s): %d shards / %d objects to write, %d bytes (planning %.3fs)",
        comm.rank, target, "cached plan reused" if reuse else "planned", len(tensors), len(objects),
        plan.bytes_per_rank.get(comm.rank, 0), time.perf_counter() - started,
    )
    return PreparedSave(
        target=target, staging=staging, comm=comm, plan=plan, options=options, store=store,
        writer=open_writer(store, staging), tensors=tensors, objects=objects,
        common=local.common_bytes if comm.rank == 0 else None, started=started, plan_reused=reuse,
        plain_tensors=local.plain_tensors,
    )


def _describe(sharded_state_dict: Dict[str, Any], store: CheckpointStore, comm: Comm,
              check_common: bool) -> LocalState:
    """Split this rank's state dict into sharded entries and common state, and describe them."""
    if isinstance(sharded_state_dict, RefusedState):
        raise sharded_state_dict.error
    expanded: List[Tuple[Any, Any]] = []
    sharded, common = split_common(apply_factories(sharded_state_dict, expanded))
    found = collect(sharded)
    local = LocalState(tensors=found["tensors"], objects=found["objects"], common=common)
    if comm.rank == 0:  # rank 0 holds the main replica of every plain tensor: its places are the ones written
        local.plain_tensors = {f.key: steps_to_json(f.steps) for f, _ in expanded if isinstance(f, PlainTensorFactory)}
    for entry in local.tensors + local.objects:
        _storable(entry.key)  # refuse keys that cannot be stored before anyone writes
    for t in local.tensors:
        _check_data(t, comm.rank)
    local.records = mark_ties(local.tensors, mark_even(RankRecords(
        [ShardRecord.of(t, comm.rank) for t in local.tensors],
        [ObjectRecord.of(o, comm.rank) for o in local.objects],
    ), comm.size))  # FSDP-like chunks: one layout for all ranks (planning/even.py); ties (planning/aliases.py)
    target = store.location
    local.object_bytes = pickle_objects(local.objects, target)  # before the handshake: a failure is agreed
    if comm.rank == 0:
        called(store, "check_target")
    # Before the exchange, so an unpicklable value is an error agreed by every rank, not rank 0's alone
    try:
        if comm.rank == 0:
            local.common_bytes = dumps(common)
            _warn_unloadable_omegaconf(common, local.common_bytes, target)
        if check_common:
            local.common_digest = common_digest(common)
    except Exception as e:
        at = _unpicklable_at(common)
        raise CheckpointingError(
            f"checkpoint {target}: the common (non-sharded) state cannot be serialized"
            f"{f' (the value at {at!r})' if at else ''}: {type(e).__name__}: {e}"
        ) from e
    return local


def _unpicklable_at(common: Any) -> Optional[str]:
    """The path of the first leaf of ``common`` that cannot be pickled alone (a lambda, a lock, an open
    file), for the error: pickle names the object, not where it is in the state. Only on that failure."""
    try:
        for path, leaf in walk_paths(common, where="the common state"):
            if isinstance(leaf, torch.Tensor):
                continue
            try:
                pickle.dumps(leaf)
            except Exception:  # noqa: BLE001 - whatever pickle raises marks the leaf
                return join_path(path) if path else "the whole state"
    except CheckpointingError:  # a tree past the walker's bounds: the error names the object only
        return None
    return None


def _check_data(st: ShardedTensor, rank: int) -> None:
    """Refuse, before the exchange, a shard whose data no longer is what it declares. The declaration
    was checked when the ShardedTensor was made, but a state dict kept from save to save may hold a
    tensor changed since (``.data = t.double()``, ``set_``, ``resize_``): its record (what is planned,
    validated and cached) comes from the declaration, its bytes from the data, so they would be stored
    under a dtype metadata.json does not say or reshaped into another layout; and found only after the
    exchange, the failure would be this rank's alone, its peers left waiting."""
    data = st.data
    if data is None:
        raise ShardingError(f"{st.key!r} on rank {rank}: a ShardedTensor without data cannot be saved")
    fr = st.flattened_range
    declared = st.local_shape if fr is None else (fr.stop - fr.start,)
    if data.dtype != st.dtype or data.shape != declared:
        raise ShardingError(
            f"{st.key!r} on rank {rank}: its data is now {data.dtype} of shape {tuple(data.shape)}, but the "
            f"ShardedTensor declares {st.dtype} of shape {declared}{' (flattened range)' if fr is not None else ''}: "
            "the tensor was changed after the ShardedTensor was made; make the sharded state dict anew for each save")


_WARNED_OMEGACONF: Set[Tuple[str, str]] = set()  # a fit saving every N steps says it once


def _warn_unloadable_omegaconf(common: Any, pickled: bytes, target: str) -> None:
    """A WARNING, now rather than first at the resume, when the common state holds an omegaconf value
    that calls a resolver (a Hydra config's ``${oc.env:...}``): a load refuses it (loaded state runs
    no code, ``storage/omegaconf_check.py``) unless resolvers are allowed."""
    if b"omegaconf" not in pickled or resolvers_allowed():
        return
    try:
        check_loaded_tree(common, f"save to {target}: common state")
    except UnsafeContentError as e:
        said = str(e).split(" refused.")[0]
        # once per folder of checkpoints and value, not per save (the save's target changes every time)
        key = (os.path.dirname(os.path.normpath(target)), said.split(": ", 1)[-1])
        if key not in _WARNED_OMEGACONF:
            _WARNED_OMEGACONF.add(key)
            logger.warning("%s. A load will refuse it: resolve the config before saving it "
                           "(OmegaConf.to_container(cfg, resolve=True)), or load with %s=1", said, ALLOW_RESOLVERS_ENV)
    except CheckpointingError:  # what the load will say itself
        pass


@functools.lru_cache(maxsize=1 << 17)
def _storable(key: str) -> str:
    """:func:`encode_key`, remembered: a run saves the same keys every time (percent-encoding
    10,000 keys costs ~10-20 ms a save); a refused key raises every time (errors are not cached)."""
    return encode_key(key)


def _group_ranks(comm: Comm) -> Tuple[int, ...]:
    return tuple(comm.global_rank(i) for i in range(comm.size)) if comm.distributed else (0,)


def _look_around(comm: Comm, store: CheckpointStore, staging: str, local: LocalState, handshakes: List[Handshake],
                 validate_access_integrity: bool, plan_cache: Optional[SavePlanCache]) -> None:
    """Warnings that need no agreement: leftovers of killed saves, rank 0's pickles naming a type a load
    refuses, common state differing by rank (once per run where the saves share a ``plan_cache``)."""
    if comm.rank == 0:
        look_around_quietly(store, staging)
        pickles = [("common.pt", local.common_bytes or b"")] + [
            (f"ShardedObject {local.objects[i].key!r}", data) for i, data in local.object_bytes.items()]
        warn_unloadable(pickles, store.location, None if plan_cache is None else plan_cache.load_check)
    if validate_access_integrity and len({h.common_digest for h in handshakes}) > 1:
        warn_common_differs(local.common, comm, store.location,
                            None if plan_cache is None else plan_cache.warned_common)


def _plan(comm: Comm, target: str, records: RankRecords, handshakes: List[Handshake],
          validate_access_integrity: bool, plan_cache: Optional[SavePlanCache]) -> SavePlan:
    """Collective: check the planning options, then validate and plan on the coordinator
    (``save_coordinate.py``), which sends each rank its writes."""
    _refuse_differing_planning(comm, target, handshakes)
    if plan_cache is not None:
        plan_cache.clear()  # a failed validation must not leave a stale plan behind
    planning = handshakes[0].planning
    options = CoordinatorOptions(validate_access_integrity, planning.balance_writes, planning.pack_max_bytes)
    return coordinate_plan(comm, target, records, [h.layout for h in handshakes], options)


def _refuse_differing_planning(comm: Comm, target: str, handshakes: List[Handshake]) -> None:
    """Raise on every rank, blaming each rank whose planning options differ from rank 0's.

    Every rank sees the same handshakes, so all of them enter the agreement, and only when it
    fails: a save whose options agree pays no extra round trip."""
    reference = handshakes[0].planning
    if all(h.planning == reference for h in handshakes):
        return
    differs = handshakes[comm.rank].planning.differences(reference)
    mismatch = ArgumentError(f"planning options differ from rank 0's: {', '.join(differs)}") if differs else None
    comm.agree(f"save to {target} failed before writing", mismatch)


def _local_writes(plan: SavePlan, local: LocalState, rank: int) -> Tuple[List[ShardWrite], List[ObjectWrite]]:
    """This rank's writes, taken straight from its entries by the plan's positions."""
    tensors = []
    for item in plan.writes.get(rank, []):
        st = local.tensors[item.source]
        # detach and reshape only where they change something: each costs microseconds, 10,000 keys
        data = st.data.detach() if st.data.requires_grad else st.data
        if st.flattened_range is None and data.shape != st.shard_shape:  # prepended axes
            data = data.reshape(st.shard_shape)
        tensors.append(ShardWrite(item.key, item.index, data, item.packed))
    objects = [ObjectWrite(item.key, item.index, local.object_bytes.get(item.source)
                           or dumps(local.objects[item.source].data)) for item in plan.object_writes.get(rank, [])]
    return tensors, objects
