"""Phase two of the global commit: the coordinator publishes the global manifest once every rank reported.

After committing its shard of step ``s``, each rank reports it under
``{key}/rank/<rank>`` of the coordination store (a :class:`ShardInfo`, or
``{"failed": ...}``). The coordinator waits for every report
(:func:`publish_global`), writes ``global/v…s.json`` and ``global/LATEST``,
applies retention and answers ``{key}/global``; a rank that waits for the
global version (:func:`await_global`) reads that answer. Both run in a thread
(they block on the key-value store).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from asymstore.errors import (
    CoordinationTimeoutError,
    GlobalCommitError,
    GlobalCommitTimeoutError,
    GlobalManifestError,
    GlobalVersionDroppedError,
    RootLayoutError,
)
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo
from asymstore.format.placement import Placement, RankPlacement
from asymstore.multirank import globaldir, rootlayout, takeover
from asymstore.multirank.job import Job
from asymstore.multirank.retention import retain_globals

if TYPE_CHECKING:
    from asymstore.dist.kv import KV

logger = logging.getLogger(__name__)


def publish_global(job: Job, key: str, step: int, meta: dict[str, Any]) -> GlobalManifest:
    """Coordinator: wait for every rank's report of ``step``, then publish its global manifest.

    Args:
        job: the coordinator's job.
        key: the coordination key prefix of this commit.
        step: the step.
        meta: the global manifest's JSON metadata (validated).

    Returns:
        The global manifest published.

    Raises:
        GlobalCommitTimeoutError: not every rank reported within ``job.timeout_s``.
        GlobalCommitError: a rank reported that its shard failed.
    """
    kv = job.kv
    keys = [f"{key}/rank/{r}" for r in range(job.world_size)]
    try:
        kv.wait(keys, job.timeout_s, f"global commit of step {step}")
    except CoordinationTimeoutError as exc:
        missing = [r for r, k in enumerate(keys) if not kv.has(k)]
        msg = (f"step {step}: rank(s) {missing} did not report a committed shard within {job.timeout_s:g} s; "
               f"the global version is not published (newest stays {max(job.global_steps(), default=None)})")
        kv.put(f"{key}/global", {"failed": msg})
        raise GlobalCommitTimeoutError(msg) from exc
    reports = kv.get_many(keys)
    dropped = {r: rep["dropped"] for r, rep in enumerate(reports) if "dropped" in rep}
    if dropped:
        msg = f"step {step}: rank(s) {sorted(dropped)} dropped their version ({next(iter(dropped.values()))}); " \
              f"no global version of it"
        kv.put(f"{key}/global", {"failed": msg, "dropped": True})
        raise GlobalVersionDroppedError(msg)
    failed = {r: rep["failed"] for r, rep in enumerate(reports) if "failed" in rep}
    if failed:
        msg = f"step {step}: shard commit failed on rank(s) {failed}; the global version is not published"
        kv.put(f"{key}/global", {"failed": msg})
        raise GlobalCommitError(msg)
    manifest = GlobalManifest(step, job.world_size, tuple(ShardInfo.from_json(r) for r in reports), meta,
                              time.time(), record_placement(job, reports))
    for stale in [s for s in job.global_steps() if s >= step]:  # a history abandoned by an older restore
        logger.warning("replacing global version %d of an abandoned history (restored an older one)", stale)
        globaldir.delete_global(job.global_dir, stale, fsync=job.fsync)
        job.global_cache.pop(stale, None)
    if not job.layout_recorded:  # the root's layout record says multi-rank of this size before the version exists
        try:  # (a takeover of a single-process root no rank was allowed to make is refused here too)
            rootlayout.record_multirank(job.root, job.world_size, resumed_single=job.resumed_single,
                                        across_layouts=job.across_layouts, fsync=job.fsync)
        except RootLayoutError as exc:
            kv.put(f"{key}/global", {"failed": f"step {step}: {exc}; the global version is not published"})
            raise
    globaldir.publish_global(job.global_dir, manifest, fsync=job.fsync)
    job.global_cache[step] = manifest
    globaldir.write_global_latest(job.global_dir, step, fsync=job.fsync)
    if not job.layout_recorded:  # a single-process LATEST would point at a layout no longer current
        rootlayout.drop_single_latest(job.root, fsync=job.fsync)
        job.layout_recorded = True
        takeover.release_root(job)  # the root is multi-rank now: its global/ lock is the one that counts
    retain_globals(job)
    kv.put(f"{key}/global", {"step": step})
    logger.debug("published global version %d (%d ranks, %d bytes)", step, job.world_size, manifest.nbytes)
    return manifest


def record_placement(job: Job, reports: list[dict[str, Any]]) -> str | None:
    """Write the placement the ranks reported with their shards (once per distinct placement); return its digest.

    None when a rank reported none (an older peer) or a malformed one: the
    global manifest then names no placement, and fsck looks for the shards in
    ``ROOT/rank-NNNNN/``.
    """
    docs = [rep.get("placement") for rep in reports]
    cached = job.placement_cache
    if cached is not None and cached[0] == docs:
        return cached[1]
    if any(d is None for d in docs):
        logger.warning("a rank reported no tier placement: fsck will look for its shards under the root")
        return None
    try:
        placement = Placement(job.world_size, tuple(RankPlacement.from_json(d) for d in docs))
        if [r.rank for r in placement.ranks] != list(range(job.world_size)):
            raise GlobalManifestError("ranks reported placements out of order")
    except GlobalManifestError as exc:
        logger.warning("not recording the tier placement: %s", exc)
        return None
    digest = globaldir.write_placement(job.global_dir, placement, fsync=job.fsync)
    job.placement_cache = (docs, digest)
    return digest


def await_global(kv: KV, key: str, step: int, timeout_s: float) -> None:
    """Wait for the coordinator's answer to the global commit of ``step``.

    Raises:
        GlobalCommitTimeoutError: no answer within ``timeout_s``.
        GlobalCommitError: the coordinator did not publish the version.
    """
    try:
        kv.wait([f"{key}/global"], timeout_s, f"the coordinator's global commit of step {step}")
    except CoordinationTimeoutError as exc:
        raise GlobalCommitTimeoutError(str(exc)) from exc
    msg = kv.get(f"{key}/global")
    if "dropped" in msg:
        raise GlobalVersionDroppedError(msg["failed"])
    if "failed" in msg:
        raise GlobalCommitError(msg["failed"])
