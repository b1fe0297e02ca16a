"""Host staging of an async save: which of a rank's shards are snapshotted for the background
write (all of them, or as many as fit a byte budget), and the reused pool they are copied into.

With no budget (or a state that fits it) every shard is copied into the pool and written in the
background: the caller is blocked only for the copy. With ``max_staging_bytes`` smaller than the
rank's state, the save goes in *waves*: the caller may change its tensors as soon as ``save``
returns, so everything that is not in the last (staged, background) wave must be written before
``save`` returns. The budget trades the caller's blocking time for host memory:

* the last wave: the largest shards that fit the budget together, copied into the pool and
  written in the background;
* CPU shards left over: written before ``save`` returns straight from their own memory (as a
  synchronous save does: no copy, no staging);
* accelerator shards left over: copied to the host pool one wave (at most the budget) at a time,
  each wave written before the next reuses the pool.

The budget bounds all the host memory the save adds, not only the pool: ``writer_bytes`` of it
(:data:`WRITER_BYTES` by default) are left to the writer's own buffers, which a synchronous save
takes too (tensorstore's and the packs' buffers, the writing threads' malloc arenas: 6 to 17 MiB
measured on a 2-vCPU VM, ``benchmarks/bench_async.py --budgets``); the pool gets the rest.

A shard is written whole by one write, so one larger than the pool's share cannot be staged: on a
CPU it is written in place; on an accelerator it is refused (:class:`ArgumentError`, naming it).
Small shards packed into one array per dtype (``ShardWrite.packed``) are written by one write
call, so they move together, as one unit.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..core.errors import ArgumentError
from ..storage import direct_write
from ..storage.base import ShardWrite
from .save import LocalWrite, PreparedSave, write_local
from .stats import format_bytes

ALIGN = 64  # each staged shard starts on a cache line (and on its dtype's alignment)
# Shards that may be written with O_DIRECT start on a page, and so does the pool: their chunk files
# then go straight from the pool (storage/direct_write.py), which wants page-aligned memory.
PAGE, PAGE_ALIGNED_FROM = direct_write.ALIGN, direct_write.MIN_DIRECT_BYTES

BufferKey = Tuple[str, int, Tuple[int, ...], torch.dtype]

WRITER_BYTES = 32 << 20  # of a staging budget, what is left to the writer's buffers (module docstring)


class StagingPlan(NamedTuple):
    """How one rank's shards are written by an async save (see the module docstring)."""

    in_place: List[ShardWrite]  # CPU shards written before save returns, from their own memory
    device_waves: List[List[ShardWrite]]  # accelerator shards written before save returns, via the pool
    staged: List[ShardWrite]  # the last wave: snapshotted into the pool, written in the background

    @property
    def pool_bytes(self) -> int:
        """The staging pool this plan needs: its largest wave that goes through the pool."""
        return max((sum(_aligned(_nbytes(w)) for w in wave) for wave in [*self.device_waves, self.staged]), default=0)

    @property
    def pinned(self) -> bool:
        """Whether any shard it stages is on an accelerator (pinned staging where asked)."""
        # not for meta (no data): its copy fails as a synchronous save's, not on pinned memory a CPU host lacks
        return any(w.data.device.type not in ("cpu", "meta") for wave in [*self.device_waves, self.staged]
                   for w in wave)

    @property
    def waves(self) -> int:
        """Write calls of the save: the synchronous ones and the background one."""
        return (1 if self.in_place else 0) + len(self.device_waves) + 1


