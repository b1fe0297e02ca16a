"""Stock Lightning checkpoints a save of ours may replace and ``ModelCheckpoint``'s rotation may remove.

A stock DCP checkpoint directory: what Lightning's ``ModelParallelStrategy`` (and ``FSDPStrategy``'s
sharded checkpoints, Fabric's too) or ``torch.distributed.checkpoint.save`` write, recognised by what
it holds, so that a run moved from the stock strategy to ours can rotate past its old checkpoints
(``ModelCheckpoint``'s top-k removal) and save ``last.ckpt`` over the stock one, as the stock strategy
itself would (it removes them whole). Only a directory (not a link) of regular files of such a
checkpoint's names (DCP's ``.metadata`` and ``__<rank>_<n>.distcp``, Lightning's ``meta.pt``) whose
``.metadata`` parses as DCP metadata (``meta.pt``, if there, a ``torch.save`` file) is one: a file
merely named ``.metadata`` proves nothing, and anything else there (a subdirectory, a link, a FIFO,
a user's file) may be a user's, which a removal would lose.

A stock Lightning checkpoint file: what ``TorchCheckpointIO`` writes (``DDPStrategy``'s ``last.ckpt``), a
``torch.save`` archive whose pickle holds the key every Lightning checkpoint has
(``pytorch-lightning_version``): a run moved from stock DDP to ours saves its ``last.ckpt`` over it. Any
other ``torch.save`` file at a checkpoint's name stays a user's, which a save refuses to replace."""

from __future__ import annotations

import os
import re
import stat
import zipfile

from ..core.errors import CheckpointingError
from .output_files import is_torch_archive

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem's _metadata_fn
LIGHTNING_META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
_DISTCP = re.compile(r"__[0-9]+_[0-9]+\.distcp")  # FileSystemWriter: f"__{rank}_{n}.distcp"


def _stock_name(name: str) -> bool:
    return name in (DCP_METADATA, LIGHTNING_META) or _DISTCP.fullmatch(name) is not None


def is_stock_dcp_dir(path: str) -> bool:
    """``path`` is a stock DCP checkpoint directory (see the module's docstring). False on any doubt,
    an unreadable entry included."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        with os.scandir(path) as entries:
            found = {e.name: e.is_file(follow_symlinks=False) for e in entries}
    except OSError:
        return False
    if DCP_METADATA not in found or not all(regular and _stock_name(n) for n, regular in found.items()):
        return False
    if LIGHTNING_META in found and not is_torch_archive(os.path.join(path, LIGHTNING_META)):
        return False
    # imported here: the reading layer sits above storage, and only a stock directory needs it
    from ..reading.formats.dcp_metadata import read_metadata

    try:
        read_metadata(os.path.join(path, DCP_METADATA), root=path)  # parsed with an allow-list: runs no code
    except (CheckpointingError, OSError):
        return False
    return True


LIGHTNING_KEY = b"pytorch-lightning_version"  # written by every Trainer's dump_checkpoint
_PICKLE_SCAN_CAP = 64 << 20  # bytes of data.pkl looked through (the tensors are records of their own)


def is_stock_lightning_file(path: str) -> bool:
    """``path`` is a regular file (not a link) that Lightning's ``TorchCheckpointIO`` wrote (see the
    module's docstring). Only the archive's directory and pickle are read, nothing unpickled; False on any doubt."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or not is_torch_archive(path):
            return False
        with zipfile.ZipFile(path) as archive:
            pickle_name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            with archive.open(pickle_name) as f:
                return _holds(f, LIGHTNING_KEY)
    except (OSError, zipfile.BadZipFile, StopIteration, NotImplementedError, ValueError, EOFError):
        return False


def _holds(f: "zipfile.ZipExtFile", needle: bytes) -> bool:
    """``needle`` within the first :data:`_PICKLE_SCAN_CAP` bytes of ``f`` (read in blocks)."""
    tail, seen = b"", 0
    while seen < _PICKLE_SCAN_CAP:
        block = f.read(1 << 20)
        if not block:
            return False
        if needle in tail + block:
            return True
        tail, seen = block[-len(needle):], seen + len(block)
    return False
