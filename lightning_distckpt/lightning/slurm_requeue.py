"""The checkpoint Lightning's SLURM auto-requeue saves.

On the signal SLURM sends before a job's time runs out, Lightning saves ``hpc_ckpt_<N>.ckpt`` in the
Trainer's root directory and requeues the job at once (``_SignalConnector._slurm_sigusr_handler_fn``);
the requeued job resumes from the highest ``N`` by itself. A background save of that checkpoint would
still be writing when the job ends, and leave the requeued job a placeholder to resume from: so it is
written before the save returns, whatever ``async_save`` says.
"""

from __future__ import annotations

import os
import re

#: ``_CheckpointConnector.hpc_save_path``'s names.
_REQUEUE_NAME = re.compile(r"hpc_ckpt_[0-9]+\.ckpt\Z")


def is_requeue_save(target: str) -> bool:
    """Whether a save to ``target`` (a path or URL) is Lightning's SLURM requeue checkpoint."""
    return _REQUEUE_NAME.match(os.path.basename(str(target).rstrip("/"))) is not None
