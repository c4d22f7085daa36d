"""HostTier: a bounded tier in host memory, optionally in shared-memory files.

Without ``path`` versions live in process memory and die with the process.
With ``path`` (for example ``/dev/shm/asym-job42``) versions are files on a
tmpfs in the same layout as :class:`LocalTier`, so a training process that
was killed can be restarted on the same node and restore without touching
disk. In process memory, segments live in a :class:`BufferPool` of
page-locked buffers (when CUDA is present; plain memory otherwise) reused
from version to version.

The bytes held never exceed ``capacity_bytes``. To make room the oldest
versions are evicted, except those the store *holds* (versions not yet
written to the tiers below, see :meth:`HostTier.hold`). When nothing more can
be evicted the back-pressure ``policy`` applies: ``"wait"`` until a held
version is released (up to ``wait_timeout_s``), or ``"skip"`` the new version
(:class:`SnapshotSkippedError`). Memory never grows past the capacity.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asymstore.calibration import probe_memory
from asymstore.errors import (
    CapacityError,
    CorruptVersionError,
    SnapshotSkippedError,
    StepCommittedError,
    TierError,
    VersionNotFoundError,
)
from asymstore.manifest import validate_segment_name
from asymstore.rootlock import is_leftover_name
from asymstore.tensorbytes import as_bytes
from asymstore.tiers.base import Buffer, VersionWriter
from asymstore.tiers.local import LocalTier
from asymstore.tiers.pool import BufferPool

logger = logging.getLogger(__name__)


@dataclass
class _MemVersion:
    manifest: bytes = b""
    segments: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(s.numel() for s in self.segments.values())


class HostTier:
    """Bounded host-memory tier.

    Args:
        capacity_bytes: most bytes held at once (committed plus in flight).
        path: a tmpfs directory for shared-memory files; None keeps versions
            in process memory.
        name: the tier's name in reports.
        keep_last: this tier's retention; None uses the store's.
        policy: back-pressure when full: ``"wait"`` or ``"skip"``.
        wait_timeout_s: longest wait under ``"wait"`` (None: no limit), then CapacityError.
        pin: page-lock the pool's buffers; None pins when CUDA is available.
    """

    persistent = False

    def __init__(self, capacity_bytes: int = 2 << 30, *, path: str | os.PathLike[str] | None = None,
                 name: str | None = None, keep_last: int | None = None, policy: str = "wait",
                 wait_timeout_s: float | None = None, pin: bool | None = None) -> None:
        """Create the tier; nothing is allocated before use."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if policy not in ("wait", "skip"):
            raise ValueError(f"policy must be 'wait' or 'skip', got {policy!r}")
        self.capacity_bytes = capacity_bytes
        self.keep_last = keep_last
        self.policy = policy
        self.wait_timeout_s = wait_timeout_s
        self._files = LocalTier(path, fsync=False) if path is not None else None
        self.name = name or (f"host:{self._files.root}" if self._files else "host:memory")
        # size classes round each buffer up by < 1 MiB; the slack keeps rounding from refusing a version
        self._pool = None if self._files else BufferPool(
            capacity_bytes + capacity_bytes // 8 + (8 << 20), device=self._device(), pin=pin)
        self._mem: dict[int, _MemVersion] = {}
        self._sizes: dict[int, int] = {}
        self._held: set[int] = set()
        self._space = asyncio.Condition()
        self._reserved = 0
        self._leftover_bytes = 0  # dead writers' shared-memory files not removed (yet)
        self.high_water_bytes = 0
        self.skipped = 0

    def _device(self) -> str:
        return "cpu"

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
        """Bytes held by committed versions, reservations in flight and dead writers' leftovers."""
        return sum(self._sizes.values()) + self._reserved + self._leftover_bytes

    async def open(self) -> None:
        """Open the backing directory and account for versions already in it."""
        if self._files:
            await self._files.open()
            for step in await self._files.list_versions():
                self._sizes[step] = await asyncio.to_thread(_dir_size, self._files._vdir(step))

    async def lock_root(self) -> None:
        """Take the shared-memory directory's writer lock (nothing to lock in process memory)."""
        if self._files:
            await self._files.lock_root()

    async def unlock_root(self) -> None:
        """Give the writer lock up."""
        if self._files:
            await self._files.unlock_root()

    async def sweep_leftovers(self) -> list[str]:
        """Remove dead writers' shared-memory files; what cannot be removed counts against the capacity."""
        if not self._files:
            return []
        removed = await self._files.sweep_leftovers()
        self._leftover_bytes = await asyncio.to_thread(_leftover_size, self._files.root, set(self._files._active))
        return removed

    async def close(self) -> None:
        """Drop in-memory versions (shared-memory files stay for a restart)."""
        for step in list(self._mem):
            await self._drop(step)

    async def list_versions(self) -> list[int]:
        """Return the held steps, ascending."""
        if self._files:
            steps = await self._files.list_versions()
            for gone in set(self._sizes) - set(steps):
                del self._sizes[gone]
            return steps
        return sorted(self._mem)

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
        inner = await self._files.begin(step, nbytes) if self._files else None
        return _HostWriter(self, step, nbytes, inner)

    def hold(self, step: int) -> None:
        """Keep ``step`` from eviction until :meth:`release` (the store holds versions not yet flushed below)."""
        self._held.add(step)

    async def release(self, step: int) -> None:
        """Let ``step`` be evicted again, and wake writers waiting for room."""
        self._held.discard(step)
        await self._notify()

    async def _notify(self) -> None:
        async with self._space:
            self._space.notify_all()

    def _release(self, nbytes: int) -> None:
        self._reserved -= nbytes

    async def _drop(self, step: int) -> None:
        if self._files:
            await self._files.delete_version(step)
        version = self._mem.pop(step, None)
        if version is not None and self._pool is not None:
            for buf in version.segments.values():
                self._pool.release(buf)
        self._sizes.pop(step, None)
        self._held.discard(step)

    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest of ``step``."""
        if self._files:
            return await self._files.read_manifest(step)
        if step not in self._mem:
            raise VersionNotFoundError(f"step {step} not on {self.name}")
        return self._mem[step].manifest

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Return a private copy of one segment (of ``size`` bytes when given)."""
        if self._files:
            return await self._files.read_segment(step, name, size)
        validate_segment_name(name)
        version = self._mem.get(step)
        if version is None or name not in version.segments:
            raise TierError(f"segment {name} of step {step} missing on {self.name}")
        if size is not None and version.segments[name].numel() != size:
            raise CorruptVersionError(f"segment {name} of step {step} on {self.name} has "
                                      f"{version.segments[name].numel()} bytes, the manifest says {size}")
        return await asyncio.to_thread(_to_host, version.segments[name])

    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        """Copy ranges of one segment straight into caller buffers (one copy out of the pool or the shm file).

        Shared-memory files return the ranges' digests, hashed as they land; memory returns None.
        """
        if self._files:
            return await self._files.read_segment_into(step, name, size, ranges)
        validate_segment_name(name)
        version = self._mem.get(step)
        if version is None or name not in version.segments:
            raise TierError(f"segment {name} of step {step} missing on {self.name}")
        buf = version.segments[name]
        if buf.numel() != size or any(off + len(view) > size for off, view in ranges):
            raise CorruptVersionError(f"segment {name} of step {step} on {self.name} has {buf.numel()} bytes, "
                                      f"the manifest says {size}")
        await asyncio.to_thread(_copy_out, buf, ranges)
        return None

    async def delete_version(self, step: int) -> None:
        """Drop a version and give its memory back."""
        await self._drop(step)
        await self._notify()

    async def quarantine(self, step: int) -> None:
        """Drop a corrupt version (memory) or move it aside (shared-memory files)."""
        if self._files:
            await self._files.quarantine(step)
            self._sizes.pop(step, None)
        else:
            await self._drop(step)
        await self._notify()

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
            pool = self.tier._pool
            assert pool is not None
            buf = pool.acquire(sum(len(p) for p in parts))
            self.version.segments[name] = buf
            await asyncio.to_thread(_fill, buf, parts)

    async def publish(self, manifest: bytes) -> None:
        if self.inner:
            await self.inner.publish(manifest)
        else:
            self.version.manifest = bytes(manifest)
            self.tier._mem[self.step] = self.version
        self.tier._sizes[self.step] = self.version.nbytes if not self.inner else self.reserved
        self._finish()
        await self.tier._notify()

    async def abort(self) -> None:
        if self.inner:
            await self.inner.abort()
        elif self.tier._pool is not None:
            for buf in self.version.segments.values():
                self.tier._pool.release(buf)
            self.version.segments.clear()
        self._finish()
        await self.tier._notify()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.tier._release(self.reserved)


def _fill(buf: torch.Tensor, parts: Sequence[Buffer]) -> None:
    """Copy ``parts`` back to back into ``buf`` (host or device memory)."""
    pos = 0
    if buf.device.type == "cpu":
        view = as_bytes(buf)
        for part in parts:
            view[pos:pos + len(part)] = part
            pos += len(part)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only parts: copied, never written
        for part in parts:
            if len(part):
                buf[pos:pos + len(part)].copy_(torch.frombuffer(part, dtype=torch.uint8))
                pos += len(part)


def _copy_out(buf: torch.Tensor, ranges: Sequence[tuple[int, memoryview]]) -> None:
    """Copy ``buf[offset:offset + len(view)]`` into each view (host or device pool buffer)."""
    src = as_bytes(buf) if buf.device.type == "cpu" else None
    for off, view in ranges:
        if not len(view):
            continue
        if src is not None:
            view[:] = src[off:off + len(view)]
        else:
            torch.frombuffer(view, dtype=torch.uint8).copy_(buf[off:off + len(view)])


def _to_host(buf: torch.Tensor) -> Buffer:
    """Return a private host copy of a pooled buffer."""
    if buf.device.type == "cpu":
        return bytearray(as_bytes(buf))
    return as_bytes(buf.cpu())


def _leftover_size(root: str, active: set[str]) -> int:
    """Bytes under ``root``'s temporary entries that are not this writer's own."""
    total = 0
    for entry in os.scandir(root):
        if is_leftover_name(entry.name) and entry.name not in active:
            total += _dir_size(entry.path) if entry.is_dir(follow_symlinks=False) else entry.stat(
                follow_symlinks=False).st_size
    return total


def _dir_size(path: str) -> int:
    total = 0
    for entry in os.scandir(path):
        if entry.is_file():
            total += entry.stat().st_size
    return total
