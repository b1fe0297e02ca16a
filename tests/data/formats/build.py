"""How the format witnesses ``v1`` ... ``v8`` were made (run by hand, never by CI).

Each ``vN/`` is a checkpoint written by the library at the last commit that wrote format N (its
``FORMAT_VERSION``), checked out as a git worktree, on 2 gloo processes::

    git worktree add --detach /work/wt-fmtN COMMIT
    PYTHONPATH=/work/wt-fmtN python tests/data/formats/build.py tests/data/formats/vN
    PYTHONPATH=/work/wt-fmtN python tests/data/formats/build.py tests/data/formats/vN-zarr zarr

The second form stores with ``StorageOptions(layout="zarr", chunk_bytes=1024)``: a file per chunk,
and arrays (or packs) of more than one chunk.

From format 8 the state also holds ``witness.py``'s tied pair (when the library on PYTHONPATH has
``planning/aliases.py``), so the save records it in ``aliases``.

The state is ``witness.py``'s (deterministic values, re-created by tests/interop/test_format_witnesses.py).
The script refuses an existing directory. See tests/data/README.md for the commits used.
"""

import datetime
import importlib.util
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import witness  # noqa: E402


def _writes_aliases() -> bool:
    """Whether the library on PYTHONPATH stores a tie once (format 8: ``planning/aliases.py``)."""
    return importlib.util.find_spec("lightning_distckpt.planning.aliases") is not None


def sharded_state(ldc, rank: int, world: int) -> dict:
    """Rank ``rank``'s sharded state dict: its shards of ``witness.full_tensors()`` and its object."""
    model, optimizer = {}, {}
    for key, full in witness.full_tensors().items():
        axis = witness.SAVE_AXES[key]
        if axis is None:
            st = ldc.ShardedTensor.from_rank_offsets(key, full.clone(), replica_id=rank)
        elif axis == "flat":
            lo, hi = witness.FLAT_SPLIT[rank], witness.FLAT_SPLIT[rank + 1]
            st = ldc.ShardedTensor.from_rank_offsets_flat(key, full.flatten()[lo:hi].clone(), full.shape,
                                                          flattened_range=slice(lo, hi))
        else:
            local = full.chunk(world, axis)[rank].contiguous()
            st = ldc.ShardedTensor.from_rank_offsets(key, local, (axis, rank, world))
        (optimizer if key.startswith("optimizer.") else model)[key] = st
    if _writes_aliases():  # format 8 on: the tied pair, one memory under both keys (as module.state_dict())
        local = witness.tied_tensor().chunk(world, 0)[rank].contiguous()
        for key in witness.TIED_KEYS:
            model[key] = ldc.ShardedTensor.from_rank_offsets(key, local.detach(), (0, rank, world))
    model["extra_state"] = ldc.ShardedObject(witness.OBJECT_KEY, witness.OBJECTS[rank], (world,), (rank,))
    return {"model": model, "optimizer": optimizer, **witness.COMMON, "scores": witness.plain_tensors()}


def _worker(rank: int, world: int, port: int, out: str, layout: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    import lightning_distckpt as ldc

    zarr = {"layout": "zarr", "chunk_bytes": 1024}
    if _writes_aliases():  # the tied pair (64 KiB a rank) an array of its own: 2 chunks a rank, not 64 of a pack
        zarr["pack_max_bytes"] = 32 * 1024
    storage = ldc.StorageOptions(**zarr) if layout == "zarr" else None
    ldc.save(sharded_state(ldc, rank, world), out, storage=storage)
    dist.barrier()
    dist.destroy_process_group()


def main(out: str, layout: str = "ocdbt") -> None:

    if os.path.exists(out):
        raise SystemExit(f"{out} exists: remove it first")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(witness.WORLD, port, os.path.abspath(out), layout), nprocs=witness.WORLD,
                       start_method="spawn")
    with open(os.path.join(out, "metadata.json")) as f:
        version = json.load(f)["format_version"]
    print(f"wrote format {version} ({layout}) to {out} with torch {torch.__version__}")


if __name__ == "__main__":
    main(*sys.argv[1:])
