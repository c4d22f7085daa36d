"""MemoryTier: the :func:`~asymstore.tiers.host_tier` tier that keeps versions in process memory.

``host_tier(capacity_bytes)`` constructs one. Segments live in a
:class:`BufferPool` of page-locked buffers (when CUDA is present; plain
memory otherwise) reused from version to version; versions die with the
process. Capacity, eviction, holds and back-pressure are
:class:`~asymstore.tiers.memory.capacity.BoundedTier`'s.

:meth:`MemoryTier.view_segment` lends a segment's pool buffer itself (the
peer tier's holder sends replicas from it): a version dropped while a view is
open leaves the listing at once, and its buffers go back to the pool when the
last view closes, so a lent buffer is never refilled under its reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from asymstore.errors import CorruptVersionError, TierError, VersionNotFoundError
from asymstore.format.manifest import validate_segment_name
from asymstore.format.tensors import as_bytes
from asymstore.io.probes import probe_memory
from asymstore.tiers.memory.capacity import BackPressure, BoundedTier, Reservation
from asymstore.tiers.memory.pool import BufferPool
from asymstore.tiers.protocol import Buffer

logger = logging.getLogger(__name__)


@dataclass
class _MemVersion:
    manifest: bytes = b""
    segments: dict[str, torch.Tensor] = field(default_factory=dict)
    views: int = 0
    """Views of its segments open (:meth:`MemoryTier.view_segment`): its buffers are not given back meanwhile."""
    dropped: bool = False
    """Deleted or evicted while viewed: the last view to close gives its buffers back."""

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(s.numel() for s in self.segments.values())


class MemoryTier(BoundedTier):
    """Bounded tier in process memory (what ``host_tier(capacity_bytes)`` returns).

    Args:
        capacity_bytes: most bytes held at once (committed plus in flight).
        name: the tier's name in reports.
        keep_last: this tier's retention; None uses the store's.
        policy: back-pressure when full: ``"wait"`` or ``"skip"``.
        wait_timeout_s: longest wait under ``"wait"`` (None: no limit), then CapacityError.
        pin: page-lock the pool's buffers; None pins when CUDA is available.
    """

    def __init__(self, capacity_bytes: int = 2 << 30, *, name: str | None = None, keep_last: int | None = None,
                 policy: BackPressure = "wait", wait_timeout_s: float | None = None, pin: bool | None = None) -> None:
        """Create the tier; the pool allocates nothing before use."""
        super().__init__(capacity_bytes, name=name or "host:memory", keep_last=keep_last, policy=policy,
                         wait_timeout_s=wait_timeout_s)
        # size classes round each buffer up by < 1 MiB; the slack keeps rounding from refusing a version
        self._pool = BufferPool(capacity_bytes + capacity_bytes // 8 + (8 << 20), device=self._device(), pin=pin)
        self._mem: dict[int, _MemVersion] = {}

    def _device(self) -> str:
        return "cpu"

    def __repr__(self) -> str:
        """Return a short description."""
        return f"host_tier('memory', capacity_bytes={self.capacity_bytes})"

    @property
    def path(self) -> None:
        """None: versions live in process memory."""
        return None

    async def open(self) -> None:
        """Nothing to open."""

    async def close(self) -> None:
        """Drop every version and give the pool's buffers back."""
        for step in list(self._mem):
            await self._drop(step)

    async def list_versions(self) -> list[int]:
        """Return the held steps, ascending."""
        return sorted(self._mem)

    async def _writer(self, step: int, nbytes: int) -> _MemWriter:
        return _MemWriter(self, Reservation(self, step, nbytes))

    async def _drop(self, step: int) -> None:
        version = self._mem.pop(step, None)
        if version is not None:
            if version.views:
                version.dropped = True  # unlisted now; the buffers go back when the last view closes
            else:
                self._release(version)
        self._forget(step)

    def _release(self, version: _MemVersion) -> None:
        for buf in version.segments.values():
            self._pool.release(buf)
        version.segments.clear()

    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest of ``step``."""
        if step not in self._mem:
            raise VersionNotFoundError(f"step {step} not on {self.name}")
        return self._mem[step].manifest

    def _segment(self, step: int, name: str) -> torch.Tensor:
        validate_segment_name(name)
        version = self._mem.get(step)
        if version is None or name not in version.segments:
            raise TierError(f"segment {name} of step {step} missing on {self.name}")
        return version.segments[name]

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Return a private copy of one segment (of ``size`` bytes when given)."""
        buf = self._segment(step, name)
        if size is not None and buf.numel() != size:
            raise CorruptVersionError(f"segment {name} of step {step} on {self.name} has "
                                      f"{buf.numel()} bytes, the manifest says {size}")
        return await asyncio.to_thread(_to_host, buf)

    @property
    def lends_copies(self) -> bool:
        """Whether :meth:`view_segment` copies (the pool is in device memory) rather than lends."""
        return self._device() != "cpu"

    @contextlib.contextmanager
    def view_segment(self, step: int, name: str, size: int | None = None) -> Iterator[memoryview]:
        """Lend one segment's pool buffer, read-only, without a copy (see :class:`~asymstore.tiers.protocol.ViewTier`).

        The version is held while the view is open: deleting or evicting it unlists it at once, but its
        buffers return to the pool (to be refilled by another version) only when its last view closes.
        A segment in device memory is lent as a host copy.
        """
        buf = self._segment(step, name)
        if size is not None and buf.numel() != size:
            raise CorruptVersionError(f"segment {name} of step {step} on {self.name} has "
                                      f"{buf.numel()} bytes, the manifest says {size}")
        if buf.device.type != "cpu":
            yield memoryview(_to_host(buf)).toreadonly()
            return
        version = self._mem[step]
        version.views += 1
        try:
            yield as_bytes(buf).toreadonly()
        finally:
            version.views -= 1
            if version.dropped and not version.views:
                self._release(version)

    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        """Copy ranges of one segment straight into caller buffers (one copy out of the pool)."""
        buf = self._segment(step, name)
        if buf.numel() != size or any(off + len(view) > size for off, view in ranges):
            raise CorruptVersionError(f"segment {name} of step {step} on {self.name} has {buf.numel()} bytes, "
                                      f"the manifest says {size}")
        await asyncio.to_thread(_copy_out, buf, ranges)
        return None  # the caller verifies the checksums on the destinations

    async def quarantine(self, step: int) -> None:
        """Drop a corrupt version (there is nowhere to move it aside)."""
        await self._drop(step)
        await self._notify()

    def calibration_key(self) -> None:
        """None: memory is measured each time, never cached."""
        return None

    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Time one copy into fresh memory per size."""
        return await asyncio.to_thread(probe_memory, sizes)

    async def write_latest(self, step: int) -> None:
        """Nothing to record: the newest held step is the latest."""

    async def read_latest(self) -> int | None:
        """Return the newest held step."""
        return max(self._mem) if self._mem else None


class _MemWriter:
    """Fills pool buffers with one version's segments; publishing makes it listed."""

    def __init__(self, tier: MemoryTier, reservation: Reservation) -> None:
        self.tier = tier
        self.reservation = reservation
        self.version = _MemVersion()

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        validate_segment_name(name)
        buf = self.tier._pool.acquire(sum(len(p) for p in parts))
        self.version.segments[name] = buf
        await asyncio.to_thread(_fill, buf, parts)

    async def publish(self, manifest: bytes) -> None:
        self.version.manifest = bytes(manifest)
        self.tier._mem[self.reservation.step] = self.version
        await self.reservation.settle(self.version.nbytes)

    async def abort(self) -> None:
        for buf in self.version.segments.values():
            self.tier._pool.release(buf)
        self.version.segments.clear()
        await self.reservation.settle(None)


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
