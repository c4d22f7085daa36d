"""Which rank holds whose replica: ranks grouped into nodes, replicas one node further round the ring.

Launchers (torchrun, Slurm, mpirun) number ranks node by node, ``LOCAL_WORLD_SIZE``
to a node, so rank ``r`` sits on node ``r // LOCAL_WORLD_SIZE``. A rank's replica
goes to the rank with the same local index on the next node (the last node's go
to the first), so every node holds the replicas of exactly one other node, and
losing one node loses no version that a surviving node does not hold. Losing
two adjacent nodes at once loses the first one's memory copies (its ranks then
restore from their disks or the remote tier).

The whole ring is computed once per membership (:func:`ring_layout`: one pass over
the ranks, cached per ``(world_size, layout)``), and each rank's place is then read
from it in O(1): N ranks opening in one process (or one rank reopening) cost O(N)
in all, not O(N) each. The per-rank :class:`Ring` values share the layout's tuples.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

LAYOUTS_CACHED = 8
"""Memberships whose ring :func:`ring_layout` keeps (a job has one; a process hosting several jobs, a few)."""


@dataclass(frozen=True)
class RingLayout:
    """The whole replication ring of one membership, computed once.

    Attributes:
        world_size: every rank of the job.
        node_of: the node of every rank (``node_of[r]``).
        dst: per rank, the rank that holds its replicas.
        src: per rank, the rank whose replicas it holds.
        nodes: how many nodes the job spans.
    """

    world_size: int
    node_of: tuple[int, ...]
    dst: tuple[int, ...]
    src: tuple[int, ...]
    nodes: int

    def ring(self, rank: int) -> Ring:
        """``rank``'s place in the ring, in O(1).

        Raises:
            ValueError: ``rank`` is not in the world.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        return Ring(rank, self.world_size, self.node_of, self.dst[rank], self.src[rank], layout=self)


@dataclass(frozen=True)
class Ring:
    """This rank's place in the replication ring.

    Attributes:
        rank: this rank.
        world_size: every rank of the job.
        node_of: the node of every rank (``node_of[r]``).
        dst: the rank that holds this rank's replicas.
        src: the rank whose replicas this rank holds.
        layout: the whole ring this place was read from (None: built by hand); not compared.
    """

    rank: int
    world_size: int
    node_of: tuple[int, ...]
    dst: int
    src: int
    layout: RingLayout | None = field(default=None, compare=False, repr=False)

    @property
    def nodes(self) -> int:
        """How many nodes the job spans."""
        if self.layout is not None:
            return self.layout.nodes
        return len(set(self.node_of))


def ring_layout(world_size: int, *, node_of: Sequence[int] | None = None,
                local_world_size: int | None = None) -> RingLayout:
    """The ring of every rank, computed once per membership and cached.

    Args:
        world_size: the number of ranks.
        node_of: the node id of every rank, given explicitly (any hashable ints).
        local_world_size: ranks per node, numbered node by node (default:
            ``LOCAL_WORLD_SIZE`` from the environment); ignored with ``node_of``.

    Raises:
        ValueError: the mapping is inconsistent, the nodes differ in size, or the
            job has a single node (a replica on the same node survives nothing more).
    """
    if node_of is not None:  # the key costs a copy and a hash of the ids (C speed), not a pass in Python
        given = tuple(node_of)
        try:
            hash(given)
        except TypeError:  # ids that convert to int but do not hash (0-d arrays): the key by value
            given = tuple(int(n) for n in given)
        return _layout(world_size, None, given)
    if local_world_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError("the peer tier needs the rank-to-node mapping: set LOCAL_WORLD_SIZE "
                             "(torchrun does) or pass local_world_size= or node_of=")
        local_world_size = int(env)
    return _layout(world_size, local_world_size, None)


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _layout(world_size: int, local_world_size: int | None, given: tuple[int, ...] | None) -> RingLayout:
    """Compute the ring of every rank in one pass: O(world_size)."""
    if given is not None:
        nodes = tuple(int(n) for n in given)
    elif local_world_size is None or local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"{world_size} ranks do not split into nodes of {local_world_size}")
    else:
        nodes = tuple(r // local_world_size for r in range(world_size))
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
    dst = [0] * world_size
    src = [0] * world_size
    for i, node in enumerate(order):  # each node's ranks, paired by local index with the next node's
        here, after = members[node], members[order[(i + 1) % len(order)]]
        for r, d in zip(here, after, strict=True):
            dst[r] = d
            src[d] = r
    return RingLayout(world_size, nodes, tuple(dst), tuple(src), len(order))


def ring_of(rank: int, world_size: int, *, node_of: Sequence[int] | None = None,
            local_world_size: int | None = None) -> Ring:
    """Place ``rank`` in the ring.

    The ring of the whole membership is computed on the first call and cached
    (:func:`ring_layout`), so every further rank of the same membership is O(1).

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
    return ring_layout(world_size, node_of=node_of, local_world_size=local_world_size).ring(rank)


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
