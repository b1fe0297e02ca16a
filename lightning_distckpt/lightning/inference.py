"""Loading a distributed checkpoint for inference in a single process (``load_from_checkpoint``-style).

Whatever split saved it (TP x DP under the strategy, any world size under the plugin, Fabric), each
tensor is read whole and the module is built un-sharded: a tensor-parallel module built with
``ParallelState.single()`` has the global shapes, so its ``state_dict`` keys and shapes match.
No process group is needed, and none is entered if one exists.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Type, TypeVar, Union

import torch
from lightning.pytorch import LightningModule
from torch import nn

from ..core.errors import CheckpointingError
from .checkpoint_io import DistCheckpointIO

M = TypeVar("M", bound=LightningModule)


def load_lightning_module(
    cls: Type[M],
    checkpoint_dir: Union[str, "os.PathLike[str]"],
    *,
    map_location: Optional[Union[str, torch.device]] = None,
    strict: Optional[bool] = None,
    extra_safe_globals: Sequence[Any] = (),
    **init_overrides: Any,
) -> M:
    """Like ``cls.load_from_checkpoint`` for a checkpoint directory written by ``DistCheckpointIO`` or
    ``DistCheckpointStrategy``: builds ``cls`` from the saved hyper-parameters (``init_overrides``
    win), calls ``configure_model`` and ``on_load_checkpoint``, loads the weights, returns the module
    in eval mode (on ``map_location`` if given).

    Example::

        model = load_lightning_module(TinyGPT, "checkpoints/last.ckpt")
        logits = model(tokens)
    """
    # Lightning's own load_from_checkpoint logic, fed with the checkpoint we read (hparams, hooks, strict).
    from lightning.pytorch.core.saving import _load_state

    io = DistCheckpointIO(extra_safe_globals=extra_safe_globals)
    checkpoint = io.load_checkpoint(checkpoint_dir)
    if "state_dict" not in checkpoint:
        raise CheckpointingError(f"checkpoint {os.fspath(checkpoint_dir)}: no 'state_dict' (not a Lightning checkpoint)")
    model = _load_state(cls, checkpoint, strict=strict, **init_overrides)
    if map_location is not None:
        model = model.to(map_location)
    model.eval()
    return model  # type: ignore[return-value]


def load_module_weights(
    module: nn.Module,
    checkpoint_dir: Union[str, "os.PathLike[str]"],
    *,
    entry: str = "state_dict",
    strict: bool = True,
    extra_safe_globals: Sequence[Any] = (),
) -> nn.Module:
    """Load a plain ``nn.Module``'s weights from a checkpoint directory in this process alone.

    ``entry`` names where the module's state sits: ``"state_dict"`` for Trainer checkpoints, the state
    key (e.g. ``"model"``) for ``fabric.save(path, {"model": model, ...})``; a Fabric entry's keys
    carry the ``"model."`` prefix, which is removed.
    """
    io = DistCheckpointIO(extra_safe_globals=extra_safe_globals)
    checkpoint = io.load_checkpoint(checkpoint_dir)
    if entry not in checkpoint:
        raise CheckpointingError(f"checkpoint {os.fspath(checkpoint_dir)}: no entry {entry!r} (has {sorted(checkpoint)})")
    state = checkpoint[entry]
    prefix = f"{entry}."
    if entry != "state_dict" and isinstance(state, dict):
        state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    module.load_state_dict(state, strict=strict)
    return module
