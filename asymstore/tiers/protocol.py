"""The tier protocol: the small interface every storage tier implements.

:class:`asymstore.AsymStore` calls a tier in a fixed order: ``open``; per version ``begin``, then
``write_segment`` for each segment, then exactly one of ``publish`` (the atomic commit point) or
``abort``; ``write_latest`` and ``delete_version`` (manifest first) after a publish; reads at any
time after ``open``; ``quarantine`` for a version that failed verification; ``close`` last.
Buffers given to ``write_segment`` stay valid only until the call returns; buffers returned by
``read_segment`` belong to the caller. Optional capabilities are protocols checked with
``isinstance``, never ``getattr``: :class:`ExclusiveTier`, :class:`StatTier`,
:class:`ProbeableTier`, :class:`HoldingTier`, :class:`ReadIntoTier`, :class:`ViewTier`,
:class:`ReferencingTier`, :class:`BytesProofTier`, and for writers :class:`ThreadedWriter`.

The call order step by step, and how to write a tier: docs/extending/tiers.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from asymstore.format.checksum import Buffer as Buffer  # the tier interface speaks in Buffers
from asymstore.io.rootlock import Swept


@runtime_checkable
class VersionWriter(Protocol):
    """Writes one version to one tier; see the module docstring for the call order."""

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        """Write one segment file made of ``parts`` concatenated, durably."""
        ...

    async def publish(self, manifest: bytes) -> None:
        """Write the manifest and make the version visible, atomically."""
        ...

    async def abort(self) -> None:
        """Remove whatever this writer wrote; the version never becomes visible."""
        ...


@runtime_checkable
class BytesProofTier(Protocol):
    """A tier that needs each segment's checksum over its bytes (optional; format 5's proofs: docs/concepts/format.md).

    By default a segment's checksum is derived from its chunks' checksums
    (``"chunks"`` proof, :mod:`asymstore.format.proof`: no second pass over
    its bytes). A tier whose far end checks each segment on arrival, before the
    version's manifest tells it where the chunks are (a peer's receiver), gets
    the ``"bytes"`` proof: one xxh3 pass over each segment at write time.
    """

    def wants_bytes_proof(self) -> bool:
        """True: prove every segment written to this tier by its bytes."""
        ...


@runtime_checkable
class ThreadedWriter(Protocol):
    """A version writer whose segments may be written from worker threads, several at once.

    The store's pipeline pool (:mod:`asymstore.write.pool`) then hashes and
    writes each segment on one of its threads; ``publish`` or ``abort`` comes
    only after every such write has returned. A subclass that changes how a
    segment is written overrides :meth:`write_segment_blocking` (the
    ``LocalTier`` writer's ``write_segment`` calls it).
    """

    def write_segment_blocking(self, name: str, parts: Sequence[Buffer]) -> None:
        """Write one segment file as ``write_segment`` does, blocking; safe to call from several threads at once.

        Raises:
            TierError: the write failed.
        """
        ...


@runtime_checkable
class Tier(Protocol):
    """A place that holds checkpoint versions; see the module docstring."""

    name: str
    persistent: bool
    keep_last: int | None

    async def open(self) -> None:
        """Prepare the tier (create directories, connect)."""
        ...

    async def close(self) -> None:
        """Release the tier's resources."""
        ...

    async def list_versions(self) -> list[int]:
        """Return the published steps, ascending."""
        ...

    async def begin(self, step: int, nbytes: int) -> VersionWriter:
        """Start writing version ``step`` of about ``nbytes`` bytes."""
        ...

    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest bytes of ``step`` (VersionNotFoundError if absent).

        Anything larger than :data:`~asymstore.format.manifest.MAX_MANIFEST_BYTES`
        raises CorruptVersionError unread.
        """
        ...

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Return the whole segment ``name`` of version ``step``.

        With ``size`` (what the manifest says), a stored object of another
        size raises CorruptVersionError before anything is read.
        """
        ...

    async def delete_version(self, step: int) -> None:
        """Delete version ``step``, manifest first."""
        ...

    async def quarantine(self, step: int) -> None:
        """Move a version that failed verification out of the listing."""
        ...

    async def write_latest(self, step: int) -> None:
        """Record ``step`` as the newest committed version (a hint)."""
        ...

    async def read_latest(self) -> int | None:
        """Return the LATEST hint, or None when absent or unreadable."""
        ...


@runtime_checkable
class ExclusiveTier(Protocol):
    """A tier whose root one writer owns at a time (optional capability).

    The store calls ``lock_root`` right after ``open`` (a second live writer
    gets :class:`~asymstore.errors.RootLockedError`), then ``sweep_leftovers``;
    it sweeps again after each publish and calls ``unlock_root`` after
    ``close``. Holding the root, the tier may remove every temporary entry
    it did not create itself: only a dead writer can have left it. A version
    without a manifest is removed only when older than ``oldest_kept``;
    any other one is moved to ``.quarantine/`` and reported.
    """

    async def lock_root(self) -> None:
        """Become the root's only writer, or raise RootLockedError naming the holder."""
        ...

    async def unlock_root(self) -> None:
        """Give the root up (idempotent)."""
        ...

    async def sweep_leftovers(self, *, oldest_kept: int | None = None) -> list[Swept]:
        """Remove what dead writers left under the root, quarantine what may be data; return what was swept.

        Args:
            oldest_kept: the oldest version retention keeps, given only while a
                retention rule is in force: a version without a manifest older than
                it is an interrupted retention delete, removed. Every other version
                without a manifest is moved to ``.quarantine/`` (None: all of them).
        """
        ...


@runtime_checkable
class StatTier(Protocol):
    """A tier that can check a segment's presence and size without reading it (optional; fsck uses it)."""

    async def stat_segment(self, step: int, name: str, size: int) -> None:
        """Raise CorruptVersionError (wrong size, not a regular file) or TierError (missing) unless it is whole."""
        ...


@runtime_checkable
class ProbeableTier(Protocol):
    """A tier that can time real writes to a scratch area of itself (optional; see :mod:`asymstore.policy`)."""

    def calibration_key(self) -> str | None:
        """Identify where the tier writes (None: do not cache its calibration)."""
        ...

    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Write one scratch file per size, as a segment is written; return seconds per write."""
        ...


@runtime_checkable
class HoldingTier(Protocol):
    """A bounded tier that evicts old versions, except those the store holds (optional).

    The store holds a version on its fast tiers while they keep the only
    copies (a memory tier as the durable one) until every slower tier has it.
    """

    def hold(self, step: int) -> None:
        """Keep ``step`` from eviction until :meth:`release`."""
        ...

    async def release(self, step: int) -> None:
        """Let ``step`` be evicted again."""
        ...


@runtime_checkable
class ReportingTier(Protocol):
    """A tier with threads of its own (a connection, a service) whose latest failure ``status()`` shows."""

    @property
    def background_error(self) -> str | None:
        """The latest failure of the tier's own threads, or None."""
        ...


@runtime_checkable
class ReadIntoTier(Protocol):
    """A tier that reads parts of a segment straight into caller buffers (optional; restore ``into=`` uses it)."""

    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        """Fill each ``(offset, view)`` with the segment's bytes ``[offset, offset + len(view))``.

        The segment must be ``size`` bytes (CorruptVersionError otherwise,
        before anything is read). The bytes are not verified here: the caller
        checks the chunk checksums on the filled buffers, or compares the
        xxh3-64 digests of the ranges when the tier returns them (computed
        while filling, in the order of ``ranges``; None: not computed).
        """
        ...


@runtime_checkable
class ViewTier(Protocol):
    """A tier that lends a stored segment without copying it (optional; the peer tier's holder sends from it)."""

    def view_segment(self, step: int, name: str, size: int | None = None) -> AbstractContextManager[memoryview]:
        """A read-only view of the whole segment ``name`` of ``step``, valid until the context exits.

        Entering raises as :meth:`Tier.read_segment` does (CorruptVersionError
        for another size than ``size``, VersionNotFoundError or TierError when
        absent). While the view is open the version's bytes stay as they were,
        even if the version is deleted or evicted meanwhile: its memory is given
        back (or its file's pages freed) once the last view is closed. Nothing
        may use the view, or a slice of it, after the context exits. Entered and
        exited on the tier's event loop thread, like every other call. A tier
        whose views are copies (device memory lent as a host copy) says so with
        a true ``lends_copies`` attribute: the store then never borrows its
        segments for background tiers (:mod:`asymstore.write.lending`).
        """
        ...


@runtime_checkable
class ReferencingTier(Protocol):
    """A tier whose versions may reference segments of its earlier versions instead of rewriting them (optional).

    Format 4 (docs/concepts/format.md): a chunk of version ``step`` may be
    stored in a segment of an earlier version on the same tier, always the one
    that wrote the bytes. Readers find it with ``read_segment(origin, name)``
    (:meth:`~asymstore.format.manifest.Manifest.locate`). The tier keeps such a
    segment while any version it holds, or one being written, references it:
    :meth:`Tier.delete_version` then removes the manifest first (the step is no
    longer a version) and only the segments nobody references; the others stay
    in the version's directory until the last version that references them is
    deleted, and the sweep leaves that directory alone. A tier without this
    capability is always written full bytes.
    """

    async def hold_references(self, step: int, refs: Mapping[int, Set[str]]) -> bool:
        """Keep the segments ``refs`` (earlier step -> segment names) for version ``step``, about to be written.

        Returns:
            True when every one is held here, committed (a version's, or one kept
            for versions that reference it): they then stay until ``step`` is
            deleted, or :meth:`release_references` (the write failed). False:
            nothing is held, and the version must be written full.
        """
        ...

    async def release_references(self, step: int) -> None:
        """Forget what :meth:`hold_references` held for ``step`` when it was not published (idempotent)."""
        ...
