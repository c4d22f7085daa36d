"""The exception hierarchy of asymstore.

Every error raised on purpose by asymstore or asymcheck derives from
:class:`AsymstoreError`, so ``except AsymstoreError`` catches them all. The
hierarchy is flat on purpose: callers catch the leaf they care about.
"""

from __future__ import annotations


class AsymstoreError(Exception):
    """Root of every error raised on purpose by asymstore and asymcheck."""


class InvalidNameError(AsymstoreError, ValueError):
    """A tensor name is empty, absolute, contains ``..`` or NUL, or is not a str."""


class DuplicateNameError(AsymstoreError, ValueError):
    """The same tensor name was put twice for one step."""


class InvalidValueError(AsymstoreError, TypeError):
    """A value given to ``put`` is not a dense tensor of a storable dtype."""


class DestinationMismatchError(InvalidValueError):
    """A tensor given to restore into has another dtype or shape than the stored one, or is not stored."""


class InvalidMetaError(AsymstoreError, ValueError):
    """User metadata is not strict JSON (dict with str keys, no NaN/inf)."""


class InvalidStepError(AsymstoreError, ValueError):
    """A step is not a non-negative integer."""


class StepCommittedError(AsymstoreError):
    """A ``put`` or ``commit`` names a step that is already committed."""


class StepOrderError(AsymstoreError):
    """A step is not greater than the newest committed step."""


class EmptyStepError(AsymstoreError):
    """``commit`` was called for a step with nothing put."""


class VersionNotFoundError(AsymstoreError, LookupError):
    """The requested version does not exist on any tier."""


class NoCheckpointError(VersionNotFoundError):
    """No tier holds any restorable version."""


class CorruptVersionError(AsymstoreError):
    """A version failed verification (checksum, size, or manifest) on every tier."""


class SliceExchangeError(CorruptVersionError):
    """Slices of a replicated state exchanged between ranks at a restore did not verify, or did not fit together.

    A peer's shard manifest that differs from its digest in the global manifest, a received chunk whose
    checksum differs from the sender's manifest, or pieces that do not cover a tensor exactly: the
    version is refused on every rank (see :mod:`asymstore.multirank.sliceexchange`).
    """


class ManifestError(CorruptVersionError):
    """A manifest is not valid JSON of a known format version."""


class CodecError(CorruptVersionError):
    """A stored chunk names an unknown codec or its bytes do not decode."""


class CapacityError(AsymstoreError):
    """A version does not fit in a bounded tier, even after evicting old versions."""


class SnapshotSkippedError(CapacityError):
    """A bounded tier is full under the ``skip`` back-pressure policy: this version is not stored there."""


class TierError(AsymstoreError):
    """A tier failed to read, write, publish or delete."""


class RootLockedError(AsymstoreError):
    """Another writer holds the root of a tier (one writer per root; the message names the holder)."""


class ReadOnlyStoreError(AsymstoreError):
    """``put`` or ``commit`` on a store opened with ``read_only=True``."""


class StoreClosedError(AsymstoreError):
    """The store is not open (use ``async with AsymStore(...)``)."""


class LayoutError(ManifestError):
    """A version's tensor layout metadata (``meta["layout"]``) is malformed or contradicts its tensors."""


class PeerError(TierError):
    """The peer tier's transport failed or its peer is gone (the replica is not there)."""


class PeerProtocolError(PeerError):
    """A peer sent bytes that are not a well-formed frame of the replication protocol."""


def describe(exc: BaseException) -> str:
    """Return a one-line reason for a failed load."""
    if isinstance(exc, AsymstoreError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc!r}"


def relayed(name: str, message: str, default: type[AsymstoreError]) -> AsymstoreError:
    """The error another rank relayed by its type name, typed again: one of the multi-rank errors, else ``default``.

    The names a coordinator relays to every rank (restore, the look at a root's layout at open) are
    those of :data:`RELAYED`; any other name becomes ``default`` with the same message.
    """
    for cls in RELAYED:
        if cls.__name__ == name:
            return cls(message)
    return default(message)


# -- multi-rank ----------------------------------------------------------------




class GlobalCommitError(AsymstoreError):
    """A rank's shard is committed but the global version was not published.

    The previous global version stays the newest restorable one; the shards of
    this step are reported by fsck as ``partial``.
    """


class GlobalVersionDroppedError(GlobalCommitError):
    """A rank dropped its version of the step (an edit between steps, a skipped version): no global version.

    The coordinator abandons the step as soon as the report arrives, so the
    next step commits on time; not a storage failure.
    """


class ReplicasDifferError(GlobalVersionDroppedError):
    """Ranks wrote slices of a replicated state that is not the same on every rank: no global version.

    The job falls back to whole copies of the replicated state on every rank (a WARNING says so); a
    version whose replicas differ is never published (see :mod:`asymstore.format.replicas`).
    """


