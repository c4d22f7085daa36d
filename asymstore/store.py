"""AsymStore: versioned checkpoints over a list of tiers, fastest first."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from asymstore.errors import (
    AsymstoreError,
    CapacityError,
    CorruptVersionError,
    EmptyStepError,
    InvalidStepError,
    NoCheckpointError,
    StepCommittedError,
    StepOrderError,
    StoreClosedError,
    TierError,
    VersionNotFoundError,
)
from asymstore.manifest import Manifest, validate_meta
from asymstore.restore import Checkpoint, describe, load_version
from asymstore.staging import PendingStep, Segment
from asymstore.tiers.base import Tier

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 64 << 20


@dataclass
class CommitResult:
    """What ``commit`` did: the manifest, and the tiers that hold the version so far."""

    step: int
    manifest: Manifest
    tiers: list[str]
    seconds: float

    @property
    def nbytes(self) -> int:
        """Raw bytes of the version."""
        return self.manifest.nbytes


class _TierState:
    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.versions: set[int] = set()
        self.bad: set[int] = set()  # steps that failed verification here
        self.lock = asyncio.Lock()  # one version written at a time, in step order
        self.last_error: str | None = None


def _check_step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidStepError(f"step must be a non-negative int, got {step!r}")
    return step


class AsymStore:
    """Checkpoint versions over tiers ordered fastest first.

    ``commit`` writes the version to every tier up to the *durable* one (by
    default the first persistent tier; the last tier when none is persistent)
    and returns once it is committed there; the tiers after it receive the
    version in the background (``flushed`` waits for them).

    Args:
        tiers: the tiers, fastest first.
        keep_last: versions kept per tier (a tier's own ``keep_last`` wins);
            None keeps all. Older versions are deleted only after a newer one
            is committed on that tier.
        durable: the tier (object or name) whose commit ``commit`` waits for.
        segment_bytes: target size of one segment file.
        chunk_bytes: largest chunk of one tensor (one checksum each).
    """

    def __init__(self, tiers: Sequence[Tier], *, keep_last: int | None = 3,
                 durable: Tier | str | None = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 chunk_bytes: int | None = None) -> None:
        """Configure the store; tiers are opened by ``open`` / ``async with``."""
        if not tiers:
            raise ValueError("AsymStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        if segment_bytes < 1:
            raise ValueError("segment_bytes must be positive")
        self._tiers = [_TierState(t) for t in tiers]
        self.keep_last = keep_last
        self.segment_bytes = segment_bytes
        self.chunk_bytes = chunk_bytes or segment_bytes
        self._durable = self._find_durable(durable)
        self._pending: dict[int, PendingStep] = {}
        self._background: dict[int, list[asyncio.Task[None]]] = {}
        self._open = False

    def _find_durable(self, durable: Tier | str | None) -> int:
        for i, state in enumerate(self._tiers):
            if durable is None and state.tier.persistent:
                return i
            if durable is not None and (state.tier is durable or state.tier.name == durable):
                return i
        if durable is not None:
            raise ValueError(f"durable tier {durable!r} is not one of the store's tiers")
        return len(self._tiers) - 1

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""
        return [s.tier for s in self._tiers]

    @property
    def durable_tier(self) -> Tier:
        """The tier ``commit`` waits for."""
        return self._tiers[self._durable].tier

    # -- lifecycle -------------------------------------------------------

    async def open(self) -> AsymStore:
        """Open every tier and read what versions they hold."""
        for state in self._tiers:
            await state.tier.open()
        await self.refresh()
        self._open = True
        return self

    async def __aenter__(self) -> AsymStore:
        """Open the store."""
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Close the store (waits for background flushes)."""
        await self.close()

    async def close(self) -> None:
        """Wait for background flushes, drop uncommitted steps, close the tiers."""
        if not self._open:
            return
        try:
            await self.flushed()
        finally:
            for step in list(self._pending):
                logger.warning("closing with step %d put but never committed; dropping it", step)
            self._pending.clear()
            self._open = False
            for state in self._tiers:
                await state.tier.close()

    async def refresh(self) -> None:
        """Re-read the versions each tier lists (after another process wrote)."""
        for state in self._tiers:
            state.versions = set(await state.tier.list_versions())

    def _require_open(self) -> None:
        if not self._open:
            raise StoreClosedError("the store is not open; use 'async with AsymStore(...)'")

    # -- queries ---------------------------------------------------------

    def versions(self) -> dict[str, list[int]]:
        """Committed steps per tier name, ascending."""
        return {s.tier.name: sorted(s.versions) for s in self._tiers}

    @property
    def newest_step(self) -> int | None:
        """Newest committed step on any tier, not counting copies known to be corrupt."""
        good = [v for s in self._tiers for v in s.versions - s.bad]
        return max(good) if good else None

    def _committed_anywhere(self, step: int) -> bool:
        return any(step in s.versions - s.bad for s in self._tiers)

    # -- writing ---------------------------------------------------------

    def _pending_for(self, step: int) -> PendingStep:
        self._require_open()
        _check_step(step)
        if self._committed_anywhere(step):
            raise StepCommittedError(f"step {step} is already committed")
        newest = self.newest_step
        if newest is not None and step < newest:
            raise StepOrderError(f"step {step} is older than the newest committed step {newest}")
        pending = self._pending.get(step)
        if pending is None:
            pending = self._pending[step] = PendingStep(step, self.chunk_bytes)
        return pending

    async def put(self, step: int, name: str, tensor: object) -> None:
        """Stage a private copy of ``tensor`` under ``name`` for ``step``.

        Safe to call concurrently, in any order of names. The tensor may be
        changed by the caller as soon as this returns.

        Raises:
            InvalidNameError, DuplicateNameError, InvalidValueError,
            StepCommittedError, StepOrderError, InvalidStepError.
        """
        pending = self._pending_for(step)
        task = asyncio.ensure_future(pending.put(name, tensor))
        pending.inflight.add(task)
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                pending.inflight.discard(task)

    async def put_many(self, step: int, tensors: Mapping[str, object]) -> None:
        """Stage every ``name -> tensor`` of ``tensors`` for ``step``."""
        pending = self._pending_for(step)
        for name in tensors:  # check the whole batch before staging any of it
            if name in pending.tensors:
                await pending.put(name, tensors[name])  # raises DuplicateNameError
        await asyncio.gather(*(self.put(step, name, value) for name, value in tensors.items()))

    def abandon(self, step: int) -> None:
        """Drop everything put for an uncommitted ``step``."""
        self._pending.pop(step, None)

    async def commit(self, step: int, meta: Mapping[str, Any] | None = None) -> CommitResult:
        """Seal ``step`` and commit it; return once it is durable.

        Raises:
            StepCommittedError: the step is already committed.
            StepOrderError: the step is not newer than the newest committed one.
            EmptyStepError: nothing was put for the step.
            InvalidMetaError: ``meta`` is not strict JSON.
            TierError: the durable tier failed (the previous version is intact).
        """
        self._require_open()
        _check_step(step)
        clean_meta = validate_meta(meta)
        if self._committed_anywhere(step):
            raise StepCommittedError(f"step {step} is already committed")
        newest = self.newest_step
        if newest is not None and step <= newest:
            raise StepOrderError(f"step {step} is not newer than the newest committed step {newest}")
        pending = self._pending.get(step)
        if pending is None or not pending.tensors:
            raise EmptyStepError(f"nothing was put for step {step}")
        pending.sealed = True
        started = time.perf_counter()
        try:
            if pending.inflight:
                await asyncio.gather(*pending.inflight, return_exceptions=True)
            pending.tensors = {k: v for k, v in pending.tensors.items() if v is not None}
            if not pending.tensors:
                raise EmptyStepError(f"every put for step {step} failed")
            manifest, segments = await asyncio.to_thread(
                pending.pack, self.segment_bytes, clean_meta, time.time())
            data = manifest.to_json()
            done: list[str] = []
            for i, state in enumerate(self._tiers[: self._durable + 1]):
                try:
                    await self._write_tier(state, manifest, data, segments)
                    done.append(state.tier.name)
                except CapacityError as exc:
                    if i == self._durable:
                        raise
                    logger.warning("step %d skipped on %s: %s", step, state.tier.name, exc)
                except AsymstoreError as exc:
                    if i == self._durable:
                        await self._unpublish(step, self._tiers[:i])
                        raise
                    logger.error("step %d failed on %s: %s", step, state.tier.name, exc)
        except BaseException:
            pending.sealed = False
            raise
        del self._pending[step]
        for older in [s for s in self._pending if s < step]:
            logger.warning("step %d was put but never committed before step %d; dropping it", older, step)
            del self._pending[older]
        rest = self._tiers[self._durable + 1:]
        if rest:
            self._background[step] = [
                asyncio.ensure_future(self._write_background(s, manifest, data, segments)) for s in rest
            ]
        return CommitResult(step, manifest, done, time.perf_counter() - started)

    async def _unpublish(self, step: int, states: list[_TierState]) -> None:
        """Remove ``step`` from the fast tiers when the durable tier refused it, so it can be retried."""
        for state in states:
            if step in state.versions:
                try:
                    await state.tier.delete_version(step)
                except Exception as exc:  # a fast tier's leftover is only a cache entry
                    logger.error("could not remove step %d from %s: %s", step, state.tier.name, exc)
                state.versions.discard(step)

    async def _write_background(self, state: _TierState, manifest: Manifest, data: bytes,
                                segments: list[Segment]) -> None:
        try:
            await self._write_tier(state, manifest, data, segments)
        except Exception as exc:  # a background tier never fails the training side
            state.last_error = describe(exc)
            logger.error("background commit of step %d to %s failed: %s", manifest.step, state.tier.name, exc)

    async def _write_tier(self, state: _TierState, manifest: Manifest, data: bytes,
                          segments: list[Segment]) -> None:
        step, tier = manifest.step, state.tier
        async with state.lock:
            if step in state.bad:
                await tier.quarantine(step)
                state.bad.discard(step)
                state.versions.discard(step)
            writer = await tier.begin(step, manifest.stored_bytes + len(data))
            try:
                for seg in segments:
                    await writer.write_segment(seg.name, seg.parts)
                await writer.publish(data)
            except BaseException as exc:
                await asyncio.shield(writer.abort())
                state.last_error = describe(exc)
                if isinstance(exc, AsymstoreError) or not isinstance(exc, Exception):
                    raise
                raise TierError(f"{tier.name}: {exc}") from exc
            state.versions.add(step)
            try:
                await tier.write_latest(max(state.versions))
                await self._retain(state)
            except Exception as exc:  # the version is committed; housekeeping can wait
                state.last_error = describe(exc)
                logger.error("after committing step %d on %s: %s", step, tier.name, exc)

    async def _retain(self, state: _TierState) -> None:
        keep = state.tier.keep_last if state.tier.keep_last is not None else self.keep_last
        if keep is None:
            return
        ordered = sorted(state.versions)
        for old in ordered[:-keep]:
            await state.tier.delete_version(old)
            state.versions.discard(old)
            state.bad.discard(old)

    async def flushed(self, step: int | None = None) -> None:
        """Wait until ``step`` (default: every committed step) is on every tier it is bound for."""
        steps = [step] if step is not None else list(self._background)
        for s in steps:
            tasks = self._background.get(s, [])
            if tasks:
                await asyncio.gather(*tasks)
            self._background.pop(s, None)

    # -- reading ---------------------------------------------------------

    async def restore(self, step: int | None = None) -> Checkpoint:
        """Return the newest version that verifies (or ``step``), from the fastest tier holding it.

        A copy that fails verification is skipped (logged, and listed in the
        result's ``fallbacks``): the next tier's copy is tried, then the
        previous version. With ``step`` given, only that step is tried.

        Raises:
            NoCheckpointError: no tier holds any version.
            VersionNotFoundError: ``step`` is on no tier.
            CorruptVersionError: no copy of any candidate verifies.
        """
        self._require_open()
        await self.refresh()
        holders: dict[int, list[_TierState]] = {}
        for state in self._tiers:
            for v in state.versions:
                holders.setdefault(v, []).append(state)
        if step is not None:
            _check_step(step)
            if step not in holders:
                raise VersionNotFoundError(f"step {step} is not committed on any tier")
            candidates = [step]
        else:
            if not holders:
                raise NoCheckpointError("no tier holds a committed version")
            candidates = sorted(holders, reverse=True)
        fallbacks: list[str] = []
        for s in candidates:
            for state in holders[s]:
                try:
                    manifest, tensors = await load_version(state.tier, s)
                except (AsymstoreError, OSError) as exc:
                    reason = f"step {s} on {state.tier.name}: {describe(exc)}"
                    logger.warning("restore skipped %s", reason)
                    fallbacks.append(reason)
                    if isinstance(exc, (CorruptVersionError, TierError, OSError)):
                        state.bad.add(s)
                    continue
                state.bad.discard(s)
                if fallbacks:
                    logger.warning("restored step %d from %s after %d failed attempt(s)",
                                   s, state.tier.name, len(fallbacks))
                return Checkpoint(s, tensors, manifest.meta, state.tier.name, manifest, fallbacks)
        raise CorruptVersionError("no copy verified: " + "; ".join(fallbacks))
