"""Kept helper threads (storage/workers.py): work runs and its errors reach the caller; the threads
are daemons with a stop() that ends them (the convention Lightning's test suites enforce for threads
a test leaves behind), and the pool starts new ones after; a forked child gets threads of its own; a
thread lets go of its task once done, not when the next one comes."""

import multiprocessing
import threading
import weakref

import pytest

from lightning_distckpt.storage.workers import KeptWorkers


def test_work_runs_and_errors_reach_the_caller():
    pool = KeptWorkers("test-workers", 3)
    assert [f.result() for f in [pool.submit(pow, 2, i) for i in range(8)]] == [2 ** i for i in range(8)]
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result()
    pool.stop()


def test_threads_left_behind_are_daemons_that_stop():
    before = set(threading.enumerate())
    pool = KeptWorkers("test-workers", 2)
    assert pool.submit(sum, [1, 2]).result() == 3
    new = set(threading.enumerate()) - before
    assert new and all(t.daemon and callable(getattr(t, "stop", None)) for t in new)
    for t in new:
        t.stop()
        assert not t.is_alive()
    assert pool.submit(sum, [3, 4]).result() == 7  # new threads after a stop
    pool.stop()
    assert set(threading.enumerate()) <= before


class _Held:
    """Something a task's closure holds (a save's plan, in the library)."""


def test_a_finished_task_is_let_go_of_before_the_next_one_comes():
    pool = KeptWorkers("test-workers", 1)
    held, freed = _Held(), threading.Event()
    weakref.finalize(held, freed.set)
    expected = id(held)
    assert pool.submit(id, held).result() == expected
    del held  # now only the worker's references to the task (its arguments) keep it alive
    # an event, not a clock: set the moment the worker drops the task; never set while it keeps it
    assert freed.wait(timeout=60), "the idle worker still holds its last task's closure"
    pool.stop()


def test_a_cancelled_task_is_let_go_of_too():
    pool = KeptWorkers("test-workers", 1)
    gate = threading.Event()
    first = pool.submit(gate.wait)  # the one thread busy: the next task waits in the queue
    held, freed = _Held(), threading.Event()
    weakref.finalize(held, freed.set)
    second = pool.submit(id, held)
    assert second.cancel()
    del held
    gate.set()
    assert first.result() is True
    assert freed.wait(timeout=60), "the idle worker still holds the cancelled task"
    pool.stop()


def _child(pool, q):
    q.put(pool.submit(sum, [5, 6]).result())


def test_a_forked_child_gets_threads_of_its_own():
    pool = KeptWorkers("test-workers", 2)
    assert pool.submit(sum, [1]).result() == 1  # the parent's threads exist
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child, args=(pool, q))
    child.start()
    child.join(60)  # a failure bound only
    assert child.exitcode == 0 and q.get(timeout=10) == 11
    pool.stop()
