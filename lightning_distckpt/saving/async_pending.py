"""Background saves still in flight in this process: their target names held, and their commit
guaranteed before the process ends.

Two things a background save must not do, that a save which returns committed never does:

* **Leave its name free.** Lightning's ``ModelCheckpoint`` picks a free name (``name-v1.ckpt``,
  ``name-v2.ckpt``) by asking its file system whether each candidate exists. A background save
  exists at its target only once committed, so the next save would take the same name and replace
  it. :func:`reserve_target` holds the name with an empty directory from the save's start: the commit
  replaces an empty directory as it replaces an older checkpoint, in one swap
  (:func:`~lightning_distckpt.storage.commit.check_target`), so the name is never free while the save
  is in flight (whichever thread commits); :func:`release_target` removes the placeholder after a
  failed save. A process killed while its save is in flight leaves the empty directory; loading it
  is refused as an uncommitted checkpoint.
* **Be forgotten.** A save issued after the training loop ended (``trainer.save_checkpoint()`` after
  ``fit()``, the spawn launcher's last weights) has no next save, load or teardown to commit it.
  Every request is tracked here until finalized: a group-of-one request (no collective in its
  commit) is committed when the process exits (``atexit``; ``multiprocessing``'s exit handlers in
  forked and spawned workers), or when this process loads the same path (:func:`finish_saves_to`). A
  collective request cannot be committed by one process alone at exit: that is logged as an ERROR,
  unless its background thread commits it (``commits_in_background``: waited for at exit).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import threading
from typing import TYPE_CHECKING, Dict, List, Optional

from ..storage.stores import open_store

if TYPE_CHECKING:
    from .async_save import AsyncSaveRequest
    from ..storage.store import CheckpointStore

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_tracked: Dict[int, "AsyncSaveRequest"] = {}  # id -> unfinalized request (a strong reference: see docstring)
_owner: Dict[int, int] = {}  # id -> pid of the process that made the request (forked children inherit both)
_hooked_pid: Optional[int] = None


def reserve_target(target: str, store: Optional["CheckpointStore"] = None) -> bool:
    """Hold ``target``'s name while a save to it is in flight, where its store needs it (a local
    directory: an empty one, :meth:`~lightning_distckpt.storage.local_store.LocalStore.reserve`); True
    when this call did (only then does :func:`release_target` undo it). Nothing is done when
    something is already there (a committed checkpoint the save will replace: the name is taken anyway).
    ``store``: the save's own (it knows the folders its save made), else one opened for ``target``."""
    store = store if store is not None else open_store(target)
    try:
        return bool(store.reserve())
    except Exception as e:  # rank 0 alone: raised here, it left the other ranks' save waiting for its commit
        logger.warning("save to %s: %r.reserve() failed (the name is not held while the save runs): %s: %s",
                       target, store, type(e).__name__, e)
        return False


def release_target(target: str, store: Optional["CheckpointStore"] = None) -> None:
    """Undo :func:`reserve_target` (anything put into the placeholder meanwhile stays, and the
    commit refuses to replace it); ``store`` as there."""
    store = store if store is not None else open_store(target)
    try:
        store.release()
    except Exception as e:  # after the commit's outcome is known: it must not replace it
        logger.warning("save to %s: %r.release() failed (a placeholder may be left at the target): %s: %s",
                       target, store, type(e).__name__, e)


def track(request: "AsyncSaveRequest") -> None:
    """Keep ``request`` until it is finalized (:func:`untrack`), to commit it at exit at the latest."""
    global _hooked_pid
    pid = os.getpid()
    with _lock:
        _tracked[id(request)] = request
        _owner[id(request)] = pid
        if _hooked_pid != pid:  # once per process (a forked child inherits the flag, not the handlers)
            _hooked_pid = pid
            atexit.register(_finish_at_exit)
            # Workers started by multiprocessing (Lightning's spawn and fork launchers) leave through
            # os._exit after its own exit handlers, which atexit does not see in forked children.
            multiprocessing.util.Finalize(None, _finish_at_exit, exitpriority=100)


def untrack(request: "AsyncSaveRequest") -> None:
    with _lock:
        _tracked.pop(id(request), None)
        _owner.pop(id(request), None)


def _mine() -> List["AsyncSaveRequest"]:
    pid = os.getpid()
    with _lock:
        return [r for key, r in _tracked.items() if _owner.get(key) == pid]


def finish_saves_to(target: str) -> None:
    """Commit this process's group-of-one background saves to ``target`` before it is read (a save
    made through another plugin instance, e.g. ``trainer.save_checkpoint()`` then a new Trainer's
    ``fit(ckpt_path=...)``); raises the save's error if it failed."""
    for request in _mine():
        if request.checkpoint_dir == target and not request.collective:
            request.finalize()


def _finish_at_exit() -> None:
    """Commit every group-of-one save this process left in flight; log the rest as lost."""
    for request in _mine():
        if request.finalized:
            continue
        if request.collective and not request.commits_in_background:
            logger.error("background save to %s was never committed: the process exits before the collective "
                         "finalize every rank must call (the staging directory stays; `python -m lightning_distckpt "
                         "clean` removes it)", request.checkpoint_dir)
            untrack(request)
            continue
        try:
            request.finalize()
        except BaseException as e:  # nobody is left to raise to: say it as loudly as an exiting process can
            logger.error("background save to %s failed while the process exited: %s: %s", request.checkpoint_dir,
                         type(e).__name__, e)
