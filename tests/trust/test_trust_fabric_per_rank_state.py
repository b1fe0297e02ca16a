"""``fabric.save`` of a state whose plain tensors differ by rank (a score each rank computed alone, a dict
keyed by something rank-local): stock Fabric DDP saves rank 0's state whole, so a load gives every rank
rank 0's values. Under our Fabric strategies such tensors were saved as replicated, written by whichever
rank the plan picked, and a key only rank 1 had failed the save ("main replicas cover 0 of 1 elements").
They are now rank 0's, as stock saves them. 2 real Fabric ranks per strategy, against stock's own result."""

import json

import pytest

from script_ranks import run_ranks, script_env

SCRIPT = r"""
import json, os, sys
import torch
from lightning.fabric import Fabric
from lightning_distckpt.lightning import FabricDistCheckpointModelParallelStrategy, FabricDistCheckpointStrategy

folder, how = sys.argv[1:3]
rank = int(os.environ["LOCAL_RANK"])


def parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


strategy = {"stock": lambda: "ddp", "ours": FabricDistCheckpointStrategy,
            "ours_mp": lambda: FabricDistCheckpointModelParallelStrategy(parallelize, data_parallel_size=2,
                                                                         tensor_parallel_size=1)}[how]()
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
torch.manual_seed(0)
model = fabric.setup_module(torch.nn.Linear(4, 2))
path = os.path.join(folder, how)
try:
    fabric.save(path, {"model": model, "score": torch.tensor(float(rank)), "by_name": {f"r{rank}": torch.tensor(1.0)}})
    state = {"model": model, "score": torch.tensor(-1.0), "by_name": {}}
    rest = fabric.load(path, state, strict=False)
    res = {"score": float(state["score"]), "by_name": sorted(state["by_name"]), "rest": sorted(rest)}
except Exception as e:
    res = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
with open(os.path.join(folder, f"{how}.rank{rank}.json"), "w") as f:
    json.dump(res, f)
"""


@pytest.mark.parametrize("how", ["stock", "ours", "ours_mp"])
def test_per_rank_plain_tensors_are_saved_as_rank_0s(tmp_path, how):
    script = tmp_path / "per_rank.py"
    script.write_text(SCRIPT)
    code, output = run_ranks(str(script), [str(tmp_path), how], script_env(), 2, timeout=240)
    for rank in range(2):
        path = tmp_path / f"{how}.rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        # stock's result, for every strategy: rank 0's score and rank 0's keys, on every rank
        assert json.loads(path.read_text()) == {"score": 0.0, "by_name": ["r0"], "rest": []}
