"""Merge the ranks' JUnit files (PEER_OUT/rank*.xml): a test passed if it passed on every rank; a
failure shows the first failing rank's message line."""

from __future__ import annotations

import glob
import os
import sys
import xml.etree.ElementTree as ET
from typing import Dict, List, Tuple


def outcomes(path: str) -> Dict[str, Tuple[str, str]]:
    """test id -> (passed|failed|skipped, first message line) for one rank's file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        state, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state = "skipped" if tag == "skipped" else "failed"
                text = (node.get("message") or "").strip().splitlines()[0:1]
                text = text[0][:200] if text else ""
                break
        if test not in out or state == "failed":
            out[test] = (state, text)
    return out


def main(out_dir: str) -> None:
    merged: Dict[str, Tuple[str, str]] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.xml"))):
        rank = os.path.basename(path)[4:-4]
        for test, (state, text) in outcomes(path).items():
            if test not in merged or (state == "failed" and merged[test][0] != "failed"):
                merged[test] = (state, f"[rank {rank}] {text}" if state == "failed" else text)
    counts: Dict[str, List[str]] = {"passed": [], "failed": [], "skipped": []}
    for test, (state, text) in sorted(merged.items()):
        counts[state].append(f"{test}  {text}".rstrip())
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        for state in ("failed", "skipped", "passed"):
            f.write(f"## {state}: {len(counts[state])}\n" + "".join(f"{t}\n" for t in counts[state]))
    print(" ".join(f"{k}={len(v)}" for k, v in counts.items()))
    for line in counts["failed"]:
        print("FAILED", line)


if __name__ == "__main__":
    main(sys.argv[1])
