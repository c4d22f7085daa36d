"""A simulated node's shared memory for multi-rank tests: /dev/shm where it is a writable tmpfs, else a tmp dir."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def shm_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory in /dev/shm (or the temporary directory), removed after use."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
