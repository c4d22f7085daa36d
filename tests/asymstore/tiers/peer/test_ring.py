"""The ring computed once per membership gives exactly the answers of the per-call computation.

``reference_ring`` is ``ring_of`` as it was before the layout was cached (one O(N) pass per call);
the property compares every rank of random memberships, valid or not, answer for answer and error
for error, and the cache's own counters show that N ranks of one membership compute the layout once.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymstore.tiers.peer import ring as ring_module
from asymstore.tiers.peer.ring import Ring, lanes_of, ring_layout, ring_of

Answer = tuple[int, int, tuple[int, ...], int, int, int] | tuple[str, str]


def reference_ring(rank: int, world_size: int, *, node_of: Sequence[int] | None = None,
                   local_world_size: int | None = None) -> Ring:
    """``ring_of`` before this change, kept verbatim as the oracle."""
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
    for r, n in enumerate(nodes):
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


def answer(rank: int, world_size: int, *, node_of: Sequence[int] | None, local_world_size: int | None,
           reference: bool) -> Answer:
    """One rank's ring as plain values (the error's type and message when there is none)."""
    try:
        if reference:
            ring = reference_ring(rank, world_size, node_of=node_of, local_world_size=local_world_size)
        else:
            ring = ring_of(rank, world_size, node_of=node_of, local_world_size=local_world_size)
    except ValueError as e:
        return (type(e).__name__, str(e))
    return (ring.rank, ring.world_size, ring.node_of, ring.dst, ring.src, ring.nodes)


@st.composite
def memberships(draw: st.DrawFn) -> tuple[int, list[int] | None, int | None]:
    """A world size with node ids given explicitly (equal nodes in any order, or anything) or by node size."""
    kind = draw(st.sampled_from(["nodes", "any ids", "by size"]))
    if kind == "by size":
        return draw(st.integers(0, 40)), None, draw(st.integers(-1, 9))
    if kind == "any ids":
        ids = draw(st.lists(st.integers(-3, 3), max_size=24))
    else:
        count, size = draw(st.integers(1, 7)), draw(st.integers(1, 5))
        names = draw(st.lists(st.integers(-1000, 1000), min_size=count, max_size=count, unique=True))
        ids = draw(st.permutations([name for name in names for _ in range(size)]))
    world = len(ids) + draw(st.sampled_from([0, 0, 0, -1, 1]))
    return max(world, 0), ids, None


@settings(max_examples=300, deadline=None)
@given(memberships())
def test_every_rank_gets_the_answer_of_the_per_call_computation(
        membership: tuple[int, list[int] | None, int | None]) -> None:
    world, node_of, local_world_size = membership
    for rank in [-1, *range(world), world]:
        new = answer(rank, world, node_of=node_of, local_world_size=local_world_size, reference=False)
        old = answer(rank, world, node_of=node_of, local_world_size=local_world_size, reference=True)
        assert new == old, (rank, world, node_of, local_world_size)
        if len(new) == 6 and rank == 0:  # the shared layout answers the same as ring_of, for every rank
            layout = ring_layout(world, node_of=node_of, local_world_size=local_world_size)
            assert [layout.ring(r) for r in range(world)] == [
                reference_ring(r, world, node_of=node_of, local_world_size=local_world_size) for r in range(world)]
            assert lanes_of(layout.ring(0)) == lanes_of(
                reference_ring(0, world, node_of=node_of, local_world_size=local_world_size))


@pytest.mark.parametrize("how", ["by size", "node ids"])
def test_all_ranks_of_one_membership_compute_the_layout_once(how: str) -> None:
    world, size = 1536, 8
    node_of = [r // size for r in range(world)] if how == "node ids" else None
    ring_module._layout.cache_clear()
    rings = [ring_of(r, world, node_of=node_of, local_world_size=size) for r in range(world)]
    info = ring_module._layout.cache_info()
    assert (info.misses, info.hits) == (1, world - 1)  # one O(N) pass for the membership, then O(1) lookups
    assert all(g.node_of is rings[0].node_of for g in rings)  # one tuple of node ids, not one per rank
    assert all(g.nodes == world // size for g in rings)
    ring_of(0, world // 2, local_world_size=size)  # another membership: computed once more
    assert ring_module._layout.cache_info().misses == 2


def test_the_layout_follows_local_world_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ring_of(0, 8).dst == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a new membership: not the cached ring of the old one
    assert ring_of(0, 8).dst == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ring_of(0, 8)
