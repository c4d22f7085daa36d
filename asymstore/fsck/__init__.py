"""fsck: check and repair a tier's root, or a multi-rank root, for recovery consistency.

``python -m asymstore.fsck LOCATION`` (see :mod:`asymstore.fsck.__main__`) or
:func:`check` then :func:`repair`. A directory tier (``LocalTier``,
``HostTier(path=...)``) is checked by :mod:`~asymstore.fsck.directory`, a URI
by :mod:`~asymstore.fsck.remote`, a multi-rank root by
:mod:`~asymstore.fsck.multirank`; :mod:`~asymstore.fsck.report` holds the
verdicts.

Each entry of the root gets a status:

- ``committed``: a version directory with a valid manifest whose segments are
  all present with the right sizes (and, with ``deep``, the right checksums).
- ``corrupt``: a version directory whose manifest is unreadable, or whose
  segments are missing, truncated or fail a checksum.
- ``partial``: a ``.tmp-*`` directory left by a commit that never published.
- ``orphaned``: a version directory without a manifest (a delete that was
  interrupted after removing the manifest), or a stray temporary file.
- ``quarantined``: a corrupt version moved aside earlier; informational.

``repair`` removes partial and orphaned data, moves corrupt versions and
files that no manifest references into ``.quarantine/`` (nothing that might
hold data is deleted), and rewrites ``LATEST`` to the newest version that
verifies. A committed version that verifies is never touched. Do not repair
while a process is writing to the same root: its in-progress commit would be
removed as partial.
"""


from __future__ import annotations

from asymstore.fsck.check import check, repair
from asymstore.fsck.report import SCHEMA_VERSION, FsckReport, Progress, VersionReport

__all__ = ["SCHEMA_VERSION", "FsckReport", "Progress", "VersionReport", "check", "repair"]
