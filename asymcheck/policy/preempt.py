"""Preemption: on SIGTERM, finish the version in flight on the durable tier within a deadline, then exit.

The signal handler only records the notice (it may run in the middle of ``optimizer.step()``); the
Checkpointer acts at its next hook of the next iteration, where the state after the newest completed
step is whole: within the deadline (counted from the signal) it seals, commits and waits for a
persistent tier (and, under several ranks, the global version) to hold that step, records
``ckpt.preempted`` and hands the signal on to what the program had installed. Under several ranks
every rank flushes the same step at the same boundary (:mod:`asymcheck.policy.agreement`).
``Checkpointer.preempt(deadline_s)`` does the same on an explicit notice, without exiting.

Guide: ``docs/guides/preemption.md``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal, TypeVar

from asymcheck.policy.agreement import PreemptAgreement
from asymcheck.versions.commits import CommitQueue
from asymcheck.versions.progress import Progress
from asymstore.protocols import CheckpointStore, CollectiveStore
from asymstore.runtime.loop import StoreLoop

logger = logging.getLogger(__name__)

PreemptOn = Literal["sigterm", "none"]
PREEMPT_ON: tuple[PreemptOn, ...] = ("sigterm", "none")
Handler = Callable[[int, FrameType | None], Any] | int | None


T = TypeVar("T")
DEFAULT_DEADLINE_S = 25.0  # under the usual grace periods (Kubernetes 30 s, Slurm's KillWait 30 s)
Reason = Literal["SIGTERM", "explicit", "peer"]


@dataclass(frozen=True)
class PreemptionRecord:
    """What a preemption flush managed.

    Attributes:
        reason: ``"SIGTERM"``, ``"explicit"``, or ``"peer"`` (under several ranks: only another rank's
            notice, read through the key-value store, reached this rank before its flush).
        step: the newest completed optimizer step at the flush.
        durable: whether ``step`` itself survives the process: on a persistent tier and, under
            several ranks, published as a global version.
        seconds: time the flush took (for SIGTERM, counted from the signal).
        versions: the store's committed steps per tier afterwards.
        deadline_s: the deadline it ran under (None: none).
        deadline_hit: a wait was cut short by the deadline (what was running goes on until the exit).
        persistent_step: the newest step on a persistent tier (this rank's shard under several ranks).
        global_step: under several ranks, the newest global version this rank knows was published.
        error: why the final commit failed, if it did.
        peer_lost: under several ranks, another rank did not take part: the key-value store was
            unreachable, or this rank's shard of ``step`` is persistent but its global version was not
            known published by the end.
    """

    reason: Reason
    step: int
    durable: bool
    seconds: float
    versions: dict[str, list[int]]
    deadline_s: float | None = None
    deadline_hit: bool = False
    persistent_step: int | None = None
    global_step: int | None = None
    error: str | None = None
    peer_lost: bool = False


class SigtermNotice:
    """Records a SIGTERM for the Checkpointer's next hook, and hands the signal on afterwards."""

    def __init__(self, on: PreemptOn) -> None:
        """Install the handler (``on="sigterm"``, from the main thread only; elsewhere Python cannot)."""
        if on not in PREEMPT_ON:
            raise ValueError(f"preempt_on must be one of {PREEMPT_ON}, got {on!r}")
        self.received: float | None = None
        self._previous: Handler = None
        self._installed = False
        if on == "sigterm":
            if threading.current_thread() is threading.main_thread():
                self._previous = signal.signal(signal.SIGTERM, self._handle)
                self._installed = True
            else:
                logger.info("not on the main thread: no SIGTERM handler installed (call ckpt.preempt() on notice)")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = time.monotonic()
            logger.warning("SIGTERM: the version in flight is finished at the next hook, then the process exits")

    @property
    def pending(self) -> bool:
        """True once a SIGTERM arrived and was not handed on yet."""
        return self.received is not None and self._installed

    def uninstall(self) -> Handler:
        """Put the program's own handler back (main thread only); return it."""
        previous = self._previous
        if self._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            self._installed = False
        return previous

    def hand_on(self) -> None:
        """Give the received SIGTERM to what the program had: default (terminate), ignore, or its handler."""
        previous = self.uninstall()
        if callable(previous):
            previous(signal.SIGTERM, None)
        elif previous in (None, signal.SIG_DFL):
            if signal.getsignal(signal.SIGTERM) == self._handle:  # not the main thread: cannot restore the default
                os._exit(128 + signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the default action now: terminated by SIGTERM, as without us


class Deadline:
    """Seconds left until ``origin + seconds`` (``seconds`` None or infinite: no deadline)."""

    def __init__(self, seconds: float | None, origin: float | None = None) -> None:
        """Start counting from ``origin`` (a ``time.monotonic()`` value; default now)."""
        self.seconds = None if seconds is None or math.isinf(seconds) else float(seconds)
        self.origin = time.monotonic() if origin is None else origin

    def left(self) -> float | None:
        """Seconds left (never negative), or None without a deadline."""
        return None if self.seconds is None else max(0.0, self.origin + self.seconds - time.monotonic())

    @property
    def expired(self) -> bool:
        """True once no time is left."""
        return self.left() == 0.0

    def elapsed(self) -> float:
        """Seconds since the origin."""
        return time.monotonic() - self.origin


def check_deadline(deadline_s: float | None) -> float | None:
    """Validate a deadline option: positive seconds, or None for no limit."""
    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"a preemption deadline must be > 0 seconds (or None), got {deadline_s!r}")
    return deadline_s


class Preemption:
    """The preemption of one :class:`asymcheck.Checkpointer`: notice, agreement, flush (see the module docstring).

    Args:
        progress: the loop's position, shared with the Checkpointer.
        commits: the Checkpointer's commit queue.
        loop: the store's loop.
        notice: the SIGTERM notice.
        agreement: the agreement across ranks (None in a single process).
        deadline_s: the default deadline of a flush (None: no limit).
        settle: opens a version whose step finished but was not delivered yet (DeepSpeed).
        seal_last: seals the newest completed step (``seal_last(save)``).
        release: stops the copy thread and closes the store
            (``release(remove_hooks=..., timeout=...)``; True when it closed in time).
        finished: told the record once a flush ended (the Checkpointer keeps it).
    """

    def __init__(self, progress: Progress, *, commits: CommitQueue, loop: StoreLoop[CheckpointStore],
                 notice: SigtermNotice, agreement: PreemptAgreement | None, deadline_s: float | None,
                 settle: Callable[[], None], seal_last: Callable[[bool], None], release: Callable[..., bool],
                 finished: Callable[[PreemptionRecord], None]) -> None:
        self.progress = progress
        self.commits = commits
        self.loop = loop
        self.notice = notice
        self.agreement = agreement
        self.deadline_s = deadline_s
        self.settle = settle
        self.seal_last = seal_last
        self.release = release
        self.finished = finished
        self.boundary = True
        """The next training hook is the first after an optimizer step (or the first of all)."""
        self.joined = False
        """This iteration's gradients (and the collectives they start) began."""

    def explicit(self, deadline_s: float | None) -> PreemptionRecord:
        """``Checkpointer.preempt()``: publish the notice under several ranks, then flush within the deadline."""
        limit = self.deadline_s if deadline_s is None else check_deadline(deadline_s)
        deadline = Deadline(limit)
        lost = False
        self.settle()  # DeepSpeed: right after engine.step() the step counts only once delivered (not step - 1)
        step = self.progress.step
        if self.agreement is not None:
            agreed = self.agreement.publish(step, "explicit")
            lost = agreed is None
            if agreed is not None and agreed.step != step:
                logger.error("preempt(): the ranks agreed on step %d (%s from rank %d) and this rank is at step %d; "
                             "flushing step %d", agreed.step, agreed.reason, agreed.rank, step, step)
        return self.flush("explicit", deadline, lost=lost)

    def check(self) -> None:
        """At a hook: act on a SIGTERM received since (under several ranks, on the agreed notice)."""
        if self.progress.closed:
            return
        agreement = self.agreement
        if agreement is None:  # one process: the state after the newest completed step is whole at any hook
            if self.notice.pending:
                self.flush("SIGTERM", Deadline(self.deadline_s, self.notice.received))
                self.notice.hand_on()
            return
        boundary, self.boundary = self.boundary, False
        notice = agreement.notice
        if notice is None:
            if self.notice.pending:  # no rank can be past step T (asymcheck.policy.agreement)
                notice = agreement.publish(self.progress.step + (2 if self.joined else 1), "SIGTERM")
            elif boundary:
                notice = agreement.poll()  # the one read of the iteration
            if notice is None:
                if agreement.lost is not None and self.notice.pending:  # no peers to agree with: flush now
                    self.flush("SIGTERM", Deadline(self.deadline_s, self.notice.received),
                                               lost=True)
                    self.notice.hand_on()
                return
        if not boundary:
            return
        if self.progress.step < notice.step:
            return  # train on to the agreed step: the other ranks need this one in its collectives
        if self.progress.step > notice.step:
            logger.error("preemption: every rank was to flush step %d, this rank is already at step %d "
                         "(a rank that does not step in lockstep?): flushing step %d", notice.step, self.progress.step,
                         self.progress.step)
        origins = [t for t in (self.notice.received, agreement.seen) if t is not None]
        self.flush("SIGTERM" if self.notice.pending else "peer",
                                   Deadline(self.deadline_s, min(origins)))
        if self.notice.pending or notice.reason == "SIGTERM":  # a peer's SIGTERM: exit as if signalled
            self.notice.hand_on()

    def _on_loop(self, coro: Coroutine[Any, Any, T], deadline: Deadline, grace_s: float = 1.0) -> T:
        """Run ``coro`` on the store's thread; give up ``grace_s`` after the deadline (TimeoutError)."""
        fut = self.loop.submit(coro)
        left = deadline.left()
        try:
            return fut.result(None if left is None else left + grace_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def flush(self, reason: Reason, deadline: Deadline, *, lost: bool = False) -> PreemptionRecord:
        """Commit the newest completed step durably within ``deadline``, close, and record what it managed."""
        self.settle()  # DeepSpeed: the last step's version opens first
        store = self.loop.store
        error: str | None = None
        hit = False
        persistent: int | None = None
        versions: dict[str, list[int]] = {}
        try:
            drained = self.commits.drain(deadline.left())  # earlier versions first: the store commits in order
            self.progress.closed = True
            self.seal_last(drained)  # the newest completed step (dropped when the deadline passed already)
            drained = drained and self.commits.drain(deadline.left())
            hit = not drained
            if drained:
                persistent = self._on_loop(store.flush(deadline.left()), deadline)
                newest = -1 if self.progress.saved_step is None else self.progress.saved_step
                known = _published(store)
                complete = _reached(persistent, newest) and (known is None or _reached(known[0], newest))
                hit = deadline.expired and not complete
            versions, held = self._on_loop(_versions(store), deadline)
            persistent = held if persistent is None else persistent
        except Exception as exc:  # recorded and logged: the process is about to exit
            hit = hit or isinstance(exc, TimeoutError)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.progress.closed = True
            if not self.release(remove_hooks=False, timeout=deadline.left()):  # hooks stay (no-ops) in a hook
                logger.warning("preemption: the store goes on closing after the deadline")
        failed = self.commits.take_error()
        if failed is not None and error is None:
            error = f"{type(failed).__name__}: {failed}"
        multirank = _published(store)
        published = None if multirank is None else multirank[0]
        durable = persistent == self.progress.step and (multirank is None or published == self.progress.step)
        lost = lost or (multirank is not None and persistent == self.progress.step and published != self.progress.step)
        record = PreemptionRecord(reason, self.progress.step, durable, deadline.elapsed(), versions, deadline.seconds,
                                  hit, persistent, published, error, lost)
        self.finished(record)
        logger.warning("preemption (%s): step %d %s in %.2f s (deadline %s%s); persistent %s, global %s; "
                       "versions %s%s%s", reason, record.step, "durable" if durable else "NOT durable",
                       record.seconds, deadline.seconds, ", hit" if hit else "", persistent, published,
                       versions, "; peer lost" if lost else "", f"; {error}" if error else "",
                       extra={"preemption": record})  # a logging handler gets the record itself
        return record


def _reached(step: int | None, newest: int) -> bool:
    return newest < 0 or (step is not None and step >= newest)


async def _versions(store: CheckpointStore) -> tuple[dict[str, list[int]], int | None]:
    return store.versions(), store.newest_persistent_step


def _published(store: CheckpointStore) -> tuple[int | None] | None:
    """Under several ranks, (the newest global version known published,); None for a single-process store."""
    if not isinstance(store, CollectiveStore):
        return None
    known = [store.published_step, store.restored_global.step if store.restored_global else None]
    return (max((s for s in known if s is not None), default=None),)
