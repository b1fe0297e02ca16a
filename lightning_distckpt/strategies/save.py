"""The save path: exchange metadata, validate, plan, write in parallel, agree, commit.

Split into ``prepare_save`` (collective, cheap: metadata only), ``write_local`` (this rank's
writes; no collectives, so it can run in a background thread for async save) and
``finalize_save`` (collective: agree on success, commit, log).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..version import __version__
from ..comm import Comm
from ..core.errors import CheckpointingError, SaveFailedError
from ..core.mapping import ShardedObject, ShardedTensor
from ..core.state_dict import apply_factories, collect, split_common
from ..planning.common_check import common_differences, digest, leaf_digests
from ..planning.metadata import ObjectRecord, ShardRecord
from ..planning.save_plan import SavePlan, make_save_plan
from ..planning.validation import raise_on_problems, validate_object_records, validate_tensor_records
from ..storage import commit as commit_mod
from ..storage import staging as staging_mod
from ..storage.layout import COMMON_FILE, FORMAT_NAME, FORMAT_VERSION, encode_key
from ..storage.safe_pickle import dumps, write_file_durable
from ..storage.base import ObjectWrite, ShardWrite
from ..storage.tensorstore_io import StorageOptions, TensorStoreIO
from .stats import log_throughput

logger = logging.getLogger("lightning_distckpt")


@dataclass
class PreparedSave:
    """Everything a rank needs to write its part, decided collectively."""

    target: str
    staging: str
    comm: Comm
    plan: SavePlan
    options: StorageOptions
    tensors: List[ShardWrite]  # this rank's stored shards: data in global-axes shape, pack offsets
    objects: List[ObjectWrite]
    common: Optional[bytes]  # rank 0 only
    started: float = field(default_factory=time.perf_counter)
    plan_reused: bool = False  # the plan came from a SavePlanCache (no records exchange, no validation)


Records = Tuple[List[ShardRecord], List[ObjectRecord]]


class SavePlanCache:
    """Remembers the last validated save plan, for repeated saves of the same layout.

    Pass the same instance to every :func:`prepare_save` of a run (the :class:`AsyncSaver` keeps
    one). When no rank's shard metadata (nor the group, nor the planning options) changed since the
    save that made the plan, the records all-gather, validation and planning are skipped: one
    round trip of tiny objects decides it, and also carries rank 0's staging directory name. Any
    change on any rank plans (and validates) from scratch, as without a cache.

    ``hits`` / ``misses`` count reused and freshly made plans.
    """

    def __init__(self) -> None:
        self._key: Optional[tuple] = None  # this rank's records + group + options of the cached plan
        self._token: Optional[str] = None  # same on every rank for the same plan (that save's staging name)
        self._plan: Optional[SavePlan] = None
        self.hits = 0
        self.misses = 0

    def lookup(self, key: tuple) -> Optional[str]:
        """The plan's token when ``key`` matches this rank's cached plan, else None (local)."""
        return self._token if self._plan is not None and self._key == key else None

    def store(self, key: tuple, token: str, plan: SavePlan) -> None:
        self._key, self._token, self._plan = key, token, plan
        self.misses += 1

    def reuse(self) -> SavePlan:
        assert self._plan is not None
        self.hits += 1
        return self._plan

    def clear(self) -> None:
        self._key = self._token = self._plan = None


def _group_ranks(comm: Comm) -> Tuple[int, ...]:
    return tuple(comm.global_rank(i) for i in range(comm.size)) if comm.distributed else (0,)


def prepare_save(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: str,
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
    when the shards are inconsistent.
    """
    target = os.path.abspath(os.fspath(checkpoint_dir))
    started = time.perf_counter()
    local_error: Optional[str] = None
    tensors: List[ShardedTensor] = []
    objects: List[ShardedObject] = []
    common: Any = None
    common_bytes: Optional[bytes] = None
    common_digest: Optional[str] = None
    records: Records = ([], [])
    try:
        expanded = apply_factories(sharded_state_dict)
        sharded, common = split_common(expanded)
        found = collect(sharded)
        tensors, objects = found["tensors"], found["objects"]
        for entry in tensors + objects:
            encode_key(entry.key)  # refuse keys that cannot be stored before anyone writes
        records = (
            [ShardRecord.of(t, comm.rank) for t in tensors],
            [ObjectRecord.of(o, comm.rank) for o in objects],
        )
        if comm.rank == 0:
            commit_mod.check_target(target)
        # Serialized before the exchange, so an unpicklable value is an error on every rank rather
        # than on rank 0 alone (which would leave the others waiting). Every rank serializes when
        # the common state is checked for consistency (only rank 0's copy is written).
        if comm.rank == 0 or (validate_access_integrity and comm.distributed):
            try:
                common_bytes = dumps(common)
            except Exception as e:
                raise CheckpointingError(
                    f"checkpoint {target}: the common (non-sharded) state cannot be serialized: {type(e).__name__}: {e}"
                ) from e
            common_digest = digest(common_bytes)
    except CheckpointingError as e:
        local_error = str(e)
    staging = staging_mod.new_staging_dir(target) if comm.rank == 0 else None
    cache_key: tuple = ()
    token: Optional[str] = None
    if plan_cache is not None and local_error is None:
        cache_key = (records, _group_ranks(comm), validate_access_integrity, balance_writes, options.pack_max_bytes)
        token = plan_cache.lookup(cache_key)
    # One exchange carries the records (only where they changed, when a plan is cached), any local
    # error, rank 0's staging directory name and the common state's digest.
    sent = None if token is not None else records
    # Every rank plans on its own: the planning options must agree, or ranks would write shards
    # where rank 0's index does not look for them.
    planning = {"balance_writes": balance_writes, "pack_max_bytes": options.pack_max_bytes}
    gathered = comm.all_gather_object((sent, token, local_error, staging, common_digest, planning))
    errors = [(rk, g[2]) for rk, g in enumerate(gathered) if g[2]]
    errors += [(rk, f"planning options {g[5]} differ from rank 0's {gathered[0][5]}")
               for rk, g in enumerate(gathered) if g[5] != gathered[0][5]]
    if errors:
        raise CheckpointingError(
            f"save to {target} failed before writing: " + "; ".join(f"rank {rk}: {err}" for rk, err in errors)
        )
    staging = gathered[0][3]
    if comm.rank == 0:
        try:  # one listdir of the parent: leftovers of killed saves take a checkpoint's space each
            staging_mod.warn_about_leftovers(target, staging)
        except OSError as e:
            logger.debug("checkpoint %s: could not look for leftover staging directories: %s", target, e)
    if validate_access_integrity and len({g[4] for g in gathered}) > 1:
        _warn_common_differs(common, comm, target)
    reuse = plan_cache is not None and all(g[1] is not None and g[1] == token for g in gathered)
    if reuse:
        assert plan_cache is not None
        plan = plan_cache.reuse()
    else:
        if any(g[0] is None for g in gathered):  # some rank held back unchanged records: fetch all
            per_rank: List[Records] = comm.all_gather_object(records)
        else:
            per_rank = [g[0] for g in gathered]
        all_tensors = [r for recs in per_rank for r in recs[0]]
        all_objects = [r for recs in per_rank for r in recs[1]]
        if plan_cache is not None:
            plan_cache.clear()  # a failed validation must not leave a stale plan behind
        if validate_access_integrity:
            raise_on_problems(validate_tensor_records(all_tensors) + validate_object_records(all_objects), target)
        plan = make_save_plan(all_tensors, all_objects, comm.size, balance_writes=balance_writes,
                              pack_max_bytes=options.pack_max_bytes)
        if plan_cache is not None:
            plan_cache.store(cache_key, staging, plan)  # staging name: unique, identical on every rank

    by_id = {(t.key, r.shard_id): t for t, r in zip(tensors, records[0])}
    mine = []
    for key, sid, index in plan.writes.get(comm.rank, []):
        st = by_id[(key, sid)]
        data = st.data.detach()
        if st.flattened_range is None:
            data = data.reshape(st.shard_shape)
        mine.append(ShardWrite(key, index, data, plan.index.tensors[key].shards[index].packed))
    obj_by_id = {(o.key, o.global_offset): o for o in objects}
    my_objects = [ObjectWrite(key, index, dumps(obj_by_id[(key, off)].data)) for key, off, index in plan.object_writes.get(comm.rank, [])]
    logger.debug(
        "rank %d: save plan for %s (%s): %d shards / %d objects to write, %d bytes (planning %.3fs)",
        comm.rank, target, "cached plan reused" if reuse else "planned", len(mine), len(my_objects),
        plan.bytes_per_rank.get(comm.rank, 0), time.perf_counter() - started,
    )
    return PreparedSave(
        target=target,
        staging=staging,
        comm=comm,
        plan=plan,
        options=options,
        tensors=mine,
        objects=my_objects,
        common=common_bytes if comm.rank == 0 else None,
        started=started,
        plan_reused=reuse,
    )


