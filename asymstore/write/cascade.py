"""The background cascade: one flusher per tier below the durable one.

``commit`` returns once the durable tier has a version; each slower tier then
gets it from its own :class:`Flusher`, so a slow or dead tier never blocks the
tiers above it. A flusher's backlog is bounded: when a newer version arrives
while ``backlog`` are already waiting, the oldest waiting one is skipped
(never half-written), and a version that keeps failing is abandoned as soon
as a newer one is waiting. Failures are retried with capped exponential
backoff for as long as no newer version supersedes them, so a tier that comes
back catches up with the newest version.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asymstore.errors import AsymstoreError, CapacityError, StepCommittedError
from asymstore.tiers.protocol import HoldingTier
from asymstore.write.lending import lend_from
from asymstore.write.segments import VersionPlan

if TYPE_CHECKING:
    import torch

    from asymstore.format.manifest import Manifest
    from asymstore.tiers.protocol import Tier
    from asymstore.write.copybuffers import CopyBuffers
    from asymstore.write.staging import PendingStep

logger = logging.getLogger(__name__)

# The library's own generator for retry jitter. Never the global ``random`` module's: the training
# loop's Python RNG state is part of every checkpoint, and a draw from this thread would change it
# behind the loop's back (a resumed run would no longer match an uninterrupted one).
_JITTER = random.Random()


@dataclass
class FlusherStats:
    """What a flusher did so far."""

    written: int = 0
    skipped: int = 0
    retries: int = 0
    bytes_written: int = 0
    seconds_writing: float = 0.0
    last_error: str | None = None

    @property
    def bytes_per_second(self) -> float:
        """Raw bytes per second of writing, over all versions written."""
        return self.bytes_written / self.seconds_writing if self.seconds_writing > 0 else 0.0


class Flusher:
    """Writes committed versions to one tier in the background, newest wins.

    Args:
        name: the tier's name (for logs).
        write: writes one version to the tier (raises on failure).
        backlog: versions kept waiting at most (older ones are skipped).
        on_finished: called with each step once the flusher is done with it
            (written, skipped or abandoned).
        min_backoff_s, max_backoff_s: retry backoff bounds.
    """

    def __init__(self, name: str, write: Callable[[VersionPlan], Awaitable[object]], *, backlog: int = 1,
                 on_finished: Callable[[int], None] | None = None, min_backoff_s: float = 0.2,
                 max_backoff_s: float = 10.0) -> None:
        """Start the flusher's task on the running loop."""
        self.name = name
        self._write = write
        self.backlog = max(1, backlog)
        self._on_finished = on_finished
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.queue: list[VersionPlan] = []
        self.current: VersionPlan | None = None
        self.newest: int | None = None  # newest step this flusher committed
        self.stats = FlusherStats()
        self._cond = asyncio.Condition()
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    @property
    def depth(self) -> int:
        """Versions waiting or being written."""
        return len(self.queue) + (self.current is not None)

    @property
    def lag_bytes(self) -> int:
        """Raw bytes of the versions waiting or being written."""
        plans = [*self.queue, *([self.current] if self.current else [])]
        return sum(p.raw_bytes for p in plans)

    def submit(self, plan: VersionPlan) -> None:
        """Queue ``plan``; skip the oldest waiting versions beyond the backlog."""
        while len(self.queue) >= self.backlog:
            old = self.queue.pop(0)
            self.stats.skipped += 1
            # the first skip is a WARNING; the later ones are counted (status().skipped) and logged at INFO, since
            # a tier behind a faster durable one (a memory tier taking every step) skips by design, at every step
            log = logger.warning if self.stats.skipped == 1 else logger.info
            log("%s is behind: skipping step %d for newer step %d%s", self.name, old.step, plan.step,
                " (further skips are counted in status().skipped and logged at INFO)" if self.stats.skipped == 1
                else "")
            self._finish(old)
        self.queue.append(plan)
        self._wake.set()

    def _finish(self, plan: VersionPlan) -> None:
        plan.tier_done()
        if self._on_finished:
            self._on_finished(plan.step)

    async def _run(self) -> None:
        while True:
            while not self.queue:
                self._wake.clear()
                await self._wake.wait()
            plan = self.current = self.queue.pop(0)
            try:
                await self._write_with_retries(plan)
            finally:
                self.current = None
                self._finish(plan)
                async with self._cond:
                    self._cond.notify_all()

    async def _write_with_retries(self, plan: VersionPlan) -> None:
        backoff = self.min_backoff_s
        while True:
            started = time.perf_counter()
            try:
                await self._write(plan)
            except StepCommittedError:
                self._committed(plan.step)  # already there (an earlier run wrote it)
                return
            except CapacityError as exc:
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                self.stats.skipped += 1
                logger.warning("%s: step %d skipped: %s", self.name, plan.step, exc)
                return
            except Exception as exc:  # a background tier never fails the training side
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                if self.queue:
                    self.stats.skipped += 1
                    logger.error("%s: giving up on step %d (a newer version is waiting): %s",
                                 self.name, plan.step, exc)
                    return
                self.stats.retries += 1
                logger.warning("%s: step %d failed, retrying in %.1f s: %s", self.name, plan.step, backoff, exc)
                self._wake.clear()
                try:  # a newer version cuts the wait short
                    await asyncio.wait_for(self._wake.wait(), backoff * (0.5 + _JITTER.random()))
                except TimeoutError:
                    pass
                backoff = min(self.max_backoff_s, backoff * 2)
                continue
            self.stats.seconds_writing += time.perf_counter() - started
            self.stats.bytes_written += plan.raw_bytes
            self.stats.written += 1
            self._committed(plan.step)
            return

    def _committed(self, step: int) -> None:
        self.newest = step if self.newest is None else max(self.newest, step)

    def caught_up(self, step: int) -> bool:
        """True once ``step`` (or a newer step) is on the tier, or nothing up to it is left to write."""
        if self.newest is not None and self.newest >= step:
            return True
        return not any(p.step <= step for p in [*self.queue, *([self.current] if self.current else [])])

    async def wait(self, step: int, timeout: float | None = None) -> None:
        """Wait until :meth:`caught_up` holds for ``step``.

        Raises:
            TimeoutError: ``timeout`` passed first.
        """
        async def until() -> None:
            async with self._cond:
                await self._cond.wait_for(lambda: self.caught_up(step))
        await asyncio.wait_for(until(), timeout)

    async def stop(self) -> None:
        """Cancel the flusher (what is still queued is dropped, never half-published)."""
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        for plan in self.queue:
            self._finish(plan)
        self.queue.clear()


