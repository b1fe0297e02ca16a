"""The node-local store: one local checkpoint of step S is ``<root>/step_<S:09d>/``, a checkpoint in our
format (metadata.json, common.pt, ``data/rank_XXXXX`` stores with chunk checksums, the commit marker)
holding only the rank stores of this node's ranks and, once replicated, its partners' stores.

What a step directory holds completely is said by its notes, ``local_tier/held_rank_XXXXX.json``: a rank's
own note is written when it starts writing (valid once the directory is committed, which happens only
after every rank wrote), a partner copy's after its store was received whole, checked and renamed into
``data/``. ``local_tier/`` is also our mark: nothing without it is ever removed by the tier.

:class:`NodeLocalStore` is the :class:`~lightning_distckpt.storage.local_store.LocalStore` of such a
directory, served for ``node-local://<path>`` locations, so the ordinary save pipeline
(:class:`~lightning_distckpt.saving.async_save.AsyncSaver`) writes it: rank 0 names the staging directory
in its own node's root and every rank maps that name into its own node's root.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from lightning_distckpt.core.errors import ArgumentError, FormatError
from lightning_distckpt.storage.layout import COMMIT_MARKER, DATA_DIR, is_committed
from lightning_distckpt.storage.local_store import LocalStore
from lightning_distckpt.storage.options import StorageOptions
from lightning_distckpt.storage.paths import kind_of, read_inside, refuse_link
from lightning_distckpt.storage.remove_tree import remove_tree
from lightning_distckpt.storage.safe_pickle import write_file_durable
from lightning_distckpt.storage.staging import is_staging_dir
from lightning_distckpt.storage.stores import register_store

SCHEME = "node-local://"
RUN_FIELD = "tier_run"  # the commit marker's field naming the run that saved the step (LocalTier's ``run``)
TIER_DIR = "local_tier"  # the notes of what a step directory holds, and our mark
_STEP = re.compile(r"step_([0-9]{9,})")
_NOTE = re.compile(r"held_rank_([0-9]{5,})\.json")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:09d}")


def step_of(name: str) -> Optional[int]:
    """The step of a step directory's name, None for any other name. Only the name :func:`step_dir`
    gives: a load reads ``step_dir(step)``, so another spelling of a step (``step_0000000010``, other
    digits than ASCII) would have a recovery check one directory and read another."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m and name == os.path.basename(step_dir("", int(m.group(1)))) else None


def note_name(rank: int) -> str:
    return f"held_rank_{rank:05d}.json"


def note_path(directory: str, rank: int) -> str:
    return os.path.join(directory, TIER_DIR, note_name(rank))


def write_note(directory: str, rank: int, copy: bool, node: Optional[str] = None, fetched: bool = False) -> None:
    """Record that ``directory`` holds ``rank``'s store (its own, or a partner ``copy`` from ``node``;
    ``fetched``: received during a recovery) completely. Written beside its name and renamed over it:
    whatever has the name (a link, a FIFO: not counted as a note) is replaced, never opened or followed."""
    folder = os.path.join(directory, TIER_DIR)
    os.makedirs(folder, exist_ok=True)
    note = {"rank": rank, "copy": copy, "from": node, "fetched": fetched}
    fd, tmp = tempfile.mkstemp(prefix=".held-", dir=folder)  # O_EXCL: a fresh file of ours
    os.close(fd)
    try:
        write_file_durable(tmp, json.dumps(note).encode())
        os.replace(tmp, note_path(directory, rank))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def check_data_dir(step_path: str) -> None:
    """FormatError when ``step_path``'s ``data/`` is there but is no directory of its own (a link, a file,
    a FIFO): stores fetched into it would replace what is wherever it points."""
    data = os.path.join(step_path, DATA_DIR)
    try:
        st = refuse_link(data, f"local checkpoint {step_path}: data directory")
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise FormatError(f"local checkpoint {step_path}: data directory {data} is {kind_of(st.st_mode)}; refused")


def read_notes(directory: str) -> Dict[int, Dict[str, Any]]:
    """rank -> note of each store ``directory`` holds completely (unreadable notes count as absent)."""
    out: Dict[int, Dict[str, Any]] = {}
    notes = os.path.join(directory, TIER_DIR)
    try:
        names = os.listdir(notes)
    except OSError:
        return out
    for name in names:
        m = _NOTE.fullmatch(name)
        if not m or name != note_name(int(m.group(1))):  # another spelling would outlive the removal of a
            continue  # damaged store's note (note_path), keeping the store counted as held
        try:
            # a note is ~100 bytes; read without waiting on a FIFO or following a link
            note = json.loads(read_inside(os.path.join(notes, name), "local tier note", max_bytes=4096))
        except (OSError, ValueError, RecursionError, FormatError):
            continue
        if isinstance(note, dict) and note.get("rank") == int(m.group(1)):
            out[int(m.group(1))] = note
    return out


