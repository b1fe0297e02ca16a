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
