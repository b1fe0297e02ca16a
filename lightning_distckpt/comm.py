"""Collectives over a process group, degrading to single-process no-ops when torch.distributed
is not initialized. Every collective the library makes goes through here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist

from .core.errors import ArgumentError, CheckpointingError, CollectiveError, RankFailure, error_class


@dataclass(frozen=True)
class Comm:
    """A process group (or none) with this process's rank and the group size."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def global_rank(self, group_rank: int) -> int:
        if not dist.is_initialized():
            return group_rank
        return dist.get_global_rank(self.group or dist.group.WORLD, group_rank)

    def _failed(self, op: str, e: Exception) -> CheckpointingError:
        return CollectiveError(
            f"rank {self.rank}: {op} over {self.size} ranks failed (a rank may have died or timed out): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        )

    def all_gather_object(self, obj: Any) -> List[Any]:
        if not self.distributed:
            return [obj]
        out: List[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except (RuntimeError, ValueError) as e:  # DistBackendError derives from RuntimeError
            raise self._failed("all_gather_object", e) from e
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast from group rank ``src``."""
        if not self.distributed:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        except (RuntimeError, ValueError) as e:
            raise self._failed("broadcast_object", e) from e
        return box[0]

    def gather_from(self, senders: Sequence[int], obj: Any, dst: int = 0) -> Dict[int, Any]:
        """Collective over ``senders`` and ``dst`` (group ranks): each sender's ``obj`` reaches
        ``dst``, which gets ``{sender: obj}`` (its own included when it is a sender); every other
        rank gets ``{}``. Point to point, so ``dst`` receives what the senders send and no more
        (``gather_object`` would pad every rank's part, senders or not, to the largest)."""
        if self.rank == dst:
            out: Dict[int, Any] = {}
            for src in senders:
                out[src] = obj if src == dst else self._p2p("recv_object_list", src)
            return out
        if self.rank in senders:
            self._p2p("send_object_list", dst, obj)
        return {}

    def _p2p(self, op: str, peer: int, obj: Any = None) -> Any:
        box = [obj]
        try:
            if op == "send_object_list":
                dist.send_object_list(box, group=self.group, group_dst=peer)
            else:
                dist.recv_object_list(box, group=self.group, group_src=peer)
        except (RuntimeError, ValueError) as e:
            raise self._failed(f"{op} with rank {peer}", e) from e
        return box[0]

    def scatter_object(self, parts: Optional[List[Any]], src: int = 0) -> Any:
        """Collective: group rank ``src`` passes one object per rank (``parts``; the others pass
        None) and each rank gets its own. Every rank receives as many bytes as the largest part."""
        if not self.distributed:
            return None if parts is None else parts[0]
        out: List[Any] = [None]
        try:
            dist.scatter_object_list(out, parts if self.rank == src else None, group=self.group, group_src=src)
        except (RuntimeError, ValueError) as e:
            raise self._failed("scatter_object", e) from e
        return out[0]

    def agree(self, what: str, error: Optional[BaseException] = None, payload: Any = None, *,
              default: Type[CheckpointingError] = CheckpointingError) -> List[Any]:
        """Collective: every rank reports its outcome (``error``, or None for success, plus a
        ``payload``); returns every rank's payload, in rank order, when all succeeded.

        When any rank failed, every rank raises one error naming each failing rank with its
        message; ``failures`` maps those ranks to :class:`RankFailure`. Its type is the failing
        ranks' library error type when they all raised the same one, else ``default``.
        """
        mine = None if error is None else (type(error).__name__, _message(error))
        gathered: List[Tuple[Optional[Tuple[str, str]], Any]] = self.all_gather_object((mine, payload))
        failures = {rk: RankFailure(rk, o[0], o[1]) for rk, (o, _) in enumerate(gathered) if o is not None}
        if failures:
            raise _agreed_error(what, failures, default) from error
        return [p for _, p in gathered]

    def barrier(self) -> None:
        if self.distributed:
            # An all_reduce rather than dist.barrier: it works the same on every backend and fails
            # with the group's timeout when a rank is gone.
            try:
                dist.all_reduce(torch.zeros(1), group=self.group)
            except (RuntimeError, ValueError) as e:
                raise self._failed("barrier", e) from e


def comm_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """The device collectives on ``group`` take: CPU for gloo/mpi, else the current accelerator."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        raise ArgumentError(f"process group backend {backend!r} needs an accelerator, but none is available")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def get_comm(process_group: Optional[dist.ProcessGroup] = None) -> Comm:
    """The Comm for ``process_group`` (default: the world group; none when not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ArgumentError("a process_group was given but torch.distributed is not initialized")
        return Comm(None, 0, 1)
    return Comm(process_group, dist.get_rank(process_group), dist.get_world_size(process_group))


def _message(error: BaseException) -> str:
    """The message of ``error``, or of the agreed error it already is (not nested twice)."""
    if isinstance(error, CheckpointingError) and len(error.failures) == 1:
        return next(iter(error.failures.values())).message
    return str(error)


def _agreed_error(what: str, failures: Dict[int, RankFailure], default: Type[CheckpointingError]) -> CheckpointingError:
    types = {f.type_name for f in failures.values()}
    cls = error_class(types.pop()) if len(types) == 1 else None
    cls = cls if cls is not None else default

    def line(f: RankFailure) -> str:
        own = error_class(f.type_name) is not None
        return f"rank {f.rank}: {f.message}" if own else f"rank {f.rank}: {f.type_name}: {f.message}"

    same: Dict[Tuple[str, str], List[int]] = {}  # one line per distinct failure: TP ranks often fail alike
    for f in failures.values():
        same.setdefault((f.type_name, f.message), []).append(f.rank)
    lines = [line(failures[ranks[0]]) + (f" (the same on {_ranks_text(ranks[1:])})" if len(ranks) > 1 else "")
             for ranks in same.values()]
    err = cls(f"{what}: " + "; ".join(lines))
    err.failures = dict(failures)
    return err


def _ranks_text(ranks: List[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"ranks 1-3, 5"``."""
    runs: List[List[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
