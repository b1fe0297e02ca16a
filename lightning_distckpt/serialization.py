"""Public entry points: ``save`` and ``load`` (collective), and single-process readers."""

from __future__ import annotations

import functools
import math
import os
import time
from enum import Enum
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .comm import get_comm
from .core.errors import ArgumentError, ArgumentTypeError
from .core.gc_pause import gc_paused
from .core.arguments import require, require_bool, require_globals, require_key_map, require_state_dict
from .core.plain_tensors import shard_tensors, tree_to_save
from .core.megatron_args import async_flag, check_strategy, content_metadata_of, with_content_metadata
from .core.megatron_leaves import from_megatron_leaves
from .core.mapping import ShardedObject, ShardedTensor
from .core.strict import StrictHandling
from .planning.flat_plan import is_flattened
from .planning.load_plan import SAME_KIND, parse_cast
from .planning.metadata import dtype_from_name
from .reading.access_integrity import check_access_integrity
from .reading.checkpoint import TemplateOnly, open_checkpoint
from .reading.shared_source import SharedCopy
from .reading.formats import KeyMap
from .reading.formats.megatron import unique_key
from .reading.loaders import Loader, resolve_loader
from .reading.pipeline import located, with_cast
from .reading.plain import check_plain_loadable
from .reading.plain_tensors import common_with_plain_tensors
from .reading.reads import read_tensors
from .storage.paths import checkpoint_location
from .storage.store import CheckpointStore
from .storage.stores import SaveTarget, save_target
from .storage.tensorstore_io import StorageOptions
from .saving.async_save import AsyncSaver, AsyncSaveRequest
from .saving.background_snapshot import Selector
from .saving.stats import log_throughput
from .saving.save import SavePlanCache, prepare_save, write_and_commit

PathLike = Union[str, "os.PathLike[str]"]


def save(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: SaveTarget,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Any = None,
    content_metadata: Optional[dict] = None,
    balance_writes: bool = True,
    storage: Optional[StorageOptions] = None,
    async_save: Union[bool, AsyncSaver] = False,
    plan_cache: Optional[SavePlanCache] = None,
    background_snapshot: Selector = False,
) -> Optional[AsyncSaveRequest]:
    """Save a sharded state dict to ``checkpoint_dir`` (collective over ``process_group``; docs/core.md).

    Each unique shard is written once, by one of the ranks holding it; the common (non-sharded) state by
    rank 0. The checkpoint appears at ``checkpoint_dir`` only once every rank has written and fsync'd its
    part; an earlier checkpoint there is replaced atomically and survives any failure of this save.

    Args:
        sharded_state_dict: nested dict of ShardedTensor / ShardedObject / ShardedTensorFactory /
            LocalNonpersistentObject and common values. A DTensor or plain ``torch.Tensor`` leaf is a
            sharded tensor keyed by its tree path (``{"model": {"w": t}}`` -> ``"model/w"``); a plain one
            is replicated: stored once, the same value expected on every rank (as in PyTorch DCP).
        checkpoint_dir: the directory (same path on every rank, shared file system) or ``s3://`` URL, or
            a ``CheckpointStore`` made by the caller (as DCP's ``storage_writer``; its own options).
        sharded_strategy, common_strategy: Megatron-Core's (None, a ``(backend, version)`` tuple or its
            strategy object): accepted so its calls run, and ignored: there is one storage format.
        process_group: the ranks taking part (default: the world; none needed single-process).
        validate_access_integrity: check before writing that the main replicas tile every tensor
            exactly once and that all ranks agree on shapes and dtypes.
        async_sharded_save, preprocess_common_before_consistancy_check, content_metadata: Megatron-Core's:
            ``async_save=True`` by its name; a hook that is checked only; a dict stored in the common
            state under ``"content_metadata"`` (:func:`load_content_metadata`).
        balance_writes: spread replicated shards' writes over their holders (else: the main replica's).
        storage: array layout options (:class:`StorageOptions`).
        async_save: ``True`` or an :class:`AsyncSaver` (reused staging buffers): returns an
            :class:`AsyncSaveRequest` once the state is in host memory; the writes go on in the
            background, committed by the request's ``finalize()`` on every rank.
        plan_cache: a :class:`SavePlanCache` kept across a run's synchronous saves: planning skipped
            while no rank's shards change (an AsyncSaver keeps its own).
        background_snapshot: with ``async_save``, ``True`` or a test of a shard's source tensor: those
            shards are copied by the background thread; leave them unchanged until the request's
            ``wait_snapshot()`` returns (:meth:`AsyncSaver.save`).

    Raises:
        ValidationError, SaveFailedError, CheckpointingError: on every rank alike; an argument of the
        wrong type is an ArgumentTypeError naming it.
    """
    checkpoint_dir, storage = save_target(checkpoint_dir, storage)  # bytes decoded, as load does
    check_strategy(sharded_strategy, "sharded_strategy")
    check_strategy(common_strategy, "common_strategy")
    async_save = async_flag(async_save, async_sharded_save)
    sharded_state_dict = with_content_metadata(sharded_state_dict, content_metadata,
                                               preprocess_common_before_consistancy_check)
    _check_save_arguments(sharded_state_dict, validate_access_integrity, balance_writes, storage, async_save,
                          plan_cache, background_snapshot)
    # Megatron-Core's leaves become ours; DTensor and plain tensor leaves sharded tensors keyed by tree path
    comm = get_comm(process_group)
    sharded_state_dict = tree_to_save(sharded_state_dict, comm.rank, comm.size)
    if async_save:
        saver = async_save if isinstance(async_save, AsyncSaver) else AsyncSaver()
        return saver.save(sharded_state_dict, checkpoint_dir, process_group=process_group,
                          validate_access_integrity=validate_access_integrity, balance_writes=balance_writes,
                          storage=storage, background_snapshot=background_snapshot)
    # Paused over the whole save, not per step: a pause ending while the plan is alive left its records
    # for the collector's next young pass to scan (15-20 ms of a 10,000-key save); here they are freed first.
    with gc_paused():
        write_and_commit(prepare_save(sharded_state_dict, checkpoint_dir, comm,
                                      validate_access_integrity=validate_access_integrity,
                                      balance_writes=balance_writes, options=storage or StorageOptions(),
                                      plan_cache=plan_cache))
    return None


