"""The store protocol and its capabilities: what the adapters program against.

:class:`CheckpointStore` is the protocol ``asymcheck`` programs against; both
:class:`~asymstore.AsymStore` and :class:`~asymstore.multirank.RankStore` satisfy it, and
``isinstance(x, CheckpointStore)`` tells a store from the other things an adapter accepts (tiers,
a directory). **Capabilities** are optional ``runtime_checkable`` protocols an adapter checks with
``isinstance``: :class:`DropReportingStore`, :class:`KnownBytesStore`, :class:`CollectiveStore` (one rank's part of a
multi-rank checkpoint), :class:`ReshardingStore` and :class:`ReplicaSlicingStore`. The values they pass are in
:mod:`asymstore.values`.

Guide: ``docs/guides/store.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.manifest import Manifest
from asymstore.values import Checkpoint, CommitResult, KnownChunks, Targets, TierStatus

if TYPE_CHECKING:
    from asymstore.dist.fabric import Fabric
    from asymstore.values import Into


# -- the store protocol and its capabilities ------------------------------------


@runtime_checkable
class CheckpointStore(Protocol):
    """A versioned checkpoint store, as the adapters use it (see the module docstring)."""

    async def open(self) -> Self:
        """Open the store (before any other call); return it."""
        ...

    async def close(self) -> None:
        """Wait for what the store still writes, then close it."""
        ...

    def versions(self) -> dict[str, list[int]]:
        """Committed steps per tier name, ascending."""
        ...

    @property
    def newest_step(self) -> int | None:
        """The newest committed step, or None."""
        ...

    @property
    def newest_persistent_step(self) -> int | None:
        """The newest step some persistent tier holds, or None."""
        ...

    async def flush(self, timeout_s: float | None = None) -> int | None:
        """Wait (at most ``timeout_s``) until a persistent tier holds the newest step; return the newest it holds."""
        ...

    def status(self) -> dict[str, TierStatus]:
        """Per tier: versions, lag, errors (see :meth:`asymstore.AsymStore.status`)."""
        ...

    async def adopt_many(self, step: int, tensors: Mapping[str, object], *,
                         release: Callable[[], None] | None = None) -> None:
        """Stage ``tensors`` for ``step`` without copying; ``release`` runs once the store is done with them."""
        ...

    def abandon(self, step: int) -> None:
        """Drop everything staged for an uncommitted ``step`` (adopted tensors are released)."""
        ...

    async def commit(self, step: int, meta: Mapping[str, Any] | None = None) -> CommitResult:
        """Commit ``step`` with its JSON ``meta``; return once it is durable."""
        ...

    async def restore(self, step: int | None = None, *, into: Into | None = None) -> Checkpoint:
        """Return the newest version that verifies (or ``step``), optionally read into ``into``."""
        ...

    async def read_manifest(self, step: int | None = None) -> Manifest:
        """The manifest of the newest version whose manifest reads (or of ``step``); no tensor is read."""
        ...


@runtime_checkable
class KnownBytesStore(Protocol):
    """A store that stages tensors whose chunk checksums the caller already holds, hashing nothing.

    :class:`~asymstore.AsymStore` is one. The Checkpointer hands it the private host copies of
    parameters known to be unchanged since an earlier version (frozen, in no optimizer param
    group, not edited: :mod:`asymcheck.snapshot.frozen`), so a version neither copies them from
    the device nor hashes them again; each :class:`~asymstore.tiers.protocol.ReferencingTier`
    then references the chunks it holds (same name, dtype, shape, bytes and checksum, held
    committed there), and every other tier writes the bytes, which are right there.
    """

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk of one tensor (the checksums must be taken with it)."""
        ...

    async def adopt_known(self, step: int, tensors: Mapping[str, KnownChunks]) -> None:
        """Stage every ``name -> KnownChunks`` for ``step`` without copying or hashing it."""
        ...


@runtime_checkable
class DropReportingStore(Protocol):
    """A store whose commit of a step involves others, who must hear when this process will not commit it.

    :class:`~asymstore.multirank.RankStore` is one: a rank that drops a version
    (an edit between steps, a version skipped under back-pressure) reports it,
    so the coordinator abandons that step's global commit at once instead of
    waiting for the rank until its timeout. The adapters check for it with
    ``isinstance``.
    """

    async def report_dropped(self, step: int, reason: str) -> None:
        """Say that ``step`` will not be committed by this process, and why."""
        ...


@runtime_checkable
class CollectiveStore(CheckpointStore, Protocol):
    """A store that is one rank's part of a multi-rank checkpoint (:class:`~asymstore.multirank.RankStore` is one).

    Its versions are global: every rank commits the same steps, the
    coordinator (rank 0) publishes a global manifest once all did, and
    ``restore`` is collective (every rank loads the same global version, into
    fresh tensors). The adapters check for it with ``isinstance`` to agree on
    preemption through the job's key-value store, to restore collectively, and
    to know which global version a rank is on; the DeepSpeed adapter reads
    other ranks' shards through it.
    """

    published_step: int | None
    """The newest global step this rank saw published."""
    restored_global: GlobalManifest | None
    """The global version ``restore`` chose."""

    @property
    def rank(self) -> int:
        """This process's rank."""
        ...

    @property
    def world_size(self) -> int:
        """The job's number of ranks."""
        ...

    @property
    def is_coordinator(self) -> bool:
        """True on the rank that publishes global manifests."""
        ...

    def coordination(self) -> Fabric:
        """This rank's routes to the job's coordination, never a collective.

        After ``open``; ``StoreClosedError`` before.
        """
        ...

    def session_key(self, name: str) -> str:
        """A coordination key of this session, the same on every rank."""
        ...

    def global_steps(self) -> list[int]:
        """Published global steps, ascending."""
        ...

    def read_global(self, step: int) -> GlobalManifest:
        """The global manifest of ``step``."""
        ...

    def newest_global(self) -> GlobalManifest | None:
        """The newest global manifest that parses, or None."""
        ...

    async def read_shard(self, rank: int, step: int) -> Checkpoint:
        """Read and verify ``rank``'s shard ``step``."""
        ...

    async def read_shard_manifest(self, rank: int, step: int) -> Manifest:
        """Read ``rank``'s shard manifest ``step``."""
        ...


@runtime_checkable
class ReshardingStore(Protocol):
    """A store that can restore versions written by another number of ranks, given the pieces this rank holds now.

    ``reshard`` is None (refuse such versions: ``WorldSizeMismatchError``) or
    the :data:`Targets` function; the Checkpointer sets it for its model.
    """

    reshard: Targets | None


@runtime_checkable
class ReplicaSlicingStore(Protocol):
    """A multi-rank store whose ranks may each write only a slice of a replicated state.

    A writer puts a claim (:mod:`asymstore.format.replicas`) into each shard's meta; the store's
    coordinator refuses a version whose replicas differ across ranks and the job falls back to whole
    copies: ``replicas_whole`` turns True, and the writer writes whole copies from then on.
    """

    @property
    def rank(self) -> int:
        """This process's rank."""
        ...

    @property
    def world_size(self) -> int:
        """The job's number of ranks."""
        ...

    @property
    def replicas_whole(self) -> bool:
        """Whether the job fell back to whole copies of its replicated state."""
        ...

    @property
    def slices_readable(self) -> bool:
        """Whether a restore gets at every rank's slices (slices may be cut).

        Every rank reads the others' shards where they are written, or the ranks exchange their slices
        at a restore (:mod:`asymstore.multirank.sliceexchange`).
        """
        ...
