"""``inspect`` and ``clean`` on node-local tiers: the steps each node root holds, own stores and partner
copies, the steps the roots recover together; leftovers of a killed local save removed by ``clean``,
committed steps never."""

import json
import os

import pytest

from dist_utils import run_distributed
from lightning_distckpt.cli.main import main
from lightning_distckpt.storage.commit import KILL_AT_ENV
from lightning_distckpt.tiers import LocalTier
from tier_helpers import options, run_killed, state

pytestmark = pytest.mark.tiers


def _save(rank, world, tmp):
    tier = LocalTier(options(tmp))
    for step in (10, 20):
        tier.save(state(rank, world, step), step)
    tier.close()


def _inspect(path, capsys):
    assert main(["inspect", "--json", path]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_shows_steps_stores_and_copies(tmp_path, capsys):
    tmp = str(tmp_path)
    run_distributed(_save, 4, tmp)
    s = _inspect(tmp, capsys)
    assert s["recoverable_steps"] == [10, 20]
    node0, node1 = s["nodes"]
    assert node0["root"].endswith("node0") and [st["step"] for st in node0["steps"]] == [10, 20]
    assert (node0["steps"][1]["own"], node0["steps"][1]["copies"]) == ([0, 1], [2, 3])
    assert (node1["steps"][1]["own"], node1["steps"][1]["copies"]) == ([2, 3], [0, 1])
    one = _inspect(os.path.join(tmp, "node1"), capsys)  # one node root: recovers alone (it holds copies)
    assert one["recoverable_steps"] == [10, 20] and len(one["nodes"]) == 1
    assert main(["inspect", tmp]) == 0
    text = capsys.readouterr().out
    assert "recoverable  step 10, step 20" in text and "partner copies 2-3" in text
    assert "NOT PRIVATE" not in text and node0["not_private"] is None
    os.chmod(os.path.join(tmp, "node1"), 0o777)  # what a tier would refuse, inspect says
    assert _inspect(tmp, capsys)["nodes"][1]["not_private"] == "others can write it (mode 777)"
    assert main(["inspect", tmp]) == 0
    assert "NOT PRIVATE: others can write it (mode 777); a tier refuses this root" in capsys.readouterr().out


def test_clean_removes_a_killed_local_save_only(tmp_path, capsys):
    tmp = str(tmp_path)
    run_killed(4, "save30", tmp, 1, {"LDC_TIER_ARM": f"{KILL_AT_ENV}=tier_before_place"})
    before = _inspect(tmp, capsys)
    assert any(n["leftovers"] for n in before["nodes"])  # rank 1's received copy, never placed
    assert main(["clean", "--older-than", "0", "--json", tmp]) == 0
    actions = json.loads(capsys.readouterr().out)
    assert actions and all(a["action"] == "removed" for a in actions)
    after = _inspect(tmp, capsys)
    assert not any(n["leftovers"] for n in after["nodes"])
    assert [[st["step"] for st in n["steps"]] for n in after["nodes"]] == \
        [[st["step"] for st in n["steps"]] for n in before["nodes"]]  # committed steps untouched
    assert after["recoverable_steps"] == [20, 30]
