"""Async saves prepared ahead of the first one, for the Trainer strategies that save in the background.

The first async save otherwise pays two one-off costs on the training thread: the rendezvous of the
saver's background-commit gloo group, and the page faults (and zeroing) of a freshly allocated
staging pool. :class:`AsyncWarmupMixin` moves both out of the save: the group is made at
``on_train_start`` (every rank is there), and the pool is reserved, its pages faulted in on a
thread of its own, at the first step boundary where the optimizers hold state (their moments are
then allocated, so the estimate covers them). Only fits with a checkpoint callback do either; a
synchronous fit does nothing (the checkpoint IO's own checks).
"""

from __future__ import annotations

from typing import Any, Iterable, Tuple

import torch

from ..comm import get_comm
from ..saving.async_staging import ALIGN

#: one tensor a save may stage on this rank: (tensor, ranks holding a replica of it, whether this
#: rank holds the main replica, the one written when writes are not balanced)
Held = Tuple[torch.Tensor, int, bool]


def staged_share(held: Iterable[Held], balance_writes: bool) -> Tuple[int, bool]:
    """The bytes a save is expected to stage on this rank, and whether any is on an accelerator.

    Balanced writes share each replicated tensor out among its holders, a whole shard per writer, so
    a rank's share is off the even split by at most the largest shard; unbalanced, the main replica
    writes it. Each staged shard starts aligned (``ALIGN``)."""
    share, sizes, on_accelerator, replicated = 0, [], False, False
    for t, replicas, main in held:
        n = t.numel() * t.element_size()
        if balance_writes and replicas > 1:
            share, replicated = share + n // replicas, True
        elif balance_writes or main:
            share += n
        else:
            continue
        sizes.append(n)
        on_accelerator = on_accelerator or t.device.type != "cpu"
    if not sizes:
        return 0, False
    return share + (max(sizes) if replicated else 0) + ALIGN * len(sizes), on_accelerator


class AsyncWarmupMixin:
    """Trainer-strategy hooks (mixed in before :class:`AsyncCommitHooksMixin`) that prepare an
    async-saving fit's saver before its first save. The strategy provides ``_raw_optimizers()`` and
    ``_staged_bytes_estimate()`` (this rank's expected staging, e.g. by :func:`staged_share`)."""

    _staging_reserved = True  # on_train_start clears it: the staging pool is reserved once per fit

    def _saves_checkpoints(self) -> bool:
        module = self.lightning_module  # type: ignore[attr-defined]
        return module is not None and bool(module.trainer.checkpoint_callbacks)

    def on_train_start(self) -> None:
        """Collective: an async-saving fit makes its saver's commit group now (every rank is here),
        not in the first save."""
        super().on_train_start()  # type: ignore[misc]
        if self._saves_checkpoints():
            self.checkpoint_io.prepare_background_saves(get_comm())  # type: ignore[attr-defined]
        self._staging_reserved = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Once the optimizers hold state (after the first step), an async-saving fit allocates its
        staging pool and faults it in on a thread of its own: the first save only copies."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._staging_reserved:  # every step but the first ones of a fit
            return
        if not any(o.state for o in self._raw_optimizers()):  # type: ignore[attr-defined]
            return
        self._staging_reserved = True
        if self._saves_checkpoints():
            nbytes, on_accelerator = self._staged_bytes_estimate()  # type: ignore[attr-defined]
            self.checkpoint_io.reserve_staging(nbytes, on_accelerator)  # type: ignore[attr-defined]
