"""Writing one version to one tier: plan, stream segments, publish, then the tier's housekeeping."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from asymstore.errors import AsymstoreError, TierError, describe
from asymstore.format.manifest import Manifest
from asymstore.format.parse import parse_manifest
from asymstore.format.proof import SegmentProof
from asymstore.io.rootlock import Swept
from asymstore.policy.compression import Compression
from asymstore.policy.costmodel import assumed_calibration
from asymstore.policy.retention import Note, Retention, beyond_keep_last, keep_last_of
from asymstore.tiers.protocol import BytesProofTier, ExclusiveTier, ReferencingTier, Tier, VersionWriter
from asymstore.values import FlushStats, TierCalibration
from asymstore.write.pool import SegmentPool, stream_pooled
from asymstore.write.references import ReferenceMode, References, find_references
from asymstore.write.segments import SegmentBuilder, VersionPlan

logger = logging.getLogger(__name__)


class TierState:
    """What a store knows of one of its tiers: versions, copies that failed, lock, calibration, last flush."""

    def __init__(self, tier: Tier, floor: Callable[[], int | None] | None = None) -> None:
        """Start with nothing known (``AsymStore.refresh`` lists the versions); ``floor``: an outer retention's."""
        self.tier = tier
        self.floor = floor  # the oldest version an outer retention keeps (AsymStore's retention_floor)
        self.versions: set[int] = set()
        self.bad: set[int] = set()  # steps that failed verification here
        self.lock = asyncio.Lock()  # one version written at a time, in step order
        self.last_error: str | None = None
        self.calibration: TierCalibration | None = None
        self.last_flush: FlushStats | None = None
        self.notes: dict[int, Note] = {}  # retention notes of the versions here, read once (see _retain)
        self.quarantined: list[str] = []  # where this store's sweeps moved versions without a manifest
        self.prev: Manifest | None = None  # the manifest of the newest version written here (references)


async def write_version(state: TierState, plan: VersionPlan, *, compression: Compression,
                        segment_bytes: int | None, memory_bytes: int,
                        retention: Retention, references: ReferenceMode = "off",
                        pool: SegmentPool | None = None) -> tuple[Manifest, FlushStats]:
    """Write ``plan``'s version to ``state.tier`` (the caller holds ``state.lock``) and publish it.

    With ``references="unchanged"`` on a :class:`~asymstore.tiers.protocol.ReferencingTier`, the chunks
    equal to those of the newest version the tier holds (not marked bad) are referenced, not written
    (:mod:`asymstore.write.references`). The segments are hashed and written by ``pool`` when it has
    more than one thread (:mod:`asymstore.write.pool`), else filled in one worker thread while the
    previous one is written.

    After the publish: ``LATEST``, retention (``retention``, with the tier's own
    ``keep_last`` first; :mod:`asymstore.policy.retention`) and the sweep of dead writers' leftovers; their failures
    are logged, never raised (the version is committed).

    Raises:
        AsymstoreError: the tier refused the version (it was aborted there).
        TierError: any other failure of the tier (aborted).
    """
    step, tier = plan.step, state.tier
    if step in state.bad:
        await tier.quarantine(step)
        state.bad.discard(step)
        state.versions.discard(step)
    refs = await _references(state, plan) if references == "unchanged" else References()
    try:
        tier_plan = await asyncio.to_thread(
            plan.plan_tier, tier.name, state.calibration or assumed_calibration(), policy=compression,
            segment_bytes=segment_bytes, memory_bytes=memory_bytes, skip=refs.chunks)
        proof: SegmentProof = "bytes" if isinstance(tier, BytesProofTier) and tier.wants_bytes_proof() else "chunks"
        builder = SegmentBuilder(plan, tier_plan, references=refs.chunks, referenced=refs.segments, proof=proof)
        writer = await tier.begin(step, tier_plan.reserve_bytes)
    except BaseException:  # nothing begun: what was held for the references is let go
        if refs.chunks and isinstance(tier, ReferencingTier):
            await asyncio.shield(tier.release_references(step))
        raise
    try:
        if pool is not None and pool.threads > 1:
            await stream_pooled(builder, writer, pool, memory_bytes)
        else:
            await _stream_segments(builder, writer)
        manifest = builder.manifest()
        await writer.publish(manifest.to_json())
    except BaseException as exc:
        await asyncio.shield(writer.abort())
        state.last_error = describe(exc)
        if isinstance(exc, AsymstoreError) or not isinstance(exc, Exception):
            raise
        raise TierError(f"{tier.name}: {exc}") from exc
    state.versions.add(step)
    state.prev = manifest
    state.notes[step] = retention.note_of(manifest.meta)
    try:
        await tier.write_latest(max(state.versions))
        await _retain(state, retention)  # retries a delete that failed earlier, so reconcile after it
        await sweep(state, retention)
        # a bounded tier (host_tier) evicts old versions on its own in ``begin``
        state.versions &= set(await tier.list_versions()) | {step}
    except Exception as exc:  # the version is committed; housekeeping can wait
        state.last_error = describe(exc)
        logger.error("after committing step %d on %s: %s", step, tier.name, exc)
    state.last_flush = builder.stats
    return manifest, builder.stats


