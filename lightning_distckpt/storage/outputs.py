"""An output is never written over an input: the one check every converter and export makes first.

``convert CK CK/common.pt`` would replace the checkpoint's own ``common.pt``; ``convert CK CK``,
an output inside ``CK/data`` or an output reached through a link into ``CK`` would destroy the
checkpoint being read; an input inside a directory that the output replaces (``convert run/ck run``)
would be deleted by the swap. :func:`check_output` refuses all of these with an
:class:`~lightning_distckpt.core.errors.ArgumentError` naming both paths, before anything is read.

Paths are compared by their real paths (links resolved; an output that does not exist yet by its
nearest existing parent, which is what ``os.path.realpath`` resolves) and, for what exists, by
identity (``st_dev``/``st_ino``: a bind mount or a second name of a directory). Locations of
other stores (``s3://``) are compared as normalized URLs of the same store (a prefix and
everything below it); two stores never hold each other.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, NamedTuple, Optional, Tuple, Type

from ..core.errors import ArgumentError
from .paths import PathLike
from .store import CheckpointStore
from .stores import open_store

# Which entries directly inside the output directory the conversion replaces (None: all of it).
Replaced = Optional[Callable[[str], bool]]


class _Place(NamedTuple):
    """A location as compared: its store's class and its real path (or normalized URL)."""

    store: Type[CheckpointStore]
    real: str

    @property
    def files(self) -> bool:
        return self.store.file_system


def _real(path: PathLike, what: str) -> _Place:
    store = open_store(path, what=what)
    real = os.path.realpath(store.location) if store.file_system else store.location.rstrip("/")
    return _Place(type(store), real)


def _shown(path: PathLike) -> str:
    return os.fsdecode(os.fspath(path))


def _below(inner: str, outer: str, sep: str) -> bool:
    """``inner`` is ``outer`` or lies below it, by path text."""
    return inner == outer or inner.startswith(outer.rstrip(sep) + sep)


def _same_or_below(inner_place: _Place, outer_place: _Place) -> bool:
    """``inner`` (a real path or URL) is ``outer`` or below it, by text or, in the file system, by
    the identity of ``outer`` and one of ``inner``'s existing ancestors."""
    inner, outer = inner_place.real, outer_place.real
    if inner_place.store is not outer_place.store:
        return False
    if not outer_place.files:
        return _below(inner, outer, "/")
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


def _first_entry(inner_place: _Place, outer_place: _Place) -> str:
    """The name, directly inside ``outer``, of the entry ``inner`` lies in (``inner`` below ``outer``)."""
    inner, outer = inner_place.real, outer_place.real
    if not outer_place.files:
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
    real = f" (real path {out.real})" if out.real != _shown(output) else ""
    for name, path in inputs:
        src = _real(path, name)
        if _same_or_below(out, src):
            where = "is" if out.real == src.real else "lies inside"
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
