"""Which node each rank runs on, where its node-local root is, and which ranks hold its partner copies.

Node identity: :attr:`TierOptions.node` when given, else ``node<rank // ranks_per_node>`` when
``ranks_per_node`` simulates nodes (tests), else the host name combined with the launcher's node: where
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set (torchrun, Lightning's launchers), the ranks of one
launched node are ``rank - LOCAL_RANK`` onwards, so that first rank names the launcher's node. A host
running one launcher node is named by its host name alone; a host name shared by several launcher nodes
(containers with one host name, ``torchrun --nnodes 2`` on one machine) is split into
``<host>-<first rank>``; ranks on different hosts are on different nodes whatever the launcher says (they
cannot share memory or a disk). The names are all-gathered once, so every rank knows every rank's node;
nodes are numbered by their first rank.

Partners: the ``k``-th partner (``k = 1 .. replicas``) of the rank with local index ``j`` on node ``i`` is
the rank with local index ``j mod size(i + k)`` on node ``(i + k) mod N``: never on the same node, spread
over the nodes' ranks, the same on every rank. ``replicas >= N`` cannot be met on ``N`` nodes: the tier
keeps ``N - 1`` copies and warns once (a one-node job then simply keeps no partner copies), rather than
refusing a configuration a job may also be started with on fewer nodes for a test.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from lightning_distckpt.comm import Comm
from lightning_distckpt.core.errors import ArgumentError
from lightning_distckpt.tiers.options import TierOptions, check_node_name

logger = logging.getLogger(__name__)

NODE_PLACEHOLDER = "{node}"


def node_name(options: TierOptions, rank: int) -> Optional[str]:
    """This rank's node name when the options give it (``node``, ``ranks_per_node``); None: from the host
    and the launcher (:func:`name_nodes`)."""
    if options.node is not None:
        return options.node
    if options.ranks_per_node is not None:
        return f"node{rank // options.ranks_per_node}"
    return None


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ArgumentError(f"local tier: the environment variable {name}={text!r} is not an integer") from None


def launcher_node(world_rank: int) -> Optional[int]:
    """The first world rank of this process's launched node (``world_rank - LOCAL_RANK``), where the
    launcher set ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; None where it did not."""
    local_rank, local_size = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    if local_rank is None or local_size is None:
        return None
    if not 0 <= local_rank < local_size or local_rank > world_rank:
        raise ArgumentError(f"local tier: LOCAL_RANK={local_rank} does not fit LOCAL_WORLD_SIZE={local_size} and "
                            f"rank {world_rank}; set TierOptions.node to name this rank's node")
    return world_rank - local_rank


def name_nodes(found: List[Tuple[Optional[str], str, Optional[int]]]) -> List[str]:
    """Every rank's node name from each rank's (name given, host name, launcher node): see the module
    docstring. The same on every rank (a pure function of the gathered values)."""
    launched: Dict[str, Set[Optional[int]]] = {}
    for given, host, first in found:
        if given is None:
            launched.setdefault(host, set()).add(first)
    out = []
    for given, host, first in found:
        if given is not None:
            out.append(given)
        else:
            out.append(host if len(launched[host]) == 1 or first is None else f"{host}-{first}")
    return out


def local_root(options: TierOptions, node: str) -> str:
    """The node-local root of ``node``: ``local_dir`` with ``{node}`` replaced, absolute."""
    return _root_of(options.local_dir, node)


def _root_of(local_dir: str, node: str) -> str:
    return os.path.abspath(os.path.expanduser(local_dir.replace(NODE_PLACEHOLDER, node)))


@dataclass(frozen=True)
class NodeMap:
    """Every rank's node (``nodes[rank]``), as the ranks of one group see it."""

    nodes: Tuple[str, ...]

    @property
    def names(self) -> List[str]:
        """The node names, in the order of their first rank."""
        return list(dict.fromkeys(self.nodes))

    def node_of(self, rank: int) -> str:
        return self.nodes[rank]

    def ranks_on(self, node: str) -> List[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def lead(self, node: str) -> int:
        """The node's lowest rank: it commits and prunes the node's directories."""
        return self.ranks_on(node)[0]

    def is_lead(self, rank: int) -> bool:
        return self.lead(self.nodes[rank]) == rank

    def copies(self, replicas: int) -> int:
        """How many partner copies can be kept: ``replicas``, at most one per other node."""
        return min(replicas, len(self.names) - 1)

    def partners(self, rank: int, replicas: int) -> List[int]:
        """The ranks that keep copies of ``rank``'s store (see the module docstring)."""
        names = self.names
        i = names.index(self.nodes[rank])
        j = self.ranks_on(self.nodes[rank]).index(rank)
        out = []
        for k in range(1, self.copies(replicas) + 1):
            ranks = self.ranks_on(names[(i + k) % len(names)])
            out.append(ranks[j % len(ranks)])
        return out

    def sources(self, rank: int, replicas: int) -> List[int]:
        """The ranks whose stores ``rank`` keeps copies of."""
        return [r for r in range(len(self.nodes)) if rank in self.partners(r, replicas)]


def _world_rank(comm: Comm) -> int:
    """This process's rank in the world (what ``LOCAL_RANK`` is relative to)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else comm.rank


def gather_nodes(options: TierOptions, comm: Comm) -> Tuple[NodeMap, str]:
    """Collective (one all-gather): every rank's node, and this rank's node-local root. ArgumentError
    on every rank when two nodes of one host would share a root (``local_dir`` needs ``{node}`` when
    nodes are simulated on one host). Each rank's name and root follow from what every rank gathered
    (its given name, host, launcher node and ``local_dir``), so every rank computes every rank's alike."""
    error: Optional[Exception] = None
    host = socket.gethostname()
    mine: Tuple[Optional[str], str, Optional[int], str] = (None, host, None, options.local_dir)
    try:
        given = node_name(options, comm.rank)
        mine = (given, host, launcher_node(_world_rank(comm)) if given is None else None, options.local_dir)
    except Exception as e:  # agreed: every rank raises it
        error = e
    found = comm.agree("local tier: naming the nodes failed", error, mine, default=ArgumentError)
    names = name_nodes([f[:3] for f in found])
    try:
        for name in dict.fromkeys(names):  # the same check on every rank: the same error everywhere
            check_node_name(name)
    except ArgumentError as e:
        raise ArgumentError(f"local tier: naming the nodes failed: {e}") from e
    owners: Dict[Tuple[str, str], str] = {}
    for node, (_, host_name, _, local_dir) in zip(names, found):
        root = _root_of(local_dir, node)
        other = owners.setdefault((host_name, root), node)
        if other != node:
            raise ArgumentError(f"TierOptions.local_dir: nodes {other!r} and {node!r} on host {host_name!r} would "
                                f"share the local directory {root!r}; put '{NODE_PLACEHOLDER}' in local_dir")
    nodes = NodeMap(tuple(names))
    if comm.rank == 0 and options.replicas > nodes.copies(options.replicas):
        # One node (a single-host job with the default replicas=1): partner copies cannot exist and a lost
        # node loses the job anyway, so there is nothing to fix: said at INFO. Several nodes but fewer than
        # asked: a lost node may take copies the user counted on, a WARNING.
        level = logging.WARNING if len(nodes.names) > 1 else logging.INFO
        logger.log(level, "local tier: replicas=%d asked, but only %d other node(s): keeping %d partner copies",
                   options.replicas, len(nodes.names) - 1, nodes.copies(options.replicas))
    return nodes, local_root(options, names[comm.rank])
