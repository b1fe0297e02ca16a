"""``DistCheckpointIO`` beside Lightning strategies that do not save or resume through it.

Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy`` (with ``save_distributed_checkpoint=True``,
their default) and ``DeepSpeedStrategy`` write their checkpoints themselves: a plugin given to them is
never asked to save or load, only to remove what ``ModelCheckpoint`` rotates away. With a full state dict
(``FSDPStrategy(state_dict_type="full")``, ``ModelParallelStrategy(save_distributed_checkpoint=False)``)
they save through the plugin but resume only a ``torch.save`` file or their own DCP directory, so
``fit(ckpt_path=...)`` under them cannot read what the plugin wrote.

Lightning gives a ``CheckpointIO`` no setup hook and no reference to its strategy (the Trainer only
assigns ``strategy.checkpoint_io``), so the plugin learns its strategy from the first call the strategy
makes into it: the caller's frame is Lightning's ``Strategy.save_checkpoint`` / ``remove_checkpoint``.
It then says, once per case, what happens and what to use instead. A warning, not an error: those calls
come on global rank 0 alone, and an error there would leave the other ranks waiting in their next
collective; the save itself is good (our format, loadable by the plugin and our strategies).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from .model_checkpoint import warn_last_not_found

logger = logging.getLogger(__name__)

#: How many frames above the plugin's method to look for the strategy: Lightning's Strategy method calls
#: the plugin directly, or through a wrapping CheckpointIO (AsyncCheckpointIO).
_DEPTH = 4

FSDP1_ADVICE = ("for FSDP use DistCheckpointModelParallelStrategy (FSDP2, our format), or drop the plugin and "
                "keep FSDPStrategy's own sharded checkpoints")
MP_ADVICE = ("use DistCheckpointModelParallelStrategy (FSDP2 / tensor parallel in our format; it also resumes "
             "what ModelParallelStrategy or this plugin wrote)")


def calling_strategy() -> Optional[Any]:
    """The Lightning strategy whose method called the plugin's method that called :func:`tell_strategy`."""
    from lightning.pytorch.strategies import Strategy

    try:  # best effort: an interpreter without frames (or a shallower stack) only means no advice
        frame = sys._getframe(3)  # 0: here, 1: tell_strategy, 2: the plugin's method, 3: its caller
    except (AttributeError, ValueError):
        return None
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Strategy):
            return owner
        frame = frame.f_back
    return None


def _stock(strategy: Any, cls: type, method: str) -> bool:
    """Whether ``strategy`` is a ``cls`` whose ``method`` is Lightning's own (a subclass overriding it decides
    for itself: ours do, and read what the plugin writes)."""
    return isinstance(strategy, cls) and getattr(type(strategy), method) is getattr(cls, method)


def advice_on_save(strategy: Any, path: str) -> Optional[str]:
    """What to tell of a save through the plugin under ``strategy`` that cannot resume it; None: nothing."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if _stock(strategy, FSDPStrategy, "load_checkpoint"):
        return (f"DistCheckpointIO under Lightning's FSDPStrategy(state_dict_type='full'): it saves {path} through "
                "this plugin, but FSDPStrategy resumes only a torch.save file or its own sharded directory, so "
                "fit(ckpt_path=...) under it cannot read this checkpoint ('does not point to a valid checkpoint'); "
                f"it loads with DistCheckpointIO under DDP or a single device. {FSDP1_ADVICE}")
    if _stock(strategy, ModelParallelStrategy, "load_checkpoint"):
        return (f"DistCheckpointIO under Lightning's ModelParallelStrategy(save_distributed_checkpoint=False): it "
                f"saves {path} through this plugin, but ModelParallelStrategy resumes only a torch.save file or its "
                "own DCP directory, so fit(ckpt_path=...) under it cannot read this checkpoint ('does not point to "
                "a valid checkpoint') and a second save to the same name (save_last) stops at IsADirectoryError; "
                f"{MP_ADVICE}")
    return None


def advice_on_remove(strategy: Any) -> Optional[str]:
    """What to tell when ``strategy`` asks the plugin to remove a checkpoint it saved itself; None: nothing."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    saves_itself = ("writes its checkpoints itself and never calls this plugin to save or load them: they are "
                    "not in our format")
    if _stock(strategy, FSDPStrategy, "save_checkpoint") and getattr(strategy, "_state_dict_type", "") == "sharded":
        return f"DistCheckpointIO under Lightning's FSDPStrategy (state_dict_type='sharded'): FSDPStrategy " \
               f"{saves_itself} (torch DCP); {FSDP1_ADVICE}"
    if _stock(strategy, ModelParallelStrategy, "save_checkpoint") and \
            getattr(strategy, "_save_distributed_checkpoint", False):
        return ("DistCheckpointIO under Lightning's ModelParallelStrategy (save_distributed_checkpoint=True): "
                f"ModelParallelStrategy {saves_itself} (torch DCP); {MP_ADVICE}")
    if _stock(strategy, DeepSpeedStrategy, "save_checkpoint"):
        return f"DistCheckpointIO under Lightning's DeepSpeedStrategy: DeepSpeedStrategy {saves_itself}; " \
               "drop the plugin"
    return None


def tell_strategy(plugin: Any, action: str, path: str) -> None:
    """Called at the top of the plugin's ``save_checkpoint`` / ``remove_checkpoint`` (``action``): if the
    calling strategy does not resume what the plugin saves, or saves without it, say so once per plugin."""
    told = plugin.__dict__.setdefault("_told_strategies", set())
    strategy = calling_strategy()
    if strategy is None or (type(strategy), action) in told:
        return
    told.add((type(strategy), action))
    if action == "save":  # the plugin's first save: its Trainer's s3:// folders holding what "last" did not find
        warn_last_not_found(getattr(getattr(strategy, "lightning_module", None), "_trainer", None))
    advice = advice_on_save(strategy, path) if action == "save" else advice_on_remove(strategy)
    if advice is not None:
        logger.warning(advice)
