"""Phase two of the global commit: the coordinator publishes the global manifest once every rank reported.

After committing its shard of step ``s``, each rank reports it in the commit's
round of the coordination store (a :class:`~asymstore.multirank.protocol.ShardReport`:
committed, failed or dropped). The coordinator waits for every report
(:func:`publish_global`), writes ``global/v…s.json`` and ``global/LATEST``,
applies retention and answers (a :class:`~asymstore.multirank.protocol.GlobalAnswer`);
a rank that waits for the global version (:func:`await_global`) reads that answer. Both run in a thread
(they block on the key-value store).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from asymstore.errors import (
    CoordinationProtocolError,
    CoordinationTimeoutError,
    GlobalCommitError,
    GlobalCommitTimeoutError,
    GlobalVersionDroppedError,
    ReplicasDifferError,
    RootLayoutError,
)
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo
from asymstore.format.names import rank_dirname, version_dirname
from asymstore.format.placement import Placement
from asymstore.format.replicas import is_sliced, refusal
from asymstore.multirank import globaldir, rootlayout, takeover
from asymstore.multirank.job import Job
from asymstore.multirank.protocol import CommitRound, GlobalAnswer, ShardReport
from asymstore.multirank.retention import retain_globals

logger = logging.getLogger(__name__)


def publish_global(job: Job, commit: CommitRound, step: int, meta: dict[str, Any]) -> GlobalManifest:
    """Coordinator: wait for every rank's report of ``step``, then publish its global manifest.

    Args:
        job: the coordinator's job.
        commit: the round of this commit on the coordination store.
        step: the step.
        meta: the global manifest's JSON metadata (validated).

    Returns:
        The global manifest published.

    Raises:
        GlobalCommitTimeoutError: not every rank reported within ``job.timeout_s``.
        GlobalCommitError: a rank reported that its shard failed.
        ReplicasDifferError: ranks wrote slices of a replicated state that differs across them, or slices
            beside whole copies (see :mod:`asymstore.format.replicas`); ``job.replicas_whole`` is set.
        CoordinationProtocolError: a rank's report is malformed (every rank waiting hears the failure).
    """
    try:
        reports = commit.reports(job.timeout_s, f"global commit of step {step}")
    except CoordinationTimeoutError as exc:
        msg = (f"step {step}: rank(s) {commit.missing_reports()} did not report a committed shard within "
               f"{job.timeout_s:g} s; the global version is not published "
               f"(newest stays {max(job.global_steps(), default=None)})")
        commit.answer(GlobalAnswer(failed=msg))
        raise GlobalCommitTimeoutError(msg) from exc
    except CoordinationProtocolError as exc:
        commit.answer(GlobalAnswer(failed=f"step {step}: {exc}; the global version is not published"))
        raise
    dropped = {r: rep.dropped for r, rep in enumerate(reports) if rep.dropped is not None}
    if dropped:
        msg = f"step {step}: rank(s) {sorted(dropped)} dropped their version ({next(iter(dropped.values()))}); " \
              f"no global version of it"
        commit.answer(GlobalAnswer(failed=msg, dropped=True))
        raise GlobalVersionDroppedError(msg)
    failed = {r: rep.failed for r, rep in enumerate(reports) if rep.failed is not None}
    if failed:
        msg = f"step {step}: shard commit failed on rank(s) {failed}; the global version is not published"
        commit.answer(GlobalAnswer(failed=msg))
        raise GlobalCommitError(msg)
    shards = tuple(rep.info for rep in reports if rep.info is not None)
    why = refusal([s.summary for s in shards], job.world_size, whole_only=job.replicas_whole)
    if why is None and not job.shards_seen and is_sliced([s.summary for s in shards]):
        why = _unseen(job, shards)
    if why is not None:  # never a version whose restore would mix ranks' states (asymstore.format.replicas)
        msg = f"step {step}: {why}; the global version is not published and the job falls back to whole " \
              "copies of the replicated state on every rank"
        logger.log(logging.INFO if job.replicas_whole else logging.WARNING, msg)  # versions in flight: once
        job.replicas_whole = True
        commit.answer(GlobalAnswer(failed=msg, dropped=True))
        raise ReplicasDifferError(msg)
    manifest = GlobalManifest(step, job.world_size, shards, meta, time.time(), record_placement(job, reports))
    for stale in [s for s in job.global_steps() if s >= step]:  # a history abandoned by an older restore
        logger.warning("replacing global version %d of an abandoned history (restored an older one)", stale)
        globaldir.delete_global(job.global_dir, stale, fsync=job.fsync)
        job.global_cache.pop(stale, None)
    if not job.layout_recorded:  # the root's layout record says multi-rank of this size before the version exists
        try:  # (a takeover of a single-process root no rank was allowed to make is refused here too)
            rootlayout.record_multirank(job.root, job.world_size, resumed_single=job.resumed_single,
                                        across_layouts=job.across_layouts, fsync=job.fsync)
        except RootLayoutError as exc:
            commit.answer(GlobalAnswer(failed=f"step {step}: {exc}; the global version is not published"))
            raise
    globaldir.publish_global(job.global_dir, manifest, fsync=job.fsync)
    job.global_cache[step] = manifest
    globaldir.write_global_latest(job.global_dir, step, fsync=job.fsync)
    if not job.layout_recorded:  # a single-process LATEST would point at a layout no longer current
        rootlayout.drop_single_latest(job.root, fsync=job.fsync)
        job.layout_recorded = True
        takeover.release_root(job)  # the root is multi-rank now: its global/ lock is the one that counts
    retain_globals(job)
    commit.answer(GlobalAnswer(step=step))
    logger.debug("published global version %d (%d ranks, %d bytes)", step, job.world_size, manifest.nbytes)
    return manifest


def _unseen(job: Job, shards: tuple[ShardInfo, ...]) -> str | None:
    """Why the ranks could not read each other's slices: a shard the coordinator does not see under the root."""
    if job.exchange_slices:  # tiers of each rank's own: the ranks exchange the slices at a restore
        job.shards_seen = True
        return None
    if not job.shards_under_root:
        return "slices were cut with tiers outside the root, where the other ranks cannot read them"
    missing = [s.rank for s in shards
               if not os.path.isdir(os.path.join(job.root, rank_dirname(s.rank), version_dirname(s.step)))]
    if missing:
        return f"rank 0 does not see the shards of rank(s) {missing[:8]} under {job.root} (not a shared filesystem?)"
    job.shards_seen = True
    return None


