"""asymstore: manifest-versioned, tiered checkpoint storage with atomic commits.

Quick start::

    from asymstore import AsymStore, LocalTier, host_tier

    async with AsymStore([host_tier(capacity_bytes=2 << 30), LocalTier("ckpt")], keep_last=3) as s:
        await s.put_many(step, state_dict)
        await s.commit(step, meta={"lr": 1e-3})
        ckpt = await s.restore()

The errors training code catches are here (imported eagerly); every error is in
:mod:`asymstore.errors`. Everything else is imported on first use, so light tools
(``python -m asymstore.fsck``) start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymstore.errors import (
    AsymstoreError,
    CapacityError,
    CorruptVersionError,
    GlobalCommitError,
    NoCheckpointError,
    RootLockedError,
    StepOrderError,
    TierError,
    VersionNotFoundError,
    WorldSizeMismatchError,
)
from asymstore.runtime.lazy import lazy_getattr, moved_getattr

if TYPE_CHECKING:
    from asymstore.format.codec import PlaneCodec
    from asymstore.format.manifest import Manifest
    from asymstore.opener import open_store
    from asymstore.policy.retention import KeepBest
    from asymstore.protocols import CheckpointStore
    from asymstore.store import AsymStore
    from asymstore.tiers import (
        BoundedTier,
        GPUTier,
        HostTier,
        LocalTier,
        NVMeTier,
        PeerTier,
        RemoteTier,
        Tier,
        VersionWriter,
        host_tier,
    )
    from asymstore.values import Checkpoint, CommitResult, FlushStats, TierCalibration, TierStatus

_LAZY = {
    "BoundedTier": "asymstore.tiers",
    "AsymStore": "asymstore.store",
    "Checkpoint": "asymstore.values",
    "CheckpointStore": "asymstore.protocols",
    "CommitResult": "asymstore.values",
    "FlushStats": "asymstore.values",
    "GPUTier": "asymstore.tiers",
    "HostTier": "asymstore.tiers",
    "host_tier": "asymstore.tiers",
    "KeepBest": "asymstore.policy.retention",
    "LocalTier": "asymstore.tiers",
    "Manifest": "asymstore.format.manifest",
    "NVMeTier": "asymstore.tiers",
    "PeerTier": "asymstore.tiers",
    "PlaneCodec": "asymstore.format.codec",
    "RemoteTier": "asymstore.tiers",
    "Tier": "asymstore.tiers",
    "TierCalibration": "asymstore.values",
    "TierStatus": "asymstore.values",
    "VersionWriter": "asymstore.tiers",
    "open_store": "asymstore.opener",
}


_MOVED_ERRORS = (
    "CodecError",
    "CoordinationTimeoutError",
    "DCPMetadataError",
    "DCPStorageError",
    "DestinationMismatchError",
    "DuplicateNameError",
    "EmptyStepError",
    "ExportError",
    "GlobalCommitTimeoutError",
    "GlobalManifestError",
    "GlobalVersionDroppedError",
    "InvalidMetaError",
    "InvalidNameError",
    "InvalidStepError",
    "InvalidValueError",
    "LayoutError",
    "ManifestError",
    "PeerError",
    "PeerProtocolError",
    "PermanentRemoteError",
    "ReadOnlyStoreError",
    "RemoteUnavailableError",
    "SnapshotSkippedError",
    "StepCommittedError",
    "StoreClosedError",
)
"""Errors reached as ``asymstore.errors.X``; ``asymstore.X`` works for one release, with a DeprecationWarning."""

__getattr__ = moved_getattr(__name__, {name: ("asymstore.errors", name) for name in _MOVED_ERRORS},
                            fallback=lazy_getattr(__name__, _LAZY))


__version__ = "0.1.0"

__all__ = [
    "AsymStore",
    "AsymstoreError",
    "BoundedTier",
    "CapacityError",
    "Checkpoint",
    "CheckpointStore",
    "CommitResult",
    "CorruptVersionError",
    "FlushStats",
    "GPUTier",
    "GlobalCommitError",
    "HostTier",
    "KeepBest",
    "LocalTier",
    "Manifest",
    "NVMeTier",
    "NoCheckpointError",
    "PeerTier",
    "PlaneCodec",
    "RemoteTier",
    "RootLockedError",
    "StepOrderError",
    "Tier",
    "TierCalibration",
    "TierError",
    "TierStatus",
    "VersionNotFoundError",
    "VersionWriter",
    "WorldSizeMismatchError",
    "host_tier",
    "open_store",
]
