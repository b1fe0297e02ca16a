"""Two-stage data-parallel load: within each data-parallel group, every globally unique chunk is
read from storage by one rank of the group and broadcast to the others.

1. the ranks of the group exchange the chunks they need (sharded-tensor metadata);
2. chunks are deduplicated: each is read by one of the ranks needing it, balanced by bytes and
   spread over the group (not always the lowest rank);
3. per chunk: the reader reads it into host memory (then to the device when the group's backend
   communicates on one), the others post a receive buffer (or receive straight into the
   parameter), the chunk is broadcast, copied into place, buffers are freed;
4. the stages overlap: a reader thread reads the next chunks while earlier ones are broadcast
   (``async_op=True``), with at most ``max_inflight_bytes`` admitted at once so host and device
   memory stay bounded; small chunks are bucketed into one broadcast;
5. :meth:`TwoStageDataParallelLoader.summarize_load_times` reports read / copy / broadcast times
   per rank.

Unlike Megatron-Core's version, the three stages overlap and reads are spread over the group.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..comm import Comm, get_comm
from ..core.strict import StrictHandling
from .chunk_exchange import LoadStats, exchange_load, format_load_times, logger


class TwoStageDataParallelLoader:
    """Read each chunk once per data-parallel group and broadcast it within the group.

    Args:
        data_parallel_group: the group whose ranks hold replicas of the same state (``None``: the
            whole group ``load`` runs over). Every rank of the load's group calls ``load`` with its
            own data-parallel group; the groups must partition the load's group.
        max_inflight_bytes: bound on the bytes of chunks admitted (being read, broadcast or copied)
            at once on a rank, including the loader's own buffers. A single chunk larger than the
            bound is admitted alone.
        bucket_bytes: chunks smaller than this are broadcast together, up to this many bytes per
            broadcast (bigger chunks go straight from / into the destination tensors, no copy).
        read_batch_bytes: the reader thread reads up to this many bytes of queued chunks in one
            tensorstore batch (more I/O concurrency; smaller batches start the broadcasts sooner).
        device: device for communication buffers (default: from the group's backend: CPU for
            gloo, the current accelerator for nccl).
    """

    def __init__(self, data_parallel_group: Optional[dist.ProcessGroup] = None, *,
                 max_inflight_bytes: int = 256 << 20, bucket_bytes: int = 256 << 10,
                 read_batch_bytes: int = 16 << 20, device: Optional[torch.device] = None) -> None:
        if max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {max_inflight_bytes}")
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
        if read_batch_bytes < 1:
            raise ValueError(f"read_batch_bytes must be >= 1, got {read_batch_bytes}")
        self.read_batch_bytes = read_batch_bytes
        self.data_parallel_group = data_parallel_group
        self.max_inflight_bytes = max_inflight_bytes
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.last_stats: List[LoadStats] = []

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: str, comm: Comm, strict: StrictHandling,
             extra_safe_globals: Sequence[Any] = ()) -> Tuple[Dict[str, Any], Set[str], Set[str]]:
        """Collective over ``comm`` (the load's group); the exchange runs within the DP group."""
        group = get_comm(self.data_parallel_group) if self.data_parallel_group is not None else comm
        state, missing, unexpected, self.last_stats = exchange_load(
            sharded_state_dict, checkpoint_dir, comm, group, strict, extra_safe_globals,
            lambda engine: engine.run_streaming(self.max_inflight_bytes, self.read_batch_bytes), bucket_bytes=self.bucket_bytes,
            device=self.device, op_name="load (two-stage)",
        )
        return state, missing, unexpected

    def summarize_load_times(self) -> str:
        """Per-rank read / wait / copy / broadcast / total seconds and bytes of the last load
        (every rank has every rank's numbers); also logged at INFO."""
        text = format_load_times(self.last_stats) if self.last_stats else "no load yet"
        logger.info("two-stage load times:\n%s", text)
        return text
