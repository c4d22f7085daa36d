"""fsck: check and repair a tier's root, or a multi-rank root, for recovery consistency.

``python -m asymstore.fsck LOCATION`` (:mod:`asymstore.fsck.__main__`) or :func:`check` then
:func:`repair`. A directory tier is checked by :mod:`~asymstore.fsck.directory`, a URI by
:mod:`~asymstore.fsck.remote`, a multi-rank root by :mod:`~asymstore.fsck.multirank`;
:mod:`~asymstore.fsck.report` holds the verdicts (``committed``, ``corrupt``, ``partial``,
``orphaned``, ``quarantined``). ``repair`` removes partial and orphaned data, moves corrupt versions
and unreferenced files into ``.quarantine/``, rewrites ``LATEST``, and never touches a committed
version that verifies; it takes the root's writer lock first, so it never races a live writer.

Guide (each status and what repair does to it): ``docs/guides/fsck.md``.
"""


from __future__ import annotations

from asymstore.fsck.check import check, repair
from asymstore.fsck.report import SCHEMA_VERSION, FsckReport, Progress, VersionReport

__all__ = ["SCHEMA_VERSION", "FsckReport", "Progress", "VersionReport", "check", "repair"]
