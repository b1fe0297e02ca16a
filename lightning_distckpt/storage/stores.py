"""Which store holds a checkpoint: the one place that looks at a location's form.

:func:`open_store` returns the :class:`~.store.CheckpointStore` for a path or URL: the first store
in :data:`STORES` whose ``scheme`` starts it, else the file system (:class:`~.local_store.LocalStore`,
which refuses other URLs by name). Adding a store is one class and one entry in :data:`STORES`
(or :func:`register_store`, as the tests' in-memory store does); planning, the save steps, the
loaders and the tools call the store's methods only.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Type, Union

from ..core.errors import ArgumentError

from .local_store import LocalStore
from .options import StorageOptions
from .paths import PathLike, checkpoint_location, path_text
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
    location any store serves), with ``options``. Opening touches nothing."""
    text = path_text(location, what)
    cls = store_class(text)
    return cls(cls.normalize(text, what), options)


def register_store(cls: Type[CheckpointStore]) -> None:
    """Serve ``cls.scheme`` locations with ``cls`` (ahead of the stores already registered).

    Raises:
        ArgumentError (a ValueError): ``cls`` has no :attr:`~.store.CheckpointStore.scheme`."""
    if not cls.scheme:
        raise ArgumentError(f"{cls.__name__}: a registered store needs a URL scheme (e.g. 'memory://'); a store "
                            "without one is passed as it is instead: save(state, store), load(template, store)")
    STORES.insert(0, cls)


def unregister_store(cls: Type[CheckpointStore]) -> None:
    """Undo :func:`register_store` of ``cls`` (nothing where it is not registered)."""
    if cls in STORES:
        STORES.remove(cls)


#: Where a save writes: a path or URL (its store picked by :func:`open_store`), or a store the caller made.
SaveTarget = Union[PathLike, CheckpointStore]


def save_target(target: SaveTarget, storage: Optional[StorageOptions]
                ) -> Tuple[Union[str, CheckpointStore], Optional[StorageOptions]]:
    """A save's target (a location normalized by its store, or the caller's store as it is) and its
    options: a store brings its own, and ``storage=`` given beside it must be the same (two sets of
    options for one save would leave the reader guessing which was written)."""
    if not isinstance(target, CheckpointStore):
        return checkpoint_location(target, "checkpoint_dir"), storage
    if storage is not None and storage != target.options:
        raise ArgumentError(f"save to the store {type(target).__name__}({target.location}): storage= differs from "
                            "the store's own options; make the store with those options instead")
    return target, target.options


def store_of(location: SaveTarget, options: Optional[StorageOptions], what: str = "checkpoint") -> CheckpointStore:
    """The store a load reads through: the caller's (with ``options`` where given: the reader's
    choices), else the one serving ``location`` (:func:`open_store`)."""
    if isinstance(location, CheckpointStore):
        return location if options is None else location.with_options(options)
    return open_store(location, options or StorageOptions(), what)
