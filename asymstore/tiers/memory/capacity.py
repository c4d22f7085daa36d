"""The capacity of a bounded memory tier: accounting, eviction and back-pressure.

:class:`BoundedTier` is the abstract base of the memory tiers
(:class:`~asymstore.tiers.memory.process.MemoryTier`, its
:class:`~asymstore.tiers.memory.gpu.GPUTier`, and
:class:`~asymstore.tiers.memory.shm.ShmTier`); the factory
:func:`~asymstore.tiers.memory.factory.host_tier` chooses between them.

This module holds what they share: the capacity accounting, eviction and
back-pressure. The bytes held never exceed ``capacity_bytes``. To make room
the oldest versions are evicted, except those the store *holds* (versions not
yet written to the tiers below, see :meth:`BoundedTier.hold`). When nothing more
can be evicted the back-pressure ``policy`` applies: ``"wait"`` until a held
version is released (up to ``wait_timeout_s``), or ``"skip"`` the new version
(:class:`SnapshotSkippedError`). Memory never grows past the capacity.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Literal

from asymstore.errors import CapacityError, SnapshotSkippedError, StepCommittedError
from asymstore.tiers.protocol import Buffer, VersionWriter

logger = logging.getLogger(__name__)

BackPressure = Literal["wait", "skip"]
"""What a full memory tier does with a new version: wait for room, or skip the version."""


class BoundedTier(abc.ABC):
    """A tier in host (or device) memory that never holds more than ``capacity_bytes``.

    Subclasses implement the storage (the Tier protocol and the ReadIntoTier
    and ProbeableTier capabilities) and the two hooks ``_drop`` and
    ``_writer``; this class admits versions (:meth:`begin`), evicts and
    applies back-pressure.

    Args:
        capacity_bytes: most bytes held at once (committed plus in flight).
        name: the tier's name in reports.
        keep_last: this tier's retention; None uses the store's.
        policy: back-pressure when full: ``"wait"`` or ``"skip"``.
        wait_timeout_s: longest wait under ``"wait"`` (None: no limit), then CapacityError.
    """

    persistent = False

    def __init__(self, capacity_bytes: int = 2 << 30, *, name: str | None = None, keep_last: int | None = None,
                 policy: BackPressure = "wait", wait_timeout_s: float | None = None) -> None:
        """Check the settings and start the accounting."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if policy not in ("wait", "skip"):
            raise ValueError(f"policy must be 'wait' or 'skip', got {policy!r}")
        self.capacity_bytes = capacity_bytes
        self.keep_last = keep_last
        self.policy = policy
        self.wait_timeout_s = wait_timeout_s
        self.name = name or "host"
        self._sizes: dict[int, int] = {}  # committed versions' bytes
        self._held: set[int] = set()
        self._space = asyncio.Condition()
        self._reserved = 0  # writers in flight
        self._leftover_bytes = 0  # dead writers' shared-memory files not removed (yet)
        self.high_water_bytes = 0
        self.skipped = 0

    @property
    @abc.abstractmethod
    def path(self) -> str | None:
        """The shared-memory directory, or None for process memory."""

    @property
    def used_bytes(self) -> int:
        """Bytes held by committed versions, reservations in flight and dead writers' leftovers."""
        return sum(self._sizes.values()) + self._reserved + self._leftover_bytes

    # What each kind implements: the storage itself (the Tier protocol and the
    # ReadIntoTier and ProbeableTier capabilities), and the two hooks below.

    @abc.abstractmethod
    async def _drop(self, step: int) -> None:
        """Remove ``step``'s bytes and stop counting them (callers wake waiters)."""

    @abc.abstractmethod
    async def _writer(self, step: int, nbytes: int) -> VersionWriter:
        """Return the writer of ``step`` once ``nbytes`` are reserved."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Prepare the tier (the shared-memory kind accounts for the versions already there)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the tier (process memory is given back; shared-memory files stay)."""

    @abc.abstractmethod
    async def list_versions(self) -> list[int]:
        """Return the held steps, ascending."""

    @abc.abstractmethod
    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest of ``step`` (VersionNotFoundError if absent)."""

    @abc.abstractmethod
    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Return a private copy of one segment (of ``size`` bytes when given)."""

    @abc.abstractmethod
    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        """Copy ranges of one segment straight into caller buffers (digests of the ranges, or None)."""

    @abc.abstractmethod
    async def quarantine(self, step: int) -> None:
        """Drop a corrupt version, or move it aside where there are files."""

    @abc.abstractmethod
    def calibration_key(self) -> str | None:
        """Identify where the tier writes for the calibration cache (None: measure each time)."""

    @abc.abstractmethod
    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Time one segment-like write per size."""

    @abc.abstractmethod
    async def write_latest(self, step: int) -> None:
        """Record the LATEST hint (where there are files)."""

    @abc.abstractmethod
    async def read_latest(self) -> int | None:
        """Return the LATEST hint, or None."""

    async def begin(self, step: int, nbytes: int) -> VersionWriter:
        """Reserve ``nbytes``: evict unheld old versions, then wait or skip by policy."""
        if step in self._sizes:
            raise StepCommittedError(f"step {step} is already held by {self.name}")
        if nbytes > self.capacity_bytes:
            raise CapacityError(f"{nbytes} bytes exceed {self.name} capacity {self.capacity_bytes}")
        deadline = None if self.wait_timeout_s is None else time.monotonic() + self.wait_timeout_s
        async with self._space:
            while True:
                for old in sorted(set(self._sizes) - self._held):
                    if self.used_bytes + nbytes <= self.capacity_bytes:
                        break
                    logger.info("%s: evicting step %d to make room for step %d", self.name, old, step)
                    await self._drop(old)
                if self.used_bytes + nbytes <= self.capacity_bytes:
                    break
                if self.policy == "skip":
                    self.skipped += 1
                    raise SnapshotSkippedError(f"{self.name} full ({self.used_bytes} of {self.capacity_bytes} "
                                               f"bytes held): skipping step {step}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CapacityError(f"{self.name}: no room for step {step} after {self.wait_timeout_s} s")
                try:
                    await asyncio.wait_for(self._space.wait(), left)
                except TimeoutError:
                    continue
            self._reserved += nbytes
            self.high_water_bytes = max(self.high_water_bytes, self.used_bytes)
        return await self._writer(step, nbytes)

    def hold(self, step: int) -> None:
        """Keep ``step`` from eviction until :meth:`release` (the store holds versions not yet flushed below)."""
        self._held.add(step)

    async def release(self, step: int) -> None:
        """Let ``step`` be evicted again, and wake writers waiting for room."""
        self._held.discard(step)
        await self._notify()

    async def delete_version(self, step: int) -> None:
        """Drop a version and give its memory back."""
        await self._drop(step)
        await self._notify()

    async def _notify(self) -> None:
        async with self._space:
            self._space.notify_all()

    def _forget(self, step: int) -> None:
        """Stop counting ``step`` (its bytes are gone)."""
        self._sizes.pop(step, None)
        self._held.discard(step)


class Reservation:
    """The bytes one writer reserved in :meth:`BoundedTier.begin`, given back exactly once.

    Args:
        tier: the tier the bytes were reserved on.
        step: the version being written.
        nbytes: the bytes reserved.
    """

    def __init__(self, tier: BoundedTier, step: int, nbytes: int) -> None:
        self.tier = tier
        self.step = step
        self.nbytes = nbytes
        self.done = False

    async def settle(self, kept: int | None) -> None:
        """Give the reservation back; ``kept`` (the published version's bytes) is counted from now on.

        Args:
            kept: bytes the published version holds, or None when it was aborted.
        """
        if kept is not None:
            self.tier._sizes[self.step] = kept
        if not self.done:
            self.done = True
            self.tier._reserved -= self.nbytes
        await self.tier._notify()