def _aligned(n: int) -> int:
    """Pool bytes a shard of ``n`` bytes may take: its bytes to the next cache line, and for a
    page-aligned one the gap before its page."""
    return -(-n // ALIGN) * ALIGN + (PAGE if n >= PAGE_ALIGNED_FROM else 0)


def _page_aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory starting on a page (torch's allocator gives 64-byte alignment)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    shift = -raw.data_ptr() % PAGE
    return raw[shift:shift + nbytes]  # a view: the storage (and its pinning) is kept


def _nbytes(w: ShardWrite) -> int:
    return w.data.numel() * w.data.element_size()


def _units(tensors: Sequence[ShardWrite]) -> List[List[ShardWrite]]:
    """Shards that must be written by one call together: each array shard alone, packed ones as one."""
    packed = [w for w in tensors if w.packed is not None]
    return [[w] for w in tensors if w.packed is None] + ([packed] if packed else [])


def _unit_bytes(unit: Sequence[ShardWrite]) -> int:
    return sum(_aligned(_nbytes(w)) for w in unit)


def _on_device(unit: Sequence[ShardWrite]) -> bool:
    return any(w.data.device.type != "cpu" for w in unit)


def pool_share(budget: Optional[int], writer_bytes: int) -> Optional[int]:
    """What the staging pool may take of ``budget`` (None: no limit) when ``writer_bytes`` of it
    are left to the writer."""
    return None if budget is None else max(0, budget - writer_bytes)


def plan_staging(tensors: Sequence[ShardWrite], max_staging_bytes: Optional[int],
                 writer_bytes: int = 0) -> StagingPlan:
    """Split a rank's shards into waves under ``max_staging_bytes`` (None: no limit), of which
    ``writer_bytes`` are not the pool's."""
    units = _units(tensors)
    budget = pool_share(max_staging_bytes, writer_bytes)
    if budget is None or sum(_unit_bytes(u) for u in units) <= budget:
        return StagingPlan([], [], list(tensors))
    staged: List[ShardWrite] = []
    left: List[List[ShardWrite]] = []
    room = budget
    for unit in sorted(units, key=_unit_bytes, reverse=True):  # the largest that fit go to the background
        if _unit_bytes(unit) <= room:
            staged += unit
            room -= _unit_bytes(unit)
        else:
            left.append(unit)
    in_place = [w for u in left if not _on_device(u) for w in u]
    waves: List[List[ShardWrite]] = []
    rooms: List[int] = []
    for unit in (u for u in left if _on_device(u)):  # first fit, largest first: few waves
        size = _unit_bytes(unit)
        if size > budget:
            w = max(unit, key=_nbytes)
            what = f"shard {w.key!r} (stored index {w.index}) on {w.data.device} is {_nbytes(w)} bytes" \
                if w.packed is None else f"the {len(unit)} small shards packed with {w.key!r} on {w.data.device} " \
                f"are {sum(_nbytes(x) for x in unit)} bytes"
            left_out = f", {writer_bytes} of them left to the writer" if writer_bytes else ""
            raise ArgumentError(f"max_staging_bytes={max_staging_bytes}{left_out}: {what}, more than the budget allows "
                                f"(a shard is written whole, in one wave); raise max_staging_bytes to at least "
                                f"{size + writer_bytes}")
        slot = next((i for i, r in enumerate(rooms) if r >= size), None)
        if slot is None:
            waves.append([])
            rooms.append(budget)
            slot = len(waves) - 1
        waves[slot] += unit
        rooms[slot] -= size
    return StagingPlan(in_place, waves, staged)


class StagingPool:
    """One flat host buffer (pinned when it stages accelerator tensors) that shards are copied into,
    as views at aligned offsets; reused by the next wave and the next save while it is large enough
    (released and reallocated when a save needs more, or less than half of it)."""

    def __init__(self, pin_memory: Optional[bool] = None) -> None:
        self.pin_memory = pin_memory
        self._pool: Optional[torch.Tensor] = None
        self.peak_bytes = 0  # the largest pool this saver held: what staging cost in host memory
        self.views: Dict[BufferKey, torch.Tensor] = {}  # the last staged wave, by (key, index, shape, dtype)
        # the last placement: (its pool, its shards' (key, index, shape, dtype) in order, their buffers). The
        # next save of the same layout takes the same buffers: three tensor ops per shard (slice, two views)
        # were most of a background snapshot's time in ``save`` (about 5 ms of 10 for 440 shards)
        self._placement: Optional[Tuple[torch.Tensor, List[BufferKey], List[torch.Tensor]]] = None
        self._touching: Optional[threading.Thread] = None  # reserve()'s first touch of the pool

    @property
    def nbytes(self) -> int:
        return 0 if self._pool is None else self._pool.numel()

    def release(self) -> None:
        self._settle()
        self._pool, self.views, self._placement = None, {}, None  # (the views would keep the pool alive)

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Allocate the pool ahead of the first save (``nbytes``: the expected size of a save's
        largest wave) and touch its pages on a thread of its own: the first save's copy otherwise
        pays the kernel's page faults and zeroing (on a loaded host several times the copy itself).
        The save uses it when :meth:`prepare` finds it the right size; no-op when a pool exists."""
        if self._pool is not None or nbytes <= 0:
            return
        self._pool = _page_aligned_empty(nbytes, pin)
        self.peak_bytes = max(self.peak_bytes, nbytes)
        # zero_ releases the GIL: the training thread runs on meanwhile
        self._touching = threading.Thread(target=self._pool.zero_, name="distckpt-staging-touch", daemon=True)
        self._touching.start()

    def _settle(self) -> None:
        """Wait for :meth:`reserve`'s touch (the pool is written by that thread until then)."""
        if self._touching is not None:
            self._touching.join()
            self._touching = None

    def prepare(self, plan: StagingPlan) -> None:
        """Size the pool for ``plan``'s largest wave (kept when it fits and is at most twice that)."""
        self._settle()
        nbytes = plan.pool_bytes
        pin = plan.pinned and (self.pin_memory if self.pin_memory is not None else True)
        pool = self._pool
        if pool is not None and nbytes <= pool.numel() <= 2 * nbytes and pool.is_pinned() == pin:
            return
        self.release()  # the old pool goes first: never two at once
        if nbytes:
            self._pool = _page_aligned_empty(nbytes, pin)
            self.peak_bytes = max(self.peak_bytes, nbytes)

    def place(self, tensors: Sequence[ShardWrite]) -> List[Tuple[ShardWrite, torch.Tensor]]:
        """Lay ``tensors`` (one wave of the plan :meth:`prepare` sized the pool for) out in the pool,
        copying nothing: each as it will be written (pointing at its buffer) with its source."""
        pool = self._pool
        keys = [(w.key, w.index, w.data.shape, w.data.dtype) for w in tensors]
        last = self._placement
        if last is not None and last[0] is pool and last[1] == keys:  # the same layout in the same pool
            bufs = last[2]
        else:
            bufs = self._lay_out(tensors)
            self._placement = (pool, keys, bufs) if pool is not None else None
            self.views = dict(zip(keys, bufs))
        return [(w._replace(data=buf), w.data) for w, buf in zip(tensors, bufs)]

    def _lay_out(self, tensors: Sequence[ShardWrite]) -> List[torch.Tensor]:
        """Each shard's buffer: a view of the pool at the next aligned offset."""
        pool = self._pool
        bufs, off = [], 0
        for w in tensors:
            data, n = w.data, _nbytes(w)
            off = -(-off // PAGE) * PAGE if n >= PAGE_ALIGNED_FROM else off
            if n == 0:  # no bytes to stage; a wave of only empty shards has no pool at all
                bufs.append(torch.empty(data.shape, dtype=data.dtype))
            else:
                assert pool is not None and off + n <= pool.numel(), "StagingPool.prepare sized the pool for the plan"
                bufs.append(pool[off:off + n].view(data.dtype).view(data.shape))
            off += -(-n // ALIGN) * ALIGN
        return bufs

    def stage(self, tensors: Sequence[ShardWrite]) -> List[ShardWrite]:
        """Copy ``tensors`` (one wave of the plan) into the pool; returns them pointing at their
        copies. Device copies are synchronized before it returns (the caller may change the state
        right after)."""
        placed = self.place(tensors)
        copy_in(placed)
        return [w for w, _ in placed]


def write_before_return(prep: PreparedSave, plan: StagingPlan, pool: StagingPool) -> Optional[LocalWrite]:
    """The waves that do not fit the staging budget, written now (the caller may change its
    tensors once save returns): CPU shards from their own memory, accelerator shards through
    the staging pool, one wave at a time. None when everything fits the budget."""
    if not plan.in_place and not plan.device_waves:
        return None
    alone = replace(prep, objects=[], common=None)  # objects and common.pt go with the last wave
    parts = [write_local(replace(alone, tensors=plan.in_place))] if plan.in_place else []
    for wave in plan.device_waves:
        parts.append(write_local(replace(alone, tensors=pool.stage(wave))))
    return LocalWrite(sum(p.nbytes for p in parts), sum(p.seconds for p in parts))


def ready_events(sources: Sequence[torch.Tensor]) -> Dict[torch.device, Any]:
    """On the thread that computes the state: a CUDA event per device of ``sources``, recorded on
    that thread's current stream, after which a copy on another stream sees the values as of now."""
    events = {}
    for device in {t.device for t in sources if t.device.type == "cuda"}:
        events[device] = torch.cuda.current_stream(device).record_event()
    return events


@torch.no_grad()  # a parameter's copy must not join its autograd graph (a node per shard, the pool held)
def copy_in(placed: Sequence[Tuple[ShardWrite, torch.Tensor]], ready: Optional[Dict[torch.device, Any]] = None) -> None:
    """Copy each source into its buffer (:meth:`StagingPool.place`); device copies have landed
    when it returns. With ``ready`` (:func:`ready_events`, from a background snapshot's caller),
    CUDA copies go on a stream of their own that first waits for that event, so they overlap the
    computation the caller queues meanwhile instead of waiting behind it."""
    streams: Dict[torch.device, Any] = {}
    devices = set()
    for w, data in placed:
        device = data.device
        on_device = device.type != "cpu"
        if ready is not None and device in ready and device not in streams:
            streams[device] = torch.cuda.Stream(device)
            streams[device].wait_event(ready[device])
        if device in streams:
            data.record_stream(streams[device])  # its memory is not reused before this stream is done with it
            with torch.cuda.stream(streams[device]):
                w.data.copy_(data, non_blocking=w.data.is_pinned())
        else:
            w.data.copy_(data, non_blocking=on_device and w.data.is_pinned())
        if on_device:
            devices.add(device)
    for device in devices:  # the copies must have landed before the caller may change the state
        if device in streams:
            streams[device].synchronize()
        else:
            torch.accelerator.synchronize(device)


def describe(plan: StagingPlan, budget: Optional[int]) -> str:
    """One line for the log: waves, and bytes written in place, via the pool, and in the background."""
    sync = sum(_nbytes(w) for w in plan.in_place) + sum(_nbytes(w) for wave in plan.device_waves for w in wave)
    staged = sum(_nbytes(w) for w in plan.staged)
    if not sync:
        return f"1 wave, {format_bytes(staged)} staged"
    return (f"{plan.waves} waves under max_staging_bytes={format_bytes(budget or 0)}: {format_bytes(sync)} written "
            f"before returning ({len(plan.device_waves)} staged wave(s) from accelerators), "
            f"{format_bytes(staged)} staged for the background")
