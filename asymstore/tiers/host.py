"""HostTier: a bounded tier in host memory, optionally in shared-memory files.

Without ``path`` versions live in process memory and die with the process.
With ``path`` (for example ``/dev/shm/asym-job42``) versions are files on a
tmpfs in the same layout as :class:`LocalTier`, so a training process that
was killed can be restarted on the same node and restore without touching
disk. Either way the bytes held never exceed ``capacity_bytes``: older
versions are evicted to make room, and a version that does not fit even then
raises :class:`CapacityError` (the store then skips this tier for it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from asymstore.calibration import probe_memory
from asymstore.errors import CapacityError, StepCommittedError, TierError, VersionNotFoundError
from asymstore.manifest import validate_segment_name
from asymstore.tiers.base import Buffer, VersionWriter
from asymstore.tiers.local import LocalTier

logger = logging.getLogger(__name__)


@dataclass
class _MemVersion:
    manifest: bytes = b""
    segments: dict[str, bytearray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(len(s) for s in self.segments.values())


class HostTier:
    """Bounded host-memory tier.

    Args:
        capacity_bytes: most bytes held at once (committed plus in flight).
        path: a tmpfs directory for shared-memory files; None keeps versions
            in process memory.
        name: the tier's name in reports.
        keep_last: this tier's retention; None uses the store's.
    """

    persistent = False

    def __init__(self, capacity_bytes: int = 2 << 30, *, path: str | os.PathLike[str] | None = None,
                 name: str | None = None, keep_last: int | None = None) -> None:
        """Create the tier; nothing is allocated before use."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.keep_last = keep_last
        self._files = LocalTier(path, fsync=False) if path is not None else None
        self.name = name or (f"host:{self._files.root}" if self._files else "host:memory")
        self._mem: dict[int, _MemVersion] = {}
        self._sizes: dict[int, int] = {}
        self._reserved = 0
        self.high_water_bytes = 0

    def __repr__(self) -> str:
        """Return a short description."""
        where = self._files.root if self._files else "memory"
        return f"HostTier({where!r}, capacity_bytes={self.capacity_bytes})"

    @property
    def path(self) -> str | None:
        """The shared-memory directory, or None for process memory."""
        return self._files.root if self._files else None

    @property
    def used_bytes(self) -> int:
        """Bytes held by committed versions plus reservations in flight."""
        return sum(self._sizes.values()) + self._reserved

    async def open(self) -> None:
        """Open the backing directory and account for versions already in it."""
        if self._files:
            await self._files.open()
            for step in await self._files.list_versions():
                self._sizes[step] = await asyncio.to_thread(_dir_size, self._files._vdir(step))

    async def close(self) -> None:
        """Drop in-memory versions (shared-memory files stay for a restart)."""
        self._mem.clear()

    async def list_versions(self) -> list[int]:
        """Return the held steps, ascending."""
        if self._files:
            steps = await self._files.list_versions()
            for gone in set(self._sizes) - set(steps):
                del self._sizes[gone]
            return steps
        return sorted(self._mem)

    async def begin(self, step: int, nbytes: int) -> VersionWriter:
        """Reserve ``nbytes``, evicting the oldest versions if needed."""
        if step in self._sizes:
            raise StepCommittedError(f"step {step} is already held by {self.name}")
        if nbytes > self.capacity_bytes:
            raise CapacityError(f"{nbytes} bytes exceed {self.name} capacity {self.capacity_bytes}")
        for old in sorted(self._sizes):
            if self.used_bytes + nbytes <= self.capacity_bytes:
                break
            logger.info("%s: evicting step %d to make room for step %d", self.name, old, step)
            await self.delete_version(old)
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise CapacityError(f"{self.name}: {nbytes} bytes do not fit ({self.used_bytes} in flight)")
        self._reserved += nbytes
        self.high_water_bytes = max(self.high_water_bytes, self.used_bytes)
        inner = await self._files.begin(step, nbytes) if self._files else None
        return _HostWriter(self, step, nbytes, inner)

    def _release(self, nbytes: int) -> None:
        self._reserved -= nbytes

    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest of ``step``."""
        if self._files:
            return await self._files.read_manifest(step)
        if step not in self._mem:
            raise VersionNotFoundError(f"step {step} not on {self.name}")
        return self._mem[step].manifest

    async def read_segment(self, step: int, name: str) -> Buffer:
        """Return a private copy of one segment."""
        if self._files:
            return await self._files.read_segment(step, name)
        validate_segment_name(name)
        version = self._mem.get(step)
        if version is None or name not in version.segments:
            raise TierError(f"segment {name} of step {step} missing on {self.name}")
        return bytearray(version.segments[name])

    async def delete_version(self, step: int) -> None:
        """Drop a version."""
        if self._files:
            await self._files.delete_version(step)
        self._mem.pop(step, None)
        self._sizes.pop(step, None)

    async def quarantine(self, step: int) -> None:
        """Drop a corrupt version (memory) or move it aside (shared-memory files)."""
        if self._files:
            await self._files.quarantine(step)
        self._mem.pop(step, None)
        self._sizes.pop(step, None)

    def calibration_key(self) -> str | None:
        """Identify the tmpfs of ``path`` for the calibration cache; None (measure each time) in memory."""
        if self._files:
            return "host-" + self._files.calibration_key()
        return None

    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Time one segment-like write per size (a file on the tmpfs, or a copy into memory)."""
        if self._files:
            return await self._files.probe_writes(sizes)
        return await asyncio.to_thread(probe_memory, sizes)

    async def write_latest(self, step: int) -> None:
        """Record the LATEST hint (shared-memory files only)."""
        if self._files:
            await self._files.write_latest(step)

    async def read_latest(self) -> int | None:
        """Return the LATEST hint."""
        if self._files:
            return await self._files.read_latest()
        return max(self._mem) if self._mem else None


class _HostWriter:
    def __init__(self, tier: HostTier, step: int, nbytes: int, inner: VersionWriter | None) -> None:
        self.tier = tier
        self.step = step
        self.reserved = nbytes
        self.inner = inner
        self.version = _MemVersion()
        self.done = False

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        validate_segment_name(name)
        if self.inner:
            await self.inner.write_segment(name, parts)
        else:
            self.version.segments[name] = await asyncio.to_thread(_join, parts)

    async def publish(self, manifest: bytes) -> None:
        if self.inner:
            await self.inner.publish(manifest)
        else:
            self.version.manifest = bytes(manifest)
            self.tier._mem[self.step] = self.version
        self.tier._sizes[self.step] = self.version.nbytes if not self.inner else self.reserved
        self._finish()

    async def abort(self) -> None:
        if self.inner:
            await self.inner.abort()
        self._finish()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.tier._release(self.reserved)


def _join(parts: Sequence[Buffer]) -> bytearray:
    out = bytearray(sum(len(p) for p in parts))
    view = memoryview(out)
    pos = 0
    for part in parts:
        view[pos:pos + len(part)] = part
        pos += len(part)
    return out


def _dir_size(path: str) -> int:
    total = 0
    for entry in os.scandir(path):
        if entry.is_file():
            total += entry.stat().st_size
    return total
