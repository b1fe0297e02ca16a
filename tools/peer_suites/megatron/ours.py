"""Megatron-Core's ``dist_checkpointing`` entry points, answered by lightning_distckpt.

Each function takes Megatron-Core 0.16's signature and calls ours. Only arguments are adapted:

- ``sharded_strategy`` / ``common_strategy`` pick Megatron-Core's storage backends; ours has one, so
  they are ignored.
- ``content_metadata`` is stored under the common state's ``"content_metadata"`` key, as Megatron-Core
  0.16's ``save`` does (``load_content_metadata`` reads it back through ``load_common_state_dict``).
- ``async_sharded_save=True`` returns Megatron-Core's ``AsyncRequest`` with no async function (our
  writes already run in our background thread) whose finalize step is our request's ``finalize()``.
- Our errors (``CheckpointingError``) are raised as Megatron-Core's ``CheckpointingException`` of the
  same message (chained), so the tests' ``pytest.raises`` see the type they name.
- ``PEER_CAST`` / ``PEER_SAFE_GLOBALS`` (environment) give the options for Megatron-Core's behaviour
  where ours differs on purpose: ``cast="any"``, and ``extra_safe_globals`` (``module:Name`` list);
  ``PEER_ERRORS_AS_DCP=1`` raises our errors as torch DCP's ``CheckpointException`` too.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable, List, Optional

import lightning_distckpt as ldc
from lightning_distckpt.core.errors import CheckpointingError
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from torch.distributed.checkpoint import CheckpointException

CONTENT_METADATA_KEY = "content_metadata"


class _AlsoDcpError(CheckpointingException, CheckpointException):
    """``PEER_ERRORS_AS_DCP=1``: our error as both Megatron-Core's and torch DCP's exception type, to
    see whether the rest of a test that asks for DCP's type (its backend's) passes."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.message, self._failures = message, {}

    def __str__(self) -> str:
        return self.message


def _as_megatron_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CheckpointingError as e:
            kind = _AlsoDcpError if os.environ.get("PEER_ERRORS_AS_DCP") == "1" else CheckpointingException
            raise kind(str(e)) from e
    return call


def _safe_globals() -> List[Any]:
    """``PEER_SAFE_GLOBALS="argparse:Namespace,collections:OrderedDict"`` as the types."""
    out = []
    for name in filter(None, os.environ.get("PEER_SAFE_GLOBALS", "").split(",")):
        module, attr = name.split(":")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def _load_options() -> dict:
    return {"cast": os.environ.get("PEER_CAST", "same_kind"), "extra_safe_globals": _safe_globals()}


@_as_megatron_error
def save(sharded_state_dict: Any, checkpoint_dir: Any, sharded_strategy: Any = None,
         common_strategy: Any = None, validate_access_integrity: bool = True,
         async_sharded_save: bool = False, preprocess_common_before_consistancy_check: Any = None,
         content_metadata: Optional[dict] = None) -> Optional[AsyncRequest]:
    """Megatron-Core's ``save`` by ours (see the module docstring for the adapted arguments)."""
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    request = ldc.save(sharded_state_dict, checkpoint_dir, validate_access_integrity=validate_access_integrity,
                       async_save=bool(async_sharded_save))
    if request is None:
        return None
    return AsyncRequest(None, (), [_as_megatron_error(request.finalize)])


@_as_megatron_error
def load(sharded_state_dict: Any, checkpoint_dir: Any, sharded_strategy: Any = None,
         common_strategy: Any = None, validate_access_integrity: bool = True, strict: Any = None) -> Any:
    """Megatron-Core's ``load`` by ours, ``validate_access_integrity`` (Megatron-Core's default: True)
    passed on: ours then checks the ranks' templates as theirs does."""
    kwargs = _load_options()
    kwargs["validate_access_integrity"] = validate_access_integrity
    if strict is not None:
        kwargs["strict"] = strict
    return ldc.load(sharded_state_dict, checkpoint_dir, **kwargs)


@_as_megatron_error
def load_tensors_metadata(checkpoint_dir: Any, sharded_strategy: Any = None) -> Any:
    """Megatron-Core 0.16's ``load_tensors_metadata`` (N-D descriptions) by ours."""
    return ldc.load_tensors_metadata(checkpoint_dir)


@_as_megatron_error
def load_common_state_dict(checkpoint_dir: Any) -> Any:
    """Megatron-Core's ``load_common_state_dict`` by ours."""
    return ldc.load_common_state_dict(checkpoint_dir, _safe_globals())


@_as_megatron_error
def load_plain_tensors(checkpoint_dir: Any) -> Any:
    """Megatron-Core's ``load_plain_tensors`` by ours."""
    return ldc.load_plain_tensors(checkpoint_dir)


@_as_megatron_error
def load_sharded_metadata(checkpoint_dir: Any, sharded_strategy: Any = None, common_strategy: Any = None) -> Any:
    """Megatron-Core's ``load_sharded_metadata`` (tensors and ShardedObjects) by ours."""
    return ldc.load_sharded_metadata(checkpoint_dir)


ROUTED = {
    "save": save,
    "load": load,
    "load_tensors_metadata": load_tensors_metadata,
    "load_common_state_dict": load_common_state_dict,
    "load_plain_tensors": load_plain_tensors,
    "load_sharded_metadata": load_sharded_metadata,
}
