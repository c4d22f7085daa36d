"""Describe a rank's open tiers as a :class:`~asymstore.format.placement.RankPlacement` for fsck."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from asymstore.format.placement import RankPlacement, TierKind, TierPlace, this_host
from asymstore.tiers.local import LocalTier
from asymstore.tiers.memory.capacity import BoundedTier
from asymstore.tiers.protocol import Tier


@runtime_checkable
class HoldsReplicas(Protocol):
    """A tier that holds another rank's versions on this rank (the peer tier, once open)."""

    def held_replicas(self) -> tuple[int, str | None]:
        """The rank whose replicas this rank holds, and their directory (None: process memory)."""


def tier_place(tier: Tier, rank: int) -> TierPlace | None:
    """Where ``tier`` keeps ``rank``'s shards, or None for a tier that keeps none here (a peer tier's sending side)."""
    kind: TierKind
    location: str | None
    if isinstance(tier, LocalTier):
        kind, location = "local", tier.root
    elif isinstance(tier, BoundedTier):
        location = tier.path
        kind = "memory" if location is None else "host"
    elif _is_remote(tier):
        kind, location = "remote", str(getattr(tier, "uri", None) or "") or None
    elif isinstance(tier, HoldsReplicas):
        return None
    else:
        kind, location = "other", None
    return TierPlace(tier.name, kind, location, rank)


def _is_remote(tier: Tier) -> bool:
    remote = sys.modules.get("asymstore.tiers.remote.tier")  # never imported: no tier can be a RemoteTier
    return remote is not None and isinstance(tier, remote.RemoteTier)


def rank_placement(tiers: Sequence[Tier], rank: int) -> RankPlacement:
    """Describe ``rank``'s open tiers: its own shards' locations, and the replicas it holds for a peer."""
    places: list[TierPlace] = []
    for tier in tiers:
        place = tier_place(tier, rank)
        if place is not None:
            places.append(place)
        if isinstance(tier, HoldsReplicas):
            src, location = tier.held_replicas()
            places.append(TierPlace(f"replicas-of-{src}", "replicas", location, src))
    return RankPlacement(rank, this_host(), tuple(places))