def is_ours(directory: str) -> bool:
    """A step directory the tier wrote (committed or not): it has our ``local_tier/`` notes folder."""
    path = os.path.join(directory, TIER_DIR)
    return os.path.isdir(path) and not os.path.islink(path)


@dataclass(frozen=True)
class LocalStep:
    """A committed step directory of this node: where, and whose stores it holds completely."""

    step: int
    path: str
    held: FrozenSet[int]
    copies: FrozenSet[int] = field(default_factory=frozenset)


def committed_steps(root: str) -> List[LocalStep]:
    """This node's committed step directories of ours, oldest first (torn and staging ones skipped)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in names:
        step = step_of(name)
        path = os.path.join(root, name)
        if step is None or os.path.islink(path) or not is_ours(path) or not is_committed(path):
            continue
        notes = read_notes(path)
        out.append(LocalStep(step, path, frozenset(notes), frozenset(r for r, n in notes.items() if n.get("copy"))))
    return sorted(out, key=lambda s: s.step)


def _subdirs(root: str) -> List[Tuple[str, str]]:
    """(name, path) of the directories in ``root``, by name: never a link, a file or a FIFO
    (``shutil.rmtree`` opens its argument: a FIFO would block it for ever, and a link is not ours to
    follow)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    paths = [(name, os.path.join(root, name)) for name in names]
    return [(name, path) for name, path in paths if os.path.isdir(path) and not os.path.islink(path)]


def uncommitted_dirs(root: str) -> List[str]:
    """Directories under ``root`` that local saves or fetches left unfinished: staging directories,
    and step directories of ours without a commit marker."""
    return [path for name, path in _subdirs(root) if is_staging_dir(path) or (
        step_of(name) is not None and is_ours(path) and not is_committed(path))]


def tier_tmp_dirs(root: str, prefix: str) -> List[str]:
    """The tier's temporary directories under ``root`` (names starting with ``prefix``): directories only."""
    return [path for name, path in _subdirs(root) if name.startswith(prefix)]


def remove_step(path: str) -> None:
    """Remove a step directory of ours (the marker first, so a half-removed one is never taken as committed);
    never through a link (its target is not ours: the marker removed would be another checkpoint's)."""
    if os.path.islink(path) or not is_ours(path):
        return
    try:
        os.remove(os.path.join(path, COMMIT_MARKER))
    except FileNotFoundError:
        pass
    remove_tree(path, f"the local tier's step directory {path}")


class NodeLocalStore(LocalStore):
    """The :class:`LocalStore` of one node-local step directory (``node-local://<path>``): staging
    names are rank 0's, mapped into this rank's node root. The tier makes one per save (:meth:`for_save`)
    and passes it to the saver, so what the save did on this rank is kept on the store it used."""

    scheme = SCHEME

    def __init__(self, location: str, options: StorageOptions = StorageOptions()) -> None:
        super().__init__(location[len(SCHEME):] if location.startswith(SCHEME) else location, options)
        #: the run saving here: recorded in the commit marker, which the other nodes' commits and the
        #: fetched copies take from rank 0's directory as it is (None: a store opened to read)
        self.run: Optional[str] = None
        #: this process's staging directory of the save in flight (set by :meth:`begin`, on every rank),
        #: where the tier's commit of the other nodes finds it
        self.staged: Optional[str] = None

    @classmethod
    def for_save(cls, location: str, run: Optional[str]) -> "NodeLocalStore":
        """The store one local save of ``run`` writes through (``location``: ``TierContext.location``)."""
        store = cls(cls.normalize(location, "local tier step"))
        store.run = run
        return store

    @classmethod
    def normalize(cls, text: str, what: str) -> str:
        path = text[len(SCHEME):]
        if not os.path.isabs(path):
            raise ArgumentError(f"{what} {text}: a {SCHEME} location names an absolute path")
        return SCHEME + LocalStore.normalize(path, what)

    def here(self, staging_dir: str) -> str:
        """Rank 0's staging directory, as this rank's node has it (same name, this node's root)."""
        return os.path.join(os.path.dirname(self.location), os.path.basename(staging_dir))

    def begin(self, staging_dir: str, rank: int) -> None:
        here = self.here(staging_dir)
        super().begin(here, rank)
        write_note(here, rank, copy=False)
        self.staged = here

    def open_writer(self, staging_dir: str) -> Any:
        return super().open_writer(self.here(staging_dir))

    def write_blob(self, staging_dir: str, name: str, data: bytes) -> None:
        super().write_blob(self.here(staging_dir), name, data)

    def commit(self, staging_dir: str, metadata_json: str, marker: Dict[str, Any]) -> None:
        run = self.run
        super().commit(self.here(staging_dir), metadata_json, {**marker, RUN_FIELD: run} if run else marker)

    def discard(self, staging_dir: str) -> None:
        super().discard(self.here(staging_dir))


register_store(NodeLocalStore)
