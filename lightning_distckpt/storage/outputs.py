"""An output is never written over an input: the one check every converter and export makes first.

``convert CK CK/common.pt`` would replace the checkpoint's own ``common.pt``; ``convert CK CK``,
an output inside ``CK/data`` or an output reached through a link into ``CK`` would destroy the
checkpoint being read; an input inside a directory that the output replaces (``convert run/ck run``)
would be deleted by the swap. :func:`check_output` refuses all of these with an
:class:`~lightning_distckpt.core.errors.ArgumentError` naming both paths, before anything is read.

Paths are compared by their real paths (links resolved; an output that does not exist yet by its
nearest existing parent, which is what ``os.path.realpath`` resolves) and, for what exists, by
identity (``st_dev``/``st_ino``: a bind mount or a second name of a directory). ``s3://``
locations are compared as normalized URLs (a prefix and everything below it).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional, Tuple

from ..core.errors import ArgumentError
from .paths import PathLike, checkpoint_location
from .s3_url import is_s3_url

# Which entries directly inside the output directory the conversion replaces (None: all of it).
Replaced = Optional[Callable[[str], bool]]


def _real(path: PathLike, what: str) -> str:
    location = checkpoint_location(path, what)
    return location.rstrip("/") if is_s3_url(location) else os.path.realpath(location)


def _shown(path: PathLike) -> str:
    return os.fsdecode(os.fspath(path))


def _below(inner: str, outer: str, sep: str) -> bool:
    """``inner`` is ``outer`` or lies below it, by path text."""
    return inner == outer or inner.startswith(outer.rstrip(sep) + sep)


def _same_or_below(inner: str, outer: str) -> bool:
    """``inner`` (a real path or URL) is ``outer`` or below it, by text or, locally, by the identity
    of ``outer`` and one of ``inner``'s existing ancestors."""
    if is_s3_url(inner) or is_s3_url(outer):
        return is_s3_url(inner) and is_s3_url(outer) and _below(inner, outer, "/")
    if _below(inner, outer, os.sep):
        return True
    try:
        target = os.stat(outer)
    except OSError:
        return False
    path = inner
    while True:
        try:
            if os.path.samestat(os.stat(path), target):
                return True
        except OSError:
            pass  # not there yet: its parent decides
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def _first_entry(inner: str, outer: str) -> str:
    """The name, directly inside ``outer``, of the entry ``inner`` lies in (``inner`` below ``outer``)."""
    if is_s3_url(outer):
        return inner[len(outer):].lstrip("/").split("/", 1)[0]
    rel = os.path.relpath(inner, outer)
    return "" if rel.startswith("..") else rel.split(os.sep, 1)[0]


def check_output(output: PathLike, inputs: Iterable[Tuple[str, PathLike]], what: str = "output",
                 replaced: Replaced = None) -> None:
    """Refuse (ArgumentError naming both) an ``output`` that is one of ``inputs`` (``(name, path)``
    pairs, e.g. ``("source", "ck")``) or lies inside one, and an input that lies inside the output
    directory where the conversion replaces it: the whole output (``replaced`` None), or the entries
    directly inside it for whose name ``replaced(name)`` is true (an export that writes some files
    into an existing directory)."""
    out = _real(output, what)
    real = f" (real path {out})" if out != _shown(output) else ""
    for name, path in inputs:
        src = _real(path, name)
        if _same_or_below(out, src):
            where = "is" if out == src else "lies inside"
            raise ArgumentError(
                f"{what} {_shown(output)} {where} the {name} {_shown(path)}{real}: writing it "
                f"would overwrite what is being read; write the {what} outside the {name}")
        if _same_or_below(src, out):
            entry = _first_entry(src, out)
            if replaced is None or not entry or replaced(entry):
                raise ArgumentError(
                    f"{name} {_shown(path)} lies inside the {what} {_shown(output)}{real}, "
                    f"which the conversion replaces: the {name} would be deleted; write the {what} where it does not "
                    f"hold the {name}")