def record_placement(job: Job, reports: list[ShardReport]) -> str | None:
    """Write the placement the ranks reported with their shards (once per distinct placement); return its digest.

    None when a rank reported none (an older peer) or a malformed one: the
    global manifest then names no placement, and fsck looks for the shards in
    ``ROOT/rank-NNNNN/``.
    """
    places = [rep.placement for rep in reports]
    cached = job.placement_cache
    if cached is not None and cached[0] == places:
        return cached[1]
    problems = [rep.placement_error for rep in reports if rep.placement_error is not None]
    if problems:
        logger.warning("not recording the tier placement: %s", problems[0])
        return None
    if any(p is None for p in places):
        logger.warning("a rank reported no tier placement: fsck will look for its shards under the root")
        return None
    placement = Placement(job.world_size, tuple(p for p in places if p is not None))
    if [r.rank for r in placement.ranks] != list(range(job.world_size)):
        logger.warning("not recording the tier placement: ranks reported placements out of order")
        return None
    digest = globaldir.write_placement(job.global_dir, placement, fsync=job.fsync)
    job.placement_cache = (places, digest)
    return digest


def await_global(commit: CommitRound, step: int, timeout_s: float) -> None:
    """Wait for the coordinator's answer to the global commit of ``step``.

    Raises:
        GlobalCommitTimeoutError: no answer within ``timeout_s``.
        GlobalCommitError: the coordinator did not publish the version.
        CoordinationProtocolError: the answer is malformed.
    """
    try:
        answer = commit.wait_answer(timeout_s, f"the coordinator's global commit of step {step}")
    except CoordinationTimeoutError as exc:
        raise GlobalCommitTimeoutError(str(exc)) from exc
    answer.raise_failure()
