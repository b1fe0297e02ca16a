"""The command line and the Fabric entry points, red-teamed: what a probe found.

* ``fabric.load(path, {"model": m, "optimizer": o})`` under ``FabricDistCheckpointStrategy`` refused,
  with a MissingKeysError, a stock Fabric ``torch.save`` checkpoint whose optimizer has no state for
  some parameter (saved before the first step, or a parameter that never had a gradient): torch keeps
  no state for such a parameter, and stock Fabric loads the file. It loads now, and the next step
  equals stock torch's after ``load_state_dict`` of the same file, bit for bit; a parameter whose
  stored state is only partly there is still refused.
* ``convert CK OUT --to dcp`` (and ``--to megatron``) over an earlier export moved the earlier one
  aside, then renamed the new one in: a ``kill -9`` between the two renames left ``OUT`` missing (a
  later ``inspect`` said "no such directory") and the earlier export hidden under a temporary name
  nothing reports. Where the file system has ``renameat2(RENAME_EXCHANGE)`` the two are swapped in
  one step: killed anywhere, ``OUT`` holds the earlier export or the new one, complete.
"""

import json
import subprocess
import sys

import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import MissingKeysError
from lightning_distckpt.export import to_dcp, to_megatron
from lightning_distckpt.cli.main import main as cli_main
from lightning_distckpt.storage.swap import exchange_paths

# Runs the CLI with SIGKILL sent to itself right before its Nth os.rename / os.replace: a kill -9 at a
# chosen point of the convert, found by what the process does, not by timing.
KILLER = """
import os, signal, sys
n, calls = int(sys.argv[1]), [0]
for name in ("rename", "replace"):
    def wrapped(*a, _orig=getattr(os, name), **k):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return _orig(*a, **k)
    setattr(os, name, wrapped)
from lightning_distckpt.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _fabric():
    from lightning.fabric import Fabric

    from lightning_distckpt.lightning import FabricDistCheckpointStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricDistCheckpointStrategy())
    fabric.launch()
    return fabric


def _step(model, optimizer, seed):
    torch.manual_seed(seed)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("stored", ["before_first_step", "bias_never_had_a_gradient"])
def test_fabric_load_of_a_stock_file_whose_optimizer_has_no_state_for_some_parameter(tmp_path, isolated_process_group,
                                                                                   stored):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if stored == "bias_never_had_a_gradient":
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}
    path = str(tmp_path / "stock.pt")
    torch.save(saved, path)  # what fabric.save writes under stock Fabric DDP

    reference = torch.nn.Linear(4, 3)  # stock: load_state_dict of the same file, then a step
    reference.load_state_dict(saved["model"])
    reference_opt = torch.optim.Adam(reference.parameters(), lr=0.5)
    reference_opt.load_state_dict(torch.load(path)["optimizer"])

    fabric = _fabric()
    live_model = torch.nn.Linear(4, 3)
    live, live_opt = fabric.setup(live_model, torch.optim.Adam(live_model.parameters(), lr=0.5))
    state = {"model": live, "optimizer": live_opt, "step": 0}
    assert fabric.load(path, state) == {}  # strict, as stock Fabric loads it
    assert state["step"] == 7 and live_opt.param_groups[0]["lr"] == 0.01
    _step(reference, reference_opt, 1)
    _step(live.module, live_opt, 1)
    for ours, theirs in zip(live.module.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)

    # A parameter whose state is stored in part is damage, still refused naming what is missing.
    saved["optimizer"]["state"] = {0: {k: v for k, v in _adam_state().items() if k != "exp_avg_sq"}}
    torch.save(saved, path)
    with pytest.raises(MissingKeysError, match="optimizer/state/0/exp_avg_sq"):
        fabric.load(path, {"model": live, "optimizer": live_opt})


def _adam_state():
    """The state of a Linear(4, 3)'s weight after one Adam step."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()
    return optimizer.state_dict()["state"][0]


def _exchange_supported(root) -> bool:
    a, b = root / "xa", root / "xb"
    a.mkdir()
    b.mkdir()
    try:
        return exchange_paths(str(a), str(b))
    finally:
        a.rmdir()
        b.rmdir()


def _inspect_keys(out, capsys):
    """``inspect --json`` in this process (the kills are what needs a process of their own)."""
    capsys.readouterr()
    assert cli_main(["inspect", out, "--json"]) == 0
    return {t["key"] for t in json.loads(capsys.readouterr().out)["tensors"]}


@pytest.mark.parametrize("to", ["dcp", "megatron"])
def test_a_convert_killed_over_an_earlier_export_leaves_the_earlier_or_the_new_one(tmp_path, to, capsys):
    if not _exchange_supported(tmp_path):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: two renames, as on NFS")
    old_src, new_src = str(tmp_path / "old_ck"), str(tmp_path / "new_ck")
    ldc.save({"old.weight": torch.ones(8, 8)}, old_src)
    ldc.save({"new.weight": torch.zeros(8, 8), "new.bias": torch.zeros(8)}, new_src)
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    out = str(tmp_path / "export")
    old_keys = None
    for n in range(1, 12):  # kill before each rename in turn, until the convert runs to its end
        (to_dcp if to == "dcp" else to_megatron)(old_src, out)  # the earlier export, through the Python API
        old_keys = old_keys or _inspect_keys(out, capsys)
        run = subprocess.run([sys.executable, str(killer), str(n), "convert", new_src, out, "--to", to, "-q"],
                             capture_output=True, text=True, timeout=120)
        keys = _inspect_keys(out, capsys)  # never missing, never a mix
        if run.returncode == 0:
            assert keys != old_keys and {k.split(".")[-1] for k in keys} >= {"weight", "bias"}
            break
        assert run.returncode == -9, run.stderr
        assert keys == old_keys
    else:
        pytest.fail("the convert never ran to its end")
