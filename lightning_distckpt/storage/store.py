"""The store interface: one checkpoint location's whole life, from a save's staging location to
the removal of the checkpoint, whatever holds the bytes.

Modelled on PyTorch DCP's ``StorageWriter`` (``prepare`` / ``write_data`` / ``finish(metadata,
results)``), ``StorageReader`` and ``FileSystemBase``: a save names a staging location
(:meth:`CheckpointStore.new_staging`, rank 0), every rank prepares it (:meth:`~CheckpointStore.begin`)
and writes its shards through the :class:`~lightning_distckpt.storage.base.ShardWriter` the store opens,
rank 0 writes ``common.pt`` (:meth:`~CheckpointStore.write_blob`), then commits ``metadata.json`` with
the commit marker (:meth:`~CheckpointStore.commit`), or discards the staging location. A reader
opens the committed checkpoint's checked metadata (:meth:`~CheckpointStore.open_metadata`), its
blobs and a :class:`~lightning_distckpt.storage.base.ShardReader`. ``clean`` and
``ModelCheckpoint``'s top-k ask the store for leftovers of killed saves and to remove a checkpoint.

Implementations: :class:`~.local_store.LocalStore` (a local or mounted directory: staging beside
the target, an atomic rename) and :class:`~.s3_store.S3Store` (``s3://``: versions and a marker).
:func:`~.stores.open_store` picks one from the location, the only place that looks at its form.
Shards and objects go through tensorstore (:class:`~.tensorstore_io.TensorStoreIO`) over the
store's key-value store (:meth:`~CheckpointStore.kvstore_spec`).
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from typing import (TYPE_CHECKING, AbstractSet, Any, Callable, ClassVar, Dict, List, NamedTuple, Optional, Sequence,
                    Tuple)

import tensorstore as ts

from ..core.errors import ArgumentError, CheckpointingError
from .layout import MetadataFile
from .options import StorageOptions

if TYPE_CHECKING:
    from ..planning.metadata import CheckpointIndex
    from ..progress import Progress
    from .tensorstore_io import TensorStoreIO

logger = logging.getLogger(__name__)


class WriterStore(NamedTuple):
    """What a store holds for one writer rank: whether anything (``exists``), how many bytes (``nbytes``, None
    where the store does not list sizes), and how its absence is said (``missing``; ``validate`` reports it)."""

    exists: bool
    nbytes: Optional[int]
    missing: str = ""  # e.g. "data directory CKPT/data/rank_00001 is missing"


#: Raised through at once, never turned into an error the ranks agree on: a Ctrl-C or an exit stops the process
#: (the group's timeout frees a peer left waiting), not waits in a collective first.
INTERRUPTS = (KeyboardInterrupt, SystemExit)


def asked(store: "CheckpointStore", call: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, one of ``store``'s reading calls (``call`` names it). A third party's store may raise
    anything: what is no CheckpointingError becomes one naming the store and the call, so that the user
    sees which store failed where, and a load agrees on it with the other ranks (an error that is no
    Exception, such as asyncio's CancelledError, escaped the agreement and left the others waiting)."""
    try:
        return fn(*args)
    except (CheckpointingError, *INTERRUPTS):
        raise
    except BaseException as e:
        raise CheckpointingError(f"{store!r}.{call} failed: {type(e).__name__}: {e}") from e


def error_said(store: "CheckpointStore", error: BaseException) -> str:
    """``store``'s words for a failure of tensorstore's own I/O (:meth:`CheckpointStore.said`); the error's
    own text where the store has none or fails to say (a third party's store: its error must still show)."""
    try:
        return str(store.said(error))
    except Exception:
        return str(error)


def ours(store: "CheckpointStore", method: str) -> bool:
    """Whether ``store``'s ``method`` is this library's own (a built-in store's, or inherited from one): its
    errors already name the location, and its commit checks itself; a third party's is named, and checked."""
    return getattr(getattr(type(store), method, None), "__module__", "").startswith("lightning_distckpt.")


def called(store: "CheckpointStore", method: str, *args: Any) -> Any:
    """``store.<method>(*args)`` on the save path: a third party's error named as :func:`asked` names it (the
    store, the call and its arguments); a built-in store's raised as it is (it names the path itself)."""
    fn = getattr(store, method)
    if ours(store, method):
        return fn(*args)
    return asked(store, f"{method}({', '.join(map(_shown_arg, args))})", fn, *args)


