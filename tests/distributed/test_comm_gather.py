"""Comm.all_gather_object: small objects in one exchange, larger ones (on any rank) in a second,
padded to the largest; every rank gets every rank's object, in rank order, whatever the sizes."""

from lightning_distckpt.comm import SMALL_OBJECT_BYTES, get_comm
from dist_utils import run_distributed


def _gather(rank, world):
    comm = get_comm()
    small = comm.all_gather_object(("small", rank, None))
    big = comm.all_gather_object(("big", rank, b"x" * (SMALL_OBJECT_BYTES * 3 if rank == 1 else 10)))
    edge = comm.all_gather_object(b"y" * (SMALL_OBJECT_BYTES - 40 + rank * 80))  # around the limit
    return small, big, edge


def test_all_gather_object_small_large_and_mixed():
    for small, big, edge in run_distributed(_gather, 3):
        assert small == [("small", r, None) for r in range(3)]
        assert big == [("big", r, b"x" * (SMALL_OBJECT_BYTES * 3 if r == 1 else 10)) for r in range(3)]
        assert edge == [b"y" * (SMALL_OBJECT_BYTES - 40 + r * 80) for r in range(3)]
