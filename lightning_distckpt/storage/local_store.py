"""Checkpoints in a local (or mounted: NFS, Lustre) directory: a save writes into a hidden staging
directory beside its target (:mod:`.staging`), rank 0 commits with ``metadata.json``, the marker
and an atomic rename (:mod:`.commit`); readers resolve the directory once and follow no link in it
(:mod:`.layout`, :mod:`.integrity`)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import stat
from typing import AbstractSet, Any, Dict, List, Optional, Set, Tuple

import tensorstore as ts

from ..core.errors import ArgumentError, CheckpointingError, FormatError, not_found
from ..progress import Progress, advance
from . import commit as commit_mod
from . import staging
from .committed import describe_missing
from .integrity import check_writer_store, store_bytes
from .layout import (COMMIT_MARKER, COMMON_FILE, DATA_DIR, FILE_CAPS, METADATA_FILE, MetadataFile, found_there,
                     is_checkpoint_dir, is_committed, is_rank_dir_name, open_metadata, rank_dir)
from .options import StorageOptions
from .output_files import is_torch_archive, missing_dirs, remove_made_dirs
from .paths import MARKER_CAP, TreeStats, holds_nothing, kind_of, local_location, read_inside, refuse_link, scan_tree
from .removal_aside import mark_removing, ours_to_clean, remove_marked
from .safe_pickle import write_file_durable
from .stock_checkpoints import USER_TORCH_FILE, is_stock_dcp_dir, is_stock_lightning_file
from .store import CheckpointStore, LeftoverChanged, StorageFacts, WriterStore
from .ts_context import child_context

logger = logging.getLogger(__name__)

def _remove_dir(target: str, stock: bool = False) -> None:
    """Remove a checkpoint directory checked by :func:`removable` so that what is removed is what was checked,
    and no step of it leaves, at a checkpoint name, a directory that says committed. It is renamed first to a
    removal's aside name (:func:`.staging.removal_aside`: the name is free at once) and checked again there:
    a directory of ours (:func:`is_checkpoint_dir`), or a ``stock`` one (a stock DCP directory or an empty
    one, no marker to tell it). Only then go its marker and the rest. Whatever else was put at the name
    between the check and the rename (a user's directory) goes back to it, or stays at the aside name when
    the name is taken again, and is named; before, it was removed whole, its ``COMMITTED`` file first.
    Interrupted (Ctrl-C in ``ModelCheckpoint``'s top-k removal), ``shutil.rmtree`` alone left a directory
    whose ``COMMITTED`` outlived some of its data: "committed (complete)" to ``inspect``, damaged to a load.
    What is left now is at the aside name, which ``clean`` removes (:mod:`.removal_aside`: only what is ours)
    and nothing recovers into place."""
    aside = staging.removal_aside(target)
    os.rename(target, aside)
    if stock:  # an empty directory stays removable
        still = not os.listdir(aside) or is_stock_dcp_dir(aside)
    else:
        still = is_checkpoint_dir(aside)
    if not still:
        where = _put_back(aside, target)
        what = ("something other than a DCP checkpoint's files appeared in it" if stock else
                f"something other than a checkpoint of ours was put at its name ({describe_refused(where)})")
        raise ArgumentError(f"remove {target}: {what} while it was being removed; left as it is at {where}")
    mark_removing(aside)  # what clean may remove there is ours (a user's directory left aside holds no note)
    # the marker first (none in a stock one: a file of that name there is not ours): an interruption then
    # leaves nothing that says committed
    remove_marked(aside, first=None if stock else COMMIT_MARKER)


def _put_back(aside: str, target: str) -> str:
    """Rename ``aside`` (what a removal found not to remove) back to ``target`` when nothing is there; where it is."""
    if os.path.lexists(target):
        return aside
    try:
        os.rename(aside, target)
    except OSError:  # something (not empty) took the name meanwhile: never replaced
        return aside
    return target


def _remove_file(target: str) -> None:
    """Remove a checkpoint file checked by :func:`removable` (a stock Lightning checkpoint file or an empty
    one): renamed aside first and checked again there, so that what is removed is what was checked (a user's
    file put at the name meanwhile goes back to it, or stays at the aside name, and is named)."""
    aside = staging.new_staging_dir(target)
    os.rename(target, aside)
    if not _removable_file(aside):
        where = _put_back(aside, target)
        raise ArgumentError(f"remove {target}: something other than a checkpoint file was put at its name while it "
                            f"was being removed ({describe_refused(where)}); left as it is at {where}")
    os.remove(aside)


def _removable_file(path: str) -> bool:
    """A regular file (not a link) that a removal may delete: a stock Lightning checkpoint file
    (:func:`.stock_checkpoints.is_stock_lightning_file`: stock DDP's ``epoch=...ckpt``, which a run moved from
    stock to ours rotates past) or an empty one (a torn stock save). Any other ``torch.save`` file
    (``torch.save(model.state_dict(), ...)``, ``fabric.save``'s, a data set's tensors) is a user's, as it is
    to a save's target check (``commit.check_target``)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (st.st_size == 0 or is_stock_lightning_file(path))


def describe_refused(path: str) -> str:
    """What is at ``path`` that a removal or relinking refuses, in a few words (:func:`.layout.found_there`; a
    ``torch.save`` file that no Trainer wrote said to be one, as a save's refusal says it)."""
    if os.path.isfile(path) and not os.path.islink(path) and is_torch_archive(path):
        return USER_TORCH_FILE
    return found_there(path)


def removable(path: str) -> bool:
    """A checkpoint directory of ours, an empty directory or a stock DCP checkpoint directory (Lightning's
    ``ModelParallelStrategy`` wrote it: a run moved to our strategy rotates past it), or a regular file that
    is a stock Lightning checkpoint (or an empty one: :func:`_removable_file`)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            return is_checkpoint_dir(path) or not os.listdir(path) or is_stock_dcp_dir(path)
    except OSError:
        return False
    return _removable_file(path)


class LocalStore(CheckpointStore):
    """A directory of the file system: the store of every location no other store's scheme names
    (a URL of another scheme is refused by :meth:`normalize`, naming it)."""

    file_system = True

    def __init__(self, location: str, options: StorageOptions = StorageOptions()) -> None:
        super().__init__(location, options)
        # staging directories whose every entry is durable (see write_blob): their commit fsyncs none
        self._entries_synced: Set[str] = set()
        # the folders above the target that rank 0 found missing when it named the save's staging directory
        # (deepest first): the save makes them (begin, reserve), and a save that commits nothing takes them
        # back (discard, release), as an export does (output_files.make_dirs): a save interrupted there
        # (Ctrl-C, the command line's SIGTERM) or failed left them empty. The save's own store (an async
        # save's placeholder is released through it too: saving/async_pending.release_target).
        self._made_parents: List[str] = []

    @classmethod
    def normalize(cls, text: str, what: str) -> str:
        return local_location(text, what)

    # -- saving -------------------------------------------------------------------------
    def check_target(self) -> None:
        commit_mod.check_target(self.location)

    def new_staging(self) -> str:
        staging_dir = staging.new_staging_dir(self.location)
        if os.path.isabs(self.location):  # (a node-local tier's is a URL: its root is made private, and kept)
            self._made_parents = missing_dirs(os.path.dirname(staging_dir))
        return staging_dir

    def begin(self, staging_dir: str, rank: int) -> None:
        """The staging directory and its ``data/`` (made before any blob: see :meth:`write_blob`),
        and this rank's owner note, made under the parent's shared lock (``staging.parent_lock``): a
        ``clean`` running meanwhile sees the directory with its note, or not at all."""
        parent = os.path.dirname(os.path.abspath(staging_dir))
        os.makedirs(parent, exist_ok=True)
        with staging.parent_lock(parent, exclusive=False):
            os.makedirs(os.path.join(staging_dir, DATA_DIR), exist_ok=True)
            staging.write_owner_note(staging_dir, rank, self.location)

    def write_blob(self, staging_dir: str, name: str, data: bytes) -> None:
        """The file, durable. After ``metadata.json``, the last of a save's blobs (``saving/save_commit.py``
        writes it beside the shards), the directory is fsync'd too: with ``data/`` made by
        :meth:`begin` and the blobs its only other entries, they are then all durable, so the commit
        (after every rank wrote) need not fsync it before its marker, and this fsync overlaps the
        shards' writes. Another blob after it undoes that."""
        write_file_durable(os.path.join(staging_dir, name), data)
        if name == METADATA_FILE:
            commit_mod.fsync_dir(staging_dir)
            self._entries_synced.add(staging_dir)
        else:
            self._entries_synced.discard(staging_dir)

    def commit(self, staging_dir: str, metadata_json: str, marker: Dict[str, Any]) -> None:
        synced = staging_dir in self._entries_synced
        self._entries_synced.discard(staging_dir)
        commit_mod.commit(staging_dir, self.location, metadata_json, json.dumps(marker), entries_synced=synced)
        self._made_parents = []  # they hold the checkpoint now

    def discard(self, staging_dir: str) -> None:
        """Remove the staging directory, then the folders the save made above it while empty; those an
        async save's placeholder still keeps are left to :meth:`release`."""
        self._entries_synced.discard(staging_dir)
        staging.discard(staging_dir)
        made, self._made_parents = self._made_parents, []
        remove_made_dirs(made)
        if made and os.path.lexists(made[0]):
            self._made_parents = made

    def look_around(self, staging_dir: str) -> None:
        try:  # one listdir of the parent: leftovers of killed saves take a checkpoint's space each
            staging.warn_about_leftovers(self.location, staging_dir)
        except OSError as e:
            logger.debug("checkpoint %s: could not look for leftover staging directories: %s", self.location, e)

    def reserve(self) -> bool:
        """An empty directory at the target (``saving/async_pending.py``): the commit replaces it
        like a missing target. Nothing when something is there already. Its folder is made first, as
        a synchronous save makes it before returning (``ModelCheckpoint(save_last="link")`` links
        ``last.ckpt`` to the target as soon as the save returns)."""
        if os.path.lexists(self.location):
            return False
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.location)), exist_ok=True)
            os.mkdir(self.location)
        except OSError:  # made meanwhile by someone else, or a parent we cannot write: the commit will say
            return False
        return True

    def release(self) -> None:
        """Remove the placeholder if it is still an empty directory (anything put into it meanwhile
        stays, and the commit refuses to replace it)."""
        try:
            if os.path.isdir(self.location) and not os.path.islink(self.location):
                os.rmdir(self.location)
        except OSError:
            return
        made, self._made_parents = self._made_parents, []
        remove_made_dirs(made)  # and the folders its save made for it

    # -- reading ------------------------------------------------------------------------
    def open_metadata(self) -> MetadataFile:
        """A missing directory (or a dangling ``last.ckpt`` link) says where the newest committed
        checkpoints are; a commit killed between its two renames is finished first."""
        given = self.location
        if not os.path.isdir(given) or holds_nothing(os.path.realpath(given)):  # missing, or a placeholder
            commit_mod.recover_interrupted_commit(given)
        if not os.path.isdir(given):
            raise not_found(given, describe_missing(given))
        return open_metadata(given, self.options.verify)

    def read_blob(self, path: str, name: str) -> Optional[bytes]:
        try:
            cap = FILE_CAPS.get(name, MARKER_CAP)
            return read_inside(os.path.join(path, name), f"checkpoint {path}:", max_bytes=cap)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointingError(f"checkpoint {path}: {name} cannot be read: {e.strerror or e}") from None

    def writer_store(self, path: str, writer: int) -> WriterStore:
        nbytes = store_bytes(path, writer)
        return WriterStore(nbytes is not None, nbytes, f"data directory {rank_dir(path, writer)} is missing")

    def check_writer(self, path: str, writer: int, claimed_bytes: int) -> None:
        check_writer_store(path, writer, claimed_bytes)

    def facts(self, path: str) -> StorageFacts:
        data, foreign = _scan_data(os.path.join(path, DATA_DIR))
        common = os.path.join(path, COMMON_FILE)
        leftovers = [{"path": lo.path, "bytes": lo.nbytes, "idle_s": round(lo.idle_s, 1),
                      "in_progress": bool(lo.live_owner_pids)} for lo in staging.find_leftovers(*os.path.split(path))]
        common_bytes = os.lstat(common).st_size if os.path.isfile(common) and not os.path.islink(common) else None
        return StorageFacts(data.files, data.nbytes, common_bytes, leftovers, foreign)

    # -- tensorstore ----------------------------------------------------------------------
    def kvstore_spec(self, path: str) -> Dict[str, Any]:
        return {"driver": "file", "path": path + "/"}

    def ts_context(self, options: StorageOptions) -> ts.Context:
        spec: Dict[str, Any] = {
            "file_io_concurrency": {"limit": options.io_concurrency},
            "data_copy_concurrency": {"limit": options.io_concurrency},
            "cache_pool": {"total_bytes_limit": 0},
        }
        # An OCDBT commit fsyncs as it goes: the data file, its directory, the manifest, the store's
        # directory, each waiting for the journal (four in a row per rank and save, most of a small
        # save's time); the zarr layout's commit fsyncs its files one after another. Unsynced here,
        # the writer makes the store durable after the commit instead (make_durable: every file at once).
        spec["file_io_sync"] = False
        return child_context(spec)  # executors shared for the process (storage/ts_context.py)

    def make_durable(self, store_dir: str, options: StorageOptions,
                     known_durable: AbstractSet[str] = frozenset()) -> List[str]:
        """After a write into the rank store ``store_dir`` committed: its files (but ``known_durable``)
        and directories durable (``storage/commit.fsync_tree``), where :meth:`ts_context` left them unsynced."""
        return commit_mod.fsync_tree(store_dir, known_durable)

    # -- versions ---------------------------------------------------------------------------
    def exists(self) -> bool:
        return is_committed(self.location)

    def remove(self) -> bool:
        """The checkpoint at this location, if it is one: a directory of ours (or an empty one), a stock
        Lightning checkpoint (a file ``TorchCheckpointIO`` wrote, or an empty file; a DCP directory), or a link
        (``save_last="link"`` made it: the link only, never what it points at) to one of those or to nothing.
        Anything else (a user's directory or file at a path ``ModelCheckpoint`` tracks, a ``torch.save`` file
        of theirs included) is an ArgumentError naming it, and nothing is removed. False when nothing is there."""
        target = self.location
        if not os.path.lexists(target):
            return False
        if os.path.islink(target):
            dest = os.path.realpath(target)
            if os.path.lexists(dest) and not removable(dest):
                raise ArgumentError(f"remove {target}: a link to {dest}, which is not a checkpoint "
                                    f"({describe_refused(dest)}); leaving both as they are")
            os.remove(target)
            return True
        ours = is_checkpoint_dir(target)  # (what the name holds may change at any time: all is checked again aside)
        if not removable(target):
            raise ArgumentError(f"remove {target}: not a checkpoint of ours nor a stock Lightning checkpoint "
                                f"({describe_refused(target)}: what is there would be lost); leaving it as it is")
        if ours or os.path.isdir(target):
            _remove_dir(target, stock=not ours)
        else:
            _remove_file(target)
        return True

    def _scope(self) -> Tuple[str, Optional[str]]:
        """(parent, name) whose staging directories are looked at: one checkpoint's (by our own
        markers: its leftovers are beside it), or every one in a directory of checkpoints."""
        if is_checkpoint_dir(self.location):
            parent, name = os.path.split(self.location)
            return parent, name
        return self.location, None

    def find_leftovers(self) -> List[staging.Leftover]:
        return staging.find_leftovers(*self._scope())

    def remove_leftover(self, leftover: Any, progress: Optional[Progress] = None) -> None:
        """Gone already (its commit renamed it into place, or another clean) is fine. A staging
        directory is checked again under its parent's exclusive lock (``staging.parent_lock``), the
        listing it was found in being unlocked: LeftoverChanged, nothing removed, where a save on
        this host now writes into it (one that was making it when listed) or it is now committed, or a
        removal's aside holds what is not ours (:func:`.removal_aside.ours_to_clean`)."""
        with staging.parent_lock(os.path.dirname(os.path.abspath(leftover.path)), exclusive=True):
            if isinstance(leftover, staging.Leftover) and leftover.link_to is None:
                owners = staging.live_owner_pids(leftover.path)
                if owners:
                    raise LeftoverChanged(f"{leftover.path}: a save on this host (pid {owners[0]}) is writing into it; "
                                          "not removed")
                if not staging.is_removal_aside(leftover.path):  # (one being removed is committed)
                    if is_committed(leftover.path) and not leftover.committed:
                        raise LeftoverChanged(f"{leftover.path}: committed meanwhile by a save that was still "
                                              "running; not removed")
                elif os.path.lexists(leftover.path) and not ours_to_clean(leftover.path):
                    raise LeftoverChanged(f"{leftover.path}: not a removal's leftover of ours; not removed")
            try:
                shutil.rmtree(leftover.path)
            except FileNotFoundError:
                pass
        advance(progress, leftover.nbytes or 0)

    def recover_leftovers(self) -> List[Tuple[Any, str, str]]:
        """Each missing checkpoint's newest committed copy renamed into place, and the previous
        checkpoint its commit moved aside removed (:func:`.commit.recover_interrupted_commit`)."""
        parent, name = self._scope()
        stranded = [lo for lo in staging.find_leftovers(parent, name)
                    if lo.verdict(math.inf) == "recover" and lo.target is not None and holds_nothing(lo.target)]
        by_path = {lo.path: lo for lo in stranded}
        done_actions: List[Tuple[Any, str, str]] = []
        for target in sorted({lo.target for lo in stranded}):
            done = commit_mod.recover_interrupted_commit(target)
            if done is None:
                continue
            if done.placed in by_path:
                done_actions.append((by_path[done.placed], "recovered",
                                     f"its commit was interrupted before its rename into place: renamed to {target}"))
            done_actions += [(by_path[p], "removed", f"the previous checkpoint that commit had moved aside; "
                              f"superseded by {os.path.basename(target)}") for p in done.removed if p in by_path]
        return done_actions

    def last_checkpoints(self, first: str, matches: Any) -> Optional[List[str]]:
        """Finish the interrupted commits of the matching checkpoints missing from the directory
        (each rank may at once: atomic renames, no collectives); Lightning then lists it itself."""
        if not os.path.isdir(self.location):
            return None
        names = [n for n in os.listdir(self.location) if staging.is_staging_dir(n)]
        targets = {t for t in (staging.target_of(os.path.join(self.location, n)) for n in names) if t is not None}
        for target in sorted(t for t in targets if matches.match(os.path.basename(t)) and holds_nothing(t)):
            commit_mod.recover_interrupted_commit(target)
        return None


def _scan_data(data_dir: str) -> Tuple[TreeStats, Tuple[str, ...]]:
    """The rank stores' files and bytes under ``data_dir`` (each walked by :func:`scan_tree`, which
    refuses a link or special file inside a store, as a load would), and the entries beside them that
    no save writes, described (``"data/x: a FIFO (named pipe)"``): a load never opens those, so they
    are reported, not refused, and never touched."""
    try:
        st = refuse_link(data_dir, "data directory")
    except FileNotFoundError:
        return TreeStats(0, 0), ()
    if not stat.S_ISDIR(st.st_mode):
        raise FormatError(f"data directory {data_dir} is {kind_of(st.st_mode)}, not a directory")
    files = nbytes = 0
    foreign: List[str] = []
    names = sorted(os.listdir(data_dir))
    for name in names:
        entry = os.path.join(data_dir, name)
        st = os.lstat(entry)
        if is_rank_dir_name(name) and stat.S_ISDIR(st.st_mode):
            store = scan_tree(entry, "data directory")
            files, nbytes = files + store.files, nbytes + store.nbytes
        else:
            foreign.append(f"{DATA_DIR}/{name}: {kind_of(st.st_mode)}")
    return TreeStats(files, nbytes), tuple(foreign)
