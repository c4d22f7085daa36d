"""Which rank holds whose replica: ranks grouped into nodes, replicas one node further round the ring.

Launchers (torchrun, Slurm, mpirun) number ranks node by node, ``LOCAL_WORLD_SIZE``
to a node, so rank ``r`` sits on node ``r // LOCAL_WORLD_SIZE``. A rank's replica
goes to the rank with the same local index on the next node (the last node's go
to the first), so every node holds the replicas of exactly one other node, and
losing one node loses no version that a surviving node does not hold. Losing
two adjacent nodes at once loses the first one's memory copies (its ranks then
restore from their disks or the remote tier).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Ring:
    """This rank's place in the replication ring.

    Attributes:
        rank: this rank.
        world_size: every rank of the job.
        node_of: the node of every rank (``node_of[r]``).
        dst: the rank that holds this rank's replicas.
        src: the rank whose replicas this rank holds.
    """

    rank: int
    world_size: int
    node_of: tuple[int, ...]
    dst: int
    src: int

    @property
    def nodes(self) -> int:
        """How many nodes the job spans."""
        return len(set(self.node_of))


def ring_of(rank: int, world_size: int, *, node_of: Sequence[int] | None = None,
            local_world_size: int | None = None) -> Ring:
    """Place ``rank`` in the ring.

    Args:
        rank: this rank.
        world_size: the number of ranks.
        node_of: the node id of every rank, given explicitly (any hashable ints).
        local_world_size: ranks per node, numbered node by node (default:
            ``LOCAL_WORLD_SIZE`` from the environment); ignored with ``node_of``.

    Raises:
        ValueError: the mapping is inconsistent, the nodes differ in size, or the
            job has a single node (a replica on the same node survives nothing more).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if node_of is None:
        if local_world_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                raise ValueError("the peer tier needs the rank-to-node mapping: set LOCAL_WORLD_SIZE "
                                 "(torchrun does) or pass local_world_size= or node_of=")
            local_world_size = int(env)
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(f"{world_size} ranks do not split into nodes of {local_world_size}")
        node_of = [r // local_world_size for r in range(world_size)]
    nodes = tuple(int(n) for n in node_of)
    if len(nodes) != world_size:
        raise ValueError(f"node_of names {len(nodes)} ranks, the job has {world_size}")
    members: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):  # one pass: O(world_size), not O(nodes x world_size)
        members.setdefault(n, []).append(r)
    order = sorted(members)
    sizes = {len(m) for m in members.values()}
    if len(sizes) != 1:
        raise ValueError(f"nodes hold different numbers of ranks ({sorted(sizes)}): the ring needs equal nodes")
    if len(order) < 2:
        raise ValueError("the peer tier needs ranks on at least two nodes (all ranks are on one node)")
    node = bisect.bisect_left(order, nodes[rank])
    local = members[nodes[rank]].index(rank)
    dst = members[order[(node + 1) % len(order)]][local]
    src = members[order[(node - 1) % len(order)]][local]
    return Ring(rank, world_size, nodes, dst, src)


def lanes_of(ring: Ring) -> list[int] | None:
    """Per rank, the replication group its own flow travels on; None: one group carries every flow.

    In a ring of two nodes each pair of ranks carries both flows (each is the other's source and holder),
    and gloo queues a receiver's "ready" notices behind the bulk going the same way: there the first
    node's flows get group 0 and the second node's group 1, so that neither direction's notices wait
    behind the other's segments. With more nodes a pair carries one flow only.
    """
    if ring.nodes != 2:
        return None
    first = min(ring.node_of)
    return [0 if node == first else 1 for node in ring.node_of]
