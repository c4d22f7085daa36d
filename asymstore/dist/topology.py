"""Which node each rank of a job is on, and which rank leads each node.

Launchers (torchrun, Slurm, mpirun) number ranks node by node, ``LOCAL_WORLD_SIZE`` to a node, so rank
``r`` sits on node ``r // node_size`` and the node's ``LOCAL_RANK`` 0 (its first rank) leads it. The
coordination protocol aggregates through the leaders (:mod:`asymstore.dist.fabric`): the job's one
coordination store sees O(nodes) requests per round, not O(ranks). Node 0 is the coordinator's: its ranks
talk to the job's store directly, so a job of one node runs the protocol exactly as before.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in nodes of ``node_size``, numbered node by node.

    Attributes:
        world_size: the job's ranks.
        node_size: ranks per node (``world_size`` for a job of one node).
    """

    world_size: int
    node_size: int

    def __post_init__(self) -> None:
        """Check the sizes.

        Raises:
            ValueError: a size below 1, or ``node_size`` does not divide ``world_size``.
        """
        if self.world_size < 1 or self.node_size < 1:
            raise ValueError(f"a topology needs at least one rank per node and one rank: {self}")
        if self.world_size % self.node_size:
            raise ValueError(f"{self.world_size} ranks do not fill nodes of {self.node_size}")

    @property
    def nodes(self) -> int:
        """How many nodes the job spans."""
        return self.world_size // self.node_size

    def node_of(self, rank: int) -> int:
        """The node of ``rank``."""
        return rank // self.node_size

    def leader(self, node: int) -> int:
        """The rank that leads ``node`` (its ``LOCAL_RANK`` 0)."""
        return node * self.node_size

    def members(self, node: int) -> range:
        """The ranks of ``node``, the leader first."""
        return range(node * self.node_size, (node + 1) * self.node_size)

    def is_leader(self, rank: int) -> bool:
        """True when ``rank`` leads its node."""
        return rank % self.node_size == 0

    def relay_groups(self) -> list[tuple[int, tuple[int, ...]]]:
        """The broadcast tree of the nodes other than 0: ``(head, the nodes its leader relays to)``, in node order.

        About √(nodes) groups of about √(nodes) consecutive nodes each: the coordinator puts a broadcast into
        each group's head, and the head's leader into the rest of its group, so neither puts more than
        about √(nodes) values per broadcast (a depth of two: one dead node never cuts off another). A
        gather goes up the same tree: the group's leaders hand their nodes' parts to the head's leader,
        which forwards the group's as one value.
        """
        others = list(range(1, self.nodes))
        if not others:
            return []
        size = math.isqrt(len(others) - 1) + 1  # ceil(sqrt(n)) for n >= 1
        return [(others[i], tuple(others[i + 1:i + size])) for i in range(0, len(others), size)]

    def relay_children(self, node: int) -> tuple[int, ...]:
        """The nodes whose stores the leader of ``node`` relays broadcasts to (empty unless it heads a group)."""
        for head, rest in self.relay_groups():
            if head == node:
                return rest
        return ()

    def relay_head(self, node: int) -> int:
        """The head of the relay group of ``node`` (other than 0): its leader gathers the group's parts."""
        for head, rest in self.relay_groups():
            if node == head or node in rest:
                return head
        raise ValueError(f"node {node} is in no relay group of {self}")

    @classmethod
    def of(cls, world_size: int, node_size: int | None = None) -> Topology:
        """The job's topology: ``node_size`` given, else ``LOCAL_WORLD_SIZE`` from the environment, else one node.

        A ``LOCAL_WORLD_SIZE`` that is not a number or does not divide ``world_size`` (nodes of different
        sizes) gives one node, with a warning: the protocol is then the direct one, never wrong, only
        O(ranks) on the coordination store.

        Raises:
            ValueError: ``node_size`` given and it does not divide ``world_size``.
        """
        if node_size is not None:
            return cls(world_size, node_size)
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        if raw is None:
            return cls(world_size, world_size)
        try:
            return cls(world_size, int(raw))
        except ValueError:
            logger.warning("LOCAL_WORLD_SIZE=%r does not split %d ranks into equal nodes: coordinating as one node",
                           raw, world_size)
            return cls(world_size, world_size)
