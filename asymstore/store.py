"""AsymStore: versioned checkpoints over a list of tiers, fastest first."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypedDict

from asymstore.errors import (
    AsymstoreError,
    CapacityError,
    EmptyStepError,
    ReadOnlyStoreError,
    StepCommittedError,
    StepOrderError,
    StoreClosedError,
    TierError,
    describe,
)
from asymstore.format.codec import PlaneCodec
from asymstore.format.manifest import Manifest, validate_meta
from asymstore.policy.calibration import CalibrationCache, calibrate
from asymstore.policy.compression import COMPRESSION_POLICIES, Compression
from asymstore.policy.costmodel import assumed_calibration
from asymstore.policy.retention import KeepBest, Retention
from asymstore.protocols import CheckpointStore, KnownBytesStore
from asymstore.read.restore import restore_newest
from asymstore.tiers.protocol import ExclusiveTier, ReportingTier, Tier
from asymstore.values import Checkpoint, CommitResult, FlushStats, KnownChunks, TierCalibration, TierStatus
from asymstore.write.cascade import Background
from asymstore.write.copybuffers import CopyBuffers
from asymstore.write.pool import SegmentPool, default_threads
from asymstore.write.puts import Release, Stager, check_step
from asymstore.write.references import REFERENCE_MODES, ReferenceMode
from asymstore.write.samples import SampleMemory
from asymstore.write.segments import VersionPlan
from asymstore.write.staging import PendingStep
from asymstore.write.tierwrite import TierState, sweep, write_version

if TYPE_CHECKING:

    from asymstore.values import Into

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_FLUSH_MEMORY_BYTES = 256 << 20
DEFAULT_SHARE_BYTES = 64 << 20  # compressed chunks kept for a later tier that compresses them too


class StoreOptions(TypedDict, total=False):
    """Options of an :class:`AsymStore` beyond its tiers and retention (see :class:`AsymStore` for each).

    :func:`asymstore.open_store` passes them to the store it opens, and a
    :class:`~asymstore.multirank.RankStore` to this rank's own store, so mypy checks them there too.
    """

    durable: Tier | str | None
    segment_bytes: int | None
    chunk_bytes: int | None
    compression: Compression
    references: ReferenceMode
    codec: PlaneCodec | None
    calibrations: Mapping[str, TierCalibration] | None
    calibration_cache: str | os.PathLike[str] | bool
    flush_memory_bytes: int
    backlog: int
    close_timeout_s: float | None
    pipeline_threads: int | None


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
        keep_every: also keep, on persistent tiers, every version whose step is
            a multiple of it, permanently (recorded in its manifest, so a restart
            with other settings keeps it too).
        keep_best: also keep, on persistent tiers, the best versions by a
            metric reported in their meta (``meta["metrics"][name]``); see
            :mod:`asymstore.policy.retention`.
        durable: the tier (object or name) whose commit ``commit`` waits for.
        segment_bytes: a fixed segment size for every tier. None (default):
            per tier and version ``B* = sqrt(a·N/c)`` from the tier's
            calibration (see :mod:`asymstore.write.segments`).
        chunk_bytes: largest chunk of one tensor (one checksum, one codec
            decision each); default ``min(segment_bytes, 16 MiB)``.
        compression: ``"auto"`` (byte-plane zstd per chunk where the cost
            model says it pays for the tier), ``"never"`` or ``"always"``.
        references: ``"unchanged"`` (default): on tiers that can
            (:class:`~asymstore.tiers.protocol.ReferencingTier`: local disk, NVMe),
            a chunk equal to the one at the same place of the same tensor in the
            tier's previous version is referenced from the version that wrote it,
            not written again (manifest format 4); ``"off"``: every version writes
            all its bytes. See docs/concepts/format.md.
        codec: zstd level and threads of the byte-plane codec.
        calibrations: tier name -> calibration to use instead of measuring.
        calibration_cache: True: the default cache file
            (:func:`asymstore.policy.calibration.default_cache_path`); a path: that
            file; False: measure at every ``open``.
        flush_memory_bytes: host memory for segments in flight per tier
            (about two segments); caps ``B`` at half of it.
        backlog: versions waiting per background tier; when a newer one
            arrives beyond it, the oldest waiting one is skipped there.
        close_timeout_s: how long ``close`` waits for background tiers
            (None: as long as it takes); what is left is reported and dropped.
        pipeline_threads: threads that stage large tensors (copy and
            checksums) and hash, compress and write one version's segments (one
            pool shared by every tier; :mod:`asymstore.write.pool`). 1: one
            segment filled while the previous one is written, large tensors
            staged in asyncio's default threads; None (default):
            :func:`~asymstore.write.pool.default_threads`, half of this process's
            share of the host's CPUs, at most 8.
        read_only: open to read only (restore, versions, status) beside a
            live writer: no root is locked, nothing is swept or calibrated,
            and ``put`` / ``commit`` raise :class:`ReadOnlyStoreError`.
        retention_floor: for a store with no retention rule of its own whose
            versions an outer retention deletes (each rank's shards of a
            :class:`~asymstore.multirank.RankStore`): returns the oldest version
            that retention keeps (None: none known). A version without a
            manifest below it is what an interrupted delete left, and the sweep
            removes it instead of quarantining it.
    """

    def __init__(self, tiers: Sequence[Tier], *, keep_last: int | None = 3, keep_every: int | None = None,
                 keep_best: KeepBest | None = None,
                 durable: Tier | str | None = None, segment_bytes: int | None = None,
                 chunk_bytes: int | None = None, compression: Compression = "auto",
                 references: ReferenceMode = "unchanged", codec: PlaneCodec | None = None,
                 calibrations: Mapping[str, TierCalibration] | None = None,
                 calibration_cache: str | os.PathLike[str] | bool = True,
                 flush_memory_bytes: int = DEFAULT_FLUSH_MEMORY_BYTES, backlog: int = 1,
                 close_timeout_s: float | None = 60.0, read_only: bool = False,
                 retention_floor: Callable[[], int | None] | None = None,
                 pipeline_threads: int | None = None) -> None:
        """Configure the store; tiers are opened by ``open`` / ``async with``."""
        if not tiers:
            raise ValueError("AsymStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        self.retention = Retention(keep_last, keep_every, keep_best)
        """The retention rules (:class:`~asymstore.policy.retention.Retention`)."""
        if segment_bytes is not None and segment_bytes < 1:
            raise ValueError("segment_bytes must be positive")
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        if compression not in COMPRESSION_POLICIES:
            raise ValueError(f"compression must be one of {COMPRESSION_POLICIES}, got {compression!r}")
        if references not in REFERENCE_MODES:
            raise ValueError(f"references must be one of {REFERENCE_MODES}, got {references!r}")
        if flush_memory_bytes < 1:
            raise ValueError("flush_memory_bytes must be positive")
        unknown = set(calibrations or {}) - set(names)
        if unknown:
            raise ValueError(f"calibrations name unknown tiers: {sorted(unknown)}")
        self._tiers = [TierState(t, retention_floor) for t in tiers]
        self.segment_bytes = segment_bytes
        chunk = chunk_bytes or min(segment_bytes or DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_BYTES)
        self._pool = SegmentPool(default_threads() if pipeline_threads is None else pipeline_threads)
        """The pipeline's threads (``pipeline_threads``): staging of large tensors and every tier's writes."""
        self._stager = Stager(chunk, self._admit, self._pool.run if self._pool.threads > 1 else None)
        """What is staged per uncommitted step (``put``, ``adopt``; :mod:`asymstore.write.puts`)."""
        self.compression: Compression = compression
        self.references: ReferenceMode = references
        self.codec = codec or PlaneCodec()
        self.flush_memory_bytes = flush_memory_bytes
        self._given = dict(calibrations or {})
        if calibration_cache is True:
            self._cache: CalibrationCache | None = CalibrationCache()
        elif calibration_cache is False:
            self._cache = None
        else:
            self._cache = CalibrationCache(calibration_cache)
        self._durable = self._find_durable(durable)
        self._commit_lock = asyncio.Lock()
        self._committed_steps: set[int] = set()  # committed through this store object
        self._background = Background()
        self._copy_buffers = CopyBuffers()  # the background tiers' private copies of adopted versions, reused
        self._samples = SampleMemory()  # compression samples of recent versions: a chunk is sampled every few
        self.close_timeout_s = close_timeout_s
        self.backlog = backlog
        self.read_only = read_only
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
        """Open every tier, take its root, sweep leftovers, list versions and calibrate write costs.

        One writer per root: each directory tier is locked while the store is
        open, so what dead writers left behind can be swept safely (a
        ``read_only`` store locks, sweeps and calibrates nothing).

        Raises:
            RootLockedError: another live store writes one of the roots.
        """
        opened: list[Tier] = []
        try:
            for state in self._tiers:
                await state.tier.open()
                opened.append(state.tier)
                if isinstance(state.tier, ExclusiveTier) and not self.read_only:
                    await state.tier.lock_root()
                    await self._sweep_at_open(state)
        except BaseException:
            for tier in reversed(opened):
                await self._close_tier(tier)
            raise
        await self.refresh()
        if self.read_only:
            self._open = True
            return self
        await self._calibrate(refresh=False)
        for state in self._tiers[self._durable + 1:]:
            self._background.add(state.tier.name, functools.partial(self._write_locked, state), self.backlog)
        self._open = True
        return self

    async def _sweep_at_open(self, state: TierState) -> None:
        """Sweep what dead writers left on a tier just locked (a version without a manifest: see ``tierwrite.sweep``).

        The tier's versions are listed first, so that retention can say which
        manifest-less versions it would have deleted; a tier that cannot list
        removes none of them (they are quarantined), and ``refresh`` reports it.
        """
        try:
            state.versions = set(await state.tier.list_versions())
        except (TierError, OSError) as exc:
            logger.debug("%s: cannot list before the sweep: %s", state.tier.name, exc)
            state.versions = set()
        await sweep(state, self.retention)

    async def _calibrate(self, *, refresh: bool) -> None:
        for state in self._tiers:
            given = self._given.get(state.tier.name)
            if given is not None:
                state.calibration = given
            elif self.segment_bytes is not None and self.compression != "auto":
                state.calibration = assumed_calibration()  # neither B nor any codec choice depends on it
            else:
                state.calibration = await calibrate(state.tier, self._cache, refresh=refresh)

    async def recalibrate(self) -> dict[str, TierCalibration]:
        """Measure every tier again (ignoring and updating the cache); return the calibrations by tier name.

        Calibrations given to the constructor are kept as they are.
        """
        self._require_open()
        await self._calibrate(refresh=True)
        return {s.tier.name: s.calibration for s in self._tiers if s.calibration is not None}

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
            await self.flushed(timeout=self.close_timeout_s)
        except TimeoutError:
            pass  # stop() reports what is left behind
        finally:
            await self._background.stop()
            for step, pending in list(self._stager.pending.items()):
                logger.warning("closing with step %d put but never committed; dropping it", step)
                pending.release_all()
            self._stager.pending.clear()
            self._open = False
            self._pool.close()
            for state in self._tiers:
                await self._close_tier(state.tier)

    async def _close_tier(self, tier: Tier) -> None:
        try:
            await tier.close()
        finally:
            if isinstance(tier, ExclusiveTier) and not self.read_only:
                await tier.unlock_root()

    async def refresh(self) -> None:
        """Re-read the versions each tier lists (after another process wrote).

        A tier other than the durable one that cannot list (a peer that is gone, a remote store that is
        down) lists nothing until the next refresh; its error is logged and kept in ``status()``, and
        the other tiers still serve restores. The durable tier's failure is raised.
        """
        for i, state in enumerate(self._tiers):
            try:
                state.versions = set(await state.tier.list_versions())
            except (TierError, OSError) as exc:
                if i == self._durable:
                    raise
                state.versions = set()
                state.last_error = describe(exc)
                logger.warning("%s cannot list its versions; restores use the other tiers: %s",
                               state.tier.name, exc)

    @property
    def keep_last(self) -> int | None:
        """Versions kept per tier by ``keep_last`` (a tier's own wins); None keeps all."""
        return self.retention.keep_last

    def _require_open(self) -> None:
        if not self._open:
            raise StoreClosedError("the store is not open; use 'async with AsymStore(...)'")

    def _require_writer(self) -> None:
        self._require_open()
        if self.read_only:
            raise ReadOnlyStoreError("the store was opened with read_only=True")

    def _admit(self, step: int) -> None:
        """Refuse to stage for ``step`` unless this store could still commit it (the Stager asks first)."""
        self._require_writer()
        check_step(step)
        if self._committed_anywhere(step):
            raise StepCommittedError(f"step {step} is already committed")
        newest = self.newest_step
        if newest is not None and step < newest:
            raise StepOrderError(f"step {step} is older than the newest committed step {newest}")

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk of one tensor (one checksum, one codec decision)."""
        return self._stager.chunk_bytes

    # -- staging (the ownership rules of adopted tensors: :mod:`asymstore.write.puts`) ----------

    async def put(self, step: int, name: str, tensor: object) -> None:
        """Stage a private copy of ``tensor`` under ``name`` for ``step``.

        Safe to call concurrently, in any order of names. The tensor may be
        changed by the caller as soon as this returns.

        Raises:
            InvalidNameError: ``name`` is not a valid tensor name.
            DuplicateNameError: ``name`` was already put for ``step``.
            InvalidValueError: ``tensor`` is not a tensor of a storable dtype.
            StepCommittedError: ``step`` is already committed.
            StepOrderError: ``step`` is older than the newest committed step.
            InvalidStepError: ``step`` is not a non-negative int.
            StoreClosedError: the store is not open.
            ReadOnlyStoreError: the store was opened ``read_only``.
        """
        await self._stager.put(step, name, tensor)

    async def put_many(self, step: int, tensors: Mapping[str, object]) -> None:
        """Stage a private copy of every ``name -> tensor`` of ``tensors`` for ``step``.

        Small tensors are staged one after another on the event loop (no task
        each: 10,000 of them cost no more scheduling than a few), yielding
        every 1024 (4096 when packing); large ones concurrently in threads. In
        a call of at least 32 tensors, those of at most 64 KiB are copied back
        to back into packs (one buffer, one checksum and one chunk per pack of
        up to 16 MiB; manifest format 3). On an error the rest of the small
        ones are not staged.

        Raises:
            DuplicateNameError: a name of ``tensors`` was already put for ``step``
                (checked for the whole batch before any is staged).
            Everything :meth:`put` raises.
        """
        await self._stager.put_many(step, tensors)

    async def adopt(self, step: int, name: str, tensor: object, *, release: Release | None = None) -> None:
        """Stage ``tensor`` itself (no copy) under ``name`` for ``step``; ``release`` hands it back.

        The caller must neither write nor free the tensor until ``release`` has
        run (the ownership rules: :mod:`asymstore.write.puts`).

        Raises:
            InvalidValueError: not a contiguous CPU tensor of a storable dtype.
            Everything :meth:`put` raises. ``release`` has run when this raises.
        """
        await self._stager.adopt(step, name, tensor, release=release)

    async def adopt_many(self, step: int, tensors: Mapping[str, object], *, release: Release | None = None) -> None:
        """Stage every tensor of ``tensors`` without copying; ``release`` runs once when the store is done with all.

        Every tensor is checked before any is staged; their checksums are
        computed in place (large ones in threads). In a call of at least 32
        tensors, those of at most 64 KiB are copied into packs all the same, as
        :meth:`put_many` does (their bytes would be gathered for the segment
        writer anyway).

        Raises:
            InvalidValueError: a tensor is not a contiguous CPU tensor of a storable dtype.
            Everything :meth:`put_many` raises. ``release`` has run when this raises.
        """
        await self._stager.adopt_many(step, tensors, release=release)

    async def adopt_known(self, step: int, tensors: Mapping[str, KnownChunks]) -> None:
        """Stage every ``name -> KnownChunks`` for ``step`` without copying or hashing it.

        Each tensor is taken as it is, with the chunk checksums the caller vouches for
        (:class:`~asymstore.values.KnownChunks`): a referencing tier references the chunks its
        previous version holds with the same name, dtype, shape, bytes and checksum; every other
        tier (and a referencing one that does not hold them committed) writes the bytes. Nothing
        is staged when any of them is refused.

        Raises:
            InvalidValueError: a tensor is not adoptable, or its checksums do not fit the store's chunks.
            Everything :meth:`put` raises.
        """
        await self._stager.adopt_known(step, tensors)

    def abandon(self, step: int) -> None:
        """Drop everything staged for an uncommitted ``step``; adopted tensors are released."""
        self._stager.abandon(step)

    # -- queries ---------------------------------------------------------

    def versions(self) -> dict[str, list[int]]:
        """Committed steps per tier name, ascending."""
        return {s.tier.name: sorted(s.versions) for s in self._tiers}

    @property
    def newest_step(self) -> int | None:
        """Newest committed step on any tier, not counting copies known to be corrupt."""
        good = [v for s in self._tiers for v in s.versions - s.bad]
        return max(good) if good else None

    def status(self) -> dict[str, TierStatus]:
        """Per tier name: committed versions, the calibration in use, what the last flush did, errors, backlog.

        ``last_flush`` (a :class:`~asymstore.write.segments.FlushStats`) shows the
        segment size chosen, chunks compressed vs raw, bytes raw vs stored and
        the time spent compressing and writing.
        """
        newest = self.newest_step
        out = {}
        for s in self._tiers:
            f = self._background.flushers.get(s.tier.name)
            have = max(s.versions) if s.versions else None
            lag = 0 if newest is None else sum(1 for v in self._committed_steps if v > (have or -1))
            error = f.stats.last_error if f and f.stats.last_error else s.last_error
            own = s.tier.background_error if isinstance(s.tier, ReportingTier) else None
            if own is not None and (error is None or own not in error):  # its own threads' failure (a peer's)
                error = own if error is None else f"{error}; {own}"
            out[s.tier.name] = TierStatus(
                s.tier.name, sorted(s.versions), s.calibration, s.last_flush, error,
                sorted(p.step for p in [*f.queue, *([f.current] if f.current else [])]) if f else [],
                newest=have, lag_versions=lag, lag_bytes=f.lag_bytes if f else 0,
                bytes_per_second=f.stats.bytes_per_second if f else 0.0, queue_depth=f.depth if f else 0,
                retries=f.stats.retries if f else 0, skipped=f.stats.skipped if f else 0,
                quarantined=list(s.quarantined))
        return out

    def _committed_anywhere(self, step: int) -> bool:
        return any(step in s.versions - s.bad for s in self._tiers)

    # -- writing ---------------------------------------------------------

    async def commit(self, step: int, meta: Mapping[str, Any] | None = None) -> CommitResult:
        """Seal ``step`` and commit it; return once it is durable.

        Raises:
            StepCommittedError: the step is already committed.
            StepOrderError: the step is not newer than the newest committed one.
            EmptyStepError: nothing was put for the step.
            InvalidMetaError: ``meta`` is not strict JSON.
            TierError: the durable tier failed (the previous version is intact).
            ReadOnlyStoreError: the store was opened ``read_only``.
        """
        self._require_writer()
        check_step(step)
        clean_meta = validate_meta(meta)
        self.retention.stamp(step, clean_meta, clean_meta)  # the decision travels with the version
        async with self._commit_lock:  # one commit at a time: step order is checked where it is decided
            self._check_commit_order(step)
            pending = self._stager.pending.get(step)
            if pending is None or not pending.tensors:
                raise EmptyStepError(f"nothing was put for step {step}")
            return await self._commit_locked(step, pending, clean_meta)

    def _check_commit_order(self, step: int) -> None:
        if self._committed_anywhere(step):
            raise StepCommittedError(f"step {step} is already committed")
        newest = self.newest_step
        if newest is not None and step <= newest:
            raise StepOrderError(f"step {step} is not newer than the newest committed step {newest}")

    async def _commit_locked(self, step: int, pending: PendingStep, clean_meta: dict[str, Any]) -> CommitResult:
        """Seal the staged step, write it up to the durable tier, retire it, hand it to the slower tiers."""
        pending.sealed = True
        started = time.perf_counter()
        try:
            plan = await self._plan(step, pending, clean_meta)
            manifest, done, flush = await self._write_durably(plan)
        except BaseException:
            pending.sealed = False
            raise
        self._retire_staged(step)
        durable = self._tiers[self._durable]
        fast = [s.tier for s in self._tiers[: self._durable + 1] if step in s.versions]
        await self._background.hand_off(plan, pending, manifest, durable.tier, fast, self._copy_buffers)
        return CommitResult(step, manifest, done, time.perf_counter() - started, flush)

    async def _plan(self, step: int, pending: PendingStep, clean_meta: dict[str, Any]) -> VersionPlan:
        """The plan of the sealed ``step``, once its puts in flight have landed (the failed ones dropped)."""
        if pending.inflight:
            await asyncio.gather(*pending.inflight, return_exceptions=True)
        pending.tensors = {k: v for k, v in pending.tensors.items() if v is not None}
        if not pending.tensors:
            raise EmptyStepError(f"every put for step {step} failed")
        return VersionPlan(step, pending.tensors, clean_meta, time.time(),  # type: ignore[arg-type]
                           codec=self.codec, share_bytes=DEFAULT_SHARE_BYTES, tiers=len(self._tiers),
                           samples=self._samples)

    async def _write_durably(self, plan: VersionPlan) -> tuple[Manifest, list[str], dict[str, FlushStats]]:
        """Write ``plan`` to every tier up to the durable one; a faster tier's own failure only skips it there.

        Returns:
            The durable tier's manifest, the tiers written, and what each flush did.

        Raises:
            Whatever the durable tier (or anything not an AsymstoreError) raised; the version is then removed
            from the faster tiers again, so restore never returns a step never committed.
        """
        step = plan.step
        done: list[str] = []
        flush: dict[str, FlushStats] = {}
        manifest: Manifest | None = None
        for i, state in enumerate(self._tiers[: self._durable + 1]):
            try:
                manifest, flush[state.tier.name] = await self._write_tier(state, plan)
                done.append(state.tier.name)
            except BaseException as exc:
                if i == self._durable or not isinstance(exc, AsymstoreError):
                    # not durable: no faster tier may keep it, or restore would return a step never committed
                    await asyncio.shield(self._unpublish(step, self._tiers[:i]))
                    raise
                if isinstance(exc, CapacityError):
                    logger.warning("step %d skipped on %s: %s", step, state.tier.name, exc)
                else:
                    logger.error("step %d failed on %s: %s", step, state.tier.name, exc)
        assert manifest is not None, "the durable tier either committed or raised"
        return manifest, done, flush

    def _retire_staged(self, step: int) -> None:
        """``step`` is committed: forget what was staged for it, and drop older steps never committed."""
        del self._stager.pending[step]
        for older in [s for s in self._stager.pending if s < step]:
            logger.warning("step %d was put but never committed before step %d; dropping it", older, step)
            self._stager.pending.pop(older).release_all()
        self._committed_steps.add(step)

    async def _unpublish(self, step: int, states: list[TierState]) -> None:
        """Remove ``step`` from the fast tiers when the durable tier refused it, so it can be retried."""
        for state in states:
            if step in state.versions:
                try:
                    await state.tier.delete_version(step)
                except Exception as exc:  # a fast tier's leftover is only a cache entry
                    logger.error("could not remove step %d from %s: %s", step, state.tier.name, exc)
                state.versions.discard(step)

    async def _write_locked(self, state: TierState, plan: VersionPlan) -> None:
        """A background tier's write (the flusher retries it and counts the tier done once)."""
        async with state.lock:
            await self._write_tier_locked(state, plan)

    async def _write_tier(self, state: TierState, plan: VersionPlan) -> tuple[Manifest, FlushStats]:
        try:
            async with state.lock:
                return await self._write_tier_locked(state, plan)
        finally:
            plan.tier_done()

    async def _write_tier_locked(self, state: TierState, plan: VersionPlan) -> tuple[Manifest, FlushStats]:
        return await write_version(state, plan, compression=self.compression, segment_bytes=self.segment_bytes,
                                   memory_bytes=self.flush_memory_bytes, retention=self.retention,
                                   references=self.references, pool=self._pool)

    async def flushed(self, step: int | None = None, *, tier: Tier | str | None = None,
                      timeout: float | None = None) -> None:
        """Wait until every background tier (or ``tier``) has ``step`` or a newer version.

        ``step`` defaults to the newest committed step. A tier that is down is
        retried until it comes back, so without ``timeout`` this waits for it.

        Raises:
            TimeoutError: ``timeout`` passed first.
            ValueError: ``tier`` is not one of the store's tiers.
        """
        if step is None:
            step = max(self._committed_steps, default=None)
            if step is None:
                return
        name = None
        if tier is not None:
            name = tier if isinstance(tier, str) else tier.name
            if name not in {s.tier.name for s in self._tiers}:
                raise ValueError(f"{name!r} is not one of the store's tiers")
        await self._background.wait(step, name, timeout)

    @property
    def newest_persistent_step(self) -> int | None:
        """Newest committed step on a persistent tier (one that survives the process), or None."""
        good = [v for s in self._tiers if s.tier.persistent for v in s.versions - s.bad]
        return max(good) if good else None

    async def flush(self, timeout_s: float | None = None) -> int | None:
        """Wait until a persistent tier holds the newest committed step; return the newest step one holds.

        When the durable tier is a memory tier, ``commit`` returns before the
        version reaches a persistent tier (the background cascade copies it
        there). This waits, up to ``timeout_s``, until some persistent tier has
        it; what is left goes on in the background. Unlike :meth:`flushed` it
        never raises on a timeout: the result tells what survives the process.

        Returns:
            :attr:`newest_persistent_step` when done waiting (None: no persistent tier has a version).
        """
        self._require_open()
        newest = max(self._committed_steps, default=None)
        if newest is None or (self.newest_persistent_step or -1) >= newest:
            return self.newest_persistent_step
        names = [s.tier.name for s in self._tiers[self._durable + 1:] if s.tier.persistent]
        waiters = {asyncio.ensure_future(self._background.wait(newest, name)) for name in names}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while waiters and (self.newest_persistent_step or -1) < newest:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, waiters = await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    logger.warning("flush: step %d is on no persistent tier after %.1f s", newest, timeout_s)
                    break
        finally:
            for waiter in waiters:
                waiter.cancel()
        return self.newest_persistent_step

    # -- reading ---------------------------------------------------------

    async def restore(self, step: int | None = None, *, into: Into | None = None) -> Checkpoint:
        """Return the newest version that verifies (or ``step``), from the fastest tier holding it.

        With ``into`` (name -> tensor of the stored dtype and shape), those
        tensors are filled in place and returned as they are: each chunk is
        read straight into the tensor's memory where the tier can (directory
        tiers, host memory) and its checksum verified there; a copy that fails
        verification is followed by an older one into the same tensors. If
        none verifies, the ``into`` tensors hold no particular version.
        ``into`` may be a function of each candidate's manifest returning the
        destinations (it may also refuse a version by raising); the other raw
        tensors are then read straight into fresh tensors as well.

        A copy that fails verification is skipped (logged, and listed in the
        result's ``fallbacks``): the next tier's copy is tried, then the
        previous version. With ``step`` given, only that step is tried.

        Raises:
            NoCheckpointError: no tier holds any version.
            VersionNotFoundError: ``step`` is on no tier.
            CorruptVersionError: no copy of any candidate verifies.
            DestinationMismatchError: a tensor of ``into`` is not stored or has another dtype or shape,
                or ``into(manifest)`` raised (its cause); checked before anything is written into it.
        """
        self._require_open()
        if step is not None:
            check_step(step)
        await self.refresh()
        return await restore_newest(self._tiers, step, into)

    async def read_manifest(self, step: int | None = None) -> Manifest:
        """The manifest of the newest version whose manifest reads (or of ``step``); no tensor is read.

        Each version is tried from the fastest tier holding it, newest first; a manifest that does
        not read or parse is skipped (logged) for the next copy, then the previous version. The
        version's tensors are not verified: :meth:`restore` may still fall back from it.

        Raises:
            NoCheckpointError: no tier holds any version.
            VersionNotFoundError: ``step`` is on no tier.
            CorruptVersionError: no copy of any candidate's manifest reads.
        """
        from asymstore.errors import CorruptVersionError, NoCheckpointError, VersionNotFoundError
        from asymstore.read.verify import read_manifest

        self._require_open()
        if step is not None:
            check_step(step)
        await self.refresh()
        holders: dict[int, list[Tier]] = {}
        for state in self._tiers:
            for v in state.versions:
                holders.setdefault(v, []).append(state.tier)
        if step is not None and step not in holders:
            raise VersionNotFoundError(f"step {step} is not committed on any tier")
        if not holders:
            raise NoCheckpointError("no tier holds a committed version")
        reasons: list[str] = []
        for s in [step] if step is not None else sorted(holders, reverse=True):
            for tier in holders[s]:
                try:
                    return await read_manifest(tier, s)
                except (AsymstoreError, OSError) as exc:
                    logger.warning("manifest of step %d on %s unreadable: %s", s, tier.name, describe(exc))
                    reasons.append(f"step {s} on {tier.name}: {describe(exc)}")
        raise CorruptVersionError("no manifest read: " + "; ".join(reasons))


_SATISFIES: type[CheckpointStore] = AsymStore
_KNOWS: type[KnownBytesStore] = AsymStore  # mypy checks that AsymStore satisfies the adapters' protocol
