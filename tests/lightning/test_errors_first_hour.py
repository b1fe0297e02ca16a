"""Errors a new user meets in the first hour name what is wrong and the fix: a file that is no
checkpoint (never torch's advice to load with weights_only=False), strategy="ddp_distckpt" after only
``import lightning_distckpt``, global shape mismatches (every key, once, and how to allow them from
the Lightning config), and a missing path in ``convert`` / ``inspect``."""

import io
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import lightning_distckpt as ldc
from lightning_distckpt.cli.main import main as cli_main
from lightning_distckpt.core.errors import FormatError, ShardingError, UnsafeContentError
from lightning_distckpt.storage.safe_pickle import torch_message

from dist_utils import run_distributed

ADVICE = ("weights_only` set to `False", "weights_only=False", "will likely succeed", "trusted source")


def _template():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}


def _load_error(path):
    """The error of ldc.load and of DistCheckpointIO.load_checkpoint (a Trainer's ckpt_path) on ``path``."""
    from lightning_distckpt.lightning import DistCheckpointIO

    with pytest.raises(FormatError) as api:
        ldc.load(_template(), str(path))
    with pytest.raises(FormatError) as plugin:
        DistCheckpointIO().load_checkpoint(str(path))
    return str(api.value), str(plugin.value)


class _Canary:
    """Unpickling this would create a file: it must never happen."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_files_that_are_no_checkpoint_say_what_they_are(tmp_path):
    canary = tmp_path / "canary"
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump({"w": _Canary(str(canary))}, f)
    (tmp_path / "notes.txt").write_text("hello, these are my notes\n")
    np.save(tmp_path / "arr.npy", np.zeros(3))
    (tmp_path / "empty.pt").write_bytes(b"")
    expected = {
        "plain.pkl": ["is not a checkpoint", "Python pickle (pickle.dump)", "torch.save(state_dict"],
        "notes.txt": ["is not a checkpoint: neither a lightning_distckpt directory nor a torch / safetensors file",
                      "it starts with 'hello, these are my note"],
        "arr.npy": ["NumPy .npy array", "numpy.load"],
        "empty.pt": ["is not a checkpoint: it is an empty file"],
    }
    for name, words in expected.items():
        for message in _load_error(tmp_path / name):
            assert str(tmp_path / name) in message
            for w in words:
                assert w in message, (name, message)
            assert not any(a in message for a in ADVICE), message
    assert not canary.exists()  # nothing ran


class Blob:
    """A type no allow-list holds (io.BytesIO is allow-listed process-wide once megatron-core is imported)."""


def test_refused_types_in_a_torch_file_keep_the_allow_list_advice(tmp_path):
    """A real torch.save file holding a type outside the allow-list: the refusal names the type and
    extra_safe_globals, never weights_only=False."""
    torch.save({"w": torch.zeros(4), "buf": Blob()}, tmp_path / "x.pt")
    with pytest.raises(UnsafeContentError) as e:
        ldc.load(_template(), str(tmp_path / "x.pt"))
    message, name = str(e.value), f"{Blob.__module__}.Blob"
    assert f"refused to deserialize {name}" in message and f"extra_safe_globals=[{name}]" in message
    assert not any(a in message for a in ADVICE), message


def test_torch_message_strips_the_advice():
    blob = pickle.dumps({"a": 1}, protocol=4)  # an opcode torch's weights-only unpickler refuses
    with pytest.raises(pickle.UnpicklingError) as e:
        torch.load(io.BytesIO(blob), weights_only=True)
    assert any(a in str(e.value) for a in ADVICE)  # torch's own message carries it ...
    text = torch_message(e.value)
    assert text and not any(a in text for a in ADVICE), text  # ... ours never
    assert "Unsupported operand" in text


REGISTRATION = textwrap.dedent("""
    import sys
    if sys.argv[1] == "blocked":  # Lightning not installed: import works, nothing of it is imported
        sys.modules["lightning"] = None
        import lightning_distckpt
        assert not any(m == "lightning" or m.startswith("lightning.") for m in sys.modules if sys.modules[m])
        print("ok")
        raise SystemExit
    if sys.argv[1] == "ours_first":
        import lightning_distckpt
        assert "lightning.pytorch" not in sys.modules
        import lightning as L
    else:
        import lightning as L
        import lightning_distckpt
    t = L.Trainer(strategy="ddp_distckpt", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    f = L.Fabric(strategy="ddp_distckpt_spawn", accelerator="cpu", devices=1)
    from lightning.pytorch.strategies import StrategyRegistry
    print(type(t.strategy).__name__, type(f.strategy).__name__, f.strategy._start_method,
          StrategyRegistry["ddp_distckpt"]["strategy"] is lightning_distckpt.lightning.DistCheckpointStrategy,
          "model_parallel_distckpt" in StrategyRegistry)
""")


@pytest.mark.parametrize("order", ["ours_first", "lightning_first", "blocked"])
def test_strategy_names_registered_by_the_top_level_import(order):
    r = subprocess.run([sys.executable, "-c", REGISTRATION, order], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last == ("ok" if order == "blocked" else
                    "DistCheckpointStrategy FabricDistCheckpointStrategy spawn True True"), r.stdout


def _mismatch_state(rows):
    return {"a": ldc.ShardedTensor.from_rank_offsets("a", torch.arange(rows * 2.0).reshape(rows, 2)),
            "b": ldc.ShardedTensor.from_rank_offsets("b", torch.ones(rows)),
            "c": ldc.ShardedTensor.from_rank_offsets("c", torch.ones(3))}


def test_shape_mismatch_lists_every_key_and_the_config_switch(tmp_path):
    from lightning_distckpt.lightning import DistCheckpointIO

    path = str(tmp_path / "ckpt")
    ldc.save(_mismatch_state(4), path)
    with pytest.raises(ShardingError) as e:
        ldc.load(_mismatch_state(6), path)
    message = str(e.value)
    assert "2 tensor(s) differ in shape" in message
    assert "'a' has global shape (4, 2) in the checkpoint, (6, 2) in the template" in message
    assert "'b' has global shape (4,) in the checkpoint, (6,) in the template" in message
    assert "'c'" not in message and message.count("'a'") == 1
    assert "allow_shape_mismatch: true" in message and "DistCheckpointStrategy(checkpoint=" in message
    # The switch the message names: the plugin / strategies' checkpoint config (YAML key alike).
    yaml = tmp_path / "ckpt.yaml"
    yaml.write_text("allow_shape_mismatch: true\n")
    loaded = DistCheckpointIO.from_config(str(yaml)).load_sharded(_mismatch_state(6), path)
    assert torch.equal(loaded["a"][:4], torch.arange(8.0).reshape(4, 2)) and not loaded["a"][4:].any()
    assert torch.equal(loaded["b"], torch.tensor([1.0] * 4 + [0.0] * 2))


def _mismatch_on_two_ranks(rank, world, path):
    try:
        ldc.load(_mismatch_state(6), path)
    except ShardingError as e:
        return str(e)
    return None


def test_shape_mismatch_on_tensor_parallel_ranks_is_said_once(tmp_path):
    path = str(tmp_path / "ckpt")
    ldc.save(_mismatch_state(4), path)
    messages = run_distributed(_mismatch_on_two_ranks, 2, path)
    assert messages[0] == messages[1] and messages[0] is not None
    assert messages[0].count("'a' has global shape (4, 2)") == 1 and "(the same on rank 1)" in messages[0], messages[0]


def test_missing_paths_list_the_committed_checkpoints_beside_them(tmp_path, capsys):
    ldc.save(_mismatch_state(4), str(tmp_path / "step=10.ckpt"))
    for argv in (["inspect", str(tmp_path / "step=11.ckpt")],
                 ["convert", str(tmp_path / "step=11.ckpt"), str(tmp_path / "out.pt")],
                 ["convert", str(tmp_path / "step=11.ckpt"), str(tmp_path / "hf"), "--to", "safetensors"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert f"committed checkpoints in {tmp_path}, newest first: step=10.ckpt" in err, err
    assert not os.path.exists(tmp_path / "out.pt")
