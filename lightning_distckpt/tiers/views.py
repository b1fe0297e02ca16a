"""What ``inspect`` and ``clean`` show of node-local tiers: the steps each node root holds, which rank
stores each step directory holds (own or partner copies) and which steps the roots shown recover
together; and the leftovers of killed local saves and transfers for ``clean``.

A path is shown as tiers when it is a node root (it holds step directories of ours) or a directory of
node roots (simulated nodes: ``local_dir=/tmp/ckpt/{node}`` gives ``/tmp/ckpt``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from lightning_distckpt.core.shown import MESSAGE_LIMIT, shown  # roots are directory names: anyone's
from lightning_distckpt.storage.staging import find_leftovers
from lightning_distckpt.tiers.context import TMP_PREFIX
from lightning_distckpt.tiers.holdings import missing_stores, scan_node, by_save
from lightning_distckpt.tiers.node_store import committed_steps, is_ours, step_of, tier_tmp_dirs, uncommitted_dirs
from lightning_distckpt.tiers.private_root import unsafe_reason


def is_tier_root(path: str) -> bool:
    """``path`` holds at least one step directory of ours."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(step_of(n) is not None and is_ours(os.path.join(path, n)) for n in names)


def tier_roots(path: str) -> List[str]:
    """The node roots at ``path``: itself, or its subdirectories that are roots (none: not tiers)."""
    if is_tier_root(path):
        return [os.path.abspath(path)]
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    subs = [os.path.join(path, n) for n in names if not os.path.islink(os.path.join(path, n))]
    return [os.path.abspath(p) for p in subs if os.path.isdir(p) and is_tier_root(p)]


def tier_summary(path: str) -> Optional[Dict[str, Any]]:
    """A JSON-able description of the node-local tiers at ``path``; None when there are none."""
    roots = tier_roots(path)
    if not roots:
        return None
    nodes, infos = [], []
    for root in roots:
        checked = {i.step: i for i in scan_node(root, os.path.basename(root))}
        infos += checked.values()
        steps = []
        for s in committed_steps(root):
            info = checked.get(s.step)
            steps.append({"step": s.step, "path": s.path, "verified": info is not None,
                          "own": sorted(s.held - s.copies), "copies": sorted(s.copies),
                          "usable": sorted(info.held) if info else [],
                          "writers": sorted(info.writers) if info else None,
                          "run": info.run if info else None})  # a recovery counts only its own run's steps
        leftovers = uncommitted_dirs(root) + _tmp_dirs(root)
        nodes.append({"root": root, "steps": steps, "leftovers": leftovers, "not_private": _not_private(root)})
    recoverable = sorted({s for (s, _), group in by_save(infos).items() if not missing_stores(group)})
    return {"path": os.path.abspath(path), "nodes": nodes, "recoverable_steps": recoverable}


def _not_private(root: str) -> Optional[str]:
    """Why a tier would refuse ``root`` (:mod:`.private_root`), or None."""
    try:
        return unsafe_reason(root) if hasattr(os, "geteuid") else None
    except OSError as e:
        return f"cannot check its owner and mode: {e}"


def _tmp_dirs(root: str) -> List[str]:
    return tier_tmp_dirs(root, TMP_PREFIX)


def render_tier(s: Dict[str, Any]) -> str:
    """The summary as text: one block per node root, one line per step."""
    from lightning_distckpt.cli.inspect import ranks_text

    lines = [f"local tiers  {shown(s['path'], None)} ({len(s['nodes'])} node root(s))",
             "recoverable  " + (", ".join(f"step {x}" for x in s["recoverable_steps"]) or
                                "nothing (some rank's store is held by no root shown)")]
    for n in s["nodes"]:
        lines.append("")
        lines.append(f"node root    {shown(n['root'], None)}")
        if n.get("not_private"):
            lines.append(f"  NOT PRIVATE: {shown(n['not_private'], MESSAGE_LIMIT)}; a tier refuses this root "
                         "(docs/tiers.md)")
        for st in n["steps"]:
            state = "verified" if st["verified"] else "NOT USABLE (failed its checks)"
            lines.append(f"  step {st['step']:>9}  own stores {ranks_text(st['own']) or '-'}; partner copies "
                         f"{ranks_text(st['copies']) or '-'}; {state}")
        if n["leftovers"]:
            lines.append(f"  {len(n['leftovers'])} unfinished local save(s) or transfer(s): lightning-distckpt clean "
                         f"{shown(n['root'], None)}")
    return "\n".join(lines)


@dataclass(frozen=True)
class TierLeftover:
    """An unfinished transfer or a torn step directory of a node root (``clean``'s view of it)."""

    path: str
    target: str
    nbytes: int
    idle_s: float
    committed: bool = False

    def verdict(self, older_than_s: float) -> str:
        return "remove" if self.idle_s >= older_than_s else "recent"

    def reason(self, verdict: str, older_than_s: float) -> str:
        if verdict == "recent":
            return (f"changed {self.idle_s:.0f} s ago (< --older-than {older_than_s:.0f} s): a local save or "
                    "transfer may still be running")
        return f"unfinished local-tier transfer or torn local step, idle {self.idle_s:.0f} s"


def tier_leftovers(path: str) -> List[Any]:
    """What killed local saves and transfers left at ``path`` (a node root or a directory of them):
    transfers in progress, torn step directories of ours; and, under a directory of roots, each root's
    staging directories (a root's own are found by its store already)."""
    roots = tier_roots(path)
    out: List[Any] = []
    for root in roots:
        if root != os.path.abspath(path):
            out += find_leftovers(root, None)
        for p in _tmp_dirs(root) + [d for d in uncommitted_dirs(root) if step_of(os.path.basename(d)) is not None]:
            sized = _size_and_idle(p)
            if sized is not None:
                out.append(TierLeftover(p, os.path.join(root, "step_*"), *sized))
    return out


def _size_and_idle(path: str) -> Optional[Tuple[int, float]]:
    """Bytes under ``path`` and seconds since anything there changed; None when ``path`` is gone. A
    running recovery renames its transfers into place and removes torn steps while ``clean`` walks:
    an entry that vanishes meanwhile is skipped (not a traceback), and counts as a change just now."""
    try:
        size, newest = 0, os.lstat(path).st_mtime
    except FileNotFoundError:
        return None
    for base, _, files in os.walk(path):
        for p in [base] + [os.path.join(base, f) for f in files]:
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                newest = time.time()
                continue
            size, newest = size + (st.st_size if p != base else 0), max(newest, st.st_mtime)
    return size, max(0.0, time.time() - newest)


class RootsInUse:
    """``clean``'s hold on the directories whose leftovers it removes (:func:`.root_lock.hold_for_clean`,
    taken as each is first asked about, kept until :meth:`release`): one a running job holds keeps all."""

    def __init__(self) -> None:
        self._claims: List[Any] = []
        self._holders: Dict[str, Optional[str]] = {}

    def holder(self, directory: str) -> Optional[str]:
        """Who holds ``directory`` (a node root of a running job), else None (now held by this clean)."""
        from lightning_distckpt.tiers.root_lock import hold_for_clean

        key = os.path.realpath(directory)
        if key not in self._holders:
            claim, self._holders[key] = hold_for_clean(key, create=is_tier_root(key))
            self._claims.append(claim)
        return self._holders[key]

    def release(self) -> None:
        for claim in self._claims:
            claim.release()
