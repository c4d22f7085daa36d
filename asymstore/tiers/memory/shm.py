"""ShmTier: the :func:`~asymstore.tiers.host_tier` tier that keeps versions as shared-memory files.

``host_tier(capacity_bytes, path=...)`` builds one over a tmpfs directory (``/dev/shm/asym-job42``).
Files are laid out, published and read as :class:`LocalTier` does it (with fsync off), so a killed
process restarted on the same node restores without touching disk, and fsck checks the directory
like any root. Capacity, eviction, holds and back-pressure are
:class:`~asymstore.tiers.memory.capacity.BoundedTier`'s. :meth:`ShmTier.view_segment` lends a
segment as a read-only mapping (the peer holder sends replicas from it); restores read with
``preadv`` instead, since a file truncated under a mapping by another program ends the process
with SIGBUS.

What the tier is for: docs/guides/store.md; the mapping and its risk: docs/concepts/threat-model.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
from collections.abc import Iterator, Sequence

from asymstore.errors import TierError
from asymstore.format.manifest import validate_segment_name
from asymstore.format.names import QUARANTINE
from asymstore.io.files import check_directory, open_regular
from asymstore.io.rootlock import Swept, is_leftover_name
from asymstore.tiers.local import LocalTier, _DirWriter
from asymstore.tiers.memory.capacity import BackPressure, BoundedTier, Reservation
from asymstore.tiers.protocol import Buffer

logger = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Fault a lent segment's pages in when it is mapped, not one by one as it is sent."""


