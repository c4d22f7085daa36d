"""``check`` and ``repair`` of any root fsck understands: one tier (directory or URI) or a multi-rank root."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from asymstore.format.names import is_uri
from asymstore.fsck.multirank import MultiRankFsckReport, check_multirank, repair_multirank
from asymstore.fsck.report import FsckReport, Progress
from asymstore.fsck.tier import check_tier, repair_tier
from asymstore.io.rootlock import DirLock


def check(root: str, *, deep: bool = False, progress: Callable[[int], Progress] | None = None,
          node_local: Sequence[str] = ()) -> FsckReport:
    """Examine every entry of ``root`` and return the report.

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
    if not is_uri(root) and os.path.isdir(os.path.join(os.path.abspath(root), "global")):
        return check_multirank(os.path.abspath(root), deep=deep, progress=progress, node_local=node_local)
    if node_local:
        raise ValueError(f"{root} is not a multi-rank root: --node-local applies to multi-rank roots only")
    return check_tier(root, deep=deep, progress=progress)


def repair(report: FsckReport) -> list[str]:
    """Fix what ``report`` found; return one line per action taken.

    Never touches a committed version without problems. Corrupt versions and
    unreferenced files are moved to ``.quarantine/``; partial and orphaned
    data is removed; LATEST is rewritten to the newest restorable version.
    Takes the root's writer lock (the writer lease on a remote root) first.

    Raises:
        RootLockedError: a live writer holds the root.
    """
    if isinstance(report, MultiRankFsckReport):
        lock = DirLock(report.root)
        lock.acquire()  # never repair under a live writer: its commit in progress would look partial
        try:
            return repair_multirank(report)
        finally:
            lock.release()
    return repair_tier(report)
