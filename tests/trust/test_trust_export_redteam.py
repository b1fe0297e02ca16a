"""Exports that wrote wrong values without a word.

* A safetensors re-export into the directory of an earlier export with the same file names
  overwrote the files one by one and wrote the index last. When it failed midway (a full disk,
  here a file-size limit in a child process), the earlier index stayed, naming the new first file
  and the old second one: transformers and ``safetensors`` loaded that mix of two checkpoints as
  one model. Now the earlier index is removed before any file it lists is overwritten, so a failed
  export leaves a directory that is visibly incomplete; the error names the file that failed.
* ``to_dcp`` turned the common state's keys into strings, so ``1`` and ``"1"`` became one DCP
  entry and one value was lost. Now that is a CheckpointingError naming both, nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.export import to_dcp, to_safetensors

INDEX = "model.safetensors.index.json"
BIG = 1 << 17  # float32 elements: a 512 KiB file, over the child's 256 KiB file-size limit

# Exports sys.argv[1] to sys.argv[2] with every file limited to 256 KiB (SIGXFSZ ignored: the write
# fails with EFBIG, as on a full disk); prints the error's type and message as JSON.
EXPORTER = """
import json, resource, signal, sys
from lightning_distckpt.export import to_safetensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
try:
    to_safetensors(sys.argv[1], sys.argv[2], max_shard_size=1000)
    print(json.dumps(["ok", ""]))
except Exception as e:
    print(json.dumps([type(e).__name__, str(e)]))
"""


def _checkpoint(path: str, value: float) -> str:
    # "a" is small and goes into the first file, "b" (large) into the second
    ldc.save({"a": ldc.ShardedTensor.from_rank_offsets("a", torch.full((4,), value)),
              "b": ldc.ShardedTensor.from_rank_offsets("b", torch.full((BIG,), value))}, path)
    return path


def test_a_failed_reexport_leaves_no_index_naming_old_and_new_files(tmp_path):
    out = str(tmp_path / "out")
    to_safetensors(_checkpoint(str(tmp_path / "old"), 1.0), out, max_shard_size=1000)
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    proc = subprocess.run([sys.executable, "-c", EXPORTER, _checkpoint(str(tmp_path / "new"), 2.0), out],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    kind, message = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kind == "CheckpointingError"
    # files are renamed into place only once all are written (test_trust_interrupts_round2_redteam.py): the
    # earlier export is whole, its index with it, and no temporary file is left
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    assert load_file(os.path.join(out, "model-00001-of-00002.safetensors"))["a"][0].item() == 1.0
    assert os.path.join(out, "model-00002-of-00002.safetensors") in message  # the file that failed


def test_a_reexport_overwriting_files_still_ends_whole(tmp_path):
    out = str(tmp_path / "out")
    to_safetensors(_checkpoint(str(tmp_path / "old"), 1.0), out, max_shard_size=1000)
    to_safetensors(_checkpoint(str(tmp_path / "new"), 2.0), out, max_shard_size=1000)
    with open(os.path.join(out, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    values = {k: load_file(os.path.join(out, name))[k].unique().tolist() for k, name in weight_map.items()}
    assert values == {"a": [2.0], "b": [2.0]}


def test_dcp_refuses_common_keys_that_are_one_string(tmp_path):
    ck = str(tmp_path / "ck")
    ldc.save({1: "int key", "1": "str key", "w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, ck)
    out = str(tmp_path / "dcp")
    with pytest.raises(CheckpointingError, match=r"keys 1 and '1' are both '1'") as info:
        to_dcp(ck, out)
    assert ck in str(info.value)
    assert not os.path.exists(out)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging directory left either
