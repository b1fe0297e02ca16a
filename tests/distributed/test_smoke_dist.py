import torch
import lightning_distckpt as ldc
from dist_utils import run_distributed


def _save_tp2_load_tp1(rank, world, path):
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    sd = {"w": ldc.ShardedTensor.from_rank_offsets("w", full[rank * 4:(rank + 1) * 4].clone(), (0, rank, world))}
    ldc.save(sd, path)
    return True


def test_tp2_to_tp1(tmp_path):
    run_distributed(_save_tp2_load_tp1, 2, str(tmp_path / "ck"))
    out = ldc.load({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 4))}, tmp_path / "ck")
    assert torch.equal(out["w"], torch.arange(32, dtype=torch.float32).reshape(8, 4))