def load(
    sharded_state_dict: Dict[str, Any],
    checkpoint_dir: SaveTarget,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    validate_access_integrity: Optional[bool] = None,
    strict: Union[StrictHandling, str] = StrictHandling.ASSUME_OK_UNEXPECTED,
    extra_safe_globals: Sequence[Any] = (),
    loader: Union[str, Loader, None] = None,
    key_map: KeyMap = None,
    cast: str = SAME_KIND,
    storage: Optional[StorageOptions] = None,
    common: bool = True,
) -> Union[Dict[str, Any], Tuple[Dict[str, Any], set, set]]:
    """Load into the template ``sharded_state_dict`` from ``checkpoint_dir`` (collective; docs/core.md).

    Returns the state dict with each ShardedTensor replaced by its tensor (read straight into its ``data``
    when that is a contiguous CPU tensor), each ShardedObject by its object, each LocalNonpersistentObject
    by its value, factories merged and the common state merged in. The template's sharding may differ
    from the saved one (resharding). A plain tensor of the template is read into itself (keyed by its tree
    path); one stored where the template has no leaf comes back there, whole, on the CPU.

    Args:
        sharded_state_dict: the template, as :func:`save` takes a state dict.
        checkpoint_dir: our checkpoint (path, URL, the ``CheckpointStore`` it was saved through, or a
            ``reading.shared_source.SharedCopy`` of it), or an ordinary file each rank reads its slices
            from: a ``torch.save`` file (keys are ``/``-joined tree paths: ``"state_dict/<name>"``), a
            ``.safetensors`` file or a Hugging Face model directory.
        sharded_strategy, common_strategy: Megatron-Core's, checked and ignored (one storage format).
        validate_access_integrity: True: Megatron-Core's check, before anything is read, that the ranks'
            templates access every shard of each of their tensors exactly once as a main replica (a
            ValidationError on every rank naming the key and the region; reading/access_integrity.py).
            None (default) or False: not checked (a load may ask for any part; every read is checked
            against the checkpoint's index).
        process_group: the ranks taking part (default: the world; none needed single-process).
        strict: a StrictHandling (ours or Megatron-Core's) or its name; RETURN_UNEXPECTED / RETURN_ALL
            return ``(state_dict, missing, unexpected)``.
        extra_safe_globals: further trusted types the common state and objects may contain.
        loader: ``"every_rank"``, ``"parallel"``, ``"two_stage"`` (default: each chunk read once and sent
            to the ranks needing it) or a loader object such as ``TwoStageDataParallelLoader(dp_group)``.
        key_map: an ordinary file's keys to the template's: a dict, or a callable returning None to skip.
        cast: ``"same_kind"`` (default: between floating, integer or complex dtypes; other kinds refused
            before anything is read) or ``"any"`` (as ``Tensor.to``; complex into real refused anyway).
        storage: the reader's :class:`StorageOptions` (``verify``, ``direct_reads``, ``io_concurrency``,
            the S3 endpoint and credentials); the layout is the one the checkpoint records.
        common: False: the template's leaves only, the common state neither read nor merged.

    Raises:
        CheckpointNotFoundError, FormatError, MissingKeysError, ShardingError, CheckpointingError: on
        every rank alike; an argument of the wrong type is an ArgumentTypeError naming it.
    """
    shared = checkpoint_dir if isinstance(checkpoint_dir, SharedCopy) else None
    if shared is None:
        checkpoint_dir = _location(checkpoint_dir)
    elif key_map is not None or storage is not None:
        raise ArgumentError("load: key_map and storage choose how a path is opened; not with a SharedCopy")
    strict = _check_load_arguments(sharded_state_dict, strict, extra_safe_globals, key_map, storage, common, cast,
                                   validate_access_integrity, (sharded_strategy, common_strategy))
    # Megatron-Core's leaves as ours; DTensors and plain tensors loaded back into the template's own
    comm = get_comm(process_group)
    # Opened inside the loader's first collective step, so a rank that cannot open it fails every rank.
    opener: Any = (shared if shared is not None
                   else functools.partial(open_checkpoint, checkpoint_dir, key_map, extra_safe_globals, storage))
    where = shared.path if shared is not None else getattr(checkpoint_dir, "location", checkpoint_dir)
    if validate_access_integrity:  # Megatron-Core's check of the templates, on every rank before anything is read
        check_access_integrity(from_megatron_leaves(sharded_state_dict), comm, str(where))
    sharded_state_dict, opener = _sharded_template(sharded_state_dict, comm, opener)
    if not common:
        opener = _template_only(opener)
    opener = located(with_cast(opener, cast), str(where))  # named alike by every rank when one cannot open it
    state, missing, unexpected = resolve_loader(loader).load(sharded_state_dict, opener, comm, strict,
                                                             extra_safe_globals)
    if strict.returns_keys:
        return state, missing, unexpected
    return state


