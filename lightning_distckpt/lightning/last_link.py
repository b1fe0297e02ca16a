"""``last.ckpt`` links pointed back at a checkpoint that exists when the save they named failed.

``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` to a checkpoint as soon as its save is
issued. An async save that then fails never makes that checkpoint: the link dangles, and the next
run's ``ckpt_path="last"`` (which passes over a link to nothing) starts from scratch although the
checkpoints before it are there. Once the failure is known, :func:`repoint_last_links` points each
such link at the newest committed checkpoint beside it, the one ``last`` named before the failed
save. Only a link pointing at the failed target is changed, by an atomic replace, and only one that
``ModelCheckpoint`` made: named as it names its last checkpoints by default (``last``, ``last-v1``, ...
with ``.ckpt``), or, whatever its name (a custom ``CHECKPOINT_NAME_LAST``: ``"{epoch}-last"``,
``"final"``), made while the save was in flight (not among :func:`links_to_target` taken when it was
issued). Nothing else is touched. With no committed checkpoint beside it the link stays as it is.

:func:`link_last` makes the link itself (``DistModelCheckpoint``), in one rename: Lightning removes what
is at ``last.ckpt`` and links after, so another job's ``ckpt_path="last"`` between the two found no last
checkpoint (and started from scratch), and two jobs linking at once crashed one of them.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from typing import Collection, List, Optional

from ..core.errors import ArgumentError
from ..storage.committed import committed_siblings
from ..storage.local_store import describe_refused, removable
from ..storage.swap import swap_into_place

logger = logging.getLogger(__name__)

_LAST_NAME = re.compile(r"last(-v?[0-9]+)?\.ckpt")  # ModelCheckpoint.CHECKPOINT_NAME_LAST, its versions


def links_to_target(target: str) -> List[str]:
    """The names of the links beside ``target`` that point at it now: taken when a background save to it is
    issued, so that its failure tells the links ``ModelCheckpoint`` made meanwhile from a user's own."""
    if "://" in target:  # an object store has no links
        return []
    path = os.path.normpath(os.path.abspath(target))
    return _links_to(os.path.dirname(path), path, every=True)


def _links_to(folder: str, target: str, linked_before: Optional[Collection[str]] = None,
              every: bool = False) -> List[str]:
    """The names in ``folder`` of links that point at ``target`` (an absolute path): ``last*.ckpt`` ones,
    any not in ``linked_before`` (given: a custom last name, linked since then), or ``every`` one."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        wanted = every or _LAST_NAME.fullmatch(name) or (linked_before is not None and name not in linked_before)
        if wanted and not name.startswith(".") and os.path.islink(path):  # ".name.tmp": link_last's own
            try:
                pointed = os.path.normpath(os.path.join(folder, os.readlink(path)))
            except OSError:  # removed meanwhile
                continue
            if pointed == target:
                found.append(name)
    return found


def repoint_last_links(failed_target: str, linked_before: Optional[Collection[str]] = None) -> List[str]:
    """After the save to ``failed_target`` failed: point each ``last*.ckpt`` link beside it that names
    it at the newest committed checkpoint in the same folder, and, given ``linked_before`` (the
    :func:`links_to_target` of when the save was issued), every other link to it made since then (a
    ``ModelCheckpoint`` with a custom ``CHECKPOINT_NAME_LAST``). Returns the links changed. Call it on
    one process (global rank 0, as ``ModelCheckpoint`` links); errors are logged, never raised: the
    save's own failure is what the caller reports."""
    if "://" in failed_target:  # an object store has no links
        return []
    target = os.path.normpath(os.path.abspath(failed_target))
    folder = os.path.dirname(target)
    if os.path.isdir(target):  # something is there after all (another save's, or a recovery's): keep the links
        return []
    links = _links_to(folder, target, None if linked_before is None else set(linked_before))
    if not links:
        return []
    newest = committed_siblings(folder, limit=1)  # links are no siblings; the failed target is not there
    if not newest:
        logger.warning("the save to %s failed and no committed checkpoint is beside it: %s still link(s) to it",
                       failed_target, ", ".join(links))
        return []
    changed = []
    for name in links:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            os.symlink(newest[0], tmp)  # relative, as ModelCheckpoint links
            os.replace(tmp, os.path.join(folder, name))
        except OSError as e:
            logger.warning("could not point %s at %s after the save it named failed: %s",
                           os.path.join(folder, name), newest[0], e)
            if os.path.islink(tmp):
                os.unlink(tmp)
            continue
        changed.append(name)
    if changed:
        logger.warning("the save to %s failed: %s now link(s) to %s, the newest committed checkpoint beside it "
                       "(ckpt_path=\"last\" resumes from there)", failed_target, ", ".join(changed), newest[0])
    return changed


def link_last(filepath: str, linkpath: str) -> None:
    """Point ``linkpath`` at ``filepath`` (relative, as ``ModelCheckpoint`` links), replacing what is there
    atomically: a link by a rename over it, a file or a directory (a ``save_last=True`` checkpoint) by
    ``renameat2(RENAME_EXCHANGE)`` with the new link, then removed once checked again (where the file system
    has no exchange: renamed aside first). Anything but a link, a checkpoint of ours, an empty directory or
    file, or a stock Lightning checkpoint (a file ``TorchCheckpointIO`` wrote, a DCP directory) there is an
    ArgumentError naming it, and stays (Lightning removed whatever was there; a user's ``torch.save`` file
    too). Another job linking the same name at once is fine: the later rename wins."""
    folder = os.path.dirname(os.path.abspath(linkpath))
    tmp = os.path.join(folder, f".{os.path.basename(linkpath)}.{secrets.token_hex(6)}.tmp")
    if os.path.lexists(linkpath) and not os.path.islink(linkpath) and not removable(linkpath):
        raise ArgumentError(f"ModelCheckpoint: {linkpath} is not a checkpoint ({describe_refused(linkpath)}: what "
                            f"is there would be lost); not replaced by a link to {filepath}: move it away")
    os.symlink(os.path.relpath(filepath, folder), tmp)
    old = None
    try:
        if os.path.islink(linkpath) or not os.path.lexists(linkpath):
            os.replace(tmp, linkpath)
        else:  # swapped, not renamed over: what comes out is checked again (the old one put back if need be)
            old = swap_into_place(tmp, linkpath, f"{tmp}.old")
    finally:
        _remove_replaced(tmp)  # what was exchanged out, or our link where the rename failed
    if old is not None and old != tmp:
        _remove_replaced(old)


def _remove_replaced(path: str) -> None:
    """Remove what :func:`link_last` moved out of the way: a link (never its target), or a file or
    directory that is still one it may remove (checked again: it was checked before it was moved, and
    the name may have held something else by the time of the swap)."""
    if os.path.islink(path):
        os.remove(path)
    elif os.path.lexists(path):
        if not removable(path):
            logger.warning("%s: replaced by a link, it is not a checkpoint (%s); left here", path,
                           describe_refused(path))
        elif os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
