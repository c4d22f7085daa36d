"""Storage tiers: the :class:`Tier` protocol and its implementations."""

from asymstore.tiers.base import Tier, VersionWriter
from asymstore.tiers.gpu import GPUTier
from asymstore.tiers.host import HostTier
from asymstore.tiers.local import LocalTier
from asymstore.tiers.nvme import NVMeTier
from asymstore.tiers.remote import RemoteTier

__all__ = ["GPUTier", "HostTier", "LocalTier", "NVMeTier", "RemoteTier", "Tier", "VersionWriter"]
