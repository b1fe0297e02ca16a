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
#: what a torch.save file that is no stock Lightning checkpoint is called when a save or removal refuses it
USER_TORCH_FILE = "a torch.save file, not a Trainer's (fabric.save's, a user's)"


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
# The key as the whole of a pickled string (BINUNICODE, protocol 2 as torch.save writes; SHORT_BINUNICODE,
# protocol 4+), its memo entry (BINPUT, LONG_BINPUT, MEMOIZE), then its value as Lightning writes it: a
# version string ("2.4.0", "2.5.0rc1"). The key merely inside a longer string, or as a value in a user's
# file, is no match: such a file stays the user's (a user's pickle holding the key with a version string
# after it is taken for Lightning's, as Lightning itself would).
_KEY_THEN_STRING = re.compile(
    rb"(?:X\x19\x00\x00\x00|\x8c\x19)" + re.escape(LIGHTNING_KEY) + rb"(?:q.|r....|\x94)?"
    rb"(?:X(?P<long>[\x03-\x40])\x00\x00\x00|\x8c(?P<short>[\x03-\x40]))", re.DOTALL)
_VERSION = re.compile(rb"[0-9]+\.[0-9]+[0-9A-Za-z.+-]*")
_OVERLAP = 128  # bytes kept from one block to the next: a match (key, memo, value) takes at most 104
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def is_stock_lightning_file(path: str) -> bool:
    """``path`` is a regular file (not a link) that Lightning's ``TorchCheckpointIO`` wrote (see the
    module's docstring). Only the archive's directory and pickle are read, nothing unpickled; False on any
    doubt. Opened once, never through a link and never waiting on a FIFO put at the name: what is read is
    the file checked."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode) or f.read(4) != b"PK\x03\x04":
                return False
            with zipfile.ZipFile(f) as archive:
                names = archive.namelist()
                folders = {n.split("/", 1)[0] for n in names}
                if len(folders) != 1 or not all("/" in n for n in names) or f"{folders.pop()}/data.pkl" not in names:
                    return False  # not as torch.save writes (see output_files.is_torch_archive)
                with archive.open(next(n for n in names if n.endswith("/data.pkl"))) as pickle_file:
                    return _holds_key(pickle_file)
    except Exception:  # noqa: BLE001 - a hostile archive (encrypted, a bad deflate stream, odd sizes) is doubt
        return False


def _holds_key(f: "zipfile.ZipExtFile") -> bool:
    """Lightning's key and its version value (:data:`_KEY_THEN_STRING`) within the first
    :data:`_PICKLE_SCAN_CAP` bytes of ``f`` (read in blocks)."""
    tail, seen = b"", 0
    while seen < _PICKLE_SCAN_CAP:
        block = f.read(1 << 20)
        if not block:
            return False
        data = tail + block
        for match in _KEY_THEN_STRING.finditer(data):
            size = ord(match["long"] or match["short"])
            if _VERSION.fullmatch(data[match.end():match.end() + size]) and match.end() + size <= len(data):
                return True
        tail, seen = data[-_OVERLAP:], seen + len(block)
    return False


# torch.distributed.checkpoint.HuggingFaceStorageWriter(save_distributed=True): each rank's shards, named so
_HF_SHARD = re.compile(r"shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors")


def dcp_hf_shards_hint(path: str) -> str:
    """``"; its shard-...safetensors files are ..."`` for a directory holding only the unconsolidated shards
    torch's ``HuggingFaceStorageWriter(save_distributed=True)`` writes (each file a rank's pieces of the
    tensors, not a Hugging Face model directory), "" otherwise: what to do instead."""
    try:
        names = [n for n in os.listdir(path) if not n.startswith(".")]
    except OSError:
        return ""
    if not names or not all(_HF_SHARD.fullmatch(n) for n in names):
        return ""
    return ("; its shard-NNNNN-model-NNNNN-of-NNNNN.safetensors files are the unconsolidated shards of torch's "
            "HuggingFaceStorageWriter(save_distributed=True), each a rank's pieces of the tensors: save with "
            "enable_consolidation=True (the model files it writes beside them load), or consolidate them with "
            "torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files")
