"""``gc_paused`` is per call and safe beside other threads: overlapping pauses keep the collector
off until the last ends, a caller's own ``gc.disable()`` survives, and a background thread (an
async save's writer) never pauses it."""

from __future__ import annotations

import gc
import threading

from lightning_distckpt.core.gc_pause import gc_paused


def test_nested_pauses_restore_the_collector_once_at_the_end():
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner end does not turn it back on under the outer pause
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failure_inside_restores_the_collector():
    try:
        with gc_paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_a_background_thread_never_pauses_the_collector_nor_ends_the_main_threads_pause():
    inside, release, seen = threading.Event(), threading.Event(), {}

    def background() -> None:
        with gc_paused():  # as the async writer would: a no-op off the main thread
            seen["in_thread"] = gc.isenabled()
            inside.set()
            release.wait(60)
        seen["after_thread"] = gc.isenabled()

    worker = threading.Thread(target=background)
    worker.start()
    assert inside.wait(60)
    assert seen["in_thread"] and gc.isenabled()  # the training loop keeps its collector
    with gc_paused():
        release.set()
        worker.join(60)
        assert not worker.is_alive()
        assert not gc.isenabled()  # the background block's end did not turn it back on
    assert gc.isenabled() and seen["after_thread"] is False
