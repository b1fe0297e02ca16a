"""Red team of the removal and replacement of stock Lightning checkpoints (storage/stock_checkpoints.py).

A save may replace, and ``ModelCheckpoint``'s rotation remove, what a stock strategy wrote: a DCP directory or a
``torch.save`` file whose pickle holds Lightning's key. Holes found and fixed:

- a user's ``torch.save`` file that holds the key only inside a string (``"see pytorch-lightning_version"``) or
  as a value was taken for Lightning's and destroyed by a save over it;
- a hostile archive (an encrypted ``data.pkl``, a broken deflate stream) crashed the save with a
  ``RuntimeError`` / ``zlib.error`` rather than a refusal;
- the commit's swap removed whatever the name held at the exchange (or the rename aside), not what was checked:
  a user's directory put at the name between the check and the swap was removed whole;
- ``remove_checkpoint`` decided whether to check a stock (or empty) directory again after its rename aside by
  looking at it a second time: one changed between the two looks (a user's file put in) was removed whole.

The change is made at that exact point (after the check) by wrapping the check: what another process would do.
Single process, real files, real DCP and Lightning writers."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_distckpt as ldc
from lightning_distckpt.cli.clean import clean
from lightning_distckpt.core.errors import ArgumentError, CheckpointingError
from lightning_distckpt.lightning import DistCheckpointIO
from lightning_distckpt.storage import commit, local_store
from lightning_distckpt.storage.stock_checkpoints import is_stock_dcp_dir, is_stock_lightning_file


def digest(path):
    """Each file under ``path`` (a directory, recursively, or a file) by its name, with its SHA-256."""
    if os.path.isfile(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()
    return {os.path.relpath(os.path.join(d, n), path): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, names in os.walk(path) for n in names}


def save_ours(path, value=0.0):
    ldc.save({"w": ldc.ShardedTensor.from_rank_offsets("w", torch.full((3,), value))}, str(path))


def stock_dcp(path):
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(path), no_dist=True)
    torch.save({"pytorch-lightning_version": "2.6.0"}, os.path.join(path, "meta.pt"))
    assert is_stock_dcp_dir(str(path))
    return str(path)


def stock_file(path):
    torch.save({"state_dict": {"w": torch.ones(2)}, "pytorch-lightning_version": "2.6.0", "global_step": 2}, path)
    return str(path)


def user_dir(path):
    os.makedirs(os.path.join(path, "sub"))
    with open(os.path.join(path, "sub", "thesis.tex"), "w") as f:
        f.write("years of work")
    return str(path)


# -- which torch.save files are Lightning's --------------------------------------------------------------

@pytest.mark.parametrize("content", [{"note": "see pytorch-lightning_version", "w": torch.ones(2)},
                                     {"k": "pytorch-lightning_version", "v": "1"},
                                     {"tags": ["pytorch-lightning_version", "release"]}],
                         ids=["inside_a_string", "as_a_value", "in_a_list"])
def test_a_user_file_naming_the_key_only_in_a_value_is_kept(tmp_path, content):
    """Before: the key anywhere in data.pkl's bytes made the file Lightning's, and a save replaced it."""
    path = tmp_path / "last.ckpt"
    torch.save(content, path)
    before = digest(str(path))
    with pytest.raises(CheckpointingError, match="exists and is not a directory"):
        save_ours(path)
    assert digest(str(path)) == before and sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def _archive(data_pkl: bytes, compress: int = zipfile.ZIP_STORED) -> bytearray:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", data_pkl, compress_type=compress)
        z.writestr("archive/version", b"3\n")
    return bytearray(buf.getvalue())


LIGHTNING_PICKLE = pickle.dumps({"pytorch-lightning_version": "2.6.0", "epoch": 1}, protocol=2) * 64


def _encrypted() -> bytes:
    raw = _archive(LIGHTNING_PICKLE)
    raw[raw.find(b"PK\x03\x04") + 6] |= 1  # the "encrypted" flag, local header and central directory
    raw[raw.find(b"PK\x01\x02") + 8] |= 1
    return bytes(raw)


def _bad_deflate() -> bytes:
    raw = _archive(LIGHTNING_PICKLE, zipfile.ZIP_DEFLATED)
    start = raw.find(b"archive/data.pkl") + len(b"archive/data.pkl") + 4
    raw[start:start + 24] = b"\xff" * 24
    return bytes(raw)


@pytest.mark.parametrize("make", [_encrypted, _bad_deflate], ids=lambda f: f.__name__.lstrip("_"))
def test_a_hostile_archive_is_refused_not_a_crash(tmp_path, make):
    """Before: RuntimeError ('password required') / zlib.error out of the save's target check."""
    path = tmp_path / "last.ckpt"
    path.write_bytes(make())
    assert is_stock_lightning_file(str(path)) is False
    with pytest.raises(CheckpointingError, match="exists and is not a directory"):
        save_ours(path)
    assert path.read_bytes() == make()


