"""What a file that failed to load as a ``torch.save`` file is, from its first bytes, and what to do.

:func:`~lightning_distckpt.storage.safe_pickle.load_file` asks :func:`not_a_torch_file` only after
``torch.load`` refused the file (nothing is read twice on the way that works). A ``torch.save``
archive (a zip holding ``.../data.pkl``) or a legacy (pre-1.6) ``torch.save`` file keeps torch's
error, which names what inside it was refused; anything else gets an error that says what the file
is (a plain pickle, a NumPy array, text, ...) and how to turn it into something that loads, instead
of torch's advice to load it with ``weights_only=False`` (which runs whatever code the file holds).
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from typing import Optional

from ..core.errors import FormatError
from .inside import inside_hint
from .paths import ANYWHERE, open_regular

HEAD_BYTES = 64
# The first object a legacy torch.save file pickles (torch.serialization's MAGIC_NUMBER).
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
NOT_A_CHECKPOINT = "neither a lightning_distckpt directory nor a torch / safetensors file"
_RESAVE = ("save its tensors with torch.save(state_dict, 'model.pt') or safetensors.torch.save_file from the "
           "program that made it, then load that file")
# Magic bytes -> (what the file is, how to use it with this library).
_KNOWN = (
    (b"\x93NUMPY", "a NumPy .npy array", "read it with numpy.load and " + _RESAVE.replace("save its", "save the")),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras .h5?)", "convert its weights with the framework that wrote it and "
     + _RESAVE.replace("save its tensors", "save them").replace(" from the program that made it", "")),
    (b"GGUF", "a GGUF file (llama.cpp)", "convert it back with the tool that made it (e.g. to safetensors)"),
    (b"\x1f\x8b", "a gzip archive", "unpack it first"),
    (b"BZh", "a bzip2 archive", "unpack it first"),
    (b"\xfd7zXZ\x00", "an xz archive", "unpack it first"),
    (b"\x28\xb5\x2f\xfd", "a zstd archive", "unpack it first"),
)


def starts_with_legacy_magic(head: bytes) -> bool:
    """The pickle opcodes at the start of ``head`` push the legacy torch.save magic number first
    (read with :mod:`pickletools`, which parses opcodes and runs nothing)."""
    try:
        for op, arg, _ in pickletools.genops(head):
            if op.name in ("PROTO", "FRAME"):
                continue
            return op.name in ("LONG1", "LONG4", "LONG", "INT") and arg == _LEGACY_MAGIC
    except Exception:  # truncated or not a pickle: genops raises ValueError and others
        return False
    return False


def _is_other_zip(path: str, root: Optional[str]) -> bool:
    """A readable zip archive without the ``<name>/data.pkl`` that ``torch.save`` writes. A zip
    that cannot be read (a truncated torch.save file) is not known to be another kind: False."""
    fd = open_regular(path, "torch.save file", root)
    with os.fdopen(fd, "rb") as f:
        try:
            with zipfile.ZipFile(f) as zf:
                return not any(n.endswith("/data.pkl") or n == "data.pkl" for n in zf.namelist())
        # NotImplementedError: a directory entry claiming a zip version past what zipfile reads
        except (zipfile.BadZipFile, NotImplementedError, OSError, ValueError, EOFError):
            return False


def _preview(head: bytes) -> str:
    text = head[:24]
    if text and all(32 <= b < 127 or b in (9, 10, 13) for b in text):
        return f"text: it starts with {text.decode('ascii')!r}"
    return f"it starts with {text!r}"


def not_a_torch_file(path: str, root: Optional[str] = ANYWHERE) -> Optional[FormatError]:
    """An error that says what ``path`` is and how to load it, when its first bytes show it is not
    a ``torch.save`` file; None when it is one (torch's own error then says what is wrong in it)."""
    try:
        fd = open_regular(path, "torch.save file", root)
        with os.fdopen(fd, "rb") as f:
            head = f.read(HEAD_BYTES)
        if head.startswith(b"PK\x03\x04") and not _is_other_zip(path, root):
            return None  # a torch.save archive (maybe damaged): torch's error says what is wrong
    except (OSError, FormatError):  # vanished or special meanwhile: torch's error stands
        return None
    if starts_with_legacy_magic(head):
        return None
    if not head:
        return FormatError(f"{path} is not a checkpoint: it is an empty file")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return FormatError(
            f"{path} is not a checkpoint: it is a Python pickle (pickle.dump), {NOT_A_CHECKPOINT}. Loading runs no "
            f"code, so a plain pickle is not read (unpickling it could run any code it names): {_RESAVE}")
    if head.startswith(b"PK\x03\x04"):
        return FormatError(f"{path} is not a checkpoint: it is a zip archive without the data.pkl of a torch.save "
                           f"file (a NumPy .npz?), {NOT_A_CHECKPOINT}: unpack it or {_RESAVE}")
    for magic, what, how in _KNOWN:
        if head.startswith(magic):
            return FormatError(f"{path} is not a checkpoint: it is {what}, {NOT_A_CHECKPOINT}: {how}")
    return FormatError(f"{path} is not a checkpoint: {NOT_A_CHECKPOINT} ({_preview(head)}){inside_hint(path)}")
