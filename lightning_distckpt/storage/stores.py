"""Which store holds a checkpoint: the one place that looks at a location's form.

:func:`open_store` returns the :class:`~.store.CheckpointStore` for a path or URL: the first store
in :data:`STORES` whose ``scheme`` starts it, else the file system (:class:`~.local_store.LocalStore`,
which refuses other URLs by name). Adding a store is one class and one entry in :data:`STORES`
(or :func:`register_store`, as the tests' in-memory store does); planning, the save steps, the
loaders and the tools call the store's methods only.
"""

from __future__ import annotations

from typing import List, Type

from .local_store import LocalStore
from .options import StorageOptions
from .paths import PathLike, path_text
from .s3_store import S3Store
from .store import CheckpointStore

#: Stores picked by their URL scheme, asked in order; the file system serves every other location.
STORES: List[Type[CheckpointStore]] = [S3Store]


def store_class(text: str) -> Type[CheckpointStore]:
    """The store class serving the location ``text`` (a path or URL string)."""
    for cls in STORES:
        if text.startswith(cls.scheme):
            return cls
    return LocalStore


def open_store(location: PathLike, options: StorageOptions = StorageOptions(),
               what: str = "checkpoint") -> CheckpointStore:
    """The store of ``location`` (normalized by it; an ArgumentError naming ``what`` when it is no
    location any store serves). Opening touches nothing."""
    text = path_text(location, what)
    cls = store_class(text)
    return cls(cls.normalize(text, what), options)


def register_store(cls: Type[CheckpointStore]) -> None:
    """Serve ``cls.scheme`` locations with ``cls`` (ahead of the stores already registered)."""
    if not cls.scheme:
        raise ValueError(f"{cls.__name__}: a registered store needs a URL scheme (e.g. 'memory://')")
    STORES.insert(0, cls)


def unregister_store(cls: Type[CheckpointStore]) -> None:
    """Undo :func:`register_store`."""
    if cls in STORES:
        STORES.remove(cls)
