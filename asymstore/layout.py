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
