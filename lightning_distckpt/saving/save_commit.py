"""Writing and committing a prepared save: ``write_local`` (this rank's writes, no collectives:
it may run in a background thread) and ``finalize_save`` (collective: agree on the outcome of
every rank's writes, commit on rank 0, agree on the commit)."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch

from ..core.errors import CheckpointingError, SaveFailedError
from ..core.format_versions import FORMAT_NAME, written_version
from ..storage.commit import in_background
from ..storage.layout import COMMON_FILE, METADATA_FILE
from ..storage.paths import PICKLE_CAP
from ..storage.save_token import TOKEN_FIELD, save_token
from ..storage.store import called
from ..version import __version__
from ..core.gc_pause import gc_paused
from .save_prepare import PreparedSave
from .store_calls import INTERRUPTS, UnopenedWriter, agreed, check_committed, discard_quietly
from .stats import log_throughput

logger = logging.getLogger(__name__)


class LocalWrite(NamedTuple):
    """What one rank wrote: bytes and seconds spent writing."""

    nbytes: int
    seconds: float


def write_local(prep: PreparedSave) -> LocalWrite:
    """This rank's writes into the store's staging location (no collectives)."""
    with gc_paused():  # a spec and a future per array: see gc_paused (a no-op in a background thread)
        return _write_local(prep)


def _write_local(prep: PreparedSave) -> LocalWrite:
    t0 = time.perf_counter()
    writer = prep.writer
    if isinstance(writer, UnopenedWriter):  # raised here, so every rank learns of it (finalize_save)
        raise writer.error
    called(prep.store, "begin", prep.staging, prep.comm.rank)
    # is_cpu, not device.type: a device object per tensor costs ~0.3 us, 3 ms a save of 10,000 keys
    tensors = [w._replace(data=w.data.cpu()) if not w.data.is_cpu else w for w in prep.tensors]

    def write_blobs() -> None:
        # metadata.json's text made here too: tens of ms for 10,000 keys, beside the shard writes
        for name, data in _rank0_files(prep):
            called(prep.store, "write_blob", prep.staging, name, data)

    if prep.common is not None and (tensors or prep.objects):  # beside the shards, so their fsyncs overlap
        nbytes = _beside(write_blobs, lambda: writer.write(prep.comm.rank, tensors, prep.objects))
    else:
        nbytes = writer.write(prep.comm.rank, tensors, prep.objects) if (tensors or prep.objects) else 0
        write_blobs()
    return LocalWrite(nbytes + (len(prep.common) if prep.common is not None else 0), time.perf_counter() - t0)


def _beside(side: Callable[[], None], main: Callable[[], int]) -> int:
    """``main()``'s result, with ``side()`` run meanwhile on a kept thread (``storage/commit.in_background``:
    no thread started per save); raises what either raised. Where the pool takes no more work (an
    async save finished at interpreter exit), ``side()`` runs first, on this thread."""
    pending = in_background(side)
    if pending is None:
        side()
        return main()
    try:
        result = main()
    finally:
        side_error = _outcome(pending)  # waits: no blob is still being written when this returns
    if side_error is not None:
        raise side_error
    return result


def _outcome(pending: "Future[None]") -> Optional[BaseException]:
    """``pending``'s error once it has ended, waiting through Ctrl-C (raised after the wait): an
    interrupt that ended the wait early let the save return, and a single-process save remove its
    staging directory, while the side thread still wrote rank 0's blobs into it."""
    interrupt: Optional[BaseException] = None
    while True:
        try:
            error = pending.exception()
            break
        except KeyboardInterrupt as e:  # the command line's SIGTERM too (cli/main.py): still waits
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
    return error


def _rank0_files(prep: PreparedSave) -> List[Tuple[str, bytes]]:
    """What rank 0 writes beside its shards: common.pt and, with it, in a file-system store,
    metadata.json (its content is the plan's, known now: written and fsync'd here, off the commit's
    critical path; the commit finds it in place, ``storage/commit.py``). An async save's earlier
    waves carry neither (``common=None``): its last one does."""
    if prep.common is None:
        return []
    files = [(COMMON_FILE, prep.common)]
    if len(prep.common) > PICKLE_CAP.limit():  # said now, not first when a load refuses it
        logger.warning("save to %s: its common (non-sharded) state pickles to %d bytes, more than the %d a load "
                       "reads unless %s is raised; make large tensors ShardedTensors", prep.target,
                       len(prep.common), PICKLE_CAP.limit(), PICKLE_CAP.env)
    if prep.comm.rank == 0 and prep.store.file_system:
        prep.metadata_text = json.dumps(_metadata(prep))
        files.append((METADATA_FILE, prep.metadata_text.encode()))
    return files


