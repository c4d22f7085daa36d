"""NVMeTier: a LocalTier whose segments go through kvikio (GDS / compat) or a POSIX O_DIRECT engine."""

from __future__ import annotations

import os
from collections.abc import Sequence

from asymstore.io.probes import filesystem_key
from asymstore.tiers.engines import Engine, select_engine
from asymstore.tiers.local import LocalTier
from asymstore.tiers.protocol import Buffer


class NVMeTier(LocalTier):
    """A local NVMe directory written with large aligned parallel I/O.

    Layout, manifest and publish protocol are those of :class:`LocalTier`
    (fsync of files and directories, rename publish), so fsck and LocalTier
    read it too; only segment files go through the engine.

    Args:
        root: the directory (created if missing).
        engine: ``"auto"`` (kvikio when it can run, else POSIX), ``"kvikio"`` or ``"posix"``.
        num_threads: I/O threads.
        task_size: bytes per parallel I/O task.
        direct: use O_DIRECT in the POSIX engine where the filesystem allows.
        name: the tier's name in reports.
        keep_last: this tier's retention; None uses the store's.
    """

    def __init__(self, root: str | os.PathLike[str], *, engine: str = "auto", num_threads: int = 4,
                 task_size: int = 16 << 20, direct: bool = True, name: str | None = None,
                 keep_last: int | None = None) -> None:
        """Create the tier and choose its engine (logged once when kvikio is unavailable)."""
        super().__init__(root, name=name or f"nvme:{os.path.abspath(os.fspath(root))}", keep_last=keep_last)
        self.engine: Engine = select_engine(engine, num_threads=num_threads, task_size=task_size, direct=direct)

    def __repr__(self) -> str:
        """Return a short description."""
        return f"NVMeTier({self.root!r}, engine={self.engine.name!r})"

    def calibration_key(self) -> str:
        """Identify the filesystem and engine for the calibration cache."""
        return filesystem_key(f"nvme-{self.engine.name}", self.root, fsync=self.fsync)

    def _write_segment_file(self, path: str, parts: Sequence[Buffer]) -> None:
        self.engine.write(path, parts, fsync=self.fsync)

    def _read_segment_file(self, path: str) -> Buffer:
        return self.engine.read(path)
