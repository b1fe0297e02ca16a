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
checkpoint. Everything else (local directories included) is ``ModelCheckpoint`` unchanged.

Lightning's ``ModelCheckpoint`` needs ``s3fs`` for any ``s3://`` ``dirpath`` (it opens an fsspec file
system for it), and so does the connector's lookup: ``pip install s3fs``.
"""

from __future__ import annotations

import re
from typing import Any, Set

from lightning.pytorch.callbacks import ModelCheckpoint

from ..storage.layout import COMMIT_MARKER
from ..storage.s3_url import is_s3_url
from ..storage.s3_versions import committed_children


class DistModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) that also finds ``ckpt_path="last"`` when ``dirpath`` is
    ``s3://bucket/prefix``; use it with :class:`DistCheckpointIO` or the strategies, which save and
    remove (top-k) ``s3://`` checkpoints."""

    def _find_last_checkpoints(self, trainer: Any) -> Set[str]:
        dirpath = None if self.dirpath is None else str(self.dirpath)
        if dirpath is None or not is_s3_url(dirpath):
            return super()._find_last_checkpoints(trainer)
        last = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?{re.escape(self.FILE_EXTENSION)}$")
        return {f"{url}/{COMMIT_MARKER}" for url in committed_children(dirpath, self.CHECKPOINT_NAME_LAST)
                if last.match(url.rsplit("/", 1)[1])}
