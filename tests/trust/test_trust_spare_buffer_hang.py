"""A rank whose part in a chunk exchange or an ingest transfer failed, and that then has no memory even for the
one spare buffer it takes part in its remaining messages with, does not leave its partners waiting.

The hole (old code): ``exchange_guard.take_part`` / ``Transfer._spare`` raised on that rank alone; its partner
waited in the message it was owed until the group's timeout (30 minutes by default), then got a CollectiveError
saying it timed out. Now the rank closes its connections in the group (``Comm.close_connections``: gloo's
``abort`` does nothing, a timed-out receive that nothing matches closes them) and raises its failure; the
partner's message fails at once with a CollectiveError saying the connection was closed, not timed out.
No agreement is possible once a rank cannot take part, so the two errors differ: each names what it saw.

Memory fails for real: ``RLIMIT_AS`` in rank 1 alone with 28 MiB of margin, below the 64 MiB message
(``test_trust_load_one_rank_fails_redteam.py``'s helpers). The two steps are driven directly (the loaders try
the largest buffers first; here the memory is gone after that try, as another thread or process could take it).
After its failure each rank goes on to the group's next collective (a barrier), as a job that goes on would:
on the old code rank 1 waits there and rank 0 in its message, until the group's timeout. Hang guard: the group
times out after ``GROUP_TIMEOUT_S``; rank 0's error then says "Timed out", which the tests refuse. Nothing
waits on time.
"""

import inspect
import sys

import pytest
import torch

from dist_utils import run_distributed
from lightning_distckpt.comm import get_comm
from lightning_distckpt.core.errors import CheckpointingError
from lightning_distckpt.ingest.plan import Manifest, SendItem, SendOp
from lightning_distckpt.ingest.transfer import Transfer
from lightning_distckpt.planning.exchange_plan import BROADCAST, P2P, ExchangeOp
from lightning_distckpt.reading.exchange_guard import take_part
from trust.test_trust_load_one_rank_fails_redteam import _address_space, _outcome

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")

# The hang guard only: the new code's partner fails within milliseconds of rank 1's failure; a bound far above
# any scheduling delay of a busy machine, so that only the old code's hang reaches it
GROUP_TIMEOUT_S = 120
N = 4096  # a (N, N) float32 tensor: 64 MiB, a fresh mapping of its own
NBYTES = N * N * 4
CPU = torch.device("cpu")


def _partner_failed_at_once(outcome):
    """Rank 0's outcome: a CollectiveError from a closed connection, not from the group's timeout."""
    kind, message = outcome
    assert kind == "CollectiveError", outcome
    assert "Timed out" not in message and ("closed" in message or "reset" in message), message


def _exchange_without_spare(rank, world, transport):
    """Rank 1's load failed before a 64 MiB message of ``transport`` (a receive from rank 0, or its own broadcast
    to rank 0); it takes part in it without memory for a spare. Rank 0 does its side as the exchange does."""
    comm = get_comm()
    src = 0 if transport == P2P else 1
    op = ExchangeOp(src=src, chunks=(("w", (0, 0)),), sizes=(NBYTES,), needers=(0, 1), transport=transport)
    if rank == 0:
        buffer = torch.zeros(NBYTES, dtype=torch.uint8)
        work = comm.isend(buffer, 1, tag=7) if transport == P2P else comm.broadcast_tensor(buffer, src)
        return _outcome(work.wait), _outcome(comm.barrier)
    failure = CheckpointingError("allocating 64.0 MiB on cpu for 'w' failed: no memory")
    extra = {"failure": failure} if "failure" in inspect.signature(take_part).parameters else {}  # (old code)
    with _address_space(28 << 20):
        outcome = _outcome(lambda: take_part(comm, [7], [op], {}, CPU, **extra))
    return outcome, _outcome(comm.barrier)


@pytest.mark.parametrize("transport", [P2P, BROADCAST])
def test_an_exchange_rank_without_a_spare_fails_its_partner_at_once(transport):
    """Rank 1 raises its failure and says it closed its connections; rank 0, waiting on it (a send to it, or
    its broadcast), fails at once with a CollectiveError of a closed connection, not at the group's timeout."""
    (partner, _), (failing, after) = run_distributed(_exchange_without_spare, 2, transport, timeout_s=GROUP_TIMEOUT_S)
    _partner_failed_at_once(partner)
    assert after[0] == "CollectiveError", after  # the group is unusable after, as after a timeout
    kind, message = failing
    assert kind == "CheckpointingError", failing
    assert message.startswith("rank 1: allocating 64.0 MiB on cpu for 'w' failed: no memory; then, without memory "
                              "to take part in its remaining messages (allocating a spare 64.0 MiB on cpu for 'w' "
                              "failed: "), message
    assert "it closed its connections in the group so that the other ranks fail now" in message, message


def _transfer_without_spare(rank, world):
    """Rank 0 broadcasts "w" (64 MiB) to rank 1, which has memory neither for the receive buffer (its transfer
    fails) nor for the spare it would take part with."""
    import lightning_distckpt

    item = SendItem("w", torch.float32, (0, 0), (N, N), 0, NBYTES, (N, N))
    manifest = Manifest("a test source", ops=(SendOp((item,), NBYTES),))
    source = {"w": torch.full((N, N), 1.0)} if rank == 0 else None
    transfer = Transfer(get_comm(), manifest, [], {}, CPU, 1, source=source)
    if rank == 0:
        return _outcome(transfer.run), _outcome(get_comm().barrier), lightning_distckpt.__file__
    with _address_space(28 << 20):
        outcome = _outcome(transfer.run)
    return outcome, _outcome(get_comm().barrier), lightning_distckpt.__file__


def test_an_ingest_receiver_without_a_spare_fails_rank_0_at_once():
    """Rank 1 raises its failed allocation and says it closed its connections; rank 0, broadcasting to it,
    fails at once with a CollectiveError of a closed connection, not at the group's timeout."""
    (partner, _, where), (failing, after, _) = run_distributed(_transfer_without_spare, 2, timeout_s=GROUP_TIMEOUT_S)
    print("lightning_distckpt from", where)
    _partner_failed_at_once(partner)
    assert after[0] == "CollectiveError", after
    kind, message = failing
    assert kind == "CheckpointingError", failing
    assert message.startswith("rank 1: allocating 64.0 MiB on cpu for the broadcast of 'w' failed: "), message
    assert "(allocating a spare 64.0 MiB on cpu failed: " in message, message
    assert "it closed its connections in the group so that the other ranks fail now" in message, message
