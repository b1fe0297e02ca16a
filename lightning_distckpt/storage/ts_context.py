"""tensorstore contexts whose thread-pool executors live as long as the process.

A tensorstore ``Context`` that defines ``file_io_concurrency`` or ``data_copy_concurrency`` gets an
executor of its own (a task group over tensorstore's shared thread pool), freed with the context.
Freeing one while the pool still holds work queued for it races inside tensorstore (0.1.86): the task
group is destroyed twice ("double free or corruption", SIGABRT) or a pool thread calls through its
freed memory (SIGSEGV in ``SharedThreadPool::FindActiveTaskProvider``). A fresh context per reader
and writer made that a crash in about one of three runs of the test suite; a loop of small writes and
reads, each through a context of its own, hit it within about 100,000 contexts (gdb: ``~TaskGroup``
called from ``FindActiveTaskProvider``), and never with the executors shared.

So the executors are made once per concurrency limit, in a parent context kept for the process; the
context of each reader and writer is a child holding what must stay its own (its cache pool, its
file options) and inheriting the executors. Children still share nothing else: no cache, no open
OCDBT database, so a checkpoint replaced between two loads is read afresh.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, Mapping

import tensorstore as ts

EXECUTORS = ("file_io_concurrency", "data_copy_concurrency")  # the resources that own a task group

_parents: Dict[str, ts.Context] = {}  # the executors' settings (JSON) -> the context holding them, never freed
_lock = threading.Lock()  # (two readers opened at once on other threads make one parent, not two)


def child_context(spec: Mapping[str, Any]) -> ts.Context:
    """A tensorstore context of ``spec`` whose executor resources (``file_io_concurrency``,
    ``data_copy_concurrency``, as ``spec`` sets them or tensorstore's defaults) are the ones this
    process keeps for those settings; every other resource of ``spec`` is the new context's own."""
    executors = {k: spec[k] for k in EXECUTORS if k in spec}
    key = json.dumps(executors, sort_keys=True)
    with _lock:
        parent = _parents.get(key)
        if parent is None:
            parent = _parents[key] = ts.Context(executors)
    return ts.Context({k: v for k, v in spec.items() if k not in EXECUTORS}, parent=parent)
