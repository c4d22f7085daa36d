"""asymstore: manifest-versioned, tiered checkpoint storage with atomic commits.

Quick start::

    from asymstore import AsymStore, HostTier, LocalTier

    async with AsymStore([HostTier(capacity_bytes=2 << 30), LocalTier("ckpt")], keep_last=3) as s:
        await s.put_many(step, state_dict)
        await s.commit(step, meta={"lr": 1e-3})
        ckpt = await s.restore()
"""

from asymstore.batcher import FlushStats, TierStatus
from asymstore.calibration import TierCalibration
from asymstore.codec import PlaneCodec
from asymstore.errors import (
    AsymstoreError,
    CapacityError,
    CodecError,
    CorruptVersionError,
    DuplicateNameError,
    EmptyStepError,
    InvalidMetaError,
    InvalidNameError,
    InvalidStepError,
    InvalidValueError,
    ManifestError,
    NoCheckpointError,
    SnapshotSkippedError,
    StepCommittedError,
    StepOrderError,
    StoreClosedError,
    TierError,
    VersionNotFoundError,
)
from asymstore.manifest import Manifest
from asymstore.restore import Checkpoint
from asymstore.store import AsymStore, CommitResult
from asymstore.tiers import GPUTier, HostTier, LocalTier, NVMeTier, RemoteTier, Tier, VersionWriter

__version__ = "0.1.0"

__all__ = [
    "AsymStore",
    "AsymstoreError",
    "CapacityError",
    "Checkpoint",
    "CodecError",
    "CommitResult",
    "CorruptVersionError",
    "DuplicateNameError",
    "EmptyStepError",
    "FlushStats",
    "GPUTier",
    "HostTier",
    "InvalidMetaError",
    "InvalidNameError",
    "InvalidStepError",
    "InvalidValueError",
    "LocalTier",
    "Manifest",
    "ManifestError",
    "NVMeTier",
    "NoCheckpointError",
    "PlaneCodec",
    "RemoteTier",
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
]