class ShmTier(BoundedTier):
    """Bounded tier of shared-memory files (what ``host_tier(capacity_bytes, path=...)`` returns).

    Args:
        capacity_bytes: most bytes held at once (committed, in flight and dead writers' leftovers).
        path: the tmpfs directory (created if missing).
        name: the tier's name in reports (default: ``"host:<path>"``).
        keep_last: this tier's retention; None uses the store's.
        policy: back-pressure when full: ``"wait"`` or ``"skip"``.
        wait_timeout_s: longest wait under ``"wait"`` (None: no limit), then CapacityError.
    """

    prefers_read_into = True
    """Restore reads every raw tensor straight into fresh memory (one copy out of the file, hashed as it lands)."""

    def __init__(self, capacity_bytes: int = 2 << 30, *, path: str | os.PathLike[str], name: str | None = None,
                 keep_last: int | None = None, policy: BackPressure = "wait",
                 wait_timeout_s: float | None = None) -> None:
        """Create the tier; nothing touches the directory before ``open``."""
        # tmpfs: fsync is a no-op there, nothing survives a reboot, and the files are memory (no O_DIRECT bounce)
        files = LocalTier(path, fsync=False, direct_reads=False)
        super().__init__(capacity_bytes, name=name or f"host:{files.root}", keep_last=keep_last, policy=policy,
                         wait_timeout_s=wait_timeout_s)
        self._files = files

    def __repr__(self) -> str:
        """Return a short description."""
        return f"host_tier({self._files.root!r}, capacity_bytes={self.capacity_bytes})"

    @property
    def path(self) -> str:
        """The shared-memory directory."""
        return self._files.root

    async def open(self) -> None:
        """Open the directory and account for the versions already in it."""
        await self._files.open()
        for step in await self._files.list_versions():
            self._sizes[step] = await asyncio.to_thread(_dir_size, self._files._vdir(step))

    async def close(self) -> None:
        """Nothing to release: the files stay for a restart."""

    async def lock_root(self) -> None:
        """Take the directory's writer lock."""
        await self._files.lock_root()

    async def unlock_root(self) -> None:
        """Give the writer lock up."""
        await self._files.unlock_root()

    async def sweep_leftovers(self, *, oldest_kept: int | None = None) -> list[Swept]:
        """Sweep as :meth:`LocalTier.sweep_leftovers` does; what cannot be removed counts against the capacity."""
        removed = await self._files.sweep_leftovers(oldest_kept=oldest_kept)
        self._leftover_bytes = await asyncio.to_thread(_leftover_size, self._files.root, set(self._files._active))
        return removed

    async def list_versions(self) -> list[int]:
        """Return the published steps, ascending (forgetting any removed behind this tier's back)."""
        steps = await self._files.list_versions()
        for gone in set(self._sizes) - set(steps):
            del self._sizes[gone]
        return steps

    async def _writer(self, step: int, nbytes: int) -> _ShmWriter:
        inner = await self._files.begin(step, nbytes)
        return _ShmWriter(inner, Reservation(self, step, nbytes))

    async def _drop(self, step: int) -> None:
        await self._files.delete_version(step)
        self._forget(step)

    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest of ``step`` (checked and bounded as :meth:`LocalTier.read_manifest` does)."""
        return await self._files.read_manifest(step)

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Return a private copy of one segment (of ``size`` bytes when given)."""
        return await self._files.read_segment(step, name, size)

    @contextlib.contextmanager
    def view_segment(self, step: int, name: str, size: int | None = None) -> Iterator[memoryview]:
        """Lend one segment as a read-only shared mapping of its file (see :class:`~asymstore.tiers.protocol.ViewTier`).

        The file is opened without following a symlink and checked (a regular file, of ``size`` bytes when
        given) on the descriptor that is mapped. A version deleted while mapped is unlinked, and its pages
        stay until the mapping is closed (the module docstring says what a truncation would do).

        Raises:
            TierError: the segment is missing or cannot be mapped.
            CorruptVersionError: it is a symlink, not a regular file, or not ``size`` bytes.
        """
        vdir = self._files._vdir(step)
        path = os.path.join(vdir, validate_segment_name(name))
        try:
            check_directory(vdir)
            fd, nbytes = open_regular(path, expected_size=size)
        except FileNotFoundError as exc:
            raise TierError(f"segment {name} of step {step} missing on {self.name}") from exc
        except OSError as exc:  # CorruptVersionError (a symlink, another file, another size) is not one
            raise TierError(f"segment {name} of step {step} on {self.name}: {exc}") from exc
        try:
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ) if nbytes else None
        except OSError as exc:
            raise TierError(f"segment {name} of step {step} on {self.name}: mapping it: {exc}") from exc
        finally:
            os.close(fd)
        if mapped is None:
            yield memoryview(b"")
            return
        view = memoryview(mapped)
        try:
            yield view
        finally:
            with contextlib.suppress(BufferError):  # something still references it: unmapped when that goes
                view.release()
                mapped.close()

    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        """Copy ranges of one segment straight into caller buffers (one copy out of the shm file, hashed as read)."""
        return await self._files.read_segment_into(step, name, size, ranges)

    async def quarantine(self, step: int) -> None:
        """Move a corrupt version aside (``.quarantine/`` under the directory)."""
        await self._files.quarantine(step)
        self._sizes.pop(step, None)
        await self._notify()

    def calibration_key(self) -> str:
        """Identify the tmpfs of ``path`` for the calibration cache."""
        return "host-" + self._files.calibration_key()

    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Time one segment-like write per size, as a file on the tmpfs."""
        return await self._files.probe_writes(sizes)

    async def write_latest(self, step: int) -> None:
        """Record the LATEST hint."""
        await self._files.write_latest(step)

    async def read_latest(self) -> int | None:
        """Return the LATEST hint."""
        return await self._files.read_latest()


class _ShmWriter:
    """A LocalTier writer whose version is counted against the capacity once published."""

    def __init__(self, inner: _DirWriter, reservation: Reservation) -> None:
        self.inner = inner
        self.reservation = reservation

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        await self.inner.write_segment(name, parts)  # checks the name

    def write_segment_blocking(self, name: str, parts: Sequence[Buffer]) -> None:
        """Write one segment file from a pipeline thread (a ThreadedWriter, as the LocalTier writer is)."""
        self.inner.write_segment_blocking(name, parts)

    async def publish(self, manifest: bytes) -> None:
        await self.inner.publish(manifest)
        await self.reservation.settle(self.reservation.nbytes)

    async def abort(self) -> None:
        await self.inner.abort()
        await self.reservation.settle(None)


def _leftover_size(root: str, active: set[str]) -> int:
    """Bytes under ``root``'s temporary entries that are not this writer's own, and under ``.quarantine/``."""
    total = 0
    for entry in os.scandir(root):
        if is_leftover_name(entry.name) and entry.name not in active:
            total += _dir_size(entry.path) if entry.is_dir(follow_symlinks=False) else entry.stat(
                follow_symlinks=False).st_size
    qdir = os.path.join(root, QUARANTINE)
    if os.path.isdir(qdir) and not os.path.islink(qdir):  # what was moved aside stays memory until removed
        total += _dir_size(qdir)
        total += sum(_dir_size(e.path) for e in os.scandir(qdir) if e.is_dir(follow_symlinks=False))
    return total


def _dir_size(path: str) -> int:
    total = 0
    for entry in os.scandir(path):
        if entry.is_file():
            total += entry.stat().st_size
    return total
