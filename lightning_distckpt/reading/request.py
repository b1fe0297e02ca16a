"""What a load asks for: the template split into the tensors and objects to read (by position)
and a tree of slots that :func:`assemble` fills with what was read; key matching over ranks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from ..comm import Comm
from ..core.errors import ShardingError
from ..core.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from ..core.plain_tensors import PlainTensorFactory
from ..core.state_dict import apply_factories, collect, merge, merge_factories, replace_leaves, split_common
from ..core.strict import StrictHandling, check_keys
from ..core.tree_paths import Steps
from ..planning.groups import representatives
from .checkpoint import CheckpointSource


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


def make_request(sharded_state_dict: Dict[str, Any]) -> LoadRequest:
    expanded: List[Tuple[Any, Any]] = []
    sharded, _ = split_common(apply_factories(sharded_state_dict, expanded))
    collect(sharded)  # refuses unexpanded factories
    plain_at = {id(st): f.steps for f, st in expanded if isinstance(f, PlainTensorFactory)}
    tensors: List[ShardedTensor] = []
    objects: List[ShardedObject] = []
    plain: Dict[int, Steps] = {}

    def slot(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            _check_writable(leaf)
            tensors.append(leaf)
            if id(leaf) in plain_at:
                plain[len(tensors) - 1] = plain_at[id(leaf)]
            return TensorSlot(len(tensors) - 1)
        if isinstance(leaf, ShardedObject):
            objects.append(leaf)
            return ObjectSlot(len(objects) - 1)
        return leaf

    return LoadRequest(replace_leaves(sharded, slot), tensors, objects, plain)


def _check_writable(st: ShardedTensor) -> None:
    """A template tensor a load can write into: none of its elements shares memory with another
    (``torch.empty(1, 4).expand(3, 4)``), which torch's copy refuses with a RuntimeError mid-load.
    The check is torch's own (``MemOverlap::Yes``); ShardingError names the key before anything is read."""
    data = st.data
    if isinstance(data, torch.Tensor) and data.numel() > 1 and torch._debug_has_internal_overlap(data) == 1:
        raise ShardingError(f"load template: {st.key!r} is a tensor whose elements share memory (strides "
                            f"{tuple(data.stride())} for shape {tuple(data.shape)}: an expand() or as_strided view), "
                            "which a load cannot write into; pass a tensor of its own (.clone(), torch.empty)")


class KeyMatch(NamedTuple):
    """How a template's keys match a checkpoint's, in Megatron-Core's words (see
    :class:`~lightning_distckpt.core.strict.StrictHandling`)."""

    absent: Set[str]  # asked for by some rank, not in the checkpoint: what the reads skip
    missing: Set[str]  # in the checkpoint, asked for by no rank (looked for by the *_ALL modes only)
    unexpected: Set[str]  # asked for by this rank, not in the checkpoint


def match_keys(source: Optional[CheckpointSource], req: LoadRequest, comm: Comm, strict: StrictHandling,
               open_error: Optional[BaseException] = None, filled: AbstractSet[str] = frozenset()) -> KeyMatch:
    """Collective: the keys asked for but absent from the checkpoint (Megatron-Core's "unexpected"
    keys: this rank's, and every rank's) and, where ``strict`` looks for them, the checkpoint's keys
    no rank asks for ("missing"); raises on every rank alike when ``strict`` says so, or when some
    rank could not open the source (``open_error``, with ``source`` None there). ``filled``: this
    rank's keys absent from the checkpoint's tensors that its common state fills (not unexpected).

    Ranks exchange their absent keys (usually none) and, where ``strict`` looks for missing keys, a
    digest of the keys they ask for, not the keys: when all digests agree (data parallelism, FSDP),
    every rank finds the missing keys from its own; otherwise only the first rank of each distinct
    digest sends its keys, to rank 0, which names the missing ones."""
    asked = {t.key for t in req.tensors if t.key} | {o.key for o in req.objects}
    lacking: Set[str] = set()
    if source is not None:
        lacking = {t.key for t in req.tensors if t.key not in source.index.tensors}
        lacking |= {o.key for o in req.objects if o.key not in source.index.objects}
    mine = lacking - filled
    where = source.path if source is not None else "the checkpoint"
    digest = _keys_digest(asked) if strict.needs_missing else None
    gathered = comm.agree(f"load from {where} failed", open_error, (digest, sorted(mine)))
    assert source is not None  # agree raised on every rank otherwise
    every = {k for _, m in gathered for k in m}
    absent = every | lacking  # skipped by the reads
    missing: Set[str] = set()
    if strict.needs_missing:
        stored = set(source.index.tensors) | set(source.index.objects)
        senders = [ranks[0] for ranks in representatives([d for d, _ in gathered]).values()]
        if len(senders) == 1:
            missing = stored - asked
        else:
            received = comm.gather_from(senders, sorted(asked) if comm.rank in senders else None)
            found = sorted(stored.difference(*received.values())) if comm.rank == 0 else None
            missing = set(comm.broadcast_object(found))
    missing, unexpected = check_keys(strict, source.path, missing, every, mine,
                                     stored=list(source.index.tensors) + list(source.index.objects) if every else ())
    return KeyMatch(absent, missing, unexpected)


def _keys_digest(keys: Set[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(keys):
        b = k.encode()
        h.update(len(b).to_bytes(8, "little") + b)  # length-prefixed: no two key lists hash alike
    return h.hexdigest()


def assemble(req: LoadRequest, common: Any, tensors: Sequence[Optional[Any]], objects: Sequence[Optional[Any]]) -> Dict[str, Any]:
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
