"""I/O probes: timed writes that measure what one segment write costs on a directory or in memory.

They measure and nothing more; :mod:`asymstore.policy.calibration` fits the
cost model of :mod:`asymstore.policy.costmodel` to what they report, and tiers
offer them through :class:`~asymstore.tiers.protocol.ProbeableTier`.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence

from asymstore.format.names import TMP_PREFIX
from asymstore.io.files import fsync_dir, write_parts


def probe_directory(root: str, sizes: Sequence[int], *, fsync: bool,
                    write: Callable[[str, Sequence[memoryview]], object] | None = None,
                    scratch: str | None = None) -> list[float]:
    """Time one segment write per size into ``ROOT/.tmp-calibrate-<id>/``, then remove it.

    ``write(path, parts)`` writes one file the way the tier writes segments
    (default: ``write_parts``, i.e. writev + fsync). ``scratch`` names the
    scratch directory (default: a fresh ``.tmp-calibrate-<id>``).
    """
    scratch = os.path.join(root, scratch or f"{TMP_PREFIX}calibrate-{uuid.uuid4().hex[:8]}")
    os.makedirs(scratch)
    data = memoryview(os.urandom(max(sizes, default=0)))
    times: list[float] = []
    try:
        for i, size in enumerate(sizes):
            path = os.path.join(scratch, f"probe-{i}.bin")
            t0 = time.perf_counter()
            if write is None:
                write_parts(path, [data[:size]], fsync=fsync)
            else:
                write(path, [data[:size]])
            times.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if fsync:
            fsync_dir(root)
    return times


def probe_memory(sizes: Sequence[int]) -> list[float]:
    """Time one copy into a fresh bytearray per size (what an in-memory tier's write does)."""
    data = memoryview(os.urandom(max(sizes, default=0)))
    times = []
    for size in sizes:
        t0 = time.perf_counter()
        buf = bytearray(size)
        buf[:] = data[:size]
        times.append(time.perf_counter() - t0)
        del buf
    return times


def filesystem_key(kind: str, path: str, *, fsync: bool) -> str:
    """Return ``"<kind>:dev=<st_dev>:<mount point>:<fsync|nofsync>"`` for the filesystem holding ``path``."""
    path = os.path.abspath(path)
    dev = os.stat(path).st_dev
    mount = path
    while True:
        parent = os.path.dirname(mount)
        if parent == mount or os.stat(parent).st_dev != dev:
            break
        mount = parent
    return f"{kind}:dev={dev}:{mount}:{'fsync' if fsync else 'nofsync'}"
