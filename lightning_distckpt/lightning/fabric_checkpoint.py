"""A checkpoint ``fabric.save`` wrote, read whole by a Trainer: a plain dict, whose missing Trainer
entries raise :class:`NotATrainerCheckpointError` naming the writer and what to call instead."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..core.errors import CheckpointingError
from .foreign import WEIGHTS_ADVICE, WEIGHTS_ONLY, fabric_writer

#: Entries only a Trainer's checkpoint has (Lightning reads "pytorch-lightning_version" first).
TRAINER_ENTRIES = frozenset({"state_dict", "loops", "pytorch-lightning_version"})


class NotATrainerCheckpointError(CheckpointingError, KeyError):
    """A Trainer asked a checkpoint that ``fabric.save`` wrote for an entry only a Trainer writes."""

    def __str__(self) -> str:  # KeyError would show the message's repr
        return str(self.args[0]) if self.args else ""


class FabricCheckpoint(Dict[str, Any]):
    """A checkpoint written by ``fabric.save``, read whole: a plain dict (Fabric reads only the
    entries it asked for), except that asking for an entry it lacks (as the Trainer does with
    ``"pytorch-lightning_version"``) raises :class:`NotATrainerCheckpointError` naming the writer."""

    path: str = ""
    writer: str = ""

    def __missing__(self, key: Any) -> Any:
        names = sorted(map(str, self))
        entries = names if len(names) <= 8 else [*names[:8], f"... {len(names)} in all"]
        if self and all(isinstance(v, torch.Tensor) for v in self.values()):  # weights alone: a state dict
            raise NotATrainerCheckpointError(f"checkpoint {self.path} {WEIGHTS_ONLY}: it has no {key!r} entry "
                                             f"(entries {entries}). {WEIGHTS_ADVICE}")
        raise NotATrainerCheckpointError(
            f"checkpoint {self.path} was written {self.writer}, not by a Trainer: it has no {key!r} entry "
            f"(entries {entries}). Load it with fabric.load(path, state) under the Fabric setup "
            "that wrote it; or load its module's weights with "
            "lightning_distckpt.lightning.load_module_weights(module, path, "
            "entry=\"model\") and call trainer.fit without ckpt_path; or read it whole with "
            "DistCheckpointIO().load_checkpoint(path) (python -m lightning_distckpt convert: one file)")


def fabric_checkpoint(state: Any, path: str, kind: Optional[str]) -> Any:
    """``state`` as read; a :class:`FabricCheckpoint` when it has none of a Trainer's entries."""
    if not isinstance(state, dict):
        return state
    if TRAINER_ENTRIES & set(state):
        return state
    out = FabricCheckpoint(state)
    out.path, out.writer = path, fabric_writer(kind)
    return out
