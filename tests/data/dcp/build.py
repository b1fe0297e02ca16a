"""How the DCP fixtures were made (run by hand, never by CI): ``torch.distributed.checkpoint.save``
of ``dcp_state.py``'s state (DTensors on a 2-process gloo mesh, an optimizer-like nested dict, plain
tensors and objects), under the torch of the interpreter that runs it::

    /work/venv-torch25/bin/python tests/data/dcp/build.py tests/data/dcp/torch-2.5
    /work/venv/bin/python tests/data/dcp/build.py tests/data/dcp/torch-2.13

It imports only torch (not lightning_distckpt). The directory must not exist.
"""

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dcp_state  # noqa: E402


def _state(mesh) -> dict:
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5 kept them private
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    leaves = {}
    for key, full in dcp_state.full_tensors().items():
        placement = dcp_state.PLACEMENTS[key]
        if placement is None:
            leaves[key] = full.clone()
        else:
            p = Replicate() if placement == "replicate" else Shard(placement[1])
            leaves[key] = distribute_tensor(full.clone(), mesh, [p])
    leaves.update(dcp_state.OBJECTS)
    return dcp_state.nested(leaves)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    dcp.save(_state(init_device_mesh("cpu", (world,))), checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def main(out: str) -> None:
    if os.path.exists(out):
        raise SystemExit(f"{out} exists: remove it first")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(dcp_state.WORLD, port, os.path.abspath(out)), nprocs=dcp_state.WORLD,
                       start_method="spawn")
    print(f"wrote {out} with torch {torch.__version__}")


if __name__ == "__main__":
    main(sys.argv[1])