def _sharded_template(template: Any, comm: Any, opener: Any) -> Tuple[Any, Any]:
    """``template`` with Megatron-Core's leaves as ours and DTensors / plain tensors as sharded tensors, and
    ``opener``. This rank's template alone may be wrong (two leaves giving one key): the others would wait for
    it in the loader's first collective, so the opener raises the error there, on every rank."""
    try:
        return shard_tensors(from_megatron_leaves(template), comm.rank), opener
    except Exception as e:
        if comm.size == 1:
            raise
        return template, functools.partial(_raise, e)


def _raise(error: BaseException) -> Any:
    raise error


def _template_only(opener: Any) -> Any:
    """An opener of ``opener``'s source read for the template's leaves only (``common=False``)."""
    return lambda: TemplateOnly(opener())


def _location(checkpoint_dir: SaveTarget) -> Union[str, CheckpointStore]:
    """Where a load reads: a path or URL normalized by its store, or the store a caller saved through."""
    if isinstance(checkpoint_dir, CheckpointStore):
        return checkpoint_dir
    return checkpoint_location(checkpoint_dir, "checkpoint_dir")


def load_tensors_metadata(checkpoint_dir: SaveTarget, sharded_strategy: Any = None, *,
                          flattened: bool = False) -> Dict[str, ShardedTensor]:
    """key -> ShardedTensor without data, describing the whole saved tensor (global shape, dtype) of
    the checkpoint at ``checkpoint_dir`` (path, URL or store; single process).

    A tensor saved as flattened pieces (``flattened_range``, the distributed-optimizer layout) is
    described as its N-D tensor by default: loading with it gives the N-D tensor. With
    ``flattened=True`` it is described as Megatron-Core 0.12-0.15's ``load_tensors_metadata`` does: the
    same shapes and a ``flattened_range`` covering the whole tensor, so loading with it gives the 1-D
    tensor of all its elements (``(8, 5, 40)`` -> ``(1600,)``). Other tensors are the same either way.
    ``sharded_strategy``: Megatron-Core's, checked and ignored (one storage format).

    Raises:
        CheckpointNotFoundError: nothing at ``checkpoint_dir``. IncompleteCheckpointError: no committed
            checkpoint there. FormatError: the metadata or bytes fail their checks (a checksum, a version).
        ArgumentError: an argument with a value it cannot take (ArgumentTypeError: a type)."""
    check_strategy(sharded_strategy, "sharded_strategy")
    require_bool(flattened, "flattened")
    source = open_checkpoint(_location(checkpoint_dir))
    out = {}
    for key, e in source.index.tensors.items():
        shape = tuple(e.global_shape)
        out[key] = ShardedTensor(
            key=key, data=None, dtype=dtype_from_name(e.dtype, key), local_shape=shape,
            global_shape=shape, global_offset=(0,) * len(shape), axis_fragmentations=(1,) * len(shape),
            flattened_range=slice(0, math.prod(shape)) if flattened and is_flattened(e) else None,
        )
    return out


