"""A local save that the disk refuses: rank 1's writes fail in the kernel (a file size limit: EFBIG, as
on a full ``/dev/shm``) during the save of step 10, whose background work then fails. Every rank gets
the same SaveFailedError from ``wait``; the failed step is never recoverable, the step before it
still is and loads exactly, and the next save (the disk writable again) succeeds."""

import resource
import signal

import pytest

from dist_utils import run_distributed
from lightning_distckpt.core.errors import SaveFailedError
from lightning_distckpt.tiers import LocalTier
from tier_helpers import check_loaded, options, state

pytestmark = pytest.mark.tiers


def _full_disk(rank, world, tmp):
    tier = LocalTier(options(tmp, ranks_per_node=1, replicas=1, keep_local=3))
    tier.save(state(rank, world, 5), 5)
    tier.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails; the process lives
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        tier.save(state(rank, world, 10), 10)
        tier.wait()
        error = None
    except SaveFailedError as e:
        error = (sorted(e.failures), str(e))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    point = tier.recoverable()
    check_loaded(tier.load(state(rank, world, 0, template=True), point), rank, world, 5)
    tier.save(state(rank, world, 15), 15)
    after = tier.recoverable()
    check_loaded(tier.load(state(rank, world, 0, template=True), after), rank, world, 15)
    tier.close()
    return error, (point.source, point.step), (after.source, after.step)


def test_local_save_on_a_full_disk(tmp_path):
    results = run_distributed(_full_disk, 2, str(tmp_path))
    for error, point, after in results:
        assert error is not None, "the failed local save raised nothing"
        # the same error on every rank (each names its own node's step directory)
        assert error[0] == [1] and "nothing was committed: rank 1: OSError: [Errno 27] File too large" in error[1], error
        assert point == ("local", 5) and after == ("local", 15)
