"""storage.swap.swap_into_place: the path names the old entry or the new one at every step, and a
failed check or rename puts everything back. Run with and without renameat2(RENAME_EXCHANGE)."""

from __future__ import annotations

import os

import pytest

from lightning_distckpt.storage.swap import NO_EXCHANGE_ENV, swap_into_place


@pytest.fixture(params=[True, False], ids=["exchange", "two_renames"])
def exchange(request, monkeypatch):
    monkeypatch.setenv(NO_EXCHANGE_ENV, "0" if request.param else "1")
    return request.param


def _dir(path, text):
    os.makedirs(path)
    with open(os.path.join(path, "f"), "w") as f:
        f.write(text)


def _text(path):
    with open(os.path.join(path, "f")) as f:
        return f.read()


def test_nothing_at_dest_is_a_rename(tmp_path, exchange):
    _dir(tmp_path / "new", "new")
    assert swap_into_place(str(tmp_path / "new"), str(tmp_path / "dest"), str(tmp_path / "aside")) is None
    assert _text(tmp_path / "dest") == "new" and not os.path.lexists(tmp_path / "new")


def test_old_entry_is_handed_back_checked(tmp_path, exchange):
    _dir(tmp_path / "new", "new")
    _dir(tmp_path / "dest", "old")
    seen = []
    old = swap_into_place(str(tmp_path / "new"), str(tmp_path / "dest"), str(tmp_path / "aside"),
                          check_old=lambda p: seen.append(_text(p)))
    assert seen == ["old"]  # the entry checked is the one replaced
    assert _text(tmp_path / "dest") == "new" and _text(old) == "old"
    assert old == str(tmp_path / ("new" if exchange else "aside"))


def test_failed_check_puts_everything_back(tmp_path, exchange):
    _dir(tmp_path / "new", "new")
    _dir(tmp_path / "dest", "old")

    def refuse(path):
        raise ValueError(f"not ours: {path}")

    with pytest.raises(ValueError, match="not ours"):
        swap_into_place(str(tmp_path / "new"), str(tmp_path / "dest"), str(tmp_path / "aside"), check_old=refuse)
    assert _text(tmp_path / "dest") == "old" and _text(tmp_path / "new") == "new"
    assert not os.path.lexists(tmp_path / "aside")


def test_failed_rename_in_keeps_the_old_entry(tmp_path, exchange):
    _dir(tmp_path / "dest", "old")
    with pytest.raises(OSError):  # ``new`` is missing: the exchange or the rename in fails
        swap_into_place(str(tmp_path / "missing"), str(tmp_path / "dest"), str(tmp_path / "aside"))
    assert _text(tmp_path / "dest") == "old" and not os.path.lexists(tmp_path / "aside")


def test_a_link_is_swapped_with_a_directory(tmp_path, exchange):
    _dir(tmp_path / "ck", "ck")
    _dir(tmp_path / "last", "old last")
    os.symlink("ck", tmp_path / "link")
    old = swap_into_place(str(tmp_path / "link"), str(tmp_path / "last"), str(tmp_path / "aside"))
    assert os.path.islink(tmp_path / "last") and _text(tmp_path / "last") == "ck"
    assert _text(old) == "old last" and not os.path.islink(old)
