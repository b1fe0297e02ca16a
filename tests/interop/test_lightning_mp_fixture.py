"""A checked-in checkpoint of Lightning 2.6.6's own ``ModelParallelStrategy`` (FSDP2 over 2 CPU
processes, gloo, 2 Adam steps: DCP files + meta.pt; tests/data/lightning_model_parallel/model.py
``build``) with the writer's whole weights and Adam state (``expected.pt``): ``ldc.load`` reads it
bit-exactly whole and on 2 gloo ranks under a column split, and lightning_distckpt's
``DistCheckpointModelParallelStrategy`` resumes a Trainer from it under tensor parallel 2."""

import json
import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.cli import main as cli_main
from script_ranks import run_ranks, script_env

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "lightning_model_parallel")
CKPT = os.path.join(HERE, "ckpt")
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _expected():
    return torch.load(os.path.join(HERE, "expected.pt"), weights_only=True)


def _stored_key(name):
    """The DCP key Lightning stored ``name`` under: ``fc1.weight`` -> ``state_dict.fc1.weight``,
    ``fc1.weight.exp_avg`` -> ``optimizer_0.state.fc1.weight.exp_avg``."""
    return f"state_dict.{name}" if name in PARAMS else f"optimizer_0.state.{name}"


def _piece(full, rank, world):
    """This rank's columns (last dim; 0-d tensors whole): the writer split rows (FSDP2 dim 0)."""
    if world == 1 or full.dim() == 0:
        return [0] * full.dim(), full
    pieces = full.chunk(world, -1)
    offset = [0] * full.dim()
    offset[-1] = sum(p.shape[-1] for p in pieces[:rank])
    return offset, pieces[rank]


def _mismatches(rank, world):
    expected = _expected()
    template = {}
    for name, full in expected.items():
        offset, piece = _piece(full, rank, world)
        template[name] = ldc.ShardedTensor.from_offsets(_stored_key(name), torch.zeros_like(piece).contiguous(),
                                                        full.shape, offset, replica_id=rank if full.dim() == 0 else 0)
    out = ldc.load(template, CKPT)
    bad = [k for k, full in expected.items() if not torch.equal(out[k], _piece(full, rank, world)[1])]
    if (out["global_step"], out["epoch"], out["hyper_parameters"]) != (2, 1, {"lr": 0.05}):
        bad.append("meta.pt")
    if out["optimizer_0.param_groups.0.params"] != list(PARAMS):
        bad.append("param_groups")
    return bad


def test_loads_whole_in_one_process():
    assert _mismatches(0, 1) == []
    plain = ldc.load_plain_tensors(CKPT)
    assert all(torch.equal(plain[_stored_key(k)], v) for k, v in _expected().items())


def test_loads_under_a_column_split_on_two_ranks():
    for rank, bad in enumerate(run_distributed(_mismatches, 2)):
        assert bad == [], f"rank {rank}"


@pytest.mark.slow
def test_model_parallel_strategy_resumes_it_under_tensor_parallel(tmp_path):
    """``fit(ckpt_path=...)`` under DistCheckpointModelParallelStrategy (TP 2, DP 1) on 2 CPU processes:
    at train start every weight and Adam state equals the writer's, the step is restored, training goes on."""
    result = tmp_path / "result.pt"
    env = script_env()
    code, output = run_ranks(os.path.join(HERE, "model.py"), ["resume", CKPT, str(result)], env, 2, timeout=600,
                             cwd=str(tmp_path))  # forked, as torchrun starts ranks; the timeout bounds a hang
    assert code == 0, output[-6000:]
    got = torch.load(result, weights_only=True)
    assert (got["step"], got["final_step"]) == (2, 3)
    expected = _expected()
    assert got["state"].keys() == expected.keys()
    assert [k for k, v in expected.items() if not torch.equal(got["state"][k].to(v.dtype), v)] == []


def test_cli_reads_it(capsys):
    """inspect and validate (``lightning_distckpt.cli.main``, in this process) read every tensor."""
    capsys.readouterr()
    assert cli_main(["inspect", "--json", CKPT]) == 0
    shown = {t["key"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert shown == {_stored_key(k) for k in _expected()}
    assert cli_main(["validate", "--json", CKPT]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["problems"] == []
