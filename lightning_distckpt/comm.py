"""Collectives over a process group, degrading to single-process no-ops when torch.distributed
is not initialized. Every collective the library makes goes through here."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist

from .comm_bytes import (SMALL_BYTES, all_gather_bytes, broadcast_bytes, recv_bytes, released, scatter_bytes,
                         send_bytes)
from .core.errors import (TRACEBACK_SECTION, ArgumentError, CheckpointingError, CollectiveError, RankFailure,
                          error_class)


#: Pickled objects up to this size travel in :meth:`Comm.all_gather_object`'s first exchange.
SMALL_OBJECT_BYTES = SMALL_BYTES
_SIZE_BYTES = 8  # each rank's pickled size, first in what it sends
#: The tag of :meth:`Comm.close_connections`' receive (and those below it, one per gloo context): no op sends it.
_CLOSING_TAG = 2**31 - 1

#: What torch raises when a collective fails (``DistBackendError`` derives from RuntimeError).
_TORCH_ERRORS = (RuntimeError, ValueError)


class Pending:
    """A tensor broadcast, send or receive in flight (:meth:`Comm.broadcast_tensor`,
    :meth:`Comm.isend`, :meth:`Comm.irecv`). :meth:`wait` raises :class:`CollectiveError` when it
    failed; the tensor is not to be touched before then."""

    __slots__ = ("_comm", "_work", "_op")

    def __init__(self, comm: "Comm", work: Any, op: Tuple[str, int, int, torch.Tensor]) -> None:
        self._comm, self._work, self._op = comm, work, op  # op: described only if it fails

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return (or raise) at once."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()
            except _TORCH_ERRORS as e:
                raise self._comm._failed(_tensor_op(*self._op), e) from e


def _tensor_op(kind: str, peer: int, tag: int, tensor: torch.Tensor) -> str:
    """How an error names a tensor operation: ``"send of 4096 bytes to rank 1 (tag 7)"``."""
    where = f"to rank {peer}" if kind == "send" else f"from rank {peer}"
    return f"{kind} of {tensor.nbytes} bytes {where}" + ("" if kind == "broadcast" else f" (tag {tag})")


@dataclass(frozen=True)
class Comm:
    """A process group (or none) with this process's rank and the group size."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def backend(self) -> str:
        """The group's backend name as torch gives it (``"gloo"``, ``"nccl"``,
        ``"cpu:gloo,cuda:nccl"``, ...); ``""`` without torch.distributed."""
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        return str(dist.get_backend(self.group))

    def global_rank(self, group_rank: int) -> int:
        if not dist.is_initialized():
            return group_rank
        return dist.get_global_rank(self.group or dist.group.WORLD, group_rank)

    def _failed(self, op: str, e: BaseException) -> CollectiveError:
        """The one mapping of a failed torch collective to :class:`CollectiveError`, naming this
        rank, the operation ``op`` and the group."""
        first = str(e).splitlines()[0] if str(e) else ""
        return CollectiveError(f"rank {self.rank}: {op} over {self._group_text()} failed (a rank may have died "
                               f"or timed out): {type(e).__name__}: {first}")

    @contextmanager
    def _mapped(self, op: str) -> Iterator[None]:
        """Runs an object collective: torch's errors through :meth:`_failed`, ours unchanged."""
        try:
            yield
        except CheckpointingError:
            raise
        except _TORCH_ERRORS as e:
            raise self._failed(op, e) from e

    def _group_text(self) -> str:
        if not dist.is_initialized() or self.group is None or self.group is dist.group.WORLD:
            return f"the world group ({self.size} ranks)"
        try:
            ranks = dist.get_process_group_ranks(self.group)
        except _TORCH_ERRORS:  # the group is gone: its size still says something
            return f"a group of {self.size} ranks"
        return f"a group of {self.size} ranks (global {_ranks_text(ranks)})"

    # -- tensors: in place, no copy; ``tensor`` is contiguous on comm_device(group). Hot paths (a
    # chunk exchange posts one per chunk): no context manager, the op described only on failure.
    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        """Start broadcasting ``tensor`` from group rank ``src`` into every rank's ``tensor``."""
        op = ("broadcast", src, 0, tensor)
        if not self.distributed:
            return Pending(self, None, op)
        try:
            return Pending(self, dist.broadcast(tensor, group_src=src, group=self.group, async_op=True), op)
        except _TORCH_ERRORS as e:
            raise self._failed(_tensor_op(*op), e) from e

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Pending:
        """Start sending ``tensor`` to group rank ``dst`` (matched by ``dst``'s :meth:`irecv` with ``tag``)."""
        op = ("send", dst, tag, tensor)
        try:
            return Pending(self, dist.isend(tensor, group_dst=dst, group=self.group, tag=tag), op)
        except _TORCH_ERRORS as e:
            raise self._failed(_tensor_op(*op), e) from e

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Pending:
        """Start receiving into ``tensor`` what group rank ``src`` sends with ``tag``."""
        op = ("receive", src, tag, tensor)
        try:
            return Pending(self, dist.irecv(tensor, group_src=src, group=self.group, tag=tag), op)
        except _TORCH_ERRORS as e:
            raise self._failed(_tensor_op(*op), e) from e

    # -- picklable objects -------------------------------------------------------------------------
    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order. One exchange when every pickled object fits in
        :data:`SMALL_OBJECT_BYTES` (a save's handshakes and agreements: a few hundred bytes), where
        torch's ``all_gather_object`` always makes two (the sizes, then the padded bytes); a second
        exchange, padded to the largest, carries larger ones."""
        if not self.distributed:
            return [obj]
        with self._mapped("all_gather_object"):
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            device = comm_device(self.group)
            # Built as bytes, read back through memoryviews: a save makes three of these exchanges,
            # and each tensor op on a few hundred bytes costs more than the bytes do
            head = bytearray(_SIZE_BYTES + SMALL_OBJECT_BYTES)
            head[:_SIZE_BYTES] = len(data).to_bytes(_SIZE_BYTES, "little")
            if len(data) <= SMALL_OBJECT_BYTES:
                head[_SIZE_BYTES:_SIZE_BYTES + len(data)] = data
            heads = all_gather_bytes(self.group, self.size, head, device)
            sizes = [int.from_bytes(h[:_SIZE_BYTES], "little") for h in heads]
            if max(sizes) <= SMALL_OBJECT_BYTES:
                return [pickle.loads(h[_SIZE_BYTES:_SIZE_BYTES + n]) for h, n in zip(heads, sizes)]
            padded = bytearray(max(sizes))
            padded[:len(data)] = data
            rest = all_gather_bytes(self.group, self.size, padded, device)
            return [pickle.loads(b[:n]) for b, n in zip(rest, sizes)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast from group rank ``src``."""
        if not self.distributed:
            return obj
        with self._mapped(f"broadcast_object from rank {src}"):
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == src else None
            return pickle.loads(broadcast_bytes(self.group, data, src, comm_device(self.group)))

    def gather_from(self, senders: Sequence[int], obj: Any, dst: int = 0) -> Dict[int, Any]:
        """Collective over ``senders`` and ``dst`` (group ranks): each sender's ``obj`` reaches
        ``dst``, which gets ``{sender: obj}`` (its own included when it is a sender); every other
        rank gets ``{}``. Point to point, so ``dst`` receives what the senders send and no more
        (``gather_object`` would pad every rank's part, senders or not, to the largest)."""
        if self.rank == dst:
            out: Dict[int, Any] = {}
            for src in senders:
                if src == dst:
                    out[src] = obj
                    continue
                with self._mapped(f"recv_object_list from rank {src}"):
                    out[src] = pickle.loads(recv_bytes(self.group, src, comm_device(self.group)))
            return out
        if self.rank in senders:
            with self._mapped(f"send_object_list to rank {dst}"):
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                send_bytes(self.group, data, dst, comm_device(self.group))
        return {}

    def scatter_object(self, parts: Optional[List[Any]], src: int = 0) -> Any:
        """Collective: group rank ``src`` passes one object per rank (``parts``; the others pass
        None) and each rank gets its own. Every rank receives as many bytes as the largest part."""
        if not self.distributed:
            return None if parts is None else parts[0]
        with self._mapped(f"scatter_object from rank {src}"):
            data = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in parts] \
                if self.rank == src and parts is not None else None
            return pickle.loads(scatter_bytes(self.group, self.rank, data, src, comm_device(self.group)))

    def agree(self, what: str, error: Optional[BaseException] = None, payload: Any = None, *,
              default: Type[CheckpointingError] = CheckpointingError) -> List[Any]:
        """Collective: every rank reports its outcome (``error``, or None for success, plus a
        ``payload``); returns every rank's payload, in rank order, when all succeeded.

        When any rank failed, every rank raises one error naming each failing rank with its
        message, followed by the first other failing rank's traceback and where the rest raised
        theirs; ``failures`` maps those ranks to :class:`RankFailure` (with its traceback). Its type
        is the failing ranks' library error type when they all raised the same one, else ``default``.
        """
        mine = None
        if error is not None:
            f = RankFailure.of(self.rank, error)
            mine = (f.type_name, f.message, f.traceback)  # plain strings travel, not our classes
        gathered: List[Tuple[Optional[Tuple[str, str, str]], Any]] = self.all_gather_object((mine, payload))
        failures = {rk: RankFailure(rk, *o) for rk, (o, _) in enumerate(gathered) if o is not None}
        if failures:
            raise _agreed_error(what, failures, default, self.rank) from error
        return [p for _, p in gathered]

    def barrier(self) -> None:
        if self.distributed:
            # An all_reduce rather than dist.barrier: it works the same on every backend and fails
            # with the group's timeout when a rank is gone.
            with self._mapped("barrier"):
                flag = torch.zeros(1, device=comm_device(self.group))
                released(lambda: dist.all_reduce(flag, group=self.group), [flag])

    def close_connections(self, device: torch.device) -> bool:
        """Break this rank's connections in the group, as the group's timeout would, at once: every rank
        waiting on this one in a message over ``device`` fails now (:class:`CollectiveError`), and so does every
        later collective of this rank's over the group. For a rank that cannot take its part in messages it
        owes (no memory for them) and would otherwise leave its partners waiting until the timeout.

        Gloo only (CPU messages): gloo's ``abort`` does nothing, but a receive whose wait times out closes the
        connections of its gloo context ("Application timeout caused pair closure"); so one receive that
        nothing matches (a tag no op uses) is waited on for a millisecond, in each of the group's contexts.
        Returns whether the connections were closed (False elsewhere: the partners wait for the timeout)."""
        if not self.distributed or device.type != "cpu":
            return False
        try:
            backend = (self.group or dist.group.WORLD)._get_backend(device)
        except _TORCH_ERRORS:
            return False
        if not isinstance(backend, dist.ProcessGroupGloo):
            return False
        contexts = max(1, len(getattr(backend.options, "devices", ()) or ()))  # a tag picks context tag % count
        closed = True
        for k in range(contexts):
            work = dist.irecv(torch.empty(1, dtype=torch.uint8), group_src=(self.rank + 1) % self.size,
                              group=self.group, tag=_CLOSING_TAG - k)
            try:
                work.wait(timedelta(milliseconds=1))
                closed = False  # matched: cannot be (no op uses the tag)
            except _TORCH_ERRORS:
                pass  # the timeout, as intended: the context's connections are closed
        return closed


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
        # init_process_group() without a backend (as init_device_mesh("cpu", ...) calls it) is "undefined",
        # configured per device ("cpu:gloo"): CPU tensors go to the CPU backend.
        if "cpu:" in str(dist.get_backend_config(group)).lower():
            return torch.device("cpu")
        raise ArgumentError(f"process group backend {backend!r} needs an accelerator, but none is available")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[timedelta]:
    """The timeout ``group``'s (default: the world's) collectives run under, as ``init_process_group``
    was given it; None where torch does not say (``new_group`` then uses its own default)."""
    try:
        pg = group if group is not None else dist.group.WORLD
        backend = pg._get_backend(comm_device(group))  # torch keeps a group's timeout in its backend's options
        timeout = backend.options._timeout
    except Exception:  # private API: any torch that lacks it gets torch's default, as before
        return None
    return timeout if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None


