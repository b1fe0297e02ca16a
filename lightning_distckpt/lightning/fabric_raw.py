"""``fabric.load_raw(path, obj)`` under our Fabric strategies: one state-dict file (``torch.save`` or
``.safetensors``) read as stock Fabric reads it, but by our own reader: no ``torch.load`` of the user's
bytes beyond the weights-only unpickler behind our checks (:func:`~..storage.safe_pickle.load_file`:
a regular file, checked zip records and pickle, claimed storages against the file's size), so a
hostile file is a clear error on every rank and never runs code. Every rank reads the file itself
(memory-mapped, as :func:`~.inference.load_module_weights` does); the outcome is agreed over the
group, so a rank never goes on alone past a file another rank could not read.

Stock semantics kept: a module under the DDP strategy loads as ``module.load_state_dict(sd, strict)``
(strict: no key missing, none unexpected), each rank reading only its tensor-parallel slices; under
the ModelParallel strategy the full state dict goes into the DTensor-sharded module through torch's
``set_model_state_dict(full_state_dict=True)`` (strict: no key missing; keys the module lacks are
ignored, as stock ignores them); an optimizer loads as ``optimizer.load_state_dict`` under DDP and is
refused under ModelParallel (``NotImplementedError``, as stock). ``weights_only`` is taken as stock's
``fabric.load_raw(path, obj, strict, weights_only=...)`` takes it, but never widens what is unpickled
(loading runs no code): with ``weights_only=False`` a refused type's error says so, and how to allow it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.optim import Optimizer

from ..core.errors import ArgumentError, ArgumentTypeError, CheckpointNotFoundError, FormatError, MissingKeysError, \
    ShardingError, UnsafeContentError
from ..core.strict import StrictHandling
from ..optim.restore_checks import load_checked
from ..reading.formats import detect
from ..reading.formats.detect import open_file
from ..reading.formats.files import check_torch_payload
from ..reading.loaders import EveryRankLoader
from ..storage.safe_pickle import load_file
from .checkpoint_io import LOCAL
from .parallel import ParallelState
from .sharded import AFTER_READING, build_on_all_ranks, model_sharded_state_dict

_DIRECTORY_FIX = ("load a checkpoint directory with fabric.load(path, {'model': model}) with the keys it was saved "
                  "under, or a module's weights in one process with "
                  "lightning_distckpt.lightning.load_module_weights(module, path, entry='model')")


def check_state_arg(state: Any, owner: str) -> None:
    """``fabric.save(path, state)``'s ``state`` is a dict of names to objects (a Mock or a module passed
    alone failed deep inside with "'Mock' object is not iterable")."""
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(
            f"{owner}.save_checkpoint(path, state): state must be a dict of names to modules, optimizers and "
            f"values, got an instance of {type(state).__name__}; call fabric.save(path, {{'model': model, "
            "'optimizer': optimizer, 'step': step})")


def raw_file(target: str) -> str:
    """``target``, the path ``fabric.load_raw`` was given, once it is one file: a directory (one of our
    checkpoints, say) or nothing at the path is refused naming it (stock: a ValueError saying a single
    file is needed / a FileNotFoundError). Checked in each rank's agreed read: ranks may see different
    files."""
    if os.path.isdir(target):
        # the first words are stock's (code and tests written for its ValueError match them)
        raise ArgumentError(f"The given path must be a single file containing the full state dict: fabric.load_raw("
                            f"{target!r}, obj) was given a directory; {_DIRECTORY_FIX}")
    if not os.path.lexists(target):
        raise CheckpointNotFoundError(f"fabric.load_raw({target!r}, obj): file {target} does not exist")
    return target


@contextlib.contextmanager
def runs_no_code(weights_only: Any, where: str) -> Iterator[None]:
    """``fabric.load_raw``'s ``weights_only`` (None or a bool, as stock's): the reads in the block stay
    weights-only whatever it says; a type refused under ``weights_only=False`` (which stock's ``torch.load``
    would have built, running the file's code) says that the flag is not honoured, then how to allow it."""
    if weights_only is not None and not isinstance(weights_only, bool):
        raise ArgumentTypeError(f"{where}: weights_only must be None, True or False, got {weights_only!r}")
    try:
        yield
    except UnsafeContentError as e:
        if weights_only is not False:
            raise
        raise UnsafeContentError(f"{e}. weights_only=False is not honoured: lightning_distckpt's loading runs no "
                                 "code, so only the types allowed as said above are unpickled") from None


def load_raw_module(module: nn.Module, path: str, ps: ParallelState, strict: bool,
                    extra_safe_globals: Sequence[Any], weights_only: Optional[bool] = None) -> None:
    """Collective: the DDP strategy's ``fabric.load_raw(path, module)``: each rank reads the slices of
    its shards (``module.sharded_state_dict()``, or whole tensors) from the file; strict as
    ``load_state_dict``'s (``weights_only``: see :func:`runs_no_code`). Agreed over the group."""
    where = f"fabric.load_raw({path!r}, module)"

    @runs_no_code(weights_only, where)
    def load() -> None:
        source = detect(raw_file(path), _flat_names, extra_safe_globals)
        if source is None:  # raw_file let only a file through, and detect opens every file or says why not
            raise FormatError(f"{where}: not a torch.save or safetensors file")
        template = model_sharded_state_dict(module, ps)
        _check_entries(where, source.index.tensors, template, _nested(n for f in source.files for n in f.names()))
        handling = StrictHandling.RAISE_ALL if strict else StrictHandling.LOG_ALL
        state, _, _ = EveryRankLoader().load(template, source, LOCAL, handling, extra_safe_globals)
        # The reads landed in the parameters where they could (contiguous CPU tensors); copy the rest.
        module.load_state_dict({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, strict=False)

    build_on_all_ranks(where, load, failed="failed")


def load_raw_sharded_module(module: nn.Module, path: str, strict: bool, extra_safe_globals: Sequence[Any],
                            weights_only: Optional[bool] = None) -> None:
    """Collective: the ModelParallel strategy's ``fabric.load_raw(path, module)``: every rank reads the
    file's tensors the module has, whole, and torch's ``set_model_state_dict(full_state_dict=True)`` puts
    them into the module's DTensors. Strict as stock: a key of the module missing from the file is a
    ``KeyError`` naming it; keys the module lacks are ignored (never read: stock's file is memory-mapped).
    ``weights_only``: see :func:`runs_no_code`."""
    where = f"fabric.load_raw({path!r}, module)"

    @runs_no_code(weights_only, where)
    def read() -> Dict[str, torch.Tensor]:
        file = open_file(raw_file(path), extra_safe_globals)  # the path first, as stock checks it first
        expected = get_model_state_dict(module)  # sharded DTensors (their shape is the global one), no gathering
        held = {name: file.shape_dtype(name)[0] for name in file.names()}  # from the header: nothing read yet
        _check_entries(where, held, expected, _nested(held))
        missing = [k for k in expected if k not in held]
        if strict and missing:
            raise MissingKeysError(f"{where}: the model contains the key(s) {missing} that the file does not hold "
                                   f"(it holds {_shown(held)}){_hint(held, missing)}; to load the others, pass "
                                   "strict=False")
        for key, value in expected.items():
            if key in held and tuple(held[key]) != tuple(value.shape):
                raise ShardingError(f"{where}: tensor {key!r} has shape {tuple(held[key])} in the file, the "
                                    f"model's has {tuple(value.shape)}")
        return {k: file.read(k, tuple(slice(None) for _ in shape)) for k, shape in held.items() if k in expected}

    state = build_on_all_ranks(where, read, failed="failed")
    options = StateDictOptions(full_state_dict=True, strict=strict)
    build_on_all_ranks(where, lambda: set_model_state_dict(module, state, options=options), failed=AFTER_READING)


def load_raw_optimizer(optimizer: Optimizer, path: str, extra_safe_globals: Sequence[Any],
                       weights_only: Optional[bool] = None) -> None:
    """Collective: the DDP strategy's ``fabric.load_raw(path, optimizer)``: ``optimizer.load_state_dict``
    of the file's ``optimizer.state_dict()``, with the param-group checks every optimizer load of ours
    makes (:func:`~..optim.restore_checks.load_checked`; ``weights_only``: see :func:`runs_no_code`).
    Agreed over the group."""
    where = f"fabric.load_raw({path!r}, optimizer)"

    @runs_no_code(weights_only, where)
    def load() -> None:
        payload = load_file(raw_file(path), extra_safe_globals)
        check_torch_payload(path, payload)  # dense CPU tensors, shapes and views within the file's budget
        if not (isinstance(payload, dict) and isinstance(payload.get("state"), dict)
                and isinstance(payload.get("param_groups"), list)):
            held = sorted(map(str, payload))[:8] if isinstance(payload, dict) else type(payload).__name__
            raise FormatError(f"{where}: the file holds no optimizer state dict (a dict with 'state' and "
                              f"'param_groups'), it holds {held}; save one with torch.save(optimizer.state_dict(), "
                              f"path), or {_DIRECTORY_FIX.replace('directory', 'file')}")
        load_checked(optimizer, lambda: optimizer.load_state_dict(payload), where)

    build_on_all_ranks(where, load, failed="failed")


def _flat_names(name: str) -> Optional[str]:
    """A raw state dict's keys are flat (``fc.weight``): a nested path (``model/fc.weight`` of a
    ``fabric.save`` file) is no key of the module."""
    return None if "/" in name else name


def _nested(names: Iterable[str]) -> Dict[str, None]:
    """The nested tensor names of a file (``model/fc.weight``), which :func:`_flat_names` skips."""
    return {n: None for n in names if "/" in n}


def _check_entries(where: str, stored: Mapping[str, Any], template: Mapping[str, Any],
                   nested: Mapping[str, Any]) -> None:
    """A file none of whose keys the module has, but with nested names (a ``fabric.save`` or Trainer
    file): refused with where the module's weights are, even non-strict (stock loads nothing then)."""
    if not template or any(k in stored for k in template) or not nested:
        return
    raise MissingKeysError(f"{where}: the file holds no key of the module: it is no raw state dict (it holds "
                           f"{_shown(nested)}){_hint(nested, list(template))}")


def _shown(names: Mapping[str, Any]) -> str:
    keys = sorted(names)
    return ", ".join(map(repr, keys[:6])) + (f", ... ({len(keys)} keys)" if len(keys) > 6 else "") or "nothing"


def _hint(held: Mapping[str, Any], wanted: Sequence[str]) -> str:
    """Where the module's keys sit in a checkpoint file (``<entry>/<key>``), and how to load from there."""
    entries = sorted({n.split("/")[0] for n in held if "/" in n and n.split("/", 1)[1] in wanted})
    if not entries:
        return ""
    return (f"; the file is a checkpoint whose entry {entries[0]!r} holds them: load it with fabric.load(path, "
            f"{{{entries[0]!r}: model}}), or lightning_distckpt.lightning.load_module_weights(module, path, "
            f"entry={entries[0]!r})")