def test_what_lightning_writes_is_still_lightnings(tmp_path):
    """A real Trainer's checkpoint (protocol 2, as TorchCheckpointIO writes), and the key at protocol 4, are
    recognised and replaced; a link to one is not."""
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, _):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))
    real = str(tmp_path / "real.ckpt")
    trainer.save_checkpoint(real)
    proto4 = str(tmp_path / "p4.ckpt")
    torch.save({"pytorch-lightning_version": "2.5.0rc1", "w": torch.ones(1)}, proto4, pickle_protocol=4)
    link = str(tmp_path / "link.ckpt")
    os.symlink(real, link)
    assert is_stock_lightning_file(real) and is_stock_lightning_file(proto4) and not is_stock_lightning_file(link)
    with pytest.raises(CheckpointingError, match="exists and is not a directory"):
        save_ours(link)
    for path in (real, proto4):
        save_ours(path, 1.0)
        assert os.path.isfile(os.path.join(path, "COMMITTED"))
    assert os.path.islink(link)


# -- the swap removes only what it checked ------------------------------------------------------------------

OLD_KINDS = {"stock_file": lambda p: stock_file(p), "stock_dcp": stock_dcp, "ours": lambda p: save_ours(p),
             "empty": os.makedirs}


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
@pytest.mark.parametrize("old", sorted(OLD_KINDS))
def test_a_user_directory_put_at_the_name_after_the_check_is_kept(tmp_path, monkeypatch, old, exchange):
    """Between the swap's last check of the target and its exchange (or rename aside), the name is given to a
    user's directory (the old checkpoint moved off by another process). Before: it was removed whole."""
    if not exchange:
        monkeypatch.setenv(commit.NO_EXCHANGE_ENV, "1")
    target = str(tmp_path / "last.ckpt")
    OLD_KINDS[old](target)
    mine = user_dir(str(tmp_path / "mine"))
    kept = digest(mine)
    real_check = commit.check_target

    def check_then_replace(path):
        real_check(path)
        if sys._getframe(1).f_code.co_name == "_swap_once" and os.path.lexists(mine):
            os.rename(path, str(tmp_path / "moved_off"))  # another process's doing, right after our check
            os.rename(mine, path)

    monkeypatch.setattr(commit, "check_target", check_then_replace)
    with pytest.raises(CheckpointingError, match="changed between the check and the swap"):
        save_ours(target, 2.0)
    assert digest(target) == kept  # the user's directory, whole, at its name


# -- removal removes only what it checked --------------------------------------------------------------------

def _add_user_file(path):
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("mine")
    return "notes.txt"


@pytest.mark.parametrize("old", ["stock_dcp", "empty"])
def test_a_directory_changed_after_the_removal_check_is_kept(tmp_path, monkeypatch, old):
    """A file put into a stock (or empty) directory right after ``remove_checkpoint`` found it removable. Before:
    the second look found it no stock directory, so it was not checked again once aside, and was removed whole."""
    target = str(tmp_path / "epoch=0-step=2.ckpt")
    OLD_KINDS[old](target)
    real_removable = local_store.removable
    added = []

    def removable_then_add(path):
        found = real_removable(path)
        added.append(_add_user_file(path))
        return found

    monkeypatch.setattr(local_store, "removable", removable_then_add)
    with pytest.raises(ArgumentError, match="appeared in it while it was being removed"):
        DistCheckpointIO().remove_checkpoint(target)
    assert open(os.path.join(target, added[0])).read() == "mine"
    assert os.listdir(tmp_path) == [os.path.basename(target)]  # nothing left aside


