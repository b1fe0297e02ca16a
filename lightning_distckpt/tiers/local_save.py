"""The background part of a local save: commit every node's step directory, send each rank's store to
its partners, prune old steps. Runs on the tier's thread, over the tier's own gloo group only.

The save pipeline itself is the ordinary one (:class:`~lightning_distckpt.saving.async_save.AsyncSaver`
over a ``node-local://`` location, :class:`~.node_store.NodeLocalStore`): its collective commit
(``finalize``) makes rank 0's node's directory the checkpoint; the other nodes' leads then commit theirs
with the same ``metadata.json`` and ``common.pt`` (sent by rank 0), after which each directory holds its
node's rank stores completely. A failure anywhere raises the same SaveFailedError on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Optional, Tuple

from lightning_distckpt.core.errors import ArgumentError, CheckpointingError, SaveFailedError
from lightning_distckpt.saving.async_save import AsyncSaveRequest
from lightning_distckpt.storage.layout import COMMIT_MARKER, COMMON_FILE, DATA_DIR, METADATA_FILE, rank_dir
from lightning_distckpt.storage.remove_tree import remove_tree
from lightning_distckpt.storage.staging import discard, is_staging_dir, live_owner_pids, names_target
from lightning_distckpt.tiers.context import TMP_PREFIX, TierContext, test_point
from lightning_distckpt.tiers.node_store import (NodeLocalStore, check_data_dir, committed_steps, remove_step,
                                                  tier_tmp_dirs, uncommitted_dirs, write_note)
from lightning_distckpt.tiers.transfer import Incoming, Outgoing, exchange

logger = logging.getLogger(__name__)

_SHA_FIELDS = ("metadata_sha256", "common_sha256")  # the commit adds them again, from the files it wrote


def finish_local_save(ctx: TierContext, request: AsyncSaveRequest, step: int) -> None:
    """Collective (the tier's thread on every rank): commit, replicate, prune (the room for the save was
    made before it started writing, :func:`make_room`)."""
    store = request.store  # the NodeLocalStore the save wrote through: its staging directory on this rank
    assert isinstance(store, NodeLocalStore)
    try:
        request.finalize()  # agreed; rank 0 commits its node's directory
    except BaseException:
        if ctx.is_lead and store.staged is not None:  # rank 0's was discarded by the pipeline; the others' here
            discard(store.staged)
        raise
    _commit_other_nodes(ctx, step, store)
    replicate(ctx, step)
    if ctx.is_lead:
        prune(ctx, step, ctx.options.keep_local)


def make_room(ctx: TierContext, step: int) -> None:
    """This node's lead, before the save of ``step`` writes anything: at most ``keep_local`` step
    directories exist on a node at any time, the one being written included (the host-memory bound of a
    ``/dev/shm`` tier), so the oldest goes now. A failure only delays it to the prune after the save
    (logged: the other ranks are not told, so no rank is left waiting)."""
    try:
        prune(ctx, step, ctx.options.keep_local - 1)
    except Exception as e:  # noqa: BLE001 - retried by the prune that ends the save
        logger.warning("local tier: node %s: making room for step %d failed: %s: %s", ctx.node, step,
                       type(e).__name__, e)


def _rank0_files(ctx: TierContext, step: int) -> Tuple[Optional[str], Any]:
    """Rank 0: (error text, (step, metadata.json text, common.pt bytes, marker)) of its committed directory."""
    path = ctx.step_dir(step)
    try:
        with open(os.path.join(path, METADATA_FILE), "rb") as f:
            meta = f.read().decode()
        with open(os.path.join(path, COMMON_FILE), "rb") as f:
            common = f.read()
        with open(os.path.join(path, COMMIT_MARKER), "rb") as f:
            marker = {k: v for k, v in json.loads(f.read()).items() if k not in _SHA_FIELDS}
    except (OSError, ValueError) as e:
        return f"rank 0 cannot read its committed local checkpoint {path}: {e}", None
    return None, (step, meta, common, marker)


def _commit_other_nodes(ctx: TierContext, step: int, store: NodeLocalStore) -> None:
    """Collective: the leads of the nodes other than rank 0's commit their step directories (``store``:
    the one the save wrote through)."""
    comm = ctx.comm
    failed, files = comm.broadcast_object(_rank0_files(ctx, step) if comm.rank == 0 else None)
    staging = store.staged
    error: Optional[Exception] = None
    if failed is not None:  # the same on every rank (broadcast): each cleans up below
        error = SaveFailedError(f"local save of step {step}: {failed}")
    elif files[0] != step:  # each node's directory is named by its lead's step: all must be rank 0's
        error = ArgumentError(f"LocalTier.save: step {step} given on rank {comm.rank}, but {files[0]} on rank 0; "
                              "every rank must save the same step")
    elif ctx.is_lead and ctx.node != ctx.nodes.node_of(0):
        try:
            if staging is None:
                raise CheckpointingError(f"no staging directory of step {step} was written on node {ctx.node}")
            _, meta, common, marker = files
            store.write_blob(staging, COMMON_FILE, common)
            store.commit(staging, meta, marker)
        except Exception as e:
            error = e
    try:
        comm.agree(f"local save of step {step}: committing on every node failed", error, default=SaveFailedError)
    except CheckpointingError:
        if ctx.is_lead:  # a step committed on some nodes only is no use: drop it everywhere
            if staging is not None:
                discard(staging)
            remove_step(ctx.step_dir(files[0] if files else step))  # named by rank 0's step
        raise


def replicate(ctx: TierContext, step: int) -> None:
    """Collective: every rank sends its store of ``step`` to its partners, which keep it in their node's
    step directory (received beside it, renamed into ``data/`` whole, then noted as held)."""
    if ctx.copies == 0:
        return
    rank, nodes, replicas = ctx.rank, ctx.nodes, ctx.options.replicas
    path = ctx.step_dir(step)
    outgoing = [Outgoing(p, f"rank_{rank:05d}", rank_dir(path, rank)) for p in nodes.partners(rank, replicas)]
    incoming = [Incoming(s, f"rank_{s:05d}", ctx.tmp_dir(step, f"rank_{s:05d}")) for s in nodes.sources(rank, replicas)]
    exchange(ctx.comm, outgoing, incoming)
    error: Optional[Exception] = None
    try:
        for item in incoming:
            place(item.directory, path, item.src, copy_from=nodes.node_of(item.src))
    except Exception as e:
        error = e
    ctx.comm.agree(f"local save of step {step}: keeping the partner copies failed", error, default=SaveFailedError)


def place(received: str, step_path: str, writer: int, copy_from: str, fetched: bool = False) -> None:
    """Rename a received store into ``step_path``'s ``data/`` (replacing a copy there) and note it held
    (a copy from node ``copy_from``; ``fetched``: during a recovery). A store with no files (a rank that
    wrote nothing) leaves only the note."""
    target = rank_dir(step_path, writer)
    test_point("tier_before_place")
    if os.listdir(received):
        check_data_dir(step_path)
        os.makedirs(os.path.join(step_path, DATA_DIR), exist_ok=True)
        if os.path.islink(target) or (os.path.lexists(target) and not os.path.isdir(target)):
            os.remove(target)  # an entry of our step directory in the store's place: replaced, never followed
        elif os.path.isdir(target):
            shutil.rmtree(target)
        os.rename(received, target)
    else:
        os.rmdir(received)
    test_point("tier_before_note")
    write_note(step_path, writer, copy=True, node=copy_from, fetched=fetched)


def prune(ctx: TierContext, step: int, keep: int) -> None:
    """This node's lead, around the save of ``step``: keep the ``keep`` newest committed steps up to
    ``step``; remove newer ones (an abandoned run's, after a restart from an older step), the tier's
    temporary directories and staging directories no live process writes."""
    steps = committed_steps(ctx.root)
    older = [s for s in steps if s.step <= step]
    drop = [s for s in steps if s.step > step] + older[:max(0, len(older) - keep)]
    for s in drop:
        remove_step(s.path)
    current = os.path.normpath(ctx.step_dir(step))
    for path in uncommitted_dirs(ctx.root):
        # The staging directory of the save of ``step`` is being written by this node's ranks, whose
        # owner notes may not exist yet: only an earlier save's may go.
        if is_staging_dir(path) and os.path.dirname(os.path.normpath(path)) == os.path.dirname(current) \
                and names_target(path, os.path.basename(current)):
            continue
        if not live_owner_pids(path):
            remove_tree(path, f"the local tier's unfinished save {path}")
    for path in tier_tmp_dirs(ctx.root, TMP_PREFIX):
        remove_tree(path, f"the local tier's temporary directory {path}")
    if drop:
        logger.debug("local tier: node %s removed steps %s", ctx.node, [s.step for s in drop])

