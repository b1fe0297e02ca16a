"""What a load asks for: the template split into the tensors and objects to read (by position)
and a tree of slots that :func:`assemble` fills with what was read; key matching over ranks."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from ..comm import Comm
from ..core.errors import ArgumentError, ShardingError, ValidationError
from ..core.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from ..core.plain_tensors import PlainTensorFactory
from ..core.state_dict import apply_factories, collect, merge, merge_factories, replace_leaves, split_common
from ..core.strict import StrictHandling, check_keys, deferred_absent, deferred_unused, refused_unused
from ..core.tree_paths import Steps
from ..planning.groups import representatives
from .checkpoint import CheckpointSource, content_id
from .tied import tie_groups, tied_to_stored


# Not NamedTuples: the tree walkers treat tuples as containers.
@dataclass(frozen=True)
class TensorSlot:
    """Where the loaded tensor of ``LoadRequest.tensors[position]`` goes in the tree."""

    position: int


@dataclass(frozen=True)
class ObjectSlot:
    """Where the loaded object of ``LoadRequest.objects[position]`` goes in the tree."""

    position: int


class Requester(NamedTuple):
    """A requested ShardedTensor and its position in the load request."""

    position: int
    tensor: ShardedTensor


@dataclass
class LoadRequest:
    """The sharded part of an expanded template: its ShardedTensors and ShardedObjects in tree
    order, and the tree with each of them replaced by its slot (factory expansions kept).
    ``plain``: position -> steps of each tensor that is a plain tensor leaf of the template
    (``core/plain_tensors.py``)."""

    tree: Any
    tensors: List[ShardedTensor]
    objects: List[ShardedObject]
    plain: Dict[int, Steps] = field(default_factory=dict)
    tied: List[List[int]] = field(default_factory=list)  # positions sharing one template tensor (reading/tied.py)


def make_request(sharded_state_dict: Dict[str, Any]) -> LoadRequest:
    expanded: List[Tuple[Any, Any]] = []
    sharded, _ = split_common(apply_factories(sharded_state_dict, expanded))
    collect(sharded)  # refuses unexpanded factories
    plain_at = {id(st): f.steps for f, st in expanded if isinstance(f, PlainTensorFactory)}
    tensors: List[ShardedTensor] = []
    objects: List[ShardedObject] = []
    plain: Dict[int, Steps] = {}
    data_ids: List[Optional[int]] = []  # taken before meta data is dropped: tied meta tensors stay tied

    # Hot: once per template tensor (10,000 tiny ones: each test taken once, the data looked up once)
    def slot(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            data = leaf.data
            if isinstance(data, torch.Tensor):
                if data.numel() > 1:
                    _check_writable(leaf)
                data_ids.append(id(data))
                if data.is_meta:
                    # A meta tensor (a model built under torch.device("meta")) has no memory to load into: it is
                    # read as a template without data, into a fresh CPU tensor, as DCP materializes meta tensors
                    leaf = dataclasses.replace(leaf, data=None, dtype=data.dtype)
            else:
                data_ids.append(None)
            tensors.append(leaf)
            if plain_at and id(leaf) in plain_at:
                plain[len(tensors) - 1] = plain_at[id(leaf)]
            return TensorSlot(len(tensors) - 1)
        if isinstance(leaf, ShardedObject):
            objects.append(leaf)
            return ObjectSlot(len(objects) - 1)
        return leaf

    tree = replace_leaves(sharded, slot)
    return LoadRequest(tree, tensors, objects, plain, tie_groups(tensors, data_ids))


def _check_writable(st: ShardedTensor) -> None:
    """A template tensor a load can write into: none of its elements shares memory with another
    (``torch.empty(1, 4).expand(3, 4)``), which torch's copy refuses with a RuntimeError mid-load.
    The check is torch's own (``MemOverlap::Yes``); ShardingError names the key before anything is read."""
    data = st.data
    if isinstance(data, torch.Tensor) and data.numel() > 1 and torch._debug_has_internal_overlap(data) == 1:
        raise ShardingError(f"load template: {st.key!r} is a tensor whose elements share memory (strides "
                            f"{tuple(data.stride())} for shape {tuple(data.shape)}: an expand() or as_strided view), "
                            "which a load cannot write into; pass a tensor of its own (.clone(), torch.empty)")


class LoaderSetup(NamedTuple):
    """What a loader's collectives depend on, which the ranks of a load must agree on (checked by
    :func:`check_alike`): its kind with its plan's parameters, and the group it exchanges over as
    ``(digest of its global ranks, its size)`` (``("", 0)``: none)."""

    kind: str = ""
    group: Tuple[str, int] = ("", 0)


