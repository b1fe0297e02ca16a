"""Loading a distributed checkpoint for inference in a single process (``load_from_checkpoint``-style).

Whatever split saved it (TP x DP under the strategy, any world size under the plugin, Fabric), each
tensor is read whole and the module is built un-sharded: a tensor-parallel module built with
``ParallelState.single()`` has the global shapes, so its ``state_dict`` keys and shapes match.
No process group is needed, and none is entered if one exists. :func:`load_module_weights` also
reads a ``torch.save`` / safetensors file or a Hugging Face directory, each rank only its shards.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence, Type, TypeVar, Union

import torch
from lightning.pytorch import LightningModule
from torch import nn

from ..core.errors import ArgumentTypeError, CheckpointingError
from ..core.strict import StrictHandling
from ..storage.paths import checkpoint_location
from ..reading.formats import KeyMap, detect
from ..reading.loaders import EveryRankLoader
from .checkpoint_io import LOCAL, DistCheckpointIO
from .parallel import parallel_state_of
from .sharded import model_sharded_state_dict

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
    in eval mode (on ``map_location`` if given). ``checkpoint_dir``: the checkpoint's path or URL;
    ``strict``: as ``load_state_dict``'s (None: the module's ``strict_loading``); ``extra_safe_globals``:
    further trusted types its common state may hold.

    Example::

        model = load_lightning_module(TinyGPT, "checkpoints/last.ckpt")
        logits = model(tokens)
    """
    # Lightning's own load_from_checkpoint logic, fed with the checkpoint we read (hparams, hooks, strict).
    from lightning.pytorch.core.saving import _load_state

    _check_module_class(cls)
    io = DistCheckpointIO(extra_safe_globals=extra_safe_globals)
    checkpoint = io.load_checkpoint(checkpoint_dir)
    if "state_dict" not in checkpoint:
        raise CheckpointingError(_no_state_dict(checkpoint_location(checkpoint_dir, "checkpoint"), checkpoint))
    model = _load_state(cls, checkpoint, strict=strict, **init_overrides)
    if map_location is not None:
        model = model.to(map_location)
    model.eval()
    return model  # type: ignore[return-value]


def load_module_weights(
    module: nn.Module,
    checkpoint: Union[str, "os.PathLike[str]"],
    *,
    entry: str = "state_dict",
    strict: bool = True,
    key_map: KeyMap = None,
    extra_safe_globals: Sequence[Any] = (),
) -> nn.Module:
    """Load a module's weights in this process alone (no collective: call it on every rank, e.g. in
    ``configure_model``, or on one).

    ``checkpoint`` is a Trainer or Fabric checkpoint directory of ours (every tensor read whole; a plain
    ``lightning_distckpt.save`` checkpoint: ``lightning_distckpt.load(template, path, key_map=...)``), or an ordinary
    file this rank reads its shards from: a ``torch.save`` file (a state dict, or a Lightning
    ``.ckpt`` whose weights sit under ``entry``), a ``.safetensors`` file, a Hugging Face model
    directory (sharded with an index or not). For those, the module's shards are described by its
    ``sharded_state_dict()`` (tensor-parallel layers) or are whole, and only the slices this rank
    holds are read. ``key_map`` maps the file's keys to the module's (a dict, or a callable
    returning None to skip a key); by default ``"<entry>/"`` is stripped and other nested paths
    skipped. ``strict``: every module tensor must be found and every file tensor used.

    For our directories, ``entry`` names where the module's state sits: ``"state_dict"`` for Trainer
    checkpoints, the state key (e.g. ``"model"``) for ``fabric.save(path, {"model": model, ...})``.
    ``extra_safe_globals``: further trusted types the checkpoint may hold. Returns ``module``.
    """
    if not isinstance(module, nn.Module):
        swapped = " (the arguments are swapped?)" if isinstance(checkpoint, nn.Module) else ""
        raise ArgumentTypeError(f"load_module_weights(module, checkpoint): module must be an nn.Module instance, got "
                                f"{_shown_value(module)}{swapped}; call load_module_weights(module, path)")
    path = checkpoint_location(checkpoint, "checkpoint")
    source = detect(path, key_map if key_map is not None else _entry_key_map(entry), extra_safe_globals)
    if source is not None:
        return _load_shards(module, source, strict, extra_safe_globals)
    io = DistCheckpointIO(extra_safe_globals=extra_safe_globals)
    loaded = io.load_checkpoint(path)
    if entry not in loaded:
        raise CheckpointingError(f"checkpoint {path}: no entry {entry!r} (has {sorted(loaded)}); name the module's "
                                 f"entry: load_module_weights(module, path, entry={_module_entry(loaded)})")
    state = loaded[entry]
    prefix = f"{entry}."
    if entry != "state_dict" and isinstance(state, dict):  # Fabric checkpoints written before the keys lost it
        state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    module.load_state_dict(state, strict=strict)
    return module


