"""A Fabric loop's last background save: Fabric has no end-of-run hook, so the loop calls
``fabric.strategy.checkpoint_io.wait()`` to commit it and hear of a failure (docs/lightning.md,
Fabric). Two ranks, ``async_save: true``; the second save fails in rank 1's background writes (a
file-size limit, the full-disk stand-in). ``wait()`` raises the same SaveFailedError on both ranks,
naming the save and rank 1, and the first checkpoint stays loadable."""

import json
import os

from script_ranks import run_ranks, script_env

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOOP = r'''
import json, os, resource, signal, sys
from datetime import timedelta
sys.path.insert(0, os.path.join(TESTS, "lightning_scripts"))
import torch
from lightning.fabric import Fabric
from lightning_distckpt.lightning import FabricDistCheckpointStrategy
from fabric_scenarios import TPNet

folder, out = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
strategy = FabricDistCheckpointStrategy(tensor_parallel_size=2, timeout=timedelta(seconds=60),
                                        checkpoint={"async_save": True})
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
model = fabric.setup(TPNet(fabric.strategy.parallel_state))
res = {}
first = {k: v.detach().clone() for k, v in model.state_dict().items()}
fabric.save(os.path.join(folder, "step=1"), {"model": model, "step": 1})
fabric.strategy.checkpoint_io.wait()  # committed
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
if fabric.global_rank == 1:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
fabric.save(os.path.join(folder, "step=2"), {"model": model, "step": 2})  # returns: writes in the background
try:
    fabric.strategy.checkpoint_io.wait()
    res["wait"] = "returned"
except Exception as e:
    res["wait"] = f"{type(e).__name__}: {e}"
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
state = {"model": model, "step": 0}
fabric.load(os.path.join(folder, "step=1"), state)
res["step"] = state["step"]
res["first_back"] = all(torch.equal(v, first[k]) for k, v in model.state_dict().items())
res["step2_exists"] = os.path.exists(os.path.join(folder, "step=2"))
with open(f"{out}.rank{fabric.global_rank}.json", "w") as f:
    json.dump(res, f)
'''.replace("TESTS", repr(TESTS))


def test_wait_raises_a_fabric_loops_failed_last_save_on_every_rank(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    code, output = run_ranks(str(script), [str(tmp_path), str(tmp_path / "out")], script_env(), 2, timeout=180)
    for rank in range(2):
        path = tmp_path / f"out.rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        res = json.loads(path.read_text())
        assert res["wait"].startswith("SaveFailedError"), (rank, res["wait"])
        assert "step=2" in res["wait"] and "rank 1" in res["wait"], res["wait"]
        assert res["step"] == 1 and res["first_back"] is True  # the committed checkpoint loads
        assert res["step2_exists"] is False  # the failed save left no checkpoint under its name
