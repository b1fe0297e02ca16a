"""Fully parallel load: over the whole load group, each unique chunk is read from storage once,
by one of the ranks that need it (balanced by bytes), and delivered to the other ranks that need
it by broadcast (everyone needs it) or point-to-point sends (a subset needs it).

Reads happen first, all of a rank's share in one tensorstore batch (the most I/O concurrency),
then the exchange; there is no bound on bytes in flight, so a rank may hold extra buffers for
its whole share at once (none on CPU when the template's tensors are contiguous). For a bounded,
pipelined exchange within data-parallel groups see
:class:`~lightning_distckpt.strategies.two_stage.TwoStageDataParallelLoader`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..comm import Comm, get_comm
from ..core.strict import StrictHandling
from .chunk_exchange import LoadStats, exchange_load, format_load_times, logger


class FullyParallelLoader:
    """Load where total storage reads equal the unique bytes needed by the group.

    Args:
        process_group: the ranks that share reads (default: the group ``load`` runs over).
        bucket_bytes: chunks smaller than this travel together, up to this many bytes per message.
        device: device for communication buffers (default: from the group's backend).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, bucket_bytes: int = 256 << 10,
                 device: Optional[torch.device] = None) -> None:
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
        self.process_group = process_group
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.last_stats: List[LoadStats] = []

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: str, comm: Comm, strict: StrictHandling,
             extra_safe_globals: Sequence[Any] = ()) -> Tuple[Dict[str, Any], Set[str], Set[str]]:
        exchange = get_comm(self.process_group) if self.process_group is not None else comm
        state, missing, unexpected, self.last_stats = exchange_load(
            sharded_state_dict, checkpoint_dir, comm, exchange, strict, extra_safe_globals,
            lambda engine: engine.run_batch(), bucket_bytes=self.bucket_bytes, device=self.device,
            op_name="load (fully parallel)",
        )
        return state, missing, unexpected

    def summarize_load_times(self) -> str:
        """Per-rank stage times and bytes of the last load (also logged)."""
        text = format_load_times(self.last_stats) if self.last_stats else "no load yet"
        logger.info("fully parallel load times:\n%s", text)
        return text