def finalize_save(prep: PreparedSave, local: Union[LocalWrite, BaseException]) -> None:
    """Collective: every rank reports its ``write_local`` result or error; if all succeeded rank 0
    commits, and every rank learns whether the commit succeeded.

    On any failure every rank raises :class:`SaveFailedError` naming the failing ranks (``failures``
    keeps what each raised), and the staging directory is removed: the previous checkpoint at the
    target is untouched.
    """
    comm = prep.comm
    failed = local if isinstance(local, BaseException) else None
    try:
        written: List[LocalWrite] = comm.agree(f"save to {prep.target} failed, nothing was committed", failed,
                                               None if failed is not None else local,
                                               default=SaveFailedError)
        commit_error = _commit(prep, written) if comm.rank == 0 else None
        comm.agree(f"save to {prep.target}: commit failed, nothing was committed", commit_error,
                   default=SaveFailedError)
    except CheckpointingError as e:
        if not e.failures:  # the exchange itself failed (a rank is gone): not an agreed outcome
            raise
        if comm.rank == 0 and not getattr(e.__cause__, "staging_kept", False):
            discard_quietly(prep.store, prep.staging)
        if isinstance(e, SaveFailedError):
            raise
        raise _save_failed(e) from e
    log_throughput("save", prep.target, comm.rank, written, time.perf_counter() - prep.started)


def _commit(prep: PreparedSave, written: List[LocalWrite]) -> Optional[BaseException]:
    """Rank 0: write metadata.json and the commit marker and move the checkpoint into place.
    Returns the error, if any (disk full while writing metadata, permissions, something in the way)."""
    marker = {"bytes": sum(w.nbytes for w in written), "world_size": prep.comm.size, "committed_unix": time.time()}
    try:
        text = prep.metadata_text
        if text is None:  # not written by write_local (an object store)
            with gc_paused():  # an index of a hundred thousand shards is as many small dicts
                text = json.dumps(_metadata(prep))
        called(prep.store, "commit", prep.staging, text, marker)
    except BaseException as e:  # a store's own BaseException too: agreed, no peer left waiting
        agreed(e)
        if _committed_anyway(prep):
            logger.warning("save to %s: %r.commit raised %s: %s, but the checkpoint it holds now is this save's "
                           "(its commit took effect, e.g. a response lost after it): kept as committed",
                           prep.target, prep.store, type(e).__name__, e)
            return None
        return e
    return check_committed(prep.store, prep.staging)


def _committed_anyway(prep: PreparedSave) -> bool:
    """After the store's commit raised: whether the checkpoint it holds now is this save's all the same (its
    save token in the checked metadata.json). Discarding the staging location then, as after any failed
    commit, removed the checkpoint just committed (a store whose ``discard`` does not check) while the save
    said nothing was committed."""
    try:
        return prep.store.open_metadata().meta.get(TOKEN_FIELD) == save_token(prep.staging)
    except Exception:  # noqa: BLE001 - no committed checkpoint of this save to be found: the commit failed
        return False


def _metadata(prep: PreparedSave) -> dict:
    """metadata.json's content: the format, versions, storage options and the plan's index."""
    return {
        "format": FORMAT_NAME,
        "format_version": written_version(bool(prep.plan.index.aliases)),  # 8 only with aliases: older readers
        "library_version": __version__,
        "torch_version": torch.__version__,
        "storage": {"backend": prep.writer.backend, **prep.options.to_json()},
        "world_size": prep.comm.size,
        "created_unix": time.time(),
        TOKEN_FIELD: save_token(prep.staging),  # what each rank store records too (storage/save_token.py)
        **prep.plan.index.to_json(),
        **({"plain_tensors": prep.plain_tensors} if prep.plain_tensors else {}),  # core/plain_tensors.py
    }


def _save_failed(agreed: CheckpointingError) -> SaveFailedError:
    """An agreed write or commit failure as SaveFailedError, whatever library error the failing
    ranks raised (each rank's type stays in ``failures``)."""
    err = SaveFailedError(str(agreed))
    err.failures = dict(agreed.failures)
    return err


def write_and_commit(prep: PreparedSave) -> None:
    """A synchronous save's last two steps: :func:`write_local`, then :func:`finalize_save` (collective),
    which reports a failed write on every rank, so none is left waiting. An interrupt (Ctrl-C, the
    command line's SIGTERM) in a save of this process alone removes the staging directory as it leaves:
    there is no other rank to tell, and nothing else would (a group's staging stays for ``clean``).
    That holds in the commit too: interrupted once its marker was written, before the rename, it left a
    committed copy that ``clean`` keeps (newer than the target) and a load of a missing target renames
    into place; interrupted between the two renames of a swap (no RENAME_EXCHANGE), the previous
    checkpoint stays moved aside, and the next load or save puts it back."""
    try:
        local: Union[LocalWrite, BaseException] = write_local(prep)
    except Exception as e:  # finalize_save turns it into SaveFailedError on every rank and cleans up
        local = e
    except BaseException as e:
        if isinstance(e, INTERRUPTS):
            _discard_alone(prep)
            raise
        local = e  # a store's own BaseException (asyncio's CancelledError): agreed too, no peer left waiting
    try:
        finalize_save(prep, local)
    except Exception:  # reported, and cleaned up, by finalize_save
        raise
    except BaseException:
        _discard_alone(prep)
        raise


def _discard_alone(prep: PreparedSave) -> None:
    """An interrupted save's staging directory removed, in a save of this process alone (nothing once
    its commit renamed it into place)."""
    if not prep.comm.distributed:
        discard_quietly(prep.store, prep.staging)  # a store's error here must not replace the interrupt