def _shown_value(value: Any) -> str:
    """A value in an argument error: its type, and a short repr for a str or path."""
    if isinstance(value, type):
        return f"the class {value.__name__}"
    if isinstance(value, (str, os.PathLike)):
        # a path is shown whole (a cut one is no help finding the file); only a long str is cut, visibly
        text = repr(os.fspath(value))
        return f"{type(value).__name__} {text if len(text) <= 300 else text[:300] + '...'}"
    return f"an instance of {type(value).__name__}"


def _check_module_class(cls: Any) -> None:
    """``load_lightning_module``'s first argument is the LightningModule class to build."""
    if isinstance(cls, type) and issubclass(cls, LightningModule):
        return
    if isinstance(cls, LightningModule):
        fix = (f"pass the class, load_lightning_module({type(cls).__name__}, path), or load the weights into this "
               f"module with load_module_weights(module, path)")
    elif isinstance(cls, nn.Module) or (isinstance(cls, type) and issubclass(cls, nn.Module)):
        fix = "for a plain nn.Module, build it and call load_module_weights(module, path)"
    else:
        fix = "the class comes first: load_lightning_module(MyModule, path)"
    raise ArgumentTypeError(f"load_lightning_module(cls, path): cls must be a LightningModule class, got "
                            f"{_shown_value(cls)}; {fix}")


def _no_state_dict(path: str, checkpoint: Any) -> str:
    """What a checkpoint without a Trainer's ``state_dict`` holds, and how to load its weights."""
    names = sorted(map(str, checkpoint))
    held = ", ".join(map(repr, names[:6])) + (f", ... ({len(names)} entries)" if len(names) > 6 else "")
    return (f"checkpoint {path}: no 'state_dict' entry, so not a Trainer's checkpoint (it holds {held or 'nothing'}); "
            f"build the module yourself and load its weights with load_module_weights(module, path) (a state dict), "
            f"or load_module_weights(module, path, entry={_module_entry(checkpoint)}) for the module's entry of a "
            f"fabric.save checkpoint")


def _module_entry(checkpoint: Any) -> str:
    """The first entry holding a mapping (where a fabric.save checkpoint keeps a module), as an argument."""
    return next((repr(k) for k, v in checkpoint.items() if isinstance(v, dict)), "NAME")


def _entry_key_map(entry: str) -> Callable[[str], Optional[str]]:
    """``"<entry>/name"`` -> ``"name"``; other nested paths (optimizer state, ...) skipped; flat names kept."""
    prefix = f"{entry}/"

    def key_map(name: str) -> Optional[str]:
        if name.startswith(prefix):
            return name[len(prefix):]
        return None if "/" in name else name

    return key_map


def _load_shards(module: nn.Module, source: Any, strict: bool, extra_safe_globals: Sequence[Any]) -> nn.Module:
    """Read this rank's slice of each of the module's tensors from a file source (no collective)."""
    template = model_sharded_state_dict(module, parallel_state_of(module))
    handling = StrictHandling.RAISE_ALL if strict else StrictHandling.LOG_ALL
    state, _, _ = EveryRankLoader().load(template, source, LOCAL, handling, extra_safe_globals)
    # The reads landed in the parameters where they could (contiguous CPU tensors); copy the rest.
    module.load_state_dict({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, strict=False)
    return module
