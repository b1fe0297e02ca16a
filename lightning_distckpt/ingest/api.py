"""Rank 0 holds the whole state dict; every rank ends with its own shards.

The protocol, the same on every rank of the default process group:

1. every rank checks its ``meta_sharded_state_dict`` and the ranks agree (``Comm.agree``): a bad
   entry anywhere fails every rank before anything else;
2. rank 0 checks each asked-for key against its state dict (present, same shape, dtype of the
   same kind) and decides the broadcasts (:func:`~.plan.build_manifest`); it broadcasts that
   manifest, or the error, to every rank, so a missing key or a wrong shape fails every rank
   with the same message before any data moves;
3. the boxes move (:class:`~.transfer.Transfer`) and each rank cuts its shards;
4. the ranks agree once more, on any error of step 3, and only then fill ``sharded_state_dict``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AbstractSet, Any, Mapping, MutableMapping, Optional, Tuple, Union

import torch

from ..comm import Comm, comm_device, get_comm
from ..core.errors import ArgumentError, ArgumentTypeError, CheckpointingError, RankFailure, error_class
from .plan import Manifest, build_manifest, collect_needs
from .transfer import Transfer, TransferStats

logger = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
DEFAULT_BUCKET_BYTES = 256 << 10


@dataclass(frozen=True)
class ShardOptions:
    """How the shards move.

    Args:
        max_inflight_bytes: bound on the bytes of broadcasts posted and not finished at once, on
            every rank; rank 0's buffers and the others' receive buffers stay within it (a single
            box larger than the bound goes alone).
        bucket_bytes: tensors smaller than this share broadcasts of up to this many bytes.
    """

    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        for name in ("max_inflight_bytes", "bucket_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ArgumentError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ShardResult:
    """What a transfer did. No public function returns one yet (the two above return None,
    :class:`DistModule` Lightning-style incompatible keys): in ``__all__`` for compatibility only.

    Attributes:
        missing: keys rank 0 lacked (when allowed).
        unexpected: rank 0's keys nobody asked for.
        sent_bytes: the bytes broadcast.
        whole_bytes: what broadcasting whole tensors would have sent.
        stats: this rank's account of the transfer.
    """

    missing: Tuple[str, ...]
    unexpected: Tuple[str, ...]
    sent_bytes: int
    whole_bytes: int
    stats: TransferStats


def broadcast_and_shard_state_dict(state_dict: Mapping[str, Any], meta_sharded_state_dict: Mapping[str, Any],
                                   sharded_state_dict: MutableMapping[str, Any], *,
                                   max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Rank 0: broadcast what the other ranks need of ``state_dict`` and cut rank 0's own shards.

    Collective over the default process group; the other ranks call
    :func:`shard_broadcasted_state_dict` at the same time. ``meta_sharded_state_dict`` maps names
    to :class:`~lightning_distckpt.ShardedTensor` s (their ``data`` may be on the meta device;
    plain tensors are loaded whole); the source of an entry is ``state_dict[entry.key]``.
    Each entry's shard, materialized in the entry's dtype (converted within floating or within
    integer dtypes) on the entry's device (the communication device for meta entries), is stored
    under the entry's name in ``sharded_state_dict``, ready for
    ``module.load_state_dict(sharded_state_dict, assign=True)``. ``max_inflight_bytes`` and
    ``bucket_bytes`` (positive ints, the same on every rank): see :class:`ShardOptions`.

    Raises:
        ArgumentError: (a ``ValueError``) on every rank, in the first collective, when a rank but 0
            calls it (the others are not left waiting for that rank), or an option is not a positive int.
        MissingKeysError, ShardingError, FormatError: on every rank, before data moves, when a
            key is not in ``state_dict``, a shape or dtype does not fit an entry, or a value is not
            a tensor.
    """
    comm = get_comm()
    error = _wrong_side(comm, "broadcast_and_shard_state_dict", rank0=True)
    if error is None and not isinstance(state_dict, Mapping):
        error = ArgumentTypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    options, error = _options(max_inflight_bytes, bucket_bytes, error)
    shard_from_rank0(comm, state_dict, meta_sharded_state_dict, sharded_state_dict, options, error=error)


