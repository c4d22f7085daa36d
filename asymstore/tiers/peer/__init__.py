"""Peer replication: each rank's newest versions also held in the memory of a rank on another node.

See :mod:`asymstore.tiers.peer.tier` (the tier), :mod:`asymstore.tiers.peer.ring` (who holds
whose replicas), :mod:`asymstore.tiers.peer.link` (the transport) and
:mod:`asymstore.tiers.peer.service` (the receiving end).
"""

from asymstore.tiers.peer.ring import Ring, RingLayout, ring_layout, ring_of
from asymstore.tiers.peer.tier import PeerTier

__all__ = ["PeerTier", "Ring", "RingLayout", "ring_layout", "ring_of"]