def _warn_common_differs(common: Any, comm: Comm, target: str) -> None:
    """Collective (entered by every rank: all saw the same digests): find and log, on rank 0, the
    common-state leaves that differ between ranks. Not an error: the save goes on with rank 0's."""
    per_rank = comm.all_gather_object(leaf_digests(common))
    if comm.rank == 0:
        logger.warning(
            "save to %s: the common (non-sharded) state differs between ranks; only rank 0's copy is saved, "
            "so other ranks' values are lost (make rank-dependent state a ShardedObject, or identical on all "
            "ranks):\n  %s", target, "\n  ".join(common_differences(per_rank)),
        )


def write_local(prep: PreparedSave) -> Tuple[int, float]:
    """This rank's writes into the staging directory (no collectives). Returns (bytes, seconds)."""
    t0 = time.perf_counter()
    os.makedirs(prep.staging, exist_ok=True)
    staging_mod.write_owner_note(prep.staging, prep.comm.rank)
    io = TensorStoreIO(prep.staging, prep.options)
    tensors = [w._replace(data=w.data.cpu()) if w.data.device.type != "cpu" else w for w in prep.tensors]
    nbytes = io.write(prep.comm.rank, tensors, prep.objects) if (tensors or prep.objects) else 0
    if prep.common is not None:
        write_file_durable(os.path.join(prep.staging, COMMON_FILE), prep.common)
        nbytes += len(prep.common)
    return nbytes, time.perf_counter() - t0


