"""Issue 16 defect 7: ``import_torch_file`` is single-process, also inside an initialized process
group: rank 0 alone exports and imports back a checkpoint while rank 1 waits at a barrier."""

import os

import torch
import torch.distributed as dist

import lightning_distckpt as ldc
from dist_utils import run_distributed


def _rank0_alone(rank, world, root):
    ck, out, back = (os.path.join(root, n) for n in ("ck", "ck.pt", "back"))
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((3,), float(rank)), (0, rank, world)),
              "note": "hi"}, ck)
    result = None
    if rank == 0:  # the others are not in any collective of this: they wait at the barrier below
        ldc.export.to_torch_file(ck, out)  # not a Lightning checkpoint: the core export format
        report = ldc.export.from_torch_file(out, back)
        result = (report.kind, ldc.load_plain_tensors(back)["w"].tolist(), ldc.load_common_state_dict(back)["note"])
    dist.barrier()
    return result


def test_import_of_an_export_by_rank0_alone_enters_no_collective(tmp_path):
    out = run_distributed(_rank0_alone, 2, str(tmp_path), timeout_s=60)
    assert out[0] == ("tensors", [0.0, 0.0, 0.0, 1.0, 1.0, 1.0], "hi")
    assert out[1] is None
