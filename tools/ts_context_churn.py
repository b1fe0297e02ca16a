"""Reproduce tensorstore's race in freeing a context's thread-pool executor (lightning_distckpt/storage/ts_context.py).

Each iteration writes and reads a small zarr array through a new context, then drops it:

* ``fresh``: each context with executors of its own (``file_io_concurrency``, ``data_copy_concurrency``), as
  our stores made them before; tensorstore 0.1.86 crashes now and then (SIGSEGV in
  ``SharedThreadPool::NotifyWorkAvailable`` / ``FindActiveTaskProvider``, or glibc's "double free or
  corruption" from ``~TaskGroup``), within about 100,000 contexts with three copies on two busy cores;
* ``shared``: each context a :func:`~lightning_distckpt.storage.ts_context.child_context` (what the stores do now).

Run several copies at once on a loaded machine, e.g.::

    for k in 1 2 3; do python tools/ts_context_churn.py fresh 60000 & done; wait
    for k in 1 2 3; do python tools/ts_context_churn.py shared 60000 & done; wait

A copy that exits on a signal (rc 134 / 139) hit the race. Not a test: how soon it hits depends on the machine.
"""

import argparse
import shutil
import tempfile

import numpy as np
import tensorstore as ts

from lightning_distckpt.storage.ts_context import child_context

EXECUTORS = {"file_io_concurrency": {"limit": 4}, "data_copy_concurrency": {"limit": 4}}
OWN = {"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["fresh", "shared"])
    p.add_argument("iterations", type=int)
    p.add_argument("--dir", default=None, help="where the arrays go (default: a temporary directory)")
    args = p.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    data = np.arange(4096, dtype=np.float32)
    try:
        for i in range(args.iterations):
            ctx = ts.Context({**OWN, **EXECUTORS}) if args.mode == "fresh" else child_context({**OWN, **EXECUTORS})
            arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/a{i % 50}"},
                           "metadata": {"shape": [4096], "data_type": "float32",
                                        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1024]}}}},
                          create=True, delete_existing=True, context=ctx).result()
            arr.write(data).result()
            if not np.array_equal(arr.read().result(), data):
                raise SystemExit(f"iteration {i}: read back differs")
            del arr, ctx
            if i % 10000 == 0:
                print(i, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mode}: {args.iterations} contexts, no crash", flush=True)


if __name__ == "__main__":
    main()