def _shown_arg(value: Any) -> str:
    """An argument as an error shows it: a path or name whole, a blob, a marker or metadata.json's text by size."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return f"<a dict of {len(value)} fields>"
    if isinstance(value, str) and len(value) > 200:
        return f"<a text of {len(value)} characters>"
    return repr(value)


def still_committed(store: "CheckpointStore", path: str) -> Optional[bool]:
    """``store.still_committed(path)``, asked after a read failed; None where the store cannot say (it raised,
    logged): no evidence either way, so the read's own error stands instead of the store's."""
    try:
        return bool(store.still_committed(path))
    except INTERRUPTS:
        raise
    except BaseException as e:  # only evidence, asked about a failure raised anyway: a CancelledError on one
        # rank alone (no Exception) escaped the load's agreement and left its peers waiting
        logger.warning("%r.still_committed(%r) failed: %s: %s", store, path, type(e).__name__, e)
        return None


class LeftoverChanged(CheckpointingError):
    """A leftover changed between its listing and its removal (committed by a save still running,
    or holding something no save writes): kept, and ``clean`` says why."""


class StorageFacts(NamedTuple):
    """What ``inspect`` shows of a committed checkpoint's storage (None: not known to this store): ``data_files``,
    ``data_bytes``, ``common_bytes`` (common.pt's), ``leftovers`` (of killed saves) and ``foreign`` entries."""

    data_files: int
    data_bytes: Optional[int]
    common_bytes: Optional[int]
    leftovers: List[Dict[str, Any]]
    #: entries under ``data/`` that no save writes (not a rank store), e.g. ``"data/x: a FIFO (named pipe)"``:
    #: never read by a load, reported by ``inspect`` and ``validate`` and left alone
    foreign: Tuple[str, ...] = ()


class CheckpointStore(ABC):
    """The store of the checkpoint (or directory of checkpoints) at ``location``. Another store: a subclass
    implementing the abstract methods (docs/architecture.md, "The store").

    A method may raise anything (KeyboardInterrupt and SystemExit go through at once): unless its docstring
    says otherwise, the save or load fails on every rank alike, a third party's error named as a
    CheckpointingError with the store's ``repr`` and the call.

    Args:
        location: normalized by :meth:`normalize` (the factory, :func:`~.stores.open_store`, does it).
        options: how arrays are stored and how this process reaches the store (endpoints, concurrency);
            the same on every rank (refused otherwise)."""

    #: Locations are paths of the local (or a mounted) file system: readers may open chunk files
    #: directly (``storage/direct_read.py``) and refuse links in them, and Lightning lists them itself.
    file_system: ClassVar[bool] = False
    #: Extra ``ocdbt`` kvstore options for this store (read coalescing for object stores).
    ocdbt_options: ClassVar[Dict[str, Any]] = {}

    def __init__(self, location: str, options: StorageOptions = StorageOptions()) -> None:
        self.location = location
        self.options = options

    def __repr__(self) -> str:  # errors and logs that name a caller's store name where it is
        return f"{type(self).__name__}({self.location!r})"

    def with_options(self, options: StorageOptions) -> "CheckpointStore":
        """This store with ``options`` (itself where they are its own): a saver's writer choices
        (``AsyncSaver(io_concurrency=...)``) applied to a store the caller made. A copy, so the
        caller's store keeps its own. A store that ``copy.copy`` cannot copy needs ``__copy__``.

        Raises:
            ArgumentError: ``copy.copy`` failed (naming the store and what to do)."""
        if options == self.options:
            return self
        try:
            out = copy.copy(self)
        except Exception as e:  # a store holding a client that refuses copies: say which store, and what to do
            raise ArgumentError(f"{self!r}: other options ({options}) need a copy of the store, and copy.copy failed: "
                                f"{type(e).__name__}: {e}; give the store a __copy__ or its own with_options") from e
        out.options = options
        return out

    # -- which locations --------------------------------------------------------------
    #: The URL scheme of this store's locations (``"s3://"``); the factory (:mod:`.stores`) matches
    #: it, as DCP's ``validate_checkpoint_id``. Empty for the file system, which serves the rest.
    scheme: ClassVar[str] = ""

    @classmethod
    def normalize(cls, text: str, what: str) -> str:
        """``text`` (the location as the caller gave it) as this store's canonical location.

        Raises:
            ArgumentError: naming ``what`` (the argument: ``"checkpoint_dir"``) where ``text`` is no location
                of this store; to the caller, before any rank saves or loads."""
        return text

    # -- saving -------------------------------------------------------------------------
    @abstractmethod
    def check_target(self) -> None:
        """Before a save writes (rank 0): refuse to replace anything but a checkpoint of ours.

        Raises:
            CheckpointingError: :attr:`location` holds something else; nothing is written."""

    @abstractmethod
    def new_staging(self) -> str:
        """A fresh staging location for one save, no other save's (rank 0 names it and sends it to the
        others; nothing is created yet): the ``staging`` of the calls below."""

    def begin(self, staging: str, rank: int) -> None:
        """Every rank, before it writes into ``staging``: create what it needs, note the writer ``rank``
        (this process's rank in the save's group). Nothing by default."""

    def open_writer(self, staging: str) -> "TensorStoreIO":
        """The :class:`~lightning_distckpt.storage.base.ShardWriter` of stored shards and objects into
        ``staging`` (a ``TensorStoreIO`` over :meth:`kvstore_spec` and :meth:`ts_context` by default).
        Raising fails this rank's writes, which every rank agrees on."""
        from .tensorstore_io import TensorStoreIO  # it asks this store for its kvstore

        return TensorStoreIO(staging, self.options, store=self)

    @abstractmethod
    def write_blob(self, staging: str, name: str, data: bytes) -> None:
        """Rank 0: write one whole blob, ``data`` named ``name`` (``common.pt``), into ``staging``, durable
        when it returns."""

    def make_durable(self, store_dir: str, options: StorageOptions,
                     known_durable: AbstractSet[str] = frozenset()) -> List[str]:
        """After a write into one rank's store committed: make what it wrote durable, where the
        store's :meth:`ts_context` leaves that to the writer (nothing by default). ``known_durable``:
        files made durable by an earlier call of the same save that nothing has changed since (an
        OCDBT store's data files are written once): no need to sync them again.

        Args:
            store_dir: the rank's store under the staging location.
            options: the save's storage options.
            known_durable: files an earlier call returned.

        Returns:
            The files it made durable. Raising fails that rank's writes, naming the store."""
        return []

    @abstractmethod
    def commit(self, staging: str, metadata_json: str, marker: Dict[str, Any]) -> None:
        """Rank 0, after every rank wrote: write ``metadata.json`` and the commit marker (``marker``
        plus the SHA-256 of metadata.json and of common.pt as stored) and make ``staging`` the
        checkpoint at :attr:`location`, atomically; the previous one stays until then. Returning means
        committed: a load right after opens it; after a third party's commit the save asks
        :meth:`open_metadata` for its save token and fails on every rank where the checkpoint is not its own.
        ``metadata_json`` is metadata.json's text; add ``metadata_sha256`` and ``common_sha256`` to ``marker``.

        Raises:
            Exception: the save fails on every rank and ``staging`` is discarded; unless :meth:`open_metadata`
                shows this save's token (the commit took effect): then a WARNING, and the save succeeds."""

    @abstractmethod
    def discard(self, staging: str) -> None:
        """Remove an uncommitted staging location (after a failed save); never the version a commit made
        the checkpoint.

        Raises:
            Exception: logged as a WARNING, ``staging`` left to ``clean``; the save's own error stands."""

    def look_around(self, staging: str) -> None:
        """Rank 0, while a save prepares: warn about leftovers of earlier saves, not this save's ``staging``
        (nothing by default).

        Raises:
            Exception: logged as a WARNING; the save goes on."""

    def reserve(self) -> bool:
        """Hold :attr:`location`'s name while a background save is in flight (True when this call
        did: :meth:`release` follows); stores whose names appear only at the commit hold nothing.

        Raises:
            Exception: logged as a WARNING; the save goes on, the name not held."""
        return False

    def release(self) -> None:
        """Undo :meth:`reserve` right before the commit.

        Raises:
            Exception: logged as a WARNING; the save goes on."""

    # -- reading ------------------------------------------------------------------------
    @abstractmethod
    def open_metadata(self) -> MetadataFile:
        """The committed checkpoint's ``metadata.json`` and marker, checked with
        ``layout.check_metadata(raw, marker, path, options.verify)``.

        Returns:
            Its ``path`` is where every later read goes (a real path, a committed version).

        Raises:
            CheckpointNotFoundError: nothing at :attr:`location`. IncompleteCheckpointError: no committed
                checkpoint. FormatError: the metadata fails its checks."""

    @abstractmethod
    def read_blob(self, path: str, name: str) -> Optional[bytes]:
        """Blob ``name`` (``common.pt``) of the committed checkpoint at ``path`` (:meth:`open_metadata`'s).

        Returns:
            Its bytes; None when missing.

        Raises:
            CheckpointingError: naming it, when it cannot be read (or is no regular file)."""

    def open_reader(self, path: str, options: StorageOptions, index: "CheckpointIndex",
                    check_sizes: bool = True) -> "TensorStoreIO":
        """The :class:`~lightning_distckpt.storage.base.ShardReader` of the stored shards and objects of the
        committed checkpoint at ``path``, for a load with ``options`` of the checkpoint's ``index``; with
        ``check_sizes``, each writer's store is checked (:meth:`check_writer`) against the bytes ``index``
        claims. A ``TensorStoreIO`` over :meth:`kvstore_spec` and :meth:`ts_context` by default."""
        from .tensorstore_io import TensorStoreIO

        return TensorStoreIO(path, options, index, check_sizes=check_sizes, store=self)

    @abstractmethod
    def writer_store(self, path: str, writer: int) -> WriterStore:
        """What ``writer``'s (a saving rank's) store under ``path`` holds, for ``validate``.

        Raises:
            CheckpointingError: it must not be read (a link out of the checkpoint)."""

    def check_writer(self, path: str, writer: int, claimed_bytes: int) -> None:
        """Before a reader opens ``writer``'s store under ``path``, which the index says holds ``claimed_bytes``:
        refuse what must not be read (nothing by default).

        Raises:
            CheckpointingError: naming the store's path and why."""

    def still_committed(self, path: str) -> bool:
        """After a read from a store that is no file system failed: whether ``path`` is still the committed
        checkpoint (False: replaced meanwhile). Only evidence for the read's error.

        Raises:
            BaseException: logged as a WARNING naming the store; the read's own error stands."""
        return True

    @abstractmethod
    def facts(self, path: str) -> StorageFacts:
        """What ``inspect`` shows of the committed checkpoint at ``path``; raising fails ``inspect``."""

    # -- tensorstore ----------------------------------------------------------------------
    @abstractmethod
    def kvstore_spec(self, path: str) -> Dict[str, Any]:
        """tensorstore's spec of the key-value store whose keys are the entries under ``path`` (a staging
        location or a committed checkpoint)."""

    @abstractmethod
    def ts_context(self, options: StorageOptions) -> ts.Context:
        """A fresh tensorstore context for one reader or writer with ``options`` (their concurrency, no
        cache), made by :func:`~.ts_context.child_context`: its thread-pool executors must outlive it
        (tensorstore frees them racily, see :mod:`.ts_context`)."""

    def said(self, error: BaseException) -> str:
        """How an error of tensorstore's own reads or writes through :meth:`kvstore_spec` reads in a message: as
        is here; a store whose requests fail for reasons a user must act on says them in its own words.
        Where it raises, the ``error``'s own text is shown."""
        return str(error)

    # -- versions ---------------------------------------------------------------------------
    @abstractmethod
    def exists(self) -> bool:
        """Whether a committed checkpoint of ours is at :attr:`location`."""

    @abstractmethod
    def remove(self) -> bool:
        """Remove the checkpoint at :attr:`location` (``ModelCheckpoint``'s top-k, through
        ``DistCheckpointIO.remove_checkpoint``); False when there was none.

        Raises:
            Exception: to the caller, the rank Lightning removes on."""

    @abstractmethod
    def find_leftovers(self) -> Sequence[Any]:
        """What killed saves left at :attr:`location` (a checkpoint, or a directory of them), oldest
        first: objects with ``path``, ``target``, ``nbytes``, ``idle_s``, ``committed``,
        ``verdict(older_than_s)`` and ``reason(verdict, older_than_s)``. Raising fails ``clean``."""

    @abstractmethod
    def remove_leftover(self, leftover: Any, progress: Optional["Progress"] = None) -> None:
        """Remove one leftover :meth:`find_leftovers` found (after its verdict said so);
        :class:`LeftoverChanged`, nothing removed, where it is no longer what was found (a store
        that can check again just before removing: committed since, or holding something else).
        ``progress`` counts the bytes removed (None: nothing counts).

        Raises:
            LeftoverChanged: kept, ``clean`` says why. OSError, CheckpointingError: reported as failed,
                the others still cleaned."""

    def recover_leftovers(self) -> List[Tuple[Any, str, str]]:
        """Finish commits interrupted before their checkpoint was in place: ``(leftover, action,
        reason)`` for each (nothing where a commit is one atomic step). Raising fails ``clean``."""
        return []

    def last_checkpoints(self, first: str, matches: Any) -> Optional[List[str]]:
        """The committed checkpoints directly under :attr:`location` whose names start with
        ``first`` and match ``matches`` (a compiled pattern), as the paths Lightning's
        ``ModelCheckpoint`` resumes from; None where Lightning lists the location itself. Raising fails
        ``ckpt_path="last"``'s resolution."""
        return None
