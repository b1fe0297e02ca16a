"""The reading pipeline: checkpoint source -> load request -> read plan -> reads into destinations
-> assembled state dict. See docs/architecture.md for the walk through it."""

from .checkpoint import CheckpointSource, OpenedCheckpoint, open_checkpoint
from .loaders import (
    DEFAULT_LOADER,
    LOADER_NAMES,
    EveryRankLoader,
    ExchangeLoader,
    FullyParallelLoader,
    Loader,
    TwoStageDataParallelLoader,
    resolve_loader,
)

__all__ = [
    "CheckpointSource",
    "DEFAULT_LOADER",
    "EveryRankLoader",
    "ExchangeLoader",
    "FullyParallelLoader",
    "LOADER_NAMES",
    "Loader",
    "OpenedCheckpoint",
    "TwoStageDataParallelLoader",
    "open_checkpoint",
    "resolve_loader",
]
