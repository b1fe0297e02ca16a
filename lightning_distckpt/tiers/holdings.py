"""What each node holds, checked, and which step the ranks agree to recover: pure functions of the
gathered holdings, so every rank computes the same answer from the same data.

A node's lead lists its committed step directories (:func:`scan_node`): each one's ``metadata.json``
checked against its commit marker's SHA-256, ``common.pt`` likewise, the index parsed for the writer
ranks, and each noted store's files at least as large as the index claims (the chunk checksums are
verified when the load reads them). A directory failing any check is left out; torn and uncommitted
directories are never listed. Directories of one save are recognised by their metadata's SHA-256 (a
restarted job may have saved the same step again).
"""

from __future__ import annotations

import logging
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Tuple

from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.planning.metadata import CheckpointIndex
from lightning_distckpt.storage.checksums import check_sha256
from lightning_distckpt.storage.integrity import store_bytes
from lightning_distckpt.storage.layout import COMMON_FILE, open_metadata
from lightning_distckpt.storage.paths import CHUNK_FILE_SLACK, PICKLE_CAP, read_inside
from lightning_distckpt.tiers.node_store import RUN_FIELD, LocalStep, check_data_dir, committed_steps

logger = logging.getLogger(__name__)

SaveId = Tuple[int, str]  # (step, SHA-256 of metadata.json): one save of one step


class StepInfo(NamedTuple):
    """One node's committed, checked directory of one save."""

    step: int
    sha: str
    node: str
    held: FrozenSet[int]  # writer ranks whose stores it holds completely (own and partner copies)
    copies: FrozenSet[int]  # of which partner copies (or fetched ones)
    writers: FrozenSet[int]  # the ranks whose stores the checkpoint has (from its index)
    committed: float  # the commit marker's time: the newer of two saves of one step wins
    run: Optional[str] = None  # the run that saved it (its commit marker's), None where none was recorded

    @property
    def save_id(self) -> SaveId:
        return (self.step, self.sha)


def scan_node(root: str, node: str) -> List[StepInfo]:
    """This node's committed step directories that pass the checks, oldest first."""
    out = []
    for local in committed_steps(root):
        try:
            out.append(_check(local, node))
        except Exception as e:  # noqa: BLE001 - whatever fails its checks is not used, never fatal
            logger.warning("local tier: node %s: %s is not used: %s: %s", node, local.path, type(e).__name__, e)
    return out


def _check(local: LocalStep, node: str) -> StepInfo:
    """A committed step directory checked (see the module docstring); CheckpointingError when it fails."""
    check_data_dir(local.path)  # a recovery fetches the stores it lacks into it: never through a link
    mf = open_metadata(local.path, verify=True)
    where = f"local checkpoint {local.path}: {COMMON_FILE}"
    common = read_inside(f"{local.path}/{COMMON_FILE}", where, max_bytes=PICKLE_CAP)
    check_sha256(common, mf.marker.get("common_sha256"), where)
    index = CheckpointIndex.from_json(mf.meta, f"local checkpoint {local.path}: metadata.json")
    claimed = index.bytes_per_writer()
    writers = set(claimed) | {s.writer for e in index.objects.values() for s in e.shards}
    held = set()
    for rank in local.held:
        try:
            # each file checked against what the index says the store holds, as a load checks it: a
            # huge (sparse) file in a copy would otherwise be sent whole to a partner that lacks it
            nbytes = store_bytes(local.path, rank, claimed.get(rank, 0))
        except CheckpointingError:  # a link, an unlistable store, a file past its cap: not held
            continue
        if nbytes is not None and nbytes > _most_store_bytes(index, rank, claimed.get(rank, 0)):
            continue  # more than a save of this index writes (a sparse file in an OCDBT data file): not held
        if claimed.get(rank, 0) == 0 or (nbytes is not None and nbytes >= claimed[rank]):
            held.add(rank)
    committed = mf.marker.get("committed_unix", 0.0)
    run = mf.marker.get(RUN_FIELD)
    return StepInfo(local.step, str(mf.marker["metadata_sha256"]), node, frozenset(held),
                    frozenset(local.copies & held), frozenset(writers), float(committed),
                    run if isinstance(run, str) else None)


def _most_store_bytes(index: CheckpointIndex, rank: int, claimed: int) -> int:
    """The most bytes a save of ``index`` writes into ``rank``'s store: its tensors, each of its objects at
    most a pickle's cap, and slack for indexes and edge chunks. A store copy above it would be sent
    whole to a partner that lacks it (a transfer sends files, not the ranges a load reads)."""
    objects = sum(1 for e in index.objects.values() for s in e.shards if s.writer == rank)
    return claimed + objects * PICKLE_CAP.limit() + CHUNK_FILE_SLACK


def by_save(infos: Iterable[StepInfo]) -> Dict[SaveId, List[StepInfo]]:
    out: Dict[SaveId, List[StepInfo]] = {}
    for info in infos:
        out.setdefault(info.save_id, []).append(info)
    return out


def missing_stores(infos: List[StepInfo]) -> FrozenSet[int]:
    """The writer ranks of one save whose stores no node holds."""
    held = frozenset().union(*(i.held for i in infos))
    return infos[0].writers - held


def newest_complete(infos: Iterable[StepInfo], step: Optional[int] = None) -> Optional[List[StepInfo]]:
    """The holdings of the newest save (of ``step``, when given) every store of which some node holds;
    of two saves of one step, the later committed. None when there is none."""
    best: Optional[Tuple[int, float, str]] = None
    chosen: Optional[List[StepInfo]] = None
    for (s, sha), group in by_save(infos).items():
        if (step is not None and s != step) or missing_stores(group):
            continue
        key = (s, max(i.committed for i in group), sha)
        if best is None or key > best:
            best, chosen = key, group
    return chosen
