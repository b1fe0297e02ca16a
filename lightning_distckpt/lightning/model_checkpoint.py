"""``DistModelCheckpoint``: Lightning's ``ModelCheckpoint`` that finds ``ckpt_path="last"`` among
``s3://`` checkpoints.

Lightning resolves ``"last"`` through fsspec: ``ModelCheckpoint._find_last_checkpoints`` lists the
checkpoint directory and the checkpoint connector asks each candidate's file system whether it
exists and when it was modified, keeping the newest. On ``s3://`` neither works for a checkpoint
that is a prefix of objects: the listing loses the protocol, so the candidates are then looked up
on the local disk and the run silently starts from scratch (Lightning issue #18261, still so in
2.6), and an S3 prefix has no modification time (s3fs raises ``IsADirectoryError``). This callback
overrides the one method the connector calls on every ``ModelCheckpoint`` (``_find_last_checkpoints``,
kept overridable for that purpose): for an ``s3://`` ``dirpath`` it lists the committed ``last*.ckpt``
checkpoints through our own store and returns the URL of each one's commit marker, a real object
whose modification time is its commit time. Every reader takes a marker's URL as naming its
checkpoint. For a local ``dirpath`` it first finishes any commit of a ``last*.ckpt`` checkpoint that
was killed between its two renames (file systems without ``RENAME_EXCHANGE``: NFS, Lustre), which
would otherwise leave ``last.ckpt`` missing and the run starting from scratch
(:func:`~lightning_distckpt.storage.commit.recover_interrupted_commit`); then it is ``ModelCheckpoint``
unchanged.

Lightning's ``ModelCheckpoint`` needs ``s3fs`` for any ``s3://`` ``dirpath`` (it opens an fsspec file
system for it), and so does the connector's lookup: ``pip install s3fs``.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any, Dict, List, Optional, Set

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from ..core.errors import CheckpointingError
from ..storage.layout import COMMIT_MARKER, parse_marker
from ..storage.paths import checkpoint_location
from ..storage.stores import open_store
from .last_link import link_last

log = logging.getLogger(__name__)


class DistModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) that also finds ``ckpt_path="last"`` when ``dirpath`` is
    ``s3://bucket/prefix``; use it with :class:`DistCheckpointIO` or the strategies, which save and
    remove (top-k) ``s3://`` checkpoints."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's setup (which resolves ``dirpath``), then refuse a folder we cannot save to
        (a URL other than ``s3://``) now rather than at the first save."""
        super().setup(trainer, pl_module, stage)
        if self.dirpath is not None:
            checkpoint_location(self.dirpath, f"{type(self).__name__} dirpath")

    def _find_last_checkpoints(self, trainer: Any) -> Set[str]:
        dirpath = None if self.dirpath is None else str(self.dirpath)
        dirpath = dirpath if dirpath is not None else self._default_dir(trainer)
        found = None if dirpath is None else committed_last(dirpath, self.CHECKPOINT_NAME_LAST, self.FILE_EXTENSION)
        return super()._find_last_checkpoints(trainer) if found is None else set(found)

    def _default_dir(self, trainer: Any) -> Optional[str]:
        """Where ``ModelCheckpoint`` saves when no ``dirpath`` was given (its own private resolution)."""
        resolve = getattr(self, "_ModelCheckpoint__resolve_ckpt_dir", None)
        return None if resolve is None or trainer is None else str(resolve(trainer))

    @staticmethod
    def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        """``save_last="link"``: rank 0 links ``linkpath`` to ``filepath`` in one rename (:func:`link_last`:
        Lightning's remove-then-link left a moment without ``last.ckpt``, when another job resuming from
        ``"last"`` found none, and crashed one of two jobs linking at once); every rank raises its error alike."""
        if "://" in str(linkpath):  # an object store has no links: Lightning's own
            ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)
            return
        error = None
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            try:
                link_last(filepath, linkpath)
            except (OSError, CheckpointingError) as e:
                error = f"{type(e).__name__}: {e}"
        error = trainer.strategy.broadcast(error, src=0)
        if error is not None:
            raise CheckpointingError(f"ModelCheckpoint(save_last='link'): linking {linkpath} to {filepath} failed: "
                                     f"{error}")


