"""``last.ckpt`` links pointed back at a checkpoint that exists when the save they named failed.

``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` to a checkpoint as soon as its save is
issued. An async save that then fails never makes that checkpoint: the link dangles, and the next
run's ``ckpt_path="last"`` (which passes over a link to nothing) starts from scratch although the
checkpoints before it are there. Once the failure is known, :func:`repoint_last_links` points each
such link at the newest committed checkpoint beside it, the one ``last`` named before the failed
save. Only a link named as ``ModelCheckpoint`` names its last checkpoints (``last``, ``last-v1``, ...
with ``.ckpt``) and pointing at the failed target is changed, by an atomic replace; nothing else is
touched. With no committed checkpoint beside it the link stays as it is.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from typing import List

from ..storage.committed import committed_siblings

logger = logging.getLogger(__name__)

_LAST_NAME = re.compile(r"last(-v?[0-9]+)?\.ckpt")  # ModelCheckpoint.CHECKPOINT_NAME_LAST, its versions


def _links_to(folder: str, target: str) -> List[str]:
    """The names in ``folder`` of ``last*.ckpt`` links that point at ``target`` (an absolute path)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if _LAST_NAME.fullmatch(name) and os.path.islink(path):
            try:
                pointed = os.path.normpath(os.path.join(folder, os.readlink(path)))
            except OSError:  # removed meanwhile
                continue
            if pointed == target:
                found.append(name)
    return found


def repoint_last_links(failed_target: str) -> List[str]:
    """After the save to ``failed_target`` failed: point each ``last*.ckpt`` link beside it that names
    it at the newest committed checkpoint in the same folder. Returns the links changed. Call it on
    one process (global rank 0, as ``ModelCheckpoint`` links); errors are logged, never raised: the
    save's own failure is what the caller reports."""
    if "://" in failed_target:  # an object store has no links
        return []
    target = os.path.normpath(os.path.abspath(failed_target))
    folder = os.path.dirname(target)
    if os.path.isdir(target):  # something is there after all (another save's, or a recovery's): keep the links
        return []
    links = _links_to(folder, target)
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