def load_sharded_metadata(checkpoint_dir: SaveTarget, sharded_strategy: Any = None, common_strategy: Any = None,
                          *, flattened: bool = False) -> Dict[str, Any]:
    """Everything sharded the checkpoint stores, without data, as Megatron-Core's function of this
    name gives it: the tensors of :func:`load_tensors_metadata` under their keys, and each stored
    ShardedObject element under Megatron-Core's unique key ``<key>/shard_<offset>_<global shape>``
    (``"opt/shard_0.3_1.8"``). ``load(load_sharded_metadata(p), p)`` reads the whole checkpoint.
    ``checkpoint_dir``, ``flattened`` and ``sharded_strategy``: as :func:`load_tensors_metadata` takes them;
    ``common_strategy``: Megatron-Core's, checked and ignored (one storage format).

    Raises:
        CheckpointNotFoundError: nothing at ``checkpoint_dir``. IncompleteCheckpointError: no committed
            checkpoint there. FormatError: the metadata or bytes fail their checks (a checksum, a version).
        ArgumentError: an argument with a value it cannot take (ArgumentTypeError: a type)."""
    check_strategy(common_strategy, "common_strategy")  # Megatron-Core's strategies: checked, ignored
    out: Dict[str, Any] = dict(load_tensors_metadata(checkpoint_dir, sharded_strategy, flattened=flattened))
    source = open_checkpoint(_location(checkpoint_dir))
    for key, e in source.index.objects.items():
        for shard in e.shards:
            out[unique_key(key, shard.offset, e.global_shape)] = ShardedObject(
                key, None, tuple(e.global_shape), tuple(shard.offset))
    return out


def load_common_state_dict(checkpoint_dir: SaveTarget, extra_safe_globals: Sequence[Any] = (), *,
                           plain_tensors: bool = True) -> Any:
    """The checkpoint's common (non-sharded) state, read safely (single process), with the plain
    tensors the saved state dict held (stored as replicated tensors by tree path) read whole and
    put back at their places, as they were when they were common state: what ``load({}, path)``
    returns. ``plain_tensors=False``: the common state alone, nothing read but ``common.pt``.
    ``checkpoint_dir``: a path, URL or store; ``extra_safe_globals``: further trusted types the common
    state may hold.

    Raises:
        CheckpointNotFoundError: nothing at ``checkpoint_dir``. IncompleteCheckpointError: no committed
            checkpoint there. FormatError: the metadata or bytes fail their checks (a checksum, a version).
            UnsafeContentError (a FormatError): a type not allowed in the common state.
        ArgumentError: an argument with a value it cannot take (ArgumentTypeError: a type)."""
    checkpoint_dir = _location(checkpoint_dir)
    require_globals(extra_safe_globals)
    require_bool(plain_tensors, "plain_tensors")
    source = open_checkpoint(checkpoint_dir)
    if not plain_tensors:
        return source.load_common(extra_safe_globals)
    return common_with_plain_tensors(source, extra_safe_globals)


