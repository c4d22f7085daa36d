"""Retention of a multi-rank checkpoint: which global versions and shards are kept, and rolling back orphans.

The coordinator keeps the newest ``keep_last`` global versions (:func:`retain_globals`), or with
``keep_every``/``keep_best`` judges every global version by the retention note its manifest carries,
and tells each rank through the coordination store which shard steps a kept version still needs
(:class:`~asymstore.multirank.protocol.RetainSet`); each rank deletes its own shards no kept version
needs (:func:`retain_shards`). Departed ranks' shards are retired by the coordinator
(:func:`retire_departed_shards`, :mod:`.departed`); after a restore, a rank's unused shards above the
restored version are rolled back (:func:`roll_back`).

Guide: ``docs/guides/multirank.md``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from asymstore.errors import CoordinationProtocolError, GlobalManifestError
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.multirank import globaldir, protocol
from asymstore.multirank.departed import retire_departed

if TYPE_CHECKING:
    from collections.abc import Callable

    from asymstore.dist.fabric import Fabric
    from asymstore.dist.kv import KV
    from asymstore.multirank.job import Job
    from asymstore.store import AsymStore

logger = logging.getLogger(__name__)


def _kept_globals(job: Job, keep_last: int) -> list[GlobalManifest] | None:
    """The global versions retention keeps, or None if one that might be kept does not parse."""
    if job.rules is not None:
        judged = _judge(job)
        return None if judged is None else judged[0]
    kept = []
    for s in job.global_steps()[-keep_last:]:
        try:
            kept.append(_global(job, s))
        except (GlobalManifestError, OSError):
            return None
    return kept


def _judge(job: Job) -> tuple[list[GlobalManifest], list[int]] | None:
    """Under ``job.rules``: (the kept global versions, the steps to delete), or None if one does not parse."""
    assert job.rules is not None
    manifests: dict[int, GlobalManifest] = {}
    for s in job.global_steps():
        try:
            manifests[s] = _global(job, s)
        except (GlobalManifestError, OSError) as exc:
            logger.warning("global version %d does not parse (%s): nothing is deleted", s, exc)
            return None
    notes = {s: job.rules.note_of(g.meta) for s, g in manifests.items()}
    kept = job.rules.kept(notes, keep_last=job.global_keep_last)
    return [manifests[s] for s in sorted(kept)], [s for s in sorted(manifests) if s not in kept]


def _retain_by_rules(job: Job) -> None:
    """Coordinator, under ``job.rules``: drop the global versions no rule keeps; publish the shards to keep."""
    judged = _judge(job)
    if judged is None:
        return
    kept, doomed = judged
    for old in doomed:
        globaldir.delete_global(job.global_dir, old, fsync=job.fsync)
        job.global_cache.pop(old, None)
    if not kept:
        return
    needed = {r: tuple(sorted({g.shard(r).step for g in kept if r < g.world_size})) for r in range(job.world_size)}
    protocol.post_retained_set(job.fabric, protocol.RetainSet(needed))


def _global(job: Job, step: int) -> GlobalManifest:
    """A kept global manifest: as the coordinator published it, else read (once) from ``global/``."""
    g = job.global_cache.get(step)
    if g is None:
        g = job.global_cache[step] = job.read_global(step)
    return g


def retain_globals(job: Job) -> None:
    """Coordinator: drop global versions beyond ``keep_last``; tell each rank which shards are still needed."""
    if job.rules is not None:
        _retain_by_rules(job)
        return
    if job.global_keep_last is None:
        return
    steps = job.global_steps()
    for old in steps[:-job.global_keep_last]:
        globaldir.delete_global(job.global_dir, old, fsync=job.fsync)
    kept = []
    for s in steps[-job.global_keep_last:]:
        try:
            kept.append(_global(job, s))
        except (GlobalManifestError, OSError):
            continue
    for s in set(job.global_cache) - {g.step for g in kept}:  # only what retention keeps
        del job.global_cache[s]
    if not kept:
        return
    needed = {r: min(steps_r) for r in range(job.world_size)
              if (steps_r := [g.shard(r).step for g in kept if r < g.world_size])}
    protocol.raise_keep_from(job.fabric, needed, job.world_size)


async def retire_departed_shards(job: Job) -> None:
    """Coordinator: drop shards of ranks no longer in the job (it shrank) that no kept version needs."""
    if (job.global_keep_last is None and job.rules is None) or \
            not any(r >= job.world_size for r in globaldir.rank_dirs(job.root)):
        return
    kept = _kept_globals(job, job.global_keep_last or 0)
    if kept is None:
        return  # an unreadable kept version: delete nothing it might need
    await retire_departed(job.root, job.world_size, kept, job.peer_tiers)


def shard_floor(job: Job) -> int | None:
    """The oldest of ``job.rank``'s shard steps that a global version retention keeps still needs.

    None when no global retention rule is in force (nothing is deleted, so a shard directory without
    a manifest is no interrupted delete), when no kept version names this rank, or when one does not
    parse. Below it, this rank's shards are ones retention deletes (:func:`retain_shards`).
    """
    if job.global_keep_last is None and job.rules is None:
        return None
    kept = _kept_globals(job, job.global_keep_last or 0)
    steps = [g.shard(job.rank).step for g in kept or () if job.rank < len(g.shards)]
    return min(steps) if steps else None


async def delete_shard(local: AsymStore, step: int) -> None:
    """Delete shard ``step`` from every tier of ``local`` that holds it (``local.refresh`` is the caller's)."""
    for tier in local.tiers:
        if step in await tier.list_versions():
            await tier.delete_version(step)


async def retain_shards(local: AsymStore, kv: KV | Fabric, rank: int, *, by_rules: bool = False,
                        floor: Callable[[int], None] | None = None) -> None:
    """Delete ``rank``'s own shards no kept global version needs.

    Args:
        local: the rank's own shards.
        kv: the coordination store.
        rank: the rank.
        by_rules: the job keeps by ``keep_every``/``keep_best`` too: read the retained set
            (:func:`~asymstore.multirank.protocol.retained_set`: below the newest step it names, only
            those steps stay), else the step every older shard goes below
            (:func:`~asymstore.multirank.protocol.keep_from`). A malformed set deletes nothing.
        floor: told the oldest shard step kept before any shard is deleted (the sweep of
            ``local`` removes, rather than quarantines, a manifest-less shard below it).
    """
    if by_rules:
        try:
            record = await asyncio.to_thread(protocol.retained_set, kv)
        except CoordinationProtocolError as exc:
            logger.warning("rank %d: deleting no shard: %s", rank, exc)
            return
        steps = record.ranks.get(rank) if record is not None else None
        if not steps:
            return
        keep, top = set(steps), max(steps)
        old = sorted({v for vs in local.versions().values() for v in vs if v < top and v not in keep})
        if floor is not None:
            floor(min(keep))
    else:
        keep_from = await asyncio.to_thread(protocol.keep_from, kv, rank)
        if keep_from < 0:
            return
        old = sorted({v for vs in local.versions().values() for v in vs if v < keep_from})
        if floor is not None:
            floor(keep_from)
    for s in old:
        await delete_shard(local, s)
    if old:
        await local.refresh()


async def roll_back(local: AsymStore, rank: int, floor: int | None, step: int) -> None:
    """Delete ``rank``'s own shards at or above ``step`` that no global version can use (after a restore).

    Args:
        local: the rank's own job.
        rank: the rank (for the log).
        floor: the newest global step when this rank last agreed on a step, or its shard's step
            in the version it restored (None: nothing is rolled back); only shards above it go.
        step: the step about to be put.
    """
    newest = local.newest_step
    if floor is None or newest is None or newest < step:
        return
    victims = [s for s in sorted({v for vs in local.versions().values() for v in vs}) if s >= step > floor]
    for s in victims:
        logger.warning("rank %d: rolling back shard %d (no global version uses it)", rank, s)
        await delete_shard(local, s)
    await local.refresh()
    for tier in local.tiers:  # LATEST must not name a shard that is gone
        left = await tier.list_versions()
        if left:
            await tier.write_latest(max(left))
