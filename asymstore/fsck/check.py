"""``check`` and ``repair`` of any root fsck understands: one tier (directory or URI) or a multi-rank root."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from asymstore.errors import RootLayoutError, RootUnreadableError
from asymstore.format.names import LATEST, is_uri
from asymstore.fsck.multirank import MultiRankFsckReport, check_multirank, repair_multirank
from asymstore.fsck.report import FsckReport, Progress
from asymstore.fsck.tier import check_tier, repair_tier
from asymstore.io.rootlock import DirLock
from asymstore.multirank.globaldir import GLOBAL_DIR
from asymstore.multirank.rootlayout import RootSurvey, drop_single_latest, survey


def check(root: str, *, deep: bool = False, progress: Callable[[int], Progress] | None = None,
          node_local: Sequence[str] = ()) -> FsckReport:
    """Examine every entry of ``root`` and return the report.

    A directory is judged as the root of a store: its layout record is read
    (:mod:`asymstore.multirank.rootlayout`) and every version of every layout
    it holds is listed. The root is multi-rank once it holds a published global
    version (:attr:`~asymstore.multirank.rootlayout.RootSurvey.current`, the
    decision a job opening it follows): a ``global/`` directory alone, or a
    record saying multi-rank, does not make it so while its current versions
    are single-process (a multi-rank job opened it and stopped, or died, before
    its first global version). A multi-rank root's single-process versions are
    ``superseded`` when its record says the multi-rank layout replaced them;
    otherwise they are a layout problem (two layouts and nothing saying which
    is current), as are a damaged record and a single-process ``LATEST`` in a
    multi-rank root (``layout_problems``; the verdict is not OK).

    Args:
        root: the tier's directory or URI, or a multi-rank root (``rank-NNNNN/`` shards and ``global/``).
        deep: verify every segment and chunk checksum (reads all data); compressed
            chunks are decoded and their raw checksum verified too.
        progress: called with the total byte count to verify; returns a
            callback that receives the bytes verified as they are.
        node_local: a multi-rank root only: examine just the shard locations under these
            paths (a per-node check, see :mod:`asymstore.fsck.multirank`).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        ValueError: ``node_local`` given for a root that is not multi-rank.
    """
    if is_uri(root):
        if node_local:
            raise ValueError(f"{root} is not a multi-rank root: --node-local applies to multi-rank roots only")
        return check_tier(root, deep=deep, progress=progress)
    path = os.path.abspath(root)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory")
    problems: list[str] = []
    try:
        found = survey(path)
    except RootUnreadableError:
        raise
    except RootLayoutError as exc:
        problems.append(f"{exc} (judged by what the root holds; repair does not touch the record)")
        found = survey(path, with_record=False)
    report: FsckReport
    if found.record is not None and found.record.layout == "single" and found.global_steps:
        problems.append(f"{found.found()}: the record says single-process, yet global/ holds published "
                        "multi-rank versions (a job opening the root refuses it: RootLayoutConflictError)")
    if found.reads_multirank():
        report = check_multirank(path, deep=deep, progress=progress, node_local=node_local)
        if found.single_steps or found.latest:
            _fold_single(report, check_tier(path, deep=deep, progress=progress), found, problems)
        report.layout = "multirank"
    else:
        if node_local:
            raise ValueError(f"{root} is not a multi-rank root: --node-local applies to multi-rank roots only")
        report = check_tier(path, deep=deep, progress=progress)  # global/ and rank-*/ entries are not its
        report.layout = found.current or "single"
    report.layout_record = None if found.record is None else json.loads(found.record.to_json())
    report.layout_problems = problems
    return report


def _fold_single(report: FsckReport, single: FsckReport, found: RootSurvey, problems: list[str]) -> None:
    """Add a multi-rank root's single-process versions to ``report``, and what is wrong about them."""
    superseded = found.superseded_single()
    for e in single.entries:
        if e.status == "committed" and superseded:
            e.status = "superseded"
        report.entries.append(e)
    if found.single_steps and found.global_steps and not superseded:
        problems.append(f"two layouts: {found.found()}; the single-process versions "
                        f"{list(found.single_steps)} are not recorded as replaced by the multi-rank layout, so "
                        "which one is current is not known (a job opening the root refuses it: "
                        "RootLayoutConflictError). Move the versions of the layout no longer wanted out of the root")
    if found.latest:
        report.stale_single_latest = True
        problems.append(f"{LATEST}: a single-process hint (says {single.latest}) in a multi-rank root, stale: "
                        f"the root's hint is {GLOBAL_DIR}/{LATEST} (repair removes it)")


def repair(report: FsckReport) -> list[str]:
    """Fix what ``report`` found; return one line per action taken.

    Never touches a committed version without problems. Corrupt versions and
    unreferenced files are moved to ``.quarantine/``; partial and orphaned
    data is removed; LATEST is rewritten to the newest restorable version; a
    multi-rank root's stale single-process ``LATEST`` is removed. Superseded
    single-process versions, the layout record and a root of two layouts are
    left as they are. Takes the root's writer lock (the writer lease on a
    remote root) first.

    Raises:
        RootLockedError: a live writer holds the root.
    """
    if isinstance(report, MultiRankFsckReport):
        lock = DirLock(report.root)
        lock.acquire()  # never repair under a live writer: its commit in progress would look partial
        try:
            actions = repair_multirank(report)
            if report.stale_single_latest and drop_single_latest(report.root):
                actions.append(f"removed the stale single-process {LATEST} (the root is multi-rank)")
            return actions
        finally:
            lock.release()
    return repair_tier(report)
