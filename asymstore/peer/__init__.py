"""Peer replication: each rank's newest versions also held in the memory of a rank on another node.

See :mod:`asymstore.peer.tier` (the tier), :mod:`asymstore.peer.ring` (who holds
whose replicas), :mod:`asymstore.peer.link` (the transport) and
:mod:`asymstore.peer.service` (the receiving end).
"""

from asymstore.peer.ring import Ring, ring_of
from asymstore.peer.tier import PeerTier

__all__ = ["PeerTier", "Ring", "ring_of"]