def load_content_metadata(checkpoint_dir: Optional[SaveTarget] = None, *,
                          preloaded_state_dict: Optional[Dict[str, Any]] = None) -> Optional[dict]:
    """What ``save(..., content_metadata=)`` stored (None if nothing), as Megatron-Core's function of this
    name: from ``preloaded_state_dict`` (the common state already loaded) or read from ``checkpoint_dir``
    (ArgumentError where neither is given; else raises as :func:`load_common_state_dict`)."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ArgumentError("load_content_metadata: give checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir, plain_tensors=False)
    return content_metadata_of(preloaded_state_dict)


def load_plain_tensors(checkpoint_dir: SaveTarget) -> Dict[str, torch.Tensor]:
    """key -> the whole global tensor of the checkpoint at ``checkpoint_dir`` (path, URL or store),
    assembled from its shards (single process, no group needed); a
    tied key (format 8 ``aliases``) is its target's very tensor, as it was in the saved state.
    Logs one INFO line, as :func:`load` does: bytes, seconds, rate.

    Raises:
        CheckpointNotFoundError: nothing at ``checkpoint_dir``. IncompleteCheckpointError: no committed
            checkpoint there. FormatError: the metadata or bytes fail their checks (a checksum, a version). A tensor
            that cannot be read whole in this process (too large, a malformed index) is a FormatError too.
        ArgumentError: an argument with a value it cannot take (ArgumentTypeError: a type)."""
    started = time.perf_counter()
    source = open_checkpoint(_location(checkpoint_dir))
    check_plain_loadable(source)  # whole tensors are allocated as the index says: check it first
    template = []
    # stored keys only: an alias allocated and read on its own would let a metadata.json of a few bytes per
    # alias make this process hold its target's bytes once per alias (thousands of copies of one stored tensor)
    for key, e in source.index.stored_tensors().items():
        shape, dtype = tuple(e.global_shape), dtype_from_name(e.dtype, key)
        template.append(ShardedTensor(key=key, data=torch.empty(shape, dtype=dtype), dtype=dtype, local_shape=shape,
                                      global_shape=shape, global_offset=(0,) * len(shape)))
    loaded, nbytes = read_tensors(source, template, set())
    seconds = time.perf_counter() - started
    log_throughput("load_plain_tensors", source.path, 0, [(nbytes, seconds)], seconds)  # one INFO line, as load's
    out = {st.key: t for st, t in zip(template, loaded)}
    return {key: out[source.index.stored_key(key)] for key in source.index.tensors}  # the index's order


def _check_save_arguments(sharded_state_dict: Any, validate_access_integrity: Any, balance_writes: Any,
                          storage: Any, async_save: Any, plan_cache: Any, background_snapshot: Any) -> None:
    """ArgumentTypeError naming the first of :func:`save`'s arguments that has a wrong type."""
    require_state_dict(sharded_state_dict, "sharded_state_dict")
    require_bool(validate_access_integrity, "validate_access_integrity")
    require_bool(balance_writes, "balance_writes")
    require(storage, (StorageOptions, type(None)), "storage", "a StorageOptions or None")
    require(async_save, (bool, AsyncSaver), "async_save", "a bool or an AsyncSaver")
    require(plan_cache, (SavePlanCache, type(None)), "plan_cache", "a SavePlanCache or None")
    if background_snapshot is not False and (not async_save or not (background_snapshot is True
                                                                     or callable(background_snapshot))):
        raise ArgumentTypeError("background_snapshot must be False, True or a function of a tensor, and needs "
                                "async_save "
                                f"(got background_snapshot={background_snapshot!r}, async_save={async_save!r})")


def _check_load_arguments(sharded_state_dict: Any, strict: Any, extra_safe_globals: Any, key_map: Any,
                          storage: Any, common: Any, cast: Any, validate_access_integrity: Any,
                          strategies: Tuple[Any, Any]) -> StrictHandling:
    """ArgumentTypeError naming the first of :func:`load`'s arguments that has a wrong type; the strict mode."""
    check_strategy(strategies[0], "sharded_strategy")
    check_strategy(strategies[1], "common_strategy")
    require(validate_access_integrity, (bool, type(None)), "validate_access_integrity", "a bool or None")
    require(storage, (StorageOptions, type(None)), "storage", "a StorageOptions or None")
    require_state_dict(sharded_state_dict, "sharded_state_dict")
    require(strict, (StrictHandling, Enum, str, bool), "strict",
            "a StrictHandling (ours or Megatron-Core's), its name or a bool")
    require_globals(extra_safe_globals)
    require_key_map(key_map)
    require_bool(common, "common")
    parse_cast(cast)
    return StrictHandling.parse(strict)