class GlobalCommitTimeoutError(GlobalCommitError, TimeoutError):
    """Not every rank reported its shard committed before the timeout."""


class CoordinationTimeoutError(AsymstoreError, TimeoutError):
    """A rank waited too long for the coordinator (or the coordinator for the ranks) outside a commit."""


class CoordinationProtocolError(AsymstoreError, ValueError):
    """A value another rank put on the coordination store is no payload of the multi-rank protocol.

    Not strict JSON, larger than the protocol allows, or of the wrong shape or types
    (:mod:`asymstore.multirank.protocol`); the message names the key.
    """


class WorldSizeMismatchError(AsymstoreError, ValueError):
    """The global version was written by another number of ranks and the store does not reshard.

    See ``RankStore.reshard`` (the Checkpointer sets it; DeepSpeed versions are never resharded).
    """


class GlobalManifestError(CorruptVersionError):
    """A global manifest is not valid JSON of a known format version."""


class RootLayoutError(AsymstoreError):
    """A root's layout record (``LAYOUT.json``) is not a valid record: a symlink, too large, not JSON, unknown fields.

    Nothing is guessed in its place: fix or remove the file (fsck names it), then open the root again.
    See :mod:`asymstore.multirank.rootlayout`.
    """


class RootLayoutConflictError(RootLayoutError):
    """A root holds versions of two layouts (single-process and multi-rank) and nothing says which is current.

    A root written before layouts were recorded that holds both, or a record that contradicts what
    the root holds. The message names each layout found, its world size and its newest step.
    """


class LayoutTakeoverError(RootLayoutConflictError):
    """A multi-rank job would publish its first version beside a single-process root's versions unread.

    It neither resumed them (``restore``) nor was told to start beside them
    (``across_layouts="start_fresh"``); nothing is committed or published, on
    every rank alike. The message names what the root holds and both ways on.

    Attributes:
        every_rank: raised by every rank's check before the commit (the same answer everywhere), not by
            the coordinator's last check at publish (that one reaches the other ranks as a failed commit).
    """

    every_rank: bool = False


class RootUnreadableError(RootLayoutError, OSError):
    """A root's entries cannot be listed (permission denied, an I/O error): its layout cannot be judged.

    Also an ``OSError``, as the failure it reports.
    """


# -- remote tiers and export ---------------------------------------------------


class PermanentRemoteError(TierError):
    """A remote operation failed in a way retrying cannot fix (credentials, missing bucket)."""


class RemoteUnavailableError(TierError):
    """A remote operation kept failing with transient errors until its deadline."""


class ExportError(AsymstoreError):
    """A version cannot be exported as asked (nothing matches, a dtype the format lacks, a sharded version)."""


# -- DCP storage (asymstore.dcp) -------------------------------------------------


class DCPStorageError(AsymstoreError, ValueError):
    """``torch.distributed.checkpoint`` asked the DCP storage for something it refuses.

    Several ranks without a :class:`~asymstore.multirank.RankStore`, ``use_collectives=False``,
    a ``checkpoint_id`` that names no step, a newer save begun before this one finished, planner
    data that strict JSON cannot hold (unless pickling it was allowed), or ranks that chose
    different versions to load. Nothing committed is changed.
    """


class DCPMetadataError(CorruptVersionError):
    """A version's DCP metadata (``.dcp/metadata``) is missing, malformed or contradicts its shards."""


# -- torchft healing (asymstore.torchft) --------------------------------------------


class HealError(AsymstoreError):
    """A replica group's heal through :class:`asymstore.torchft.StoreTransport` failed; nothing was loaded.

    torchft's Manager logs it and reports it (the step is not committed), and the next quorum heals again.
    """


class HealVersionMissingError(HealError, VersionNotFoundError):
    """The healthy replica's store holds no committed version of the step the quorum asked for."""


class HealCorruptError(HealError, CorruptVersionError):
    """The bytes a healthy replica served do not verify against the version's manifest (or its state record)."""


class HealProtocolError(HealError, ValueError):
    """A peer's metadata or answer is not the serving protocol, or a state has no pickle-free form.

    Malformed, or beyond the protocol's bounds; nothing was loaded.
    """


class HealTimeoutError(HealError, TimeoutError):
    """The version did not arrive (or was not committed on the serving side) within the Manager's timeout."""


RELAYED: tuple[type[AsymstoreError], ...] = (
    NoCheckpointError, VersionNotFoundError, WorldSizeMismatchError, CorruptVersionError, DestinationMismatchError,
    RootLayoutError, RootLayoutConflictError, RootUnreadableError, RootLockedError,
)
"""The errors a coordinator relays to every rank by type name (:func:`relayed`)."""
