"""This process's record of the staging directories it writes into is shared by the threads that save at once
(an async save's, a local tier's): one thread's note while another's save ends must not fail the save
(before: "RuntimeError: Set changed size during iteration", a SaveFailedError in an async tiers fit)."""

from __future__ import annotations

import os
import threading

from lightning_distckpt.storage import staging


def test_a_note_written_while_another_thread_drops_its_own_does_not_fail(tmp_path, monkeypatch):
    others = [str(tmp_path / f".distckpt-staging-other{i}") for i in range(3)]
    monkeypatch.setattr(staging, "_OWN_STAGING", set(others))
    real_lexists = os.path.lexists
    dropped = threading.Event()
    started = []

    def lexists_while_another_thread_ends_its_save(path):
        if not started:  # once, in the middle of the note's look at the record
            started.append(True)
            threading.Thread(target=lambda: (staging.remove_owner_notes(others[0]), dropped.set()),
                             daemon=True).start()
            dropped.wait(1)  # the old code let the other thread change the record here; now it waits its turn
        return real_lexists(path)

    monkeypatch.setattr(staging.os.path, "lexists", lexists_while_another_thread_ends_its_save)
    mine = tmp_path / ".distckpt-staging-mine"
    mine.mkdir()
    staging.write_owner_note(str(mine), 0)
    monkeypatch.setattr(staging.os.path, "lexists", real_lexists)
    assert dropped.wait(30)  # the other thread's change went through once the note was written
    assert staging.live_owner_pids(str(mine)) == (os.getpid(),)
    assert os.path.abspath(others[0]) not in staging._OWN_STAGING
