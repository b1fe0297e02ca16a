"""Opening the files of a model in another format (``torch.save`` files, safetensors, Hugging Face
directories, DCP, Megatron-Core ``torch_dist``) under one rule, the one of
:mod:`lightning_distckpt.storage.paths`: a regular file only (a FIFO, socket, device or directory in
its place is a FormatError naming it, never a wait), and a link only when its real path stays inside
the model's root (:func:`~lightning_distckpt.storage.paths.model_root`). Unlike our own readers,
a missing or unreadable file is a FormatError here too: each source names what it lacks.
"""

from __future__ import annotations

import os
from typing import BinaryIO, Union

from ...core.errors import FormatError
from ...storage.paths import SizeCap, check_regular, open_inside, read_inside


def _unreadable(path: str, what: str, e: OSError) -> FormatError:
    return FormatError(f"{what} {path} is missing or unreadable: {e.strerror or e}")


def open_model_file(path: str, what: str, root: str) -> BinaryIO:
    """The regular file ``path`` of a model rooted at ``root``, opened for binary reads."""
    try:
        return open_inside(path, what, root)
    except OSError as e:
        raise _unreadable(path, what, e) from None


def read_model_file(path: str, what: str, root: str, max_bytes: Union[int, SizeCap, None] = None) -> bytes:
    """The bytes of the regular file ``path`` of a model rooted at ``root`` (at most ``max_bytes``)."""
    try:
        return read_inside(path, what, root, max_bytes)
    except OSError as e:
        raise _unreadable(path, what, e) from None


def check_model_file(path: str, what: str, root: str) -> os.stat_result:
    """The ``stat`` of the regular file ``path`` of a model rooted at ``root``: call before handing
    ``path`` to a library that opens it by name."""
    try:
        return check_regular(path, what, root)
    except OSError as e:
        raise _unreadable(path, what, e) from None
