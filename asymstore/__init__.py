"""asymstore: manifest-versioned, tiered checkpoint storage with atomic commits.

Quick start::

    from asymstore import AsymStore, HostTier, LocalTier

    async with AsymStore([HostTier(capacity_bytes=2 << 30), LocalTier("ckpt")], keep_last=3) as s:
        await s.put_many(step, state_dict)
        await s.commit(step, meta={"lr": 1e-3})
        ckpt = await s.restore()

The errors are imported eagerly; everything else on first use, so light
tools (``python -m asymstore.fsck``) start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asymstore.errors import (
    AsymstoreError,
    CapacityError,
    CodecError,
    CoordinationTimeoutError,
    CorruptVersionError,
    DCPMetadataError,
    DCPStorageError,
    DestinationMismatchError,
    DuplicateNameError,
    EmptyStepError,
    ExportError,
    GlobalCommitError,
    GlobalCommitTimeoutError,
    GlobalManifestError,
    GlobalVersionDroppedError,
    InvalidMetaError,
    InvalidNameError,
    InvalidStepError,
    InvalidValueError,
    LayoutError,
    ManifestError,
    NoCheckpointError,
    PeerError,
    PeerProtocolError,
    PermanentRemoteError,
    ReadOnlyStoreError,
    RemoteUnavailableError,
    RootLockedError,
    SnapshotSkippedError,
    StepCommittedError,
    StepOrderError,
    StoreClosedError,
    TierError,
    VersionNotFoundError,
    WorldSizeMismatchError,
)
from asymstore.runtime.lazy import lazy_getattr

if TYPE_CHECKING:
    from asymstore.api import Checkpoint, CheckpointStore, CommitResult, FlushStats, TierCalibration, TierStatus
    from asymstore.format.codec import PlaneCodec
    from asymstore.format.manifest import Manifest
    from asymstore.policy.retention import KeepBest
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
    )

_LAZY = {
    "BoundedTier": "asymstore.tiers",
    "AsymStore": "asymstore.store",
    "Checkpoint": "asymstore.api",
    "CheckpointStore": "asymstore.api",
    "CommitResult": "asymstore.api",
    "FlushStats": "asymstore.api",
    "GPUTier": "asymstore.tiers",
    "HostTier": "asymstore.tiers",
    "KeepBest": "asymstore.policy.retention",
    "LocalTier": "asymstore.tiers",
    "Manifest": "asymstore.format.manifest",
    "NVMeTier": "asymstore.tiers",
    "PeerTier": "asymstore.tiers",
    "PlaneCodec": "asymstore.format.codec",
    "RemoteTier": "asymstore.tiers",
    "Tier": "asymstore.tiers",
    "TierCalibration": "asymstore.api",
    "TierStatus": "asymstore.api",
    "VersionWriter": "asymstore.tiers",
    "open_store": "asymstore.opener",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__version__ = "0.1.0"

__all__ = [
    "AsymStore",
    "AsymstoreError",
    "BoundedTier",
    "CapacityError",
    "Checkpoint",
    "CheckpointStore",
    "CodecError",
    "CommitResult",
    "CoordinationTimeoutError",
    "CorruptVersionError",
    "DCPMetadataError",
    "DCPStorageError",
    "DestinationMismatchError",
    "DuplicateNameError",
    "EmptyStepError",
    "ExportError",
    "FlushStats",
    "GPUTier",
    "GlobalCommitError",
    "GlobalCommitTimeoutError",
    "GlobalManifestError",
    "GlobalVersionDroppedError",
    "HostTier",
    "InvalidMetaError",
    "InvalidNameError",
    "InvalidStepError",
    "InvalidValueError",
    "KeepBest",
    "LayoutError",
    "LocalTier",
    "Manifest",
    "ManifestError",
    "NVMeTier",
    "NoCheckpointError",
    "PeerError",
    "PeerProtocolError",
    "PeerTier",
    "PermanentRemoteError",
    "PlaneCodec",
    "ReadOnlyStoreError",
    "RemoteTier",
    "RemoteUnavailableError",
    "RootLockedError",
    "SnapshotSkippedError",
    "StepCommittedError",
    "StepOrderError",
    "StoreClosedError",
    "Tier",
    "TierCalibration",
    "TierError",
    "TierStatus",
    "VersionNotFoundError",
    "VersionWriter",
    "WorldSizeMismatchError",
]
