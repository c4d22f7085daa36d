"""What the Checkpointer measured: stall, copy time and bytes per step, commits."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from asymcheck.policy.pacing import PaceReport


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as the Checkpointer saw it.

    Attributes:
        step: optimizer steps completed before this one (the version it sealed, if any).
        sealed: whether a version was sealed at this step's pre-hook.
        stall_s: seconds the step pre-hook blocked (drain wait plus back-pressure).
        backpressure_s: the part of ``stall_s`` spent waiting for an earlier commit.
        hook_s: seconds spent inside forward/backward hooks during the iteration.
        open_s: seconds the previous step's post-hook took (opening the version).
        copy_bytes: bytes of the flat state of the sealed version.
        copy_s: seconds the copy engine spent copying since the previous step's record
            (off the training thread with the copy thread; inside the hooks when inline).
        iteration_s: seconds since the previous step pre-hook.
        skipped: the version was dropped because a commit was still in flight.
        dropped: the version was dropped because a captured tensor changed before its copy.
        overlap_s: the part of ``copy_s`` that ran while training went on (not while the
            step pre-hook, ``editing()`` or an inline hook waited for it). CPU copies only:
            CUDA copies run on a side stream and are not timed (0).
        forward_bytes: bytes of the sealed version issued by forward hooks.
        backward_bytes: bytes of the sealed version issued by backward (gradient) hooks.
        boundary_bytes: bytes of the sealed version issued at the step boundary (the drain in
            the step pre-hook, or ``editing()``): planned so, or planned for a hook that did not run.
    """

    step: int
    sealed: bool
    stall_s: float
    backpressure_s: float
    hook_s: float
    open_s: float
    copy_bytes: int
    iteration_s: float
    skipped: bool = False
    copy_s: float = 0.0
    dropped: bool = False
    overlap_s: float = 0.0
    forward_bytes: int = 0
    backward_bytes: int = 0
    boundary_bytes: int = 0

    @property
    def overhead_s(self) -> float:
        """All time the training thread spent in the Checkpointer for this step."""
        return self.stall_s + self.hook_s + self.open_s

    @property
    def overlap_fraction(self) -> float:
        """``overlap_s / copy_s``: how much of this step's copying overlapped training (0 when none was timed)."""
        return self.overlap_s / self.copy_s if self.copy_s > 0 else 0.0


@dataclass(frozen=True)
class CheckpointStats:
    """A copy of the Checkpointer's counters; ``summary()`` gives the headline numbers.

    ``versions_dropped`` counts versions not committed because a captured
    tensor changed in place before it was copied (see :mod:`asymcheck.snapshot.edits`),
    ``eager_tensors`` the tensors copied eagerly since. ``commits_failed`` and
    ``failures_since_durable`` count failed background commits (all of them,
    and those since the newest durable version); ``last_error`` is the newest.
    ``pacing`` is what the step-time budget measured and decided
    (:mod:`asymcheck.policy.pacing`); ``host_bytes`` the host memory held by the
    staging slots (allocated once: ``host_slots`` times the flat state).
    """

    steps: tuple[StepRecord, ...]
    versions_opened: int
    versions_sealed: int
    versions_committed: int
    versions_skipped: int
    commits_failed: int
    copy_seconds: float
    copy_bytes: int
    commit_seconds: tuple[float, ...]
    stored_bytes: int
    last_error: str | None
    replans: int
    last_committed: int | None
    versions_dropped: int = 0
    eager_tensors: tuple[str, ...] = ()
    failures_since_durable: int = 0
    pacing: PaceReport | None = None
    host_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        """Medians and 90th percentiles of stall and iteration time over sealed steps."""
        sealed = [s for s in self.steps if s.sealed] or list(self.steps)
        timed = [s for s in sealed if s.iteration_s > 0]

        def pct(values: list[float], q: float) -> float:
            if not values:
                return 0.0
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

        stall = [s.stall_s for s in sealed]
        copy_s = sum(s.copy_s for s in sealed)
        overhead = [s.overhead_s for s in sealed]
        iters = [s.iteration_s for s in timed]
        return {
            "steps": len(self.steps),
            "versions_committed": self.versions_committed,
            "versions_skipped": self.versions_skipped,
            "commits_failed": self.commits_failed,
            "versions_dropped": self.versions_dropped,
            "stall_median_s": statistics.median(stall) if stall else 0.0,
            "stall_p90_s": pct(stall, 0.9),
            "overhead_median_s": statistics.median(overhead) if overhead else 0.0,
            "overhead_p90_s": pct(overhead, 0.9),
            "iteration_median_s": statistics.median(iters) if iters else 0.0,
            "bytes_per_version": (self.stored_bytes // self.versions_committed) if self.versions_committed else 0,
            "copy_seconds": self.copy_seconds,
            "copy_overlap_fraction": sum(s.overlap_s for s in sealed) / copy_s if copy_s > 0 else 0.0,
            "commit_median_s": statistics.median(self.commit_seconds) if self.commit_seconds else 0.0,
            "last_committed": self.last_committed,
            "replans": self.replans,
        }


@dataclass
class StatsRecorder:
    """The mutable counters behind :class:`CheckpointStats` (thread-safe where it matters)."""

    keep: int = 100_000
    steps: deque[StepRecord] = field(default_factory=deque)
    versions_opened: int = 0
    versions_sealed: int = 0
    versions_committed: int = 0
    versions_skipped: int = 0
    commits_failed: int = 0
    commit_seconds: deque[float] = field(default_factory=deque)
    stored_bytes: int = 0
    last_error: str | None = None
    last_committed: int | None = None
    last_committed_at: float | None = None  # time.monotonic() of the newest commit
    failures_since_durable: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_step(self, record: StepRecord) -> None:
        """Append one step (oldest dropped beyond ``keep``)."""
        self.steps.append(record)
        if len(self.steps) > self.keep:
            self.steps.popleft()

    def committed(self, step: int, nbytes: int, seconds: float) -> None:
        """Count a committed version (called from the store's thread)."""
        with self.lock:
            self.versions_committed += 1
            self.stored_bytes += nbytes
            self.commit_seconds.append(seconds)
            if len(self.commit_seconds) > self.keep:
                self.commit_seconds.popleft()
            self.last_committed = max(step, self.last_committed or 0)
            self.last_committed_at = time.monotonic()
            self.failures_since_durable = 0

    def failed(self, reason: str) -> None:
        """Count a failed commit."""
        with self.lock:
            self.commits_failed += 1
            self.failures_since_durable += 1
            self.last_error = reason

    def snapshot(self, copy_seconds: float, copy_bytes: int, replans: int, dropped: int = 0,
                 eager: tuple[str, ...] = ()) -> CheckpointStats:
        """Return an immutable copy."""
        with self.lock:
            return CheckpointStats(
                steps=tuple(self.steps),
                versions_opened=self.versions_opened,
                versions_sealed=self.versions_sealed,
                versions_committed=self.versions_committed,
                versions_skipped=self.versions_skipped,
                commits_failed=self.commits_failed,
                copy_seconds=copy_seconds,
                copy_bytes=copy_bytes,
                commit_seconds=tuple(self.commit_seconds),
                stored_bytes=self.stored_bytes,
                last_error=self.last_error,
                replans=replans,
                last_committed=self.last_committed,
                versions_dropped=dropped,
                eager_tensors=eager,
                failures_since_durable=self.failures_since_durable,
            )
