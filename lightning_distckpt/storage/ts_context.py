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

import functools
import json
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

import tensorstore as ts

EXECUTORS = ("file_io_concurrency", "data_copy_concurrency")  # the resources that own a task group

_lock = threading.Lock()  # (lru_cache alone may make two parents for one key when threads race)


@functools.lru_cache(maxsize=None)
def _parent(limits: Tuple[Tuple[str, Optional[str]], ...]) -> ts.Context:
    """The process's context holding the executors of ``limits`` ((resource, its JSON spec or None
    for tensorstore's default)); one per distinct set, never freed (there are only a few)."""
    return ts.Context({name: json.loads(text) for name, text in limits if text is not None})


def child_context(spec: Mapping[str, Any]) -> ts.Context:
    """A tensorstore context of ``spec`` whose executor resources (``file_io_concurrency``,
    ``data_copy_concurrency``, as ``spec`` sets them or tensorstore's defaults) are the ones this
    process keeps for those settings; every other resource of ``spec`` is the new context's own."""
    own: Dict[str, Any] = {k: v for k, v in spec.items() if k not in EXECUTORS}
    limits = tuple((name, json.dumps(spec[name], sort_keys=True) if name in spec else None) for name in EXECUTORS)
    with _lock:
        parent = _parent(limits)
    return ts.Context(own, parent=parent)