def committed_last(dirpath: str, name_last: str, extension: str) -> Optional[List[str]]:
    """The commit markers of the newest committed last checkpoints (``last.ckpt``, ``last-v1.ckpt``, ...) in
    the object store folder ``dirpath``; None for a local folder (Lightning lists it), whose interrupted
    commits of last checkpoints are finished first."""
    # \Z, not $ (which also matches before a final newline: "last.ckpt\n" is no name we save to). The
    # version counter names the next ones last-v1.ckpt, last-v2.ckpt (a ModelCheckpoint whose last.ckpt is
    # another's: changed arguments, a second callback), which Lightning's own listing counts as last ones
    last = re.compile(rf"^{re.escape(name_last)}(-v?[0-9]+)?{re.escape(extension)}\Z")
    # the store finishes interrupted commits of last*.ckpt, and lists what Lightning cannot (None: it can)
    store = open_store(dirpath)
    found = store.last_checkpoints(name_last, last)
    return None if found is None else _newest(store, found)


def warn_last_not_found(trainer: Any) -> None:
    """On global rank 0 of a fit that started from scratch: for each of the Trainer's ``ModelCheckpoint``\\ s
    that lists its folder as Lightning does (stock, not :class:`DistModelCheckpoint`) while that folder is in
    an object store (``s3://``) holding committed last checkpoints, warn naming the newest and how to resume.
    Lightning's ``ckpt_path="last"`` cannot find them there (issue #18261) and starts from scratch with only
    "there is no last checkpoint available"; what the user passed is not known here, so this says what is
    there and never resumes from it. Called as the strategies start training and at the plugin's first save."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.ckpt_path is not None:
        return
    if not trainer.is_global_zero:
        return
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        lists_itself = getattr(type(callback), "_find_last_checkpoints", None) is ModelCheckpoint._find_last_checkpoints
        if not lists_itself or dirpath is None or "://" not in str(dirpath):
            continue
        try:
            found = committed_last(str(dirpath), callback.CHECKPOINT_NAME_LAST, callback.FILE_EXTENSION)
        except Exception as e:  # noqa: BLE001 a warning's look, on rank 0 alone: it must not fail the fit there
            # while the other ranks go on (the saves report the store's failures themselves, on every rank)
            log.debug("could not list the last checkpoints in %s: %s", dirpath, e)
            continue
        if found:
            newest = " or ".join(f'"{m[:-len(COMMIT_MARKER)].rstrip("/")}"' for m in sorted(found))
            log.warning(
                f"{type(callback).__name__}(dirpath={str(dirpath)!r}): this fit started from scratch, but that folder "
                f"holds {newest}, committed by an earlier run. Lightning's ModelCheckpoint does not find checkpoints "
                f"in an object store for ckpt_path=\"last\" (Lightning issue #18261: it starts from scratch). To "
                f"resume, pass fit(ckpt_path={newest.split(' or ')[0]}), or use "
                "lightning_distckpt.lightning.DistModelCheckpoint (the same arguments), which finds it for "
                "ckpt_path=\"last\".")


def _newest(store: Any, markers: List[str]) -> List[str]:
    """Of the commit markers of several last checkpoints in an object store, the one its marker says was
    committed last (``committed_unix``). Lightning compares the markers' modification times, whole seconds
    on S3: two commits within a second tied, and Lightning took either. Where a marker cannot say, all of
    them, for Lightning to choose as before (a load checks the one it picks)."""
    when: Dict[str, float] = {}
    for marker in markers if len(markers) > 1 else ():
        checkpoint = marker[:-len(COMMIT_MARKER)].rstrip("/")
        try:
            raw = store.read_blob(checkpoint, COMMIT_MARKER)
            value = None if raw is None else parse_marker(raw, marker).get("committed_unix")
        except CheckpointingError:
            return markers
        if type(value) not in (int, float) or not math.isfinite(value):
            return markers
        when[marker] = float(value)
    return [max(markers, key=lambda m: (when[m], m))] if when else markers