def new_gloo_group(ranks: Optional[List[int]] = None) -> dist.ProcessGroup:
    """Collective over the world (as ``dist.new_group``): a gloo group over ``ranks`` (None: every rank)
    for the library's background work, with the world's timeout, so a dead rank fails it when it fails
    the caller's own collectives (``new_group`` alone would wait torch's default 30 minutes)."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=group_timeout())


def get_comm(process_group: Optional[dist.ProcessGroup] = None) -> Comm:
    """The Comm for ``process_group`` (default: the world group; none when not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ArgumentError("a process_group was given but torch.distributed is not initialized")
        return Comm(None, 0, 1)
    return Comm(process_group, dist.get_rank(process_group), dist.get_world_size(process_group))


def _agreed_error(what: str, failures: Dict[int, RankFailure], default: Type[CheckpointingError],
                  me: int) -> CheckpointingError:
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
    # Another rank's traceback is shown where it tells this rank something: an unexpected error (not
    # one of ours, whose messages say what and where), unlike this rank's own failure (whose
    # traceback is this error's __cause__). Every traceback stays in ``failures``.
    own = failures.get(me)
    others = [f for f in failures.values()
              if f.rank != me and error_class(f.type_name) is None
              and (own is None or (f.type_name, f.message) != (own.type_name, own.message))]
    err = cls(f"{what}: " + "; ".join(lines) + _tracebacks(others))
    err.failures = dict(failures)
    return err


def _tracebacks(remote: List[RankFailure]) -> str:
    """The first of the ``remote`` failures' tracebacks in full, the others' raise sites (this
    rank's own traceback is the raised error's ``__cause__``). A traceback without a frame (an
    error built, not raised, e.g. by a pre-check) says nothing its message did not: left out."""
    remote = [f for f in remote if f.raised_at]
    if not remote:
        return ""
    first = remote[0]
    text = f"{TRACEBACK_SECTION}{first.rank} ---\n{first.traceback.rstrip()}"
    sites: Dict[str, List[int]] = {}
    for f in remote[1:]:
        sites.setdefault(f.raised_at or "(no frame)", []).append(f.rank)
    if sites:
        text += "\n--- the other failing ranks raised at: " + "; ".join(
            f"{_ranks_text(ranks)}: {site}" for site, ranks in sites.items())
    return text


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