def shard_broadcasted_state_dict(meta_sharded_state_dict: Mapping[str, Any],
                                 sharded_state_dict: MutableMapping[str, Any],
                                 *, max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Every rank but 0: receive what rank 0 broadcasts and store this rank's shards in
    ``sharded_state_dict`` (see :func:`broadcast_and_shard_state_dict`, which rank 0 calls, for
    ``meta_sharded_state_dict``, ``max_inflight_bytes`` and ``bucket_bytes``).

    Raises:
        ArgumentError: (a ``ValueError``) on every rank, in the first collective, when rank 0 calls it.
    """
    comm = get_comm()
    options, error = _options(max_inflight_bytes, bucket_bytes,
                              _wrong_side(comm, "shard_broadcasted_state_dict", rank0=False))
    shard_from_rank0(comm, None, meta_sharded_state_dict, sharded_state_dict, options, error=error)


def _wrong_side(comm: Comm, what: str, rank0: bool) -> Optional[ArgumentError]:
    """The error of a call on the wrong side, for the first collective: raised alone, it left the other
    ranks waiting there until the group's timeout (a rank testing its local rank instead of the global one)."""
    if rank0 and comm.rank != 0:
        return ArgumentError(f"{what} runs on global rank 0 only; rank {comm.rank} must call "
                             f"shard_broadcasted_state_dict(meta_sharded_state_dict, sharded_state_dict) "
                             f"(test torch.distributed.get_rank(), the global rank, not the local one)")
    if not rank0 and comm.rank == 0:
        return ArgumentError(f"{what} runs on the ranks other than 0; rank 0 holds the state dict and must call "
                             f"broadcast_and_shard_state_dict(state_dict, meta_sharded_state_dict, sharded_state_dict)")
    return None


def _options(max_inflight_bytes: int, bucket_bytes: int,
             error: Optional[BaseException]) -> Tuple[ShardOptions, Optional[BaseException]]:
    """The options, and the first error (``error``, else a bad option's): reported in the first collective."""
    try:
        return ShardOptions(max_inflight_bytes, bucket_bytes), error
    except ArgumentError as e:
        return ShardOptions(), error or e


def shard_from_rank0(comm: Comm, state_dict: Optional[Mapping[str, Any]], meta_sharded_state_dict: Mapping[str, Any],
                     sharded_state_dict: MutableMapping[str, Any], options: ShardOptions, *,
                     missing_ok: Union[bool, AbstractSet[str]] = False, unexpected_ok: bool = True,
                     error: Optional[BaseException] = None) -> ShardResult:
    """The collective behind both sides (``state_dict`` on rank 0, ``None`` elsewhere). With
    ``missing_ok`` keys rank 0 lacks are skipped (and listed in the result) instead of refused;
    without ``unexpected_ok`` keys of rank 0's state dict that no entry asks for are refused (both
    before any data moves). ``error``: what this rank's caller found wrong with its arguments: every
    rank raises it in the first collective, before anything else."""
    needs: list = []
    on_gpu = False
    try:
        if error is not None:
            raise error
        if not isinstance(sharded_state_dict, MutableMapping):
            raise ArgumentTypeError(
                f"sharded_state_dict must be a dict to store the shards in, got {type(sharded_state_dict).__name__}")
        needs = collect_needs(meta_sharded_state_dict, comm.rank)
        on_gpu = any(d.type == "cuda" for d in map(_own_device, meta_sharded_state_dict.values()) if d is not None)
    except Exception as e:  # reported in the collective every rank is in: none waits for a rank that left
        error = e
    gathered = comm.agree("sharding from rank 0: checking the sharded state dicts", error, payload=(needs, on_gpu),
                          default=ArgumentError)
    device = _communication_device(comm, any(gpu for _, gpu in gathered))
    devices = {name: _own_device(entry) or device for name, entry in meta_sharded_state_dict.items()}
    manifest: Optional[Manifest] = None
    if state_dict is not None:
        manifest = _rank0_manifest(state_dict, [n for part, _ in gathered for n in part], options, missing_ok,
                                   unexpected_ok)
    manifest = comm.broadcast_object(manifest)
    if manifest.error is not None:
        raise _manifest_error(manifest)
    transfer = Transfer(comm, manifest, needs, devices, device, options.max_inflight_bytes, source=state_dict)
    comm.agree(f"sharding {manifest.source} from rank 0", _room_for(manifest, device))
    transfer.run()
    failed = CheckpointingError("; ".join(transfer.errors[:3])) if transfer.errors else None
    comm.agree(f"sharding {manifest.source} from rank 0", failed)
    sharded_state_dict.update(transfer.shards)
    if comm.rank == 0:
        logger.info("sharded %s over %d ranks: %d broadcasts, %.1f MB (whole tensors: %.1f MB) in %.2f s",
                    manifest.source, comm.size, transfer.stats.ops, manifest.sent_bytes / 1e6,
                    manifest.whole_bytes / 1e6, transfer.stats.seconds)
    return ShardResult(manifest.missing, manifest.unexpected, manifest.sent_bytes, manifest.whole_bytes, transfer.stats)


def _room_for(manifest: Manifest, device: torch.device) -> Optional[CheckpointingError]:
    """The largest broadcast's buffer allocated and freed: a rank without room even for it fails every
    rank here, before any broadcast (in the middle of them, the others would wait for it until the
    group's timeout)."""
    op = max(manifest.ops, key=lambda o: o.nbytes, default=None)
    try:
        if op is not None:
            torch.empty(op.nbytes, dtype=torch.uint8, device=device)
    except Exception as e:  # torch's OutOfMemoryError; a RuntimeError on the CPU ("can't allocate memory")
        keys = ", ".join(repr(i.key) for i in op.items[:3]) + (" ..." if len(op.items) > 3 else "")
        return CheckpointingError(f"allocating {op.nbytes / 2**20:.1f} MiB on {device} for the broadcast of {keys} "
                                  f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
    return None


def _rank0_manifest(state_dict: Mapping[str, Any], needs: list, options: ShardOptions,
                    missing_ok: Union[bool, AbstractSet[str]], unexpected_ok: bool) -> Manifest:
    """Rank 0's manifest; any failure in deciding it travels in it (the other ranks are already
    waiting for its broadcast: an error raised here alone would leave them waiting until the
    collective timeout)."""
    try:
        return build_manifest(state_dict, needs, bucket_bytes=options.bucket_bytes, missing_ok=missing_ok,
                              unexpected_ok=unexpected_ok)
    except Exception as e:  # build_manifest returns the library's own errors: this is anything else
        return Manifest("rank 0's state dict", error=("CheckpointingError", f"{type(e).__name__}: {e}"[:2000]))


def _own_device(entry: Any) -> Optional[torch.device]:
    """The device of an entry's data; ``None`` for meta entries (their shards go to the
    communication device)."""
    data = entry if isinstance(entry, torch.Tensor) else entry.data
    if data is None or data.device.type == "meta":
        return None
    return data.device


def _communication_device(comm: Comm, model_on_gpu: bool) -> torch.device:
    """The group backend's device; with a group that has both gloo and NCCL, the GPU when any
    rank's model is there (decided from the agreed payloads, so the same on every rank)."""
    device = comm_device(comm.group)
    if device.type == "cpu" and model_on_gpu and "nccl" in comm.backend:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _manifest_error(manifest: Manifest) -> CheckpointingError:
    """Rank 0's error, as the same error type and message on every rank."""
    assert manifest.error is not None
    type_name, message = manifest.error
    err = (error_class(type_name) or CheckpointingError)(message)
    err.failures = {0: RankFailure(0, type_name, message)}
    return err
