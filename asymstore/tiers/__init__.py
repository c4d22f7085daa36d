"""Storage tiers: the :class:`Tier` protocol and its implementations.

The implementations are imported on first use, so importing one tier (as
``python -m asymstore.fsck`` does with :class:`LocalTier`) does not import
torch through the memory tiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymstore.lazy import lazy_getattr
from asymstore.tiers.base import Tier, VersionWriter

if TYPE_CHECKING:
    from asymstore.tiers.gpu import GPUTier
    from asymstore.tiers.host import HostTier
    from asymstore.tiers.local import LocalTier
    from asymstore.tiers.nvme import NVMeTier
    from asymstore.tiers.remote import RemoteTier

_LAZY = {
    "GPUTier": "asymstore.tiers.gpu",
    "HostTier": "asymstore.tiers.host",
    "LocalTier": "asymstore.tiers.local",
    "NVMeTier": "asymstore.tiers.nvme",
    "RemoteTier": "asymstore.tiers.remote",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = ["GPUTier", "HostTier", "LocalTier", "NVMeTier", "RemoteTier", "Tier", "VersionWriter"]
