"""Names of things inside a directory-backed tier (LocalTier, HostTier on /dev/shm).

::

    ROOT/
      LATEST                      hint: newest committed step, decimal text
      v000000000012/              a committed version (published by rename)
        MANIFEST.json             the commit point
        seg-000000.bin ...        segment files
      .tmp-v000000000013-<id>/    a commit in progress (partial if left behind)
      .quarantine/                corrupt versions moved aside by repair or recommit
"""

from __future__ import annotations

import os
import re
import time
import uuid

LATEST = "LATEST"
TMP_PREFIX = ".tmp-"
QUARANTINE = ".quarantine"
_VERSION = re.compile(r"^v(\d{12,20})$")


def version_dirname(step: int) -> str:
    """Return the directory name of ``step`` (zero padded so names sort by step)."""
    return f"v{step:012d}"


def parse_version_dirname(name: str) -> int | None:
    """Return the step of a version directory name, or None if it is not one."""
    match = _VERSION.match(name)
    return int(match.group(1)) if match else None


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (new, renamed, removed names) to stable storage."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def quarantine_entry(root: str, path: str, label: str, *, fsync: bool = True) -> str:
    """Move ``path`` (an entry of the tier ``root``) to ``root/.quarantine/<label>-<time>-<id>``; return where."""
    qdir = os.path.join(root, QUARANTINE)
    os.makedirs(qdir, exist_ok=True)
    dest = os.path.join(qdir, f"{label}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
    os.rename(path, dest)
    if fsync:
        fsync_dir(qdir)
        fsync_dir(root)
    return dest


def retention_leftover(step: int, committed: list[int]) -> bool:
    """Whether a version directory of ``step`` without a manifest can be what an interrupted retention delete left.

    Retention deletes only versions older than every version it keeps (manifest
    first), so such a leftover is older than the oldest committed version.
    Anything else — a manifest lost from a committed version by a person, a
    disk, a tool — holds data that may be the only copy: quarantine it.
    """
    return bool(committed) and step < min(committed)


def is_uri(location: str) -> bool:
    """True for a tier URI (``file://``, ``s3://``, ``hdfs://`` ...), False for a plain directory path."""
    return "://" in location
