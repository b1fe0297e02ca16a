"""Names the library recognises as its own are spelled in ASCII digits only. Python's ``\\d`` matches
every script's digits and ``int`` reads them, so ``rank_٠٠٠٠٠`` (Arabic-Indic zeros) was taken as rank 0's
store and a folder holding only it as a checkpoint of ours (which ``clean`` and saves then treat as
ours); the same for a Hugging Face shard name, a ``last-v٣.ckpt`` link, a staging directory's ``.old٣``."""

import os

from lightning_distckpt.export.hf_owned import SHARD_NAME
from lightning_distckpt.lightning.last_link import _LAST_NAME
from lightning_distckpt.storage.layout import is_checkpoint_dir, is_rank_dir_name

ARABIC_ZEROS = "\u0660" * 5


def test_a_rank_store_name_in_other_digits_is_not_ours(tmp_path):
    assert is_rank_dir_name("rank_00000") and not is_rank_dir_name(f"rank_{ARABIC_ZEROS}")
    os.makedirs(tmp_path / "folder" / "data" / f"rank_{ARABIC_ZEROS}")
    assert not is_checkpoint_dir(str(tmp_path / "folder"))
    os.makedirs(tmp_path / "ours" / "data" / "rank_00000")
    assert is_checkpoint_dir(str(tmp_path / "ours"))


def test_other_names_we_own_take_ascii_digits_only():
    assert SHARD_NAME.fullmatch("model-00001-of-00002.safetensors")
    assert not SHARD_NAME.fullmatch(f"model-{ARABIC_ZEROS}-of-00002.safetensors")
    assert _LAST_NAME.fullmatch("last-v3.ckpt") and not _LAST_NAME.fullmatch("last-v\u0663.ckpt")


def test_a_name_with_a_final_newline_is_not_one_of_ours(tmp_path):
    """``$`` also matches before a final newline: ``last.ckpt\\n`` was offered as a last checkpoint, and an
    S3 version ``v-<12 hex>\\n`` or key ``data/rank_00000/x\\n`` taken as ours (``\\Z`` now)."""
    import torch

    import lightning_distckpt as ldc
    from lightning_distckpt.lightning import DistModelCheckpoint
    from lightning_distckpt.storage.s3 import _OUR_KEY, _VERSION

    assert _VERSION.match("v-0123456789ab") and not _VERSION.match("v-0123456789ab\n")
    assert _OUR_KEY.match("data/rank_00000/x") and not _OUR_KEY.match("data/rank_00000/x\n")
    for name in ("last.ckpt", "last.ckpt\n"):
        ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, str(tmp_path / name))
    found = DistModelCheckpoint(dirpath=str(tmp_path))._find_last_checkpoints(None)
    assert {os.path.basename(p) for p in found} == {"last.ckpt"}
