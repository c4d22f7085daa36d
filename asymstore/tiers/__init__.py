"""Storage tiers: the :class:`Tier` protocol and its implementations.

The implementations are imported on first use, so importing one tier (as
``python -m asymstore.fsck`` does with :class:`LocalTier`) does not import
torch through the memory tiers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    """Import a tier class on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asymstore.tiers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["GPUTier", "HostTier", "LocalTier", "NVMeTier", "RemoteTier", "Tier", "VersionWriter"]
