"""Behaviour shared with Megatron-Core's ``dist_checkpointing``, checked side by side against the
real megatron-core (test extra), and the ``torch_dist`` checkpoints of each of its releases."""