async def _references(state: TierState, plan: VersionPlan) -> References:
    """The chunks of ``plan`` this tier can reference from the newest version it holds (held there), or none.

    None when the tier cannot reference, holds no older version, that version or
    one whose segments it references failed verification here (``state.bad``),
    or the tier no longer holds every segment they would name.
    """
    tier, none = state.tier, References()
    if not isinstance(tier, ReferencingTier):
        return none
    prev_step = max((v for v in state.versions if v < plan.step and v not in state.bad), default=None)
    if prev_step is None:
        return none
    prev = state.prev
    if prev is None or prev.step != prev_step:
        try:
            prev = parse_manifest(await tier.read_manifest(prev_step))
        except (AsymstoreError, OSError) as exc:
            logger.warning("%s: step %d's manifest is unreadable; step %d written full: %s", tier.name, prev_step,
                           plan.step, exc)
            return none
        if prev.step != prev_step:
            return none
        state.prev = prev
    if not state.bad.isdisjoint(prev.references):
        return none
    refs = await asyncio.to_thread(find_references, plan, prev)
    if refs.chunks and not await tier.hold_references(plan.step, refs.by_origin):
        logger.info("%s: the segments step %d would reference are not all held; written full", tier.name, plan.step)
        return none
    return refs


async def _stream_segments(builder: SegmentBuilder, writer: VersionWriter) -> None:
    """Write the builder's segments in order, filling segment k+1 in a thread while k is written."""
    nxt = asyncio.ensure_future(asyncio.to_thread(builder.next_segment))
    stats = builder.stats
    written = 0  # bytes of the segment written while this one filled
    try:
        while (seg := await nxt) is not None:
            nxt = asyncio.ensure_future(asyncio.to_thread(builder.next_segment))
            stats.inflight_peak_bytes = max(stats.inflight_peak_bytes, written + seg.size)
            written = seg.size
            t0 = time.perf_counter()
            await writer.write_segment(seg.name, seg.parts)
            builder.stats.write_seconds += time.perf_counter() - t0
    finally:
        if not nxt.done():
            nxt.cancel()  # its thread runs to the end on its own; that segment is dropped
        elif not nxt.cancelled():
            nxt.exception()  # retrieved: the error that matters is already propagating


async def _victims(state: TierState, retention: Retention) -> list[int]:
    """The versions of ``state.versions`` that no retention rule keeps, oldest first (reading notes once)."""
    tier = state.tier
    if not retention.reads_notes:
        return beyond_keep_last(state.versions, keep_last_of(tier.keep_last, retention.keep_last))
    for step in sorted(state.versions - set(state.notes)):  # listed at open: read each note once
        try:
            state.notes[step] = retention.note_of(parse_manifest(await tier.read_manifest(step)).meta)
        except (AsymstoreError, OSError) as exc:  # never delete what cannot be judged: it stays
            logger.warning("%s: retention cannot read step %d's manifest, keeping it: %s", tier.name, step, exc)
    judged = {s: state.notes[s] for s in state.versions if s in state.notes}
    return retention.to_delete(judged, keep_last=tier.keep_last, persistent=tier.persistent)


async def _retain(state: TierState, retention: Retention) -> None:
    for old in await _victims(state, retention):
        await state.tier.delete_version(old)
        state.versions.discard(old)
        state.bad.discard(old)
        state.notes.pop(old, None)


def retention_in_force(tier: Tier, retention: Retention) -> bool:
    """Whether a retention rule is in force on ``tier``: ``keep_last``, ``keep_every`` or ``keep_best``."""
    return keep_last_of(tier.keep_last, retention.keep_last) is not None or retention.reads_notes


async def oldest_kept(state: TierState, retention: Retention) -> int | None:
    """The oldest of ``state.versions`` that retention keeps, or None (no rule in force, or no version).

    With no rule of the store's own, an outer retention's floor (``state.floor``) when it has one.
    """
    if not retention_in_force(state.tier, retention):
        return state.floor() if state.floor is not None else None
    kept = state.versions - set(await _victims(state, retention))
    return min(kept) if kept else None


async def sweep(state: TierState, retention: Retention) -> list[Swept]:
    """Sweep dead writers' leftovers from ``state.tier`` (an :class:`ExclusiveTier`; others have none).

    ``state.versions`` must be the tier's committed versions. A version
    without a manifest is removed only when retention would have deleted it
    (older than :func:`oldest_kept`); any other one is quarantined by the tier
    and recorded in ``state.quarantined`` (``AsymStore.status()``).
    """
    tier = state.tier
    if not isinstance(tier, ExclusiveTier):
        return []
    swept = await tier.sweep_leftovers(oldest_kept=await oldest_kept(state, retention))
    state.quarantined += [entry.path for entry in swept if entry.action == "quarantined"]
    return swept
