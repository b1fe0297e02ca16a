"""The save path: exchange metadata, validate, plan, write in parallel, agree, commit.

Three steps, each callable on its own (the async saver runs the middle one in a thread):

* :func:`prepare_save` (collective, cheap: metadata only; :mod:`.save_prepare`) describes each
  rank's entries, exchanges one :class:`~.save_prepare.Handshake` per rank, validates and plans;
* :func:`write_local` (this rank's writes, no collectives; :mod:`.save_commit`);
* :func:`finalize_save` (collective; :mod:`.save_commit`): agree on every rank's outcome, commit.

Every failure that ranks must agree on goes through :meth:`~lightning_distckpt.comm.Comm.agree`.
"""

from .save_commit import LocalWrite, finalize_save, write_and_commit, write_local
from .save_prepare import PreparedSave, SavePlanCache, prepare_save

__all__ = ["LocalWrite", "PreparedSave", "SavePlanCache", "finalize_save", "prepare_save", "write_and_commit",
           "write_local"]
