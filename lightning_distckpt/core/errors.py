"""Exception hierarchy: every error the library raises derives from ``CheckpointingError``."""

from __future__ import annotations


class CheckpointingError(Exception):
    """Base class of all errors raised by lightning_distckpt."""


class ShardingError(CheckpointingError, ValueError):
    """A sharded state dict entry has inconsistent metadata (shape, offset, dtype, replicas)."""


class ValidationError(CheckpointingError):
    """The ranks' shards do not describe a consistent checkpoint (gaps, overlaps, disagreements)."""


class IncompleteCheckpointError(CheckpointingError):
    """The directory holds no committed checkpoint (a save that did not finish, or no checkpoint)."""


class FormatError(CheckpointingError):
    """The checkpoint's format or version is unknown, or its metadata is malformed."""


class MissingKeysError(CheckpointingError, KeyError):
    """Keys asked for are not in the checkpoint (or, in strict modes, keys in it were not asked for)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class SaveFailedError(CheckpointingError):
    """Writing failed on at least one rank; nothing was committed."""
