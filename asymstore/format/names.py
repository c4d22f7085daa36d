"""Names of things inside a tier's root (directory tiers, shared memory, object-store prefixes) and of tier locations.

::

    ROOT/
      LATEST                      hint: newest committed step, decimal text
      v000000000012/              a committed version (published by rename)
        MANIFEST.json             the commit point
        seg-000000.bin ...        segment files
      .tmp-v000000000013-<id>/    a commit in progress (partial if left behind)
      .quarantine/                corrupt versions moved aside by repair or recommit

A multi-rank root holds one such root per rank, named by :func:`rank_dirname` (``rank-NNNNN``).
"""

from __future__ import annotations

import re

LATEST = "LATEST"
LAYOUT_FILE = "LAYOUT.json"
"""A root's layout record (:mod:`asymstore.multirank.rootlayout`)."""
TMP_PREFIX = ".tmp-"
QUARANTINE = ".quarantine"
_VERSION = re.compile(r"^v(\d{12,20})$")
RANK_PREFIX = "rank-"
"""The prefix of a rank's directory under a multi-rank root (:func:`rank_dirname`)."""
_RANK_NAME = re.compile(r"^rank-(\d{5,})$")


def version_dirname(step: int) -> str:
    """Return the directory name of ``step`` (zero padded so names sort by step)."""
    return f"v{step:012d}"


def segment_filename(index: int) -> str:
    """Return the file name of a version's ``index``-th segment (zero padded so names sort by index)."""
    return f"seg-{index:06d}.bin"


def parse_version_dirname(name: str) -> int | None:
    """Return the step of a version directory name, or None if it is not one."""
    match = _VERSION.match(name)
    return int(match.group(1)) if match else None


def rank_dirname(rank: int) -> str:
    """Return the directory name of ``rank``'s shards under a multi-rank root (``rank-NNNNN``, at least 5 digits)."""
    return f"{RANK_PREFIX}{rank:05d}"


def parse_rank_dirname(name: str) -> int | None:
    """Return the rank of a rank directory name (:func:`rank_dirname`), or None if it is not one."""
    match = _RANK_NAME.match(name)
    return int(match.group(1)) if match else None


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