def finalize_save(prep: PreparedSave, local: Tuple[int, float] | BaseException) -> None:
    """Collective: every rank reports success or its error; if all succeeded rank 0 commits.

    On any failure every rank raises SaveFailedError naming the failing ranks, and the staging
    directory is removed: the previous checkpoint at the target is untouched.
    """
    comm = prep.comm
    status = (None, local) if not isinstance(local, BaseException) else (f"{type(local).__name__}: {local}", None)
    gathered = comm.all_gather_object(status)
    failures = [(rk, err) for rk, (err, _) in enumerate(gathered) if err]
    commit_error: Optional[str] = None
    if not failures and comm.rank == 0:
        total = sum(r[1][0] for r in gathered)
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "library_version": __version__,
            "torch_version": torch.__version__,
            "storage": {"backend": "tensorstore", **prep.options.to_json()},
            "world_size": comm.size,
            "created_unix": time.time(),
            **prep.plan.index.to_json(),
        }
        marker = {"bytes": total, "world_size": comm.size, "committed_unix": time.time()}
        try:
            commit_mod.commit(prep.staging, prep.target, json.dumps(meta), json.dumps(marker))
        except Exception as e:  # disk full while writing metadata, permissions, ...
            commit_error = f"{type(e).__name__}: {e}"
    if not failures:
        commit_error = comm.broadcast_object(commit_error, src=0)
    if failures or commit_error:
        if comm.rank == 0:
            staging_mod.discard(prep.staging)
        detail = "; ".join(f"rank {rk}: {err}" for rk, err in failures) or f"rank 0 (commit): {commit_error}"
        raise SaveFailedError(f"save to {prep.target} failed, nothing was committed: {detail}")
    seconds = time.perf_counter() - prep.started
    per_rank = [r[1] for r in gathered]
    log_throughput("save", prep.target, comm.rank, per_rank, seconds)
