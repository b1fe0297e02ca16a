"""A rank that dies during a save makes the others fail with an error, not hang, and nothing is committed."""

import datetime
import multiprocessing as mp
import os
import time

import torch

from dist_utils import free_port


def _member(rank, port, path, queue):
    import torch.distributed as dist

    import lightning_distckpt as ldc

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, rank, 2))}
    ldc.save(sd, path + "_good")
    if rank == 1:
        os._exit(3)  # dies before the next save
    t0 = time.monotonic()
    try:
        ldc.save(sd, path)
        queue.put(("no error", time.monotonic() - t0))
    except Exception as e:  # gloo reports the closed connection
        queue.put((f"{isinstance(e, ldc.CheckpointingError)} {type(e).__name__}: {e}", time.monotonic() - t0))


def test_dead_rank_does_not_hang(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    path = str(tmp_path / "ck")
    procs = [ctx.Process(target=_member, args=(r, port, path, queue)) for r in range(2)]
    for p in procs:
        p.start()
    msg, seconds = queue.get(timeout=90)
    for p in procs:
        p.join(timeout=30)
    assert msg.startswith("True CollectiveError") and "may have died" in msg, msg
    assert seconds < 60
    assert procs[1].exitcode == 3
    assert not os.path.exists(path)  # nothing committed
    assert os.path.exists(path + "_good")
