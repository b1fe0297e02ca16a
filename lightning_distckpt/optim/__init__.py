"""Optimizer state as sharded state dicts (sharded like the model's parameters)."""

from .sharded_optimizer import init_optimizer_state, optimizer_sharded_state_dict, restore_optimizer_state

__all__ = ["init_optimizer_state", "optimizer_sharded_state_dict", "restore_optimizer_state"]
