"""Moving whole directories (a rank store, a step directory's metadata and common state) between ranks
with torch.distributed point-to-point messages, through :class:`~lightning_distckpt.comm.Comm`.

One exchange is collective over the tier's group: every rank all-gathers the manifests of what it sends
(relative path and size of each file, per item), so every rank computes the same schedule: files cut into
pieces, pieces grouped into rounds bounded in bytes per rank (:func:`schedule`). In each round a rank
posts all its receives and sends at once (no pair can wait on another) and waits for them. A receiver
writes each item into the directory it names, its files created at their listed sizes; the stored chunks
carry their own checksums, verified when they are read.
"""

from __future__ import annotations

import mmap
import os
import shutil
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from lightning_distckpt.comm import Comm, Pending
from lightning_distckpt.comm_bytes import backend_refs, settle
from lightning_distckpt.core.errors import CheckpointingError, FormatError

Manifest = List[Tuple[str, int]]  # (relative path, size) of each file of an item


class Outgoing(NamedTuple):
    """An item this rank sends: ``label`` names it for the receiver, ``directory`` holds its files
    (``names``: only these top-level entries; None: all; a missing directory sends nothing)."""

    dst: int
    label: str
    directory: str
    names: Optional[Tuple[str, ...]] = None


class Incoming(NamedTuple):
    """An item this rank receives: from ``src``, written into ``directory`` (replaced if present)."""

    src: int
    label: str
    directory: str


def manifest_of(directory: str, names: Optional[Tuple[str, ...]] = None) -> Manifest:
    """The regular files under ``directory`` (links refused), sorted; empty when it does not exist."""
    out: Manifest = []
    if not os.path.isdir(directory):
        return out
    tops = (sorted(os.listdir(directory)) if names is None
            else [n for n in names if os.path.lexists(os.path.join(directory, n))])
    for top in tops:
        path = os.path.join(directory, top)
        if os.path.islink(path):
            raise FormatError(f"local tier: {path} is a link; a local checkpoint holds no links")
        if os.path.isfile(path):
            out.append((top, os.path.getsize(path)))
            continue
        for base, dirs, files in os.walk(path):
            dirs.sort()
            for f in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
                full = os.path.join(base, f)
                if os.path.islink(full) or not os.path.isfile(full):
                    raise FormatError(f"local tier: {full} is not a regular file")
                out.append((os.path.relpath(full, directory), os.path.getsize(full)))
    return out


def _safe_relpath(rel: str) -> str:
    """A manifest's path as a relative path that stays inside its directory (FormatError otherwise)."""
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm == "." or norm.startswith(".." + os.sep) or norm == ".." or "\0" in norm:
        raise FormatError(f"local tier: a peer sent the file name {rel!r}, which leaves its directory")
    return norm


#: Files travel in pieces of at most this many bytes, in rounds of at most ROUND_BYTES sent plus received
#: by any one rank: the host memory a transfer takes is bounded whatever the stores' sizes.
PIECE_BYTES = 64 << 20
ROUND_BYTES = 256 << 20


class Piece(NamedTuple):
    """``length`` bytes at ``offset`` of file ``rel`` of item ``label``, from ``src`` to ``dst``."""

    src: int
    dst: int
    label: str
    rel: str
    offset: int
    length: int


def schedule(gathered: List[Dict[Tuple[int, str], Manifest]], piece_bytes: Optional[int] = None,
             round_bytes: Optional[int] = None) -> List[List[Piece]]:
    """Every piece of every item, in rounds (the same on every rank, from the same manifests): a round
    ends where one more piece would take a rank's bytes in it above ``round_bytes`` (default: the
    module's :data:`PIECE_BYTES` and :data:`ROUND_BYTES`, read at the call)."""
    piece_bytes = piece_bytes or PIECE_BYTES
    round_bytes = round_bytes or ROUND_BYTES
    rounds: List[List[Piece]] = [[]]
    load: Dict[int, int] = {}
    for src, part in enumerate(gathered):
        for (dst, label), manifest in sorted(part.items()):
            for rel, size in manifest:
                for off in range(0, size, piece_bytes):
                    piece = Piece(src, dst, label, rel, off, min(piece_bytes, size - off))
                    if rounds[-1] and max(load.get(src, 0), load.get(dst, 0)) + piece.length > round_bytes:
                        rounds.append([])
                        load = {}
                    rounds[-1].append(piece)
                    load[src] = load.get(src, 0) + piece.length
                    load[dst] = load.get(dst, 0) + piece.length
    return rounds