# -- found sound (kept as regressions) ------------------------------------------------------------------------

class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _metadata_link(path, tmp_path):
    os.replace(os.path.join(path, ".metadata"), str(tmp_path / "elsewhere.metadata"))
    os.symlink(str(tmp_path / "elsewhere.metadata"), os.path.join(path, ".metadata"))


def _metadata_fifo(path, tmp_path):
    os.remove(os.path.join(path, ".metadata"))
    os.mkfifo(os.path.join(path, ".metadata"))


def _metadata_runs_code(path, tmp_path):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_RunsCode(str(tmp_path / "code_ran")), f)


def _metadata_huge(path, tmp_path):
    with open(os.path.join(path, ".metadata"), "r+b") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB that are never read


def _metadata_other_format(path, tmp_path):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b'{"format": "json, not a pickle"}')


def _lookalike_name(path, tmp_path):
    os.rename(os.path.join(path, "__0_0.distcp"), os.path.join(path, "__\uff10_0.distcp"))  # a fullwidth zero


@pytest.mark.parametrize("spoil", [_metadata_link, _metadata_fifo, _metadata_runs_code, _metadata_huge,
                                   _metadata_other_format, _lookalike_name], ids=lambda f: f.__name__.lstrip("_"))
def test_a_hostile_dcp_looking_directory_is_refused_untouched(tmp_path, spoil):
    path = stock_dcp(str(tmp_path / "last.ckpt"))
    spoil(path, tmp_path)
    before = sorted(os.listdir(path))
    assert not is_stock_dcp_dir(path)
    with pytest.raises(ArgumentError, match="not a checkpoint of ours"):
        DistCheckpointIO().remove_checkpoint(path)
    with pytest.raises(CheckpointingError, match="refusing to replace it"):
        save_ours(path)
    assert sorted(os.listdir(path)) == before and not os.path.exists(tmp_path / "code_ran")


def test_hard_links_and_many_shards(tmp_path):
    """A ``.distcp`` or ``.metadata`` hard-linked to a user's file elsewhere: the removal unlinks the name, the
    user's file stays; thousands of shard files are one listing, removed like a few."""
    path = stock_dcp(str(tmp_path / "ckpt"))
    users = str(tmp_path / "users.bin")
    with open(users, "wb") as f:
        f.write(b"the user's bytes")
    os.remove(os.path.join(path, "__0_0.distcp"))
    os.link(users, os.path.join(path, "__0_0.distcp"))
    for i in range(1, 3000):
        open(os.path.join(path, f"__{i}_0.distcp"), "wb").close()
    DistCheckpointIO().remove_checkpoint(path)
    assert sorted(os.listdir(tmp_path)) == ["users.bin"]
    assert open(users, "rb").read() == b"the user's bytes"


def test_clean_leaves_a_stock_directory_and_file(tmp_path):
    """``clean`` removes only leftovers of ours: a stock DCP directory or Lightning file beside them stays."""
    stock_dcp(str(tmp_path / "a.ckpt"))
    stock_file(str(tmp_path / "b.ckpt"))
    save_ours(tmp_path / "ours")
    before = digest(str(tmp_path))
    assert clean(str(tmp_path), older_than_s=0.0, dry_run=False) == []
    assert digest(str(tmp_path)) == before


def test_a_file_changed_after_the_removal_check_is_kept(tmp_path, monkeypatch):
    """A user's file put at a stock Lightning file's name right after ``remove_checkpoint`` found it removable.
    Before: removed by name, whatever the name held by then."""
    target = tmp_path / "epoch=0-step=2.ckpt"
    stock_file(target)
    real_removable = local_store.removable

    def removable_then_replace(path):
        found = real_removable(path)
        with open(path, "w") as f:  # the user's notes, under the checkpoint's name
            f.write("mine")
        return found

    monkeypatch.setattr(local_store, "removable", removable_then_replace)
    with pytest.raises(ArgumentError, match="other than a checkpoint file was put at its name"):
        DistCheckpointIO().remove_checkpoint(str(target))
    assert target.read_text() == "mine" and os.listdir(tmp_path) == [target.name]  # back at its name, nothing aside