class KeyMatch(NamedTuple):
    """How a template's keys match a checkpoint's, in Megatron-Core's words (see
    :class:`~lightning_distckpt.core.strict.StrictHandling`)."""

    absent: Set[str]  # asked for by some rank, not in the checkpoint: what the reads skip
    missing: Set[str]  # in the checkpoint, asked for by no rank (looked for by the *_ALL modes only)
    unexpected: Set[str]  # asked for by this rank, not in the checkpoint


def match_keys(source: Optional[CheckpointSource], req: LoadRequest, comm: Comm, strict: StrictHandling,
               open_error: Optional[BaseException] = None, filled: AbstractSet[str] = frozenset(),
               loader: Optional[LoaderSetup] = None, location: Optional[str] = None) -> KeyMatch:
    """Collective: the keys asked for but absent from the checkpoint (Megatron-Core's "unexpected"
    keys: this rank's, and every rank's) and, where ``strict`` looks for them, the checkpoint's keys
    no rank asks for ("missing"); raises on every rank alike when ``strict`` says so, or when some
    rank could not open the source (``open_error``, with ``source`` None there). ``filled``: this
    rank's keys absent from the checkpoint's tensors that its common state fills (not unexpected).

    Ranks exchange their absent keys (usually none) and, where ``strict`` looks for missing keys, a
    digest of the keys they ask for, not the keys: when all digests agree (data parallelism, FSDP),
    every rank finds the missing keys from its own; otherwise only the first rank of each distinct
    digest sends its keys, to rank 0, which names the missing ones. Under
    :func:`~lightning_distckpt.core.strict.refusing_unused` (Lightning's ``strict_loading`` for a module)
    the same is done in any mode, and those of the keys it names that no rank asks for are refused.

    The same exchange checks that the ranks load alike (:func:`check_alike`): one checkpoint, one
    ``strict`` mode, one ``loader`` protocol (what the loader's collectives depend on). ``location``: where the
    load was asked to read, which names it when some rank could not open it."""
    asked = {t.key for t in req.tensors if t.key} | {o.key for o in req.objects}
    lacking: Set[str] = set()
    if source is not None:
        lacking = {t.key for t in req.tensors if t.key not in source.index.tensors}
        lacking |= {o.key for o in req.objects if o.key not in source.index.objects}
    # a key tied to a stored one takes its value (a tied embedding saved once): not unexpected
    mine = lacking - filled
    if req.tied and source is not None:
        mine -= tied_to_stored(req.tensors, req.tied, source.index.tensors.keys())
    # the place asked for where known (every rank says the same, whether it opened it or not), else what was opened
    where = location or (source.path if source is not None else "the checkpoint")
    # a module's keys of the checkpoint that no rank may leave unused (Lightning's strict_loading): found as
    # the *_ALL modes find missing keys, over the same exchange
    scoped = refused_unused()
    looks = strict.needs_missing or scoped is not None
    # also where a mode may refuse absent keys: the refusal names the checkpoint's keys no rank asks for
    # when all ranks ask alike (their digests agree)
    digest = _keys_digest(asked) if looks or not strict.skips_unexpected else None
    mode = strict.value if scoped is None else f"{strict.value} with strict_loading"  # the ranks must agree on both
    setup = None if source is None else (content_id(source), source.path, mode, *(loader or LoaderSetup()))
    # a digest of what must be equal everywhere (not the path, which may differ for one checkpoint) and
    # the exchange group travel; the details (paths are long, ranks many) only when a digest differs
    alike = None if setup is None else (_keys_digest({repr((setup[0], *setup[2:4]))}), setup[4])
    gathered = comm.agree(f"load from {where} failed", open_error, (digest, sorted(mine), alike))
    assert source is not None and setup is not None  # agree raised on every rank otherwise
    if len({a[0] for _, _, a in gathered}) > 1:
        check_alike(comm.all_gather_object(setup))  # raises on every rank alike
    _check_partition(f"load from {source.path}", [a[1] for _, _, a in gathered])  # before collectives using them
    gathered = [(d, m) for d, m, _ in gathered]
    every = {k for _, m in gathered for k in m}
    absent = every | lacking  # skipped by the reads
    missing: Set[str] = set()
    if looks:
        stored = set(source.index.tensors) | set(source.index.objects)
        senders = [ranks[0] for ranks in representatives([d for d, _ in gathered]).values()]
        if len(senders) == 1:
            missing = stored - asked
        else:
            received = comm.gather_from(senders, sorted(asked) if comm.rank in senders else None)
            found = sorted(stored.difference(*received.values())) if comm.rank == 0 else None
            missing = set(comm.broadcast_object(found))
    stored_keys = list(source.index.tensors) + list(source.index.objects) if every else []
    unasked = missing if looks else None
    if every and unasked is None and len({d for d, _ in gathered}) == 1:  # every rank asks alike: no exchange
        unasked = set(stored_keys) - asked
    unused = missing & scoped if scoped is not None else set()
    deferred = deferred_unused()
    if deferred is not None:  # refused by the caller, once the user's hooks had their say (as stock refuses them)
        deferred.update(unused)
        missing = missing - unused  # logged by the caller after the hooks, which may drop or rename them
        held = deferred_absent()
        if held is not None and unused and every:
            # a hook may rename one of those unused weights onto a key the checkpoint lacks: the caller checks
            # them after the hooks too (every rank's keys, so every rank decides alike; a non-strict load names
            # there the ones no hook filled, not here before the hooks ran); the reads skip them
            held.update(every)
            every, mine = set(), set()
        unused = set()
    missing, unexpected = check_keys(strict, source.path, missing, every, mine, stored=stored_keys, unasked=unasked,
                                     unused=unused)
    return KeyMatch(absent, missing, unexpected)


