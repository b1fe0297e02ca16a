"""Megatron-Core's ``dist_checkpointing`` arguments that ours takes so code written for it runs unchanged
(``save(sd, path, strategy, async_sharded_save=..., content_metadata=...)``), checked here: a value that
is none of what Megatron-Core accepts is still an ``ArgumentTypeError`` naming the argument."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .arguments import require
from .errors import ArgumentTypeError

#: the common-state key Megatron-Core 0.16's ``save(..., content_metadata=)`` stores it under
CONTENT_METADATA_KEY = "content_metadata"
_STRATEGIES_MODULE = "megatron.core.dist_checkpointing.strategies"


def check_strategy(value: Any, what: str) -> None:
    """``value`` is None, a ``(backend, version)`` tuple or one of Megatron-Core's strategy objects (by its
    type's module or a base's; nothing imported). Ours has one storage format and picks its own readers and writers,
    so a strategy changes nothing; anything else is an ArgumentTypeError (a misplaced argument)."""
    # by the type's bases too: a framework's subclass of one (NeMo's async TorchDist strategy) is one
    if value is None or any(getattr(c, "__module__", "").startswith(_STRATEGIES_MODULE) for c in type(value).__mro__):
        return
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
        return
    raise ArgumentTypeError(f"{what} must be None, a (backend, version) tuple or a Megatron-Core strategy "
                            f"(ignored: one storage format), got {type(value).__name__}")


def async_flag(async_save: Any, async_sharded_save: Any) -> Any:
    """``save``'s ``async_save`` given Megatron-Core's name for it too: either one set is the save's."""
    require(async_sharded_save, bool, "async_sharded_save", "a bool")
    if async_sharded_save and async_save is False:
        return True
    return async_save


def with_content_metadata(sharded_state_dict: Dict[str, Any], content_metadata: Optional[dict],
                          preprocess_common: Any) -> Dict[str, Any]:
    """The state dict to save with ``content_metadata`` in its common state (a new top-level dict; the
    caller's is unchanged), replacing one there, as Megatron-Core does. ``preprocess_common`` (its
    ``preprocess_common_before_consistancy_check``) is checked only: ours compares the whole common
    state across ranks, where a difference is a warning."""
    if preprocess_common is not None and not callable(preprocess_common):
        raise ArgumentTypeError("preprocess_common_before_consistancy_check must be None or a function, "
                                f"got {type(preprocess_common).__name__}")
    if content_metadata is None:
        return sharded_state_dict
    require(content_metadata, dict, "content_metadata", "a dict or None")
    return {**sharded_state_dict, CONTENT_METADATA_KEY: content_metadata}


def content_metadata_of(common: Any) -> Optional[dict]:
    """The content metadata in a loaded common state (None when the save had none)."""
    require(common, dict, "preloaded_state_dict", "the checkpoint's common state (a dict)")
    return common.get(CONTENT_METADATA_KEY)
