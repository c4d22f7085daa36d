"""Storage tiers: the :class:`Tier` protocol and its implementations.

The implementations are imported on first use, so importing one tier (as
``python -m asymstore.fsck`` does with :class:`LocalTier`) does not import
torch through the memory tiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymstore.runtime.lazy import lazy_getattr
from asymstore.tiers.protocol import Tier, VersionWriter

if TYPE_CHECKING:
    from asymstore.tiers.local import LocalTier
    from asymstore.tiers.location import from_location, rank_tier
    from asymstore.tiers.memory.capacity import BoundedTier
    from asymstore.tiers.memory.factory import HostTier, host_tier
    from asymstore.tiers.memory.gpu import GPUTier
    from asymstore.tiers.nvme import NVMeTier
    from asymstore.tiers.peer.tier import PeerTier
    from asymstore.tiers.remote.tier import RemoteTier

_LAZY = {
    "GPUTier": "asymstore.tiers.memory.gpu",
    "HostTier": "asymstore.tiers.memory.factory",
    "host_tier": "asymstore.tiers.memory.factory",
    "BoundedTier": "asymstore.tiers.memory.capacity",
    "LocalTier": "asymstore.tiers.local",
    "from_location": "asymstore.tiers.location",
    "rank_tier": "asymstore.tiers.location",
    "NVMeTier": "asymstore.tiers.nvme",
    "PeerTier": "asymstore.tiers.peer.tier",
    "RemoteTier": "asymstore.tiers.remote.tier",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "BoundedTier",
    "GPUTier",
    "HostTier",
    "LocalTier",
    "NVMeTier",
    "PeerTier",
    "RemoteTier",
    "Tier",
    "VersionWriter",
    "from_location",
    "host_tier",
    "rank_tier",
]
