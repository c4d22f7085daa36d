"""Fault-injecting tiers for crash and failure tests (yours and ours).

Each is a real :class:`~asymstore.tiers.local.LocalTier` (real files, real fsync) that misbehaves
once, at a chosen phase of the commit protocol (:data:`PHASES`: ``"segments_written"``,
``"manifest_half"``, ``"published"``, ``"retention"``). :class:`CrashingLocalTier` SIGKILLs its own
process there, leaving the disk exactly as a crash would (run it in a child process);
:class:`FailingLocalTier` raises :class:`~asymstore.errors.TierError` instead;
:class:`SlowLocalTier` stalls each commit before its manifest, for tests of deadlines.
:class:`FailingSegmentTier` fails one segment write with ``OSError`` (a full disk), in whichever
thread writes it (a pipeline thread of :mod:`asymstore.write.pool`, or the write thread).
:class:`CrashingPeerTier` dies part way through sending a version to its neighbour.

What each phase leaves on disk, and a typical crash test: docs/extending/tiers.md.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence, Set
from typing import Any, Literal, NoReturn, get_args

from asymstore.errors import TierError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.io.files import fsync_dir, write_parts
from asymstore.tiers.local import LocalTier, _DirWriter
from asymstore.tiers.peer.tier import PeerTier
from asymstore.tiers.protocol import Buffer

logger = logging.getLogger(__name__)

__all__ = ["PHASES", "CrashingLocalTier", "CrashingPeerTier", "FailingLocalTier", "FailingSegmentTier", "Phase",
           "SlowLocalTier"]

Phase = Literal["segments_written", "manifest_half", "published", "retention"]
PHASES: tuple[Phase, ...] = get_args(Phase)


class _FaultyLocalTier(LocalTier):
    """A LocalTier that calls ``_fault`` the ``after + 1``-th time it reaches ``phase``."""

    def __init__(self, root: str | os.PathLike[str], *, phase: Phase, after: int, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        if after < 0:
            raise ValueError("after must be >= 0")
        self.phase = phase
        self.after = after
        self.reached = 0  # times ``phase`` was reached so far
        self.faults = 0  # times the fault fired

    def _due(self, phase: Phase) -> bool:
        """Count one arrival at ``phase``; True when the fault fires now."""
        if phase != self.phase or not self._armed():
            return False
        self.reached += 1
        return self.reached > self.after

    def _armed(self) -> bool:
        return True

    def _fault(self, phase: Phase) -> NoReturn:
        raise NotImplementedError

    async def begin(self, step: int, nbytes: int) -> _DirWriter:
        """Start writing ``step``, through a writer that can fault."""
        writer = await super().begin(step, nbytes)
        return _FaultyWriter(self, step, writer.tmp)

    async def write_latest(self, step: int) -> None:
        """Update LATEST (``"published"`` faults before it)."""
        if self._due("published"):
            self._fault("published")
        await super().write_latest(step)

    def _delete_sync(self, vdir: str, keep: Set[str] = frozenset()) -> None:
        manifest = os.path.join(vdir, MANIFEST_NAME)
        if os.path.exists(manifest) and self._due("retention"):
            os.unlink(manifest)
            if self.fsync:
                fsync_dir(vdir)
            self._fault("retention")
        super()._delete_sync(vdir, keep)


class _FaultyWriter(_DirWriter):
    tier: _FaultyLocalTier

    def _publish_sync(self, manifest: bytes, latest: bool = False) -> bool:
        # LATEST is left to write_latest, where the "published" phase faults before it
        if self.tier._due("segments_written"):
            self.tier._fault("segments_written")
        if self.tier._due("manifest_half"):
            write_parts(os.path.join(self.tmp, MANIFEST_NAME), [manifest[: len(manifest) // 2]],
                        fsync=self.tier.fsync)
            if self.tier.fsync:
                fsync_dir(self.tmp)
            self.tier._fault("manifest_half")
        return super()._publish_sync(manifest, False)


class CrashingLocalTier(_FaultyLocalTier):
    """A LocalTier whose process is SIGKILLed at ``crash_at``, after ``after`` clean passes.

    Args:
        root: the tier's directory.
        crash_at: the phase at which to die (see the module docstring).
        after: how many times ``crash_at`` is passed cleanly first. For the
            commit phases that is the number of commits that succeed; for
            ``"retention"`` the number of old versions deleted cleanly.
        **kwargs: passed to :class:`~asymstore.tiers.local.LocalTier`.
    """

    def __init__(self, root: str | os.PathLike[str], *, crash_at: Phase, after: int = 0, **kwargs: Any) -> None:
        """Create the tier; it kills its process when ``crash_at`` is due."""
        super().__init__(root, phase=crash_at, after=after, **kwargs)

    def _fault(self, phase: Phase) -> NoReturn:
        self.faults += 1
        os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(128 + signal.SIGKILL)  # not reached: SIGKILL cannot be handled


class FailingLocalTier(_FaultyLocalTier):
    """A LocalTier that raises :class:`~asymstore.errors.TierError` at ``fail_at``.

    A failure at ``"segments_written"`` or ``"manifest_half"`` fails the
    commit (the store aborts it and the previous version stays the newest);
    at ``"published"`` or ``"retention"`` the version is already committed
    and the store only logs the housekeeping error.

    Args:
        root: the tier's directory.
        fail_at: the phase at which to raise (see the module docstring).
        after: how many times ``fail_at`` is passed cleanly first.
        times: how many times to fail before behaving normally again; None
            fails every time from then on.
        **kwargs: passed to :class:`~asymstore.tiers.local.LocalTier`.
    """

    def __init__(self, root: str | os.PathLike[str], *, fail_at: Phase, after: int = 0,
                 times: int | None = 1, **kwargs: Any) -> None:
        """Create the tier; it raises when ``fail_at`` is due."""
        super().__init__(root, phase=fail_at, after=after, **kwargs)
        self.times = times

    def _armed(self) -> bool:
        return self.times is None or self.faults < self.times

    def _fault(self, phase: Phase) -> NoReturn:
        self.faults += 1
        raise TierError(f"{self.name}: injected failure at {phase!r}")


class CrashingPeerTier(PeerTier):
    """A PeerTier whose process is SIGKILLed right after the first segment of a version ``>= at_step`` is sent.

    The neighbour has then received part of a version and no manifest: the
    replica must never be published there.

    Args:
        at_step: the step during whose replication the process dies.
        **kwargs: passed to :class:`~asymstore.tiers.peer.PeerTier`.
    """

    def __init__(self, *, at_step: int, **kwargs: Any) -> None:
        """Create the tier; it kills its process while sending ``at_step``."""
        super().__init__(**kwargs)
        self.at_step = at_step

    def _sent(self, step: int, name: str, nbytes: int) -> None:
        if step >= self.at_step:
            logger.warning("CrashingPeerTier: SIGKILL after sending %s of step %d", name, step)
            os.kill(os.getpid(), signal.SIGKILL)


class SlowLocalTier(LocalTier):
    """A LocalTier whose commits stall ``delay_s`` with every segment written, before the manifest.

    Args:
        root: the tier's directory.
        delay_s: the stall of each commit after the first ``after``.
        after: how many commits run at full speed first.
        **kwargs: passed to :class:`~asymstore.tiers.local.LocalTier`.
    """

    def __init__(self, root: str | os.PathLike[str], *, delay_s: float, after: int = 0, **kwargs: Any) -> None:
        """Create the tier."""
        super().__init__(root, **kwargs)
        if delay_s < 0 or after < 0:
            raise ValueError("delay_s and after must be >= 0")
        self.delay_s = delay_s
        self.after = after
        self.commits = 0  # commits that reached the manifest so far

    async def begin(self, step: int, nbytes: int) -> _DirWriter:
        """Start writing ``step``, through a writer that stalls before the manifest."""
        writer = await super().begin(step, nbytes)
        return _SlowWriter(self, step, writer.tmp)


class _SlowWriter(_DirWriter):
    tier: SlowLocalTier

    def _publish_sync(self, manifest: bytes, latest: bool = False) -> bool:
        self.tier.commits += 1
        if self.tier.commits > self.tier.after:
            time.sleep(self.tier.delay_s)
        return super()._publish_sync(manifest, latest)


class FailingSegmentTier(LocalTier):
    """A LocalTier whose ``after + 1``-th segment write raises ``OSError(ENOSPC)``, once; the others stall a little.

    The store turns the error into :class:`~asymstore.errors.TierError` and
    aborts the version; the previous one stays the newest.

    Args:
        root: the tier's directory.
        after: how many segment writes succeed first.
        delay_s: how long every other segment write stalls before it writes
            (so several are in flight when the failure strikes).
        **kwargs: passed to :class:`~asymstore.tiers.local.LocalTier`.
    """

    def __init__(self, root: str | os.PathLike[str], *, after: int = 0, delay_s: float = 0.0, **kwargs: Any) -> None:
        """Create the tier; it fails one segment write."""
        super().__init__(root, **kwargs)
        if after < 0 or delay_s < 0:
            raise ValueError("after and delay_s must be >= 0")
        self.after = after
        self.delay_s = delay_s
        self.writes = 0  # segment writes started so far
        self.failed_in: str | None = None  # the name of the thread whose write failed
        self._count_lock = threading.Lock()  # (``_lock`` is LocalTier's root lock)
        self._failed = False

    def _write_segment_file(self, path: str, parts: Sequence[Buffer]) -> None:
        with self._count_lock:
            self.writes += 1
            due = not self._failed and self.writes > self.after
            if due:
                self._failed = True
                self.failed_in = threading.current_thread().name
        if due:
            raise OSError(errno.ENOSPC, "injected: no space left on device", path)
        time.sleep(self.delay_s)
        super()._write_segment_file(path, parts)
