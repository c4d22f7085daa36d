"""Background commits: sealed versions go to the store on its loop thread, a bounded number at a time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from asymcheck.stats import StatsRecorder
from asymstore import CommitResult
from asymstore.errors import AsymstoreError, GlobalVersionDroppedError
from asymstore.protocols import CheckpointStore, DropReportingStore, KnownBytesStore
from asymstore.runtime.loop import StoreLoop
from asymstore.values import KnownChunks

logger = logging.getLogger(__name__)

WHEN_BUSY = ("wait", "skip")


class CommitQueue:
    """Commits sealed versions in the background; at most ``max_inflight`` at once.

    When a version is sealed while ``max_inflight`` commits are still running,
    ``when_busy="wait"`` blocks the caller until the oldest finishes
    (back-pressure) and ``"skip"`` drops the new version; both are counted.

    Args:
        loop: the store's loop thread.
        stats: where commits, skips and failures are counted.
        max_inflight: commits running at once.
        when_busy: ``"wait"`` or ``"skip"``.
        first_committed: run (in a thread of the store's loop) once, after the first commit that
            succeeds: the root's layout record (:func:`asymcheck.versions.storespec.layout_recorder`).
    """

    def __init__(self, loop: StoreLoop[CheckpointStore], stats: StatsRecorder, *, max_inflight: int = 1,
                 when_busy: str = "wait", first_committed: Callable[[], None] | None = None) -> None:
        """Configure the queue."""
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if when_busy not in WHEN_BUSY:
            raise ValueError(f"when_busy must be one of {WHEN_BUSY}, got {when_busy!r}")
        self.loop = loop
        self.stats = stats
        self.max_inflight = max_inflight
        self.when_busy = when_busy
        self._inflight: deque[concurrent.futures.Future[CommitResult]] = deque()
        self._errors: list[BaseException] = []
        self._first_committed = first_committed

    def _prune(self) -> None:
        while self._inflight and self._inflight[0].done():
            self._collect(self._inflight.popleft())

    def _collect(self, fut: concurrent.futures.Future[CommitResult]) -> None:
        exc = fut.exception()
        if exc is not None and not isinstance(exc, GlobalVersionDroppedError):  # another rank's choice, not a failure
            self._errors.append(exc)

    def report_dropped(self, step: int, reason: str) -> None:
        """Tell a store whose commits involve other ranks that ``step`` will not be committed here (no wait)."""
        store = self.loop.store
        if not isinstance(store, DropReportingStore):
            return

        def done(fut: concurrent.futures.Future[None]) -> None:
            if fut.exception() is not None:
                logger.warning("could not report dropped version %d: %s", step, fut.exception())

        self.loop.submit(store.report_dropped(step, reason)).add_done_callback(done)

    @property
    def inflight(self) -> int:
        """Commits submitted and not finished."""
        self._prune()
        return len(self._inflight)

    @property
    def pending(self) -> list[concurrent.futures.Future[CommitResult]]:
        """The commits submitted and not finished."""
        self._prune()
        return list(self._inflight)

    def take_error(self) -> BaseException | None:
        """Return (and forget) the oldest commit failure not reported yet."""
        self._prune()
        return self._errors.pop(0) if self._errors else None

    def submit(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], ready: Any,
               release: Callable[[], None], *, force: bool = False,
               known: Mapping[str, KnownChunks] | None = None) -> tuple[bool, float]:
        """Commit a sealed version in the background.

        Args:
            step: the version.
            tensors: its tensors (views into a host slot, valid until ``release``).
            meta: its JSON metadata.
            ready: a CUDA event to synchronize before reading ``tensors``, or None.
            release: gives the host slot back; the store calls it once it no longer reads ``tensors``.
            force: wait even under ``when_busy="skip"`` (the final version).
            known: tensors staged with the checksums the caller holds (host copies of frozen
                parameters, never written): a :class:`~asymstore.protocols.KnownBytesStore` hashes
                nothing of them; any other store is given them as plain tensors.

        Returns:
            (submitted, seconds waited for an earlier commit).
        """
        self._prune()
        waited = 0.0
        if len(self._inflight) >= self.max_inflight:
            if self.when_busy == "skip" and not force:
                release()
                logger.info("version %d skipped: %d commit(s) still in flight", step, len(self._inflight))
                self.report_dropped(step, "skipped: earlier commits still in flight")
                return False, 0.0
            started = time.perf_counter()
            while len(self._inflight) >= self.max_inflight:
                fut = self._inflight.popleft()
                concurrent.futures.wait([fut])
                self._collect(fut)
            waited = time.perf_counter() - started
        self._inflight.append(self.loop.submit(self._commit(step, tensors, meta, ready, release, dict(known or {}))))
        return True, waited

    async def _commit(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], ready: Any,
                      release: Callable[[], None], known: dict[str, KnownChunks]) -> CommitResult:
        store = self.loop.store
        if known and not isinstance(store, KnownBytesStore):
            tensors = {**tensors, **{name: k.tensor for name, k in known.items()}}  # hashed as any tensor
            known = {}
        try:
            try:
                if ready is not None:
                    await asyncio.to_thread(ready.synchronize)
            except BaseException:
                release()
                raise
            # the store takes the slot's memory as it is (no second copy) and calls ``release`` once
            # every tier written by the commit has it, or when the commit fails
            try:
                await store.adopt_many(step, tensors, release=release)
                if known:  # after: a refusal abandons the step, and that releases the slot
                    assert isinstance(store, KnownBytesStore)
                    await store.adopt_known(step, known)  # host copies never written: nothing to release
            except BaseException as exc:
                store.abandon(step)
                if isinstance(store, DropReportingStore):  # the other ranks must not wait for this one
                    try:
                        await store.report_dropped(step, f"staging failed: {type(exc).__name__}: {exc}")
                    except Exception as report_exc:
                        logger.warning("could not report dropped version %d: %s", step, report_exc)
                raise
            try:
                result = await store.commit(step, meta)
            finally:
                store.abandon(step)  # a failed commit: hand the slot back (nothing left to do after success)
        except GlobalVersionDroppedError as exc:
            logger.info("version %d is not a global version: %s", step, exc)
            raise
        except Exception as exc:
            self.stats.failed(f"step {step}: {type(exc).__name__}: {exc}")
            logger.error("commit of version %d failed (the next version is the next attempt): %s", step, exc)
            try:
                store.abandon(step)  # nothing staged for a failed version stays in memory
            except Exception:  # pragma: no cover - abandon only drops a dict entry
                logger.debug("abandon(%d) failed", step, exc_info=True)
            raise
        self.stats.committed(step, result.nbytes, result.seconds)
        if self._first_committed is not None:
            record, self._first_committed = self._first_committed, None
            try:
                await asyncio.to_thread(record)
            except (AsymstoreError, OSError) as exc:  # the version is committed; a root without a record is inferred
                logger.warning("version %d committed, but the root's layout was not recorded: %s", step, exc)
        logger.debug("version %d committed to %s in %.3f s", step, result.tiers, result.seconds)
        return result

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every commit submitted so far, at most ``timeout`` seconds; return whether all finished."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._inflight:
            left = None if end is None else max(0.0, end - time.monotonic())
            done, _ = concurrent.futures.wait([self._inflight[0]], timeout=left)
            if not done:
                return False  # still running on the store's thread
            self._collect(self._inflight.popleft())
        return True