def exchange(comm: Comm, outgoing: List[Outgoing], incoming: List[Incoming]) -> int:
    """Collective: send ``outgoing`` and receive ``incoming`` (every rank calls it, with matching
    lists: what a rank receives from ``src`` under ``label`` is what ``src`` sends it under that label).
    Returns the bytes this rank received. A rank that cannot list what it sends, or is sent nothing it
    expects, fails every rank before any byte moves."""
    error: Optional[Exception] = None
    mine: Dict[Tuple[int, str], Manifest] = {}
    try:
        mine = {(o.dst, o.label): manifest_of(o.directory, o.names) for o in outgoing}
    except Exception as e:  # agreed below: no rank waits for a message that never comes
        error = e
    gathered: List[Dict[Tuple[int, str], Manifest]] = comm.agree("local tier: listing the files to send failed",
                                                                 error, mine)
    try:
        _prepare_incoming(comm.rank, gathered, incoming)
    except Exception as e:
        error = e
    comm.agree("local tier: preparing to receive failed", error)
    sources = {(o.dst, o.label): o.directory for o in outgoing}
    targets = {(i.src, i.label): i.directory for i in incoming}
    received, error = 0, None
    for pieces in schedule(gathered):
        received += _round(comm, pieces, sources, targets)
    try:
        for i in incoming:  # durable before anyone renames the item into place
            _fsync_tree(i.directory)
    except OSError as e:
        error = e
    # Every rank's items are whole when this returns: a node's lead may move what its other ranks received.
    comm.agree("local tier: writing the received files failed", error)
    return received


def _fsync_tree(directory: str) -> None:
    for base, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _prepare_incoming(rank: int, gathered: List[Dict[Tuple[int, str], Manifest]], incoming: List[Incoming]) -> None:
    """Check that every expected item is sent, and create its files at their sizes (empty ones included)."""
    missing = [f"{i.label} from rank {i.src}" for i in incoming if (rank, i.label) not in gathered[i.src]]
    if missing:
        raise CheckpointingError(f"local tier: rank {rank} expects {', '.join(missing)}, which is not sent")
    for i in incoming:
        shutil.rmtree(i.directory, ignore_errors=True)
        os.makedirs(i.directory)
        for rel, size in gathered[i.src][(rank, i.label)]:
            path = os.path.join(i.directory, _safe_relpath(rel))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)


class _Mapped:
    """The files of one round mapped into memory: a piece is sent straight from its file's pages and
    received straight into them (on ``/dev/shm`` those pages are the local tier itself: a transfer takes
    no host memory of its own; elsewhere they are page cache, written back by the fsync that follows)."""

    def __init__(self) -> None:
        self._maps: Dict[Tuple[str, bool], mmap.mmap] = {}

    def view(self, path: str, offset: int, length: int, writable: bool) -> torch.Tensor:
        """``length`` bytes of ``path`` at ``offset`` as a uint8 tensor over the mapped file."""
        key = (path, writable)
        if key not in self._maps:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
            try:
                # ACCESS_COPY for reading: a writable (private, never written) view, which torch wants
                self._maps[key] = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
            finally:
                os.close(fd)
        mm = self._maps[key]
        if offset + length > len(mm):
            raise CheckpointingError(f"local tier: {path} changed while being sent (it ends before {offset + length})")
        return torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=offset)

    def close(self) -> None:
        """Flush what was received (msync) and unmap, once no tensor uses the maps any more."""
        for (_, writable), mm in self._maps.items():
            if writable:
                mm.flush()
            try:
                mm.close()
            except BufferError:  # a tensor over it still lives (held by torch): unmapped when it goes
                pass
        self._maps.clear()


def _round(comm: Comm, pieces: List[Piece], sources: Dict[Tuple[int, str], str],
           targets: Dict[Tuple[int, str], str]) -> int:
    """Collective: one round. This rank maps each of its pieces' files first (:class:`_Mapped`: a piece goes
    straight from or into its file's pages) and the ranks agree on that, so a rank that cannot (no address
    space left, a file that shrank) fails every rank here instead of leaving its partners waiting for its
    messages; then its receives and sends are posted at once and waited for. A piece's tag is its place in
    the round (unique, the same on both sides)."""
    maps = _Mapped()
    mine: List[Tuple[int, Piece, torch.Tensor]] = []
    pending: List[Pending] = []
    refs: List[Optional[int]] = []  # each view's references before its message (comm_bytes.settle)
    received = 0
    try:
        error: Optional[Exception] = None
        path = ""
        try:
            for tag, p in enumerate(pieces):
                if p.dst == comm.rank:
                    path = os.path.join(targets[(p.src, p.label)], _safe_relpath(p.rel))
                    mine.append((tag, p, maps.view(path, p.offset, p.length, True)))
                elif p.src == comm.rank:
                    path = os.path.join(sources[(p.dst, p.label)], p.rel)
                    mine.append((tag, p, maps.view(path, p.offset, p.length, False)))
        except Exception as e:  # agreed below: raised on every rank, before any message of the round
            error = e if isinstance(e, CheckpointingError) else CheckpointingError(
                f"local tier: mapping {path} to transfer it failed: {type(e).__name__}: {e}")
        comm.agree("local tier: transferring the local copies failed", error)
        for tag, p, view in mine:
            refs.append(backend_refs(view))
            if p.dst == comm.rank:
                pending.append(comm.irecv(view, p.src, tag=tag))
                received += p.length
            else:
                pending.append(comm.isend(view, p.dst, tag=tag))
        for i in range(len(pending)):  # (no loop variable left holding the last work: settle waits on it)
            pending[i].wait()
        pending.clear()
        # gloo lets go of a message's tensor a moment after its wait: a view still held cannot be unmapped
        # (maps.close leaves it mapped), and its release at exit would need the GIL (comm_bytes).
        for (_, _, view), count in zip(mine, refs):
            settle(view, count)
    finally:
        mine.clear()
        pending.clear()  # the works hold the tensors over the maps: released before unmapping
        maps.close()
    return received
