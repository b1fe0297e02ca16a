"""Error classes and the words Megatron-Core users' code and log scrapers look for, beside
megatron-core's own functions: a checkpoint directory that does not exist, one that is not a
distributed checkpoint, a common state that differs by rank; and Lightning's CheckpointIO contract
(a missing checkpoint is a FileNotFoundError). A ShardedObject holding a type outside the
allow-list stays refused, and the refusal names each argument / configuration that allows it:
each is checked to work, in a fresh process: importing megatron-core allow-lists ``io.BytesIO``
(and a few more types) in torch for the whole process (``megatron.core.safe_globals``), so these
tests import it only inside the tests that use it."""

from __future__ import annotations

import io
import os

import pytest
import torch

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import CheckpointNotFoundError, UnsafeContentError

from .megatron_side import Records


def _megatron():
    return pytest.importorskip("megatron.core.dist_checkpointing")


def _template():
    return {"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(3))}


def test_missing_directory_is_file_not_found_with_megatron_words(tmp_path):
    _megatron()
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import verify_checkpoint_and_load_strategy

    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointingException, match="does not exist"):
        verify_checkpoint_and_load_strategy(missing)
    for call in (lambda: ldc.load(_template(), missing), lambda: ldc.load_common_state_dict(missing),
                 lambda: ldc.load_tensors_metadata(missing)):
        with pytest.raises(CheckpointNotFoundError) as err:
            call()
        assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ldc.IncompleteCheckpointError)
        assert "does not exist" in str(err.value) and "no such directory" in str(err.value)  # theirs and ours


def test_checkpoint_io_contract_file_not_found(tmp_path):
    """Lightning's own TorchCheckpointIO and ours raise FileNotFoundError for a missing path."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_distckpt.lightning import DistCheckpointIO

    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        TorchCheckpointIO().load_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DistCheckpointIO().load_checkpoint(missing)


def test_not_a_distributed_checkpoint(tmp_path):
    _megatron()
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import verify_checkpoint_and_load_strategy

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint"):
        verify_checkpoint_and_load_strategy(str(tmp_path))
    with pytest.raises(ldc.IncompleteCheckpointError, match="not a lightning_distckpt checkpoint.*is not a distributed "
                                                            "checkpoint") as err:
        ldc.load(_template(), tmp_path)
    assert not isinstance(err.value, FileNotFoundError)  # the directory exists


def _common_differs(rank: int, world: int, path: str):
    """Megatron-Core's check of the common state and our save, on the same diverging state."""
    from megatron.core.dist_checkpointing.validation import _validate_common_state_dict

    common = {"step": 5 if rank == 0 else 7, "lr": 0.1}
    with Records("megatron.core") as theirs:
        _validate_common_state_dict(common)
    with Records("lightning_distckpt") as ours:
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world)), **common}, path)
    return theirs.messages, ours.messages


def test_common_state_differs_logged_per_rank_in_megatron_words(tmp_path):
    _megatron()
    (theirs0, ours0), (theirs1, ours1) = run_distributed(_common_differs, 2, str(tmp_path / "ck"))
    line = "Rank 1 common state dict differs from rank 0 common state dict."
    assert theirs0 == [] and len(theirs1) == 1 and theirs1[0].startswith(line)
    assert [m for m in ours1 if m.startswith(line)] == theirs1  # to the letter: Megatron's tests compare lines
    assert not any(m.startswith("Rank") for m in ours0)  # rank 0 logs its summary of every rank instead
    assert any("'step': differs from rank 0's value on ranks [1]" in m for m in ours0)


def _bytes_object(path):
    ldc.save({"o": ldc.ShardedObject("o", io.BytesIO(b"payload"), (1,), (0,), replica_id=0)}, path)
    return {"o": ldc.ShardedObject("o", None, (1,), (0,), replica_id=0)}


def _refused_then_allowed(rank: int, world: int, root: str) -> str:
    """In a fresh process (no megatron-core imported): the refusal, then each way it names."""
    import sys

    from lightning_distckpt.lightning import DistCheckpointIO, DistCheckpointStrategy

    assert "megatron.core" not in sys.modules
    path = os.path.join(root, "ck")
    template = _bytes_object(path)
    try:
        ldc.load(template, path)  # a Megatron-shaped call: no extra_safe_globals
        raise AssertionError("an io.BytesIO object loaded without being allowed")
    except UnsafeContentError as e:
        message = str(e)
    assert ldc.load(template, path, extra_safe_globals=[io.BytesIO])["o"].getvalue() == b"payload"
    plugin = DistCheckpointIO(config={"safe_globals": ["_io.BytesIO"]})
    assert plugin.load_sharded(template, path)["o"].getvalue() == b"payload"
    yaml = os.path.join(root, "strategy.yaml")
    with open(yaml, "w") as f:
        f.write("tensor_parallel_size: 1\ncheckpoint:\n  safe_globals: ['io.BytesIO']\n")
    assert io.BytesIO in DistCheckpointStrategy.from_config(yaml).checkpoint_io.extra_safe_globals
    torch.serialization.add_safe_globals([io.BytesIO])  # process-wide: calls without the argument too
    assert ldc.load(template, path)["o"].getvalue() == b"payload"
    return message


def test_refused_object_type_names_what_allows_it(tmp_path):
    (message,) = run_distributed(_refused_then_allowed, 1, str(tmp_path))
    for words in ("object 'o'", "refused to deserialize _io.BytesIO", "extra_safe_globals=[_io.BytesIO]",
                  "DistCheckpointIO(", "safe_globals: ['_io.BytesIO']", "torch.serialization.add_safe_globals"):
        assert words in message, words


def test_unknown_safe_globals_name_is_a_config_error():
    from lightning_distckpt.lightning import DistCheckpointIO

    with pytest.raises(ldc.CheckpointingError, match="safe_globals: cannot import 'io.NoSuchType'"):
        DistCheckpointIO(config={"safe_globals": ["io.NoSuchType"]})