def check_alike(setups: Sequence[Tuple[Optional[str], str, str, str, Tuple[str, int]]]) -> None:
    """Every rank's ``(checkpoint content id, path, strict, loader kind, exchange group)`` (the same
    list on every rank, so every rank raises alike). Ranks in different strict modes or loaders, or
    whose exchange groups do not partition the load's group, would enter different collectives (a
    hang, a gloo abort on mismatched sizes, or one's message read as another's); ranks that opened
    different checkpoints would mix one's bytes into the other's tensors through the exchange."""
    def ranks_of(pick: Any) -> str:
        groups: Dict[Any, List[int]] = {}
        for rank, s in enumerate(setups):
            groups.setdefault(pick(s), []).append(rank)
        return "; ".join(f"ranks {ranks}: {value}" for value, ranks in groups.items())

    where = f"load from {setups[0][1]}"
    if len({s[3] for s in setups}) > 1:
        raise ArgumentError(f"{where}: the ranks passed different loaders ({ranks_of(lambda s: s[3])}); every rank "
                            "of the load's group must pass the same kind of loader (every-rank or exchange) and "
                            "bucket_bytes")
    if len({s[2] for s in setups}) > 1:
        raise ArgumentError(f"{where}: the ranks passed different strict modes ({ranks_of(lambda s: s[2])}); every "
                            "rank of the load's group must pass the same strict")
    _check_partition(where, [s[4] for s in setups])
    if len({s[0] for s in setups}) > 1:
        opened = ranks_of(lambda s: f"{s[1]} (metadata.json sha256 {str(s[0])[:16]}...)")
        raise ValidationError(f"load: the ranks opened different checkpoints ({opened}): every rank of the load's "
                              "group must load the same one (was the path replaced, or a link to it moved by a "
                              "save, between the ranks' opens?); nothing was read")


def _check_partition(where: str, groups: Sequence[Tuple[str, int]]) -> None:
    """The exchange groups the ranks passed partition the load's group. Each rank is a member of its
    own group (torch refuses a collective on a group it is not in), so the ranks naming one group
    are a subset of it: they are all of it exactly when there are as many as its size."""
    members: Dict[Tuple[str, int], List[int]] = {}
    for rank, g in enumerate(groups):
        members.setdefault(g, []).append(rank)
    for (digest, size), ranks in members.items():
        if size and len(ranks) != size:
            shown = "; ".join(f"ranks {r}: a group of {n}" for (_, n), r in members.items())
            raise ArgumentError(f"{where}: the exchange groups the ranks passed ({shown}) do not partition the load's "
                                "group: each rank must pass its own data-parallel group, and every member of a group "
                                "the same group")


def _keys_digest(keys: Set[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(keys):
        b = k.encode()
        h.update(len(b).to_bytes(8, "little") + b)  # length-prefixed: no two key lists hash alike
    return h.hexdigest()


def assemble(req: LoadRequest, common: Any, tensors: Sequence[Optional[Any]],
             objects: Sequence[Optional[Any]]) -> Dict[str, Any]:
    """Put loaded values in the template's slots (a slot with nothing loaded, a key absent from the
    checkpoint, keeps the template's ``data``), fold factories, merge the common state."""

    def fill(leaf: Any) -> Any:
        if isinstance(leaf, TensorSlot):
            value = tensors[leaf.position]
            return value if value is not None else req.tensors[leaf.position].data
        if isinstance(leaf, ObjectSlot):
            value = objects[leaf.position]
            return value if value is not None else req.objects[leaf.position].data
        if isinstance(leaf, LocalNonpersistentObject):
            return leaf.unwrap()
        return leaf

    loaded = merge_factories(replace_leaves(req.tree, fill))
    return merge(common if isinstance(common, dict) else {}, loaded)
