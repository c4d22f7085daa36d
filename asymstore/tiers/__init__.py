"""Storage tiers: the :class:`Tier` protocol and its implementations."""

from asymstore.tiers.base import Tier, VersionWriter
from asymstore.tiers.host import HostTier
from asymstore.tiers.local import LocalTier

__all__ = ["HostTier", "LocalTier", "Tier", "VersionWriter"]