@dataclass
class _Hold:
    left: int  # flushers not done with the version yet
    tiers: list[HoldingTier]  # fast tiers keeping their copy until then
    on_done: Callable[[], None] | None


def _call(fn: Callable[[], None], step: int) -> None:
    try:
        fn()
    except Exception:
        logger.exception("step %d: a callback after the background tiers failed", step)


class Background:
    """The store's slower tiers: one :class:`Flusher` each, and the fast-tier copies held for them.

    When the durable tier is not persistent (a memory tier), the copies on the
    tiers up to it are the only ones until every slower tier has the version:
    those tiers *hold* it (:class:`~asymstore.tiers.protocol.HoldingTier`) until
    each flusher has finished with it.
    """

    def __init__(self) -> None:
        """Start with no background tier."""
        self.flushers: dict[str, Flusher] = {}
        self._holds: dict[int, _Hold] = {}  # step -> flushers left, held tiers, what runs when all are done
        self._side_tasks: set[asyncio.Future[None]] = set()

    def add(self, name: str, write: Callable[[VersionPlan], Awaitable[object]], backlog: int) -> None:
        """Start a flusher for the tier ``name``."""
        self.flushers[name] = Flusher(name, write, backlog=backlog, on_finished=self._finished)

    def submit(self, plan: VersionPlan, held: Sequence[object],
               on_done: Callable[[], None] | None = None) -> None:
        """Hand ``plan`` to every flusher.

        ``held`` tiers keep their copy until all of them are done with it, and
        then ``on_done`` runs (on the event loop; its errors are logged).
        """
        if not self.flushers:
            if on_done is not None:
                _call(on_done, plan.step)
            return
        holders = [t for t in held if isinstance(t, HoldingTier)]
        self._holds[plan.step] = _Hold(len(self.flushers), holders, on_done)
        for tier in holders:
            tier.hold(plan.step)
        for f in self.flushers.values():
            f.submit(plan)

    def _finished(self, step: int) -> None:
        """A flusher is done with ``step``: once every flusher is, release the held copies and run ``on_done``."""
        hold = self._holds.get(step)
        if hold is None:
            return
        hold.left -= 1
        if hold.left > 0:
            return
        del self._holds[step]
        if hold.on_done is not None:
            _call(hold.on_done, step)
        for tier in hold.tiers:
            task = asyncio.ensure_future(tier.release(step))
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)

    async def hand_off(self, plan: VersionPlan, pending: PendingStep, manifest: Manifest, durable: Tier,
                       fast: Sequence[Tier], buffers: CopyBuffers) -> None:
        """After the durable tier committed a version: give the caller's memory back, then hand it to every flusher.

        Adopted tensors (``pending.releases``) go back to their owner now, so the slower tiers read
        another copy: the durable tier's own where it lends one (:mod:`asymstore.write.lending`), else
        a private copy from ``buffers`` (no memory for it: the slower tiers skip this version). When
        ``durable`` is not persistent, the ``fast`` tiers (those up to it that hold the version) keep
        their copy until every flusher is done with it.

        Args:
            plan: the committed version's plan.
            pending: what was staged for it (released here).
            manifest: the durable tier's manifest of it.
            durable: the durable tier.
            fast: the tiers up to the durable one that hold the version.
            buffers: where a private copy comes from (and goes back to).
        """
        background = bool(self.flushers)
        copy: torch.Tensor | None = None
        lent: contextlib.ExitStack | None = None
        if background and pending.releases:  # adopted memory goes back now: slower tiers read another copy
            try:  # the durable tier's own, where it lends it (lending); else a private copy
                lent = lend_from(durable, manifest, plan, pending.tensors)  # type: ignore[arg-type]
            except (AsymstoreError, OSError) as exc:
                logger.info("step %d: the durable tier could not lend it (%s); copying it for the background "
                            "tiers", plan.step, exc)
            if lent is None:
                try:
                    copy = await asyncio.to_thread(plan.detach, pending.tensors, buffers)  # type: ignore[arg-type]
                except BaseException:
                    background = False
                    logger.exception("step %d: no memory to copy it for the background tiers; they skip it",
                                     plan.step)
        pending.release_all()
        if not background:
            return
        done_with = (functools.partial(buffers.give_back, copy) if copy is not None
                     else lent.close if lent is not None else None)
        self.submit(plan, [] if durable.persistent else fast, done_with)  # not persistent: held until flushed

    async def wait(self, step: int, name: str | None = None, timeout: float | None = None) -> None:
        """Wait until every flusher (or the one of tier ``name``) has ``step`` or a newer version.

        Raises:
            TimeoutError: ``timeout`` passed first.
        """
        flushers = [f for f in self.flushers.values() if name is None or f.name == name]
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in flushers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await f.wait(step, left)

    async def stop(self) -> None:
        """Stop every flusher, reporting the versions each is still behind by."""
        for name, f in self.flushers.items():
            if f.depth:
                logger.error("closing: %s is %d version(s) behind (newest there: %s; last error: %s); "
                             "dropping them", name, f.depth, f.newest, f.stats.last_error)
        for f in self.flushers.values():
            await f.stop()
        self.flushers.clear()
