"""Moving whole directories (a rank store, a step directory's metadata and common state) between ranks
with torch.distributed point-to-point messages, through :class:`~lightning_distckpt.comm.Comm`.

One exchange is collective over the tier's group: every rank all-gathers the manifests of what it sends
(relative path and size of each file, per item), so every receiver knows every message's size; then all
receives and sends are posted at once (no pair can wait on another) and waited for. A receiver writes
each item into the directory it names and checks that every file arrived at its size; the stored chunks
carry their own checksums, verified when they are read.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from lightning_distckpt.comm import Comm, Pending
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
    tops = sorted(os.listdir(directory)) if names is None else [n for n in names if os.path.lexists(os.path.join(directory, n))]
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
        missing = [f"{i.label} from rank {i.src}" for i in incoming if (comm.rank, i.label) not in gathered[i.src]]
        error = CheckpointingError(f"local tier: rank {comm.rank} expects {', '.join(missing)}, "
                                   "which is not sent") if missing else None
        recvs = [(i, rel, size) for i in incoming for rel, size in gathered[i.src][(comm.rank, i.label)]
                 if not missing]
        paths = [os.path.join(i.directory, _safe_relpath(rel)) for i, rel, _ in recvs]
    except Exception as e:
        error, recvs, paths = e, [], []
    comm.agree("local tier: planning the transfers failed", error)
    pending: List[Pending] = []
    bufs = [torch.empty(size, dtype=torch.uint8) for _, _, size in recvs]
    for i in incoming:
        shutil.rmtree(i.directory, ignore_errors=True)
        os.makedirs(i.directory)
    tags: Dict[Tuple[int, int], int] = {}  # per (src, dst) pair: messages numbered in label order on both sides
    for (i, rel, size), buf in sorted(zip(recvs, bufs), key=lambda x: (x[0][0].src, x[0][0].label)):
        if size:
            pending.append(comm.irecv(buf, i.src, tag=_next(tags, i.src, comm.rank)))
    for o in sorted(outgoing, key=lambda o: (o.dst, o.label)):
        for rel, size in mine[(o.dst, o.label)]:
            if size:
                data = _read(os.path.join(o.directory, rel), size)
                pending.append(comm.isend(data, o.dst, tag=_next(tags, comm.rank, o.dst)))
    for p in pending:
        p.wait()
    for path, buf in zip(paths, bufs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(memoryview(buf.numpy()))
            f.flush()
            os.fsync(f.fileno())
    return sum(b.numel() for b in bufs)


def _next(tags: Dict[Tuple[int, int], int], src: int, dst: int) -> int:
    """The next message tag of the pair ``src -> dst`` (both sides count in the same order)."""
    n = tags.get((src, dst), 0)
    tags[(src, dst)] = n + 1
    return n


def _read(path: str, size: int) -> torch.Tensor:
    """A file's bytes as a uint8 tensor (its size checked against the manifest's)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if len(data) != size:
        raise CheckpointingError(f"local tier: {path} changed while being sent ({size} -> {len(data)} bytes)")
    return torch.frombuffer(data, dtype=torch.uint8)
