"""fsck of one tier location, wherever it is: a directory or a URI (``file://``, ``s3://``, ``hdfs://``)."""

from __future__ import annotations

from collections.abc import Callable

from asymstore.format.names import is_uri
from asymstore.fsck.directory import check_directory, repair_directory
from asymstore.fsck.remote import check_remote, repair_remote
from asymstore.fsck.report import FsckReport, Progress


def check_tier(location: str, *, deep: bool = False, progress: Callable[[int], Progress] | None = None) -> FsckReport:
    """Examine the tier at ``location``: a ``file://``/``s3://``/``hdfs://`` URI or a directory.

    Raises:
        FileNotFoundError: a directory ``location`` does not exist.
    """
    if is_uri(location):
        return check_remote(location, deep=deep, progress=progress)
    return check_directory(location, deep=deep, progress=progress)


def repair_tier(report: FsckReport) -> list[str]:
    """Fix what ``report`` found on its tier, under the tier's writer lock (or lease); one line per action.

    Raises:
        RootLockedError: a live writer holds the tier.
    """
    if is_uri(report.root):
        return repair_remote(report)
    return repair_directory(report)
