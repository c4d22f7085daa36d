"""Blocking file primitives with explicit durability (run them in a thread)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence

from asymstore.layout import fsync_dir

_IOV_MAX = 1024


def write_parts(path: str, parts: Sequence[memoryview | bytes | bytearray], *, fsync: bool = True) -> int:
    """Create ``path`` (it must not exist) holding ``parts`` concatenated; return its size.

    Uses ``writev`` so many small buffers become few system calls, and fsyncs
    the file before returning when ``fsync`` is true.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    total = 0
    try:
        pending = [memoryview(p).cast("B") for p in parts if len(p)]
        while pending:
            batch = pending[:_IOV_MAX]
            written = os.writev(fd, batch)
            total += written
            # drop fully written buffers, trim a partially written one
            consumed = 0
            while consumed < len(batch) and written >= len(batch[consumed]):
                written -= len(batch[consumed])
                consumed += 1
            pending = pending[consumed:]
            if written:
                pending[0] = pending[0][written:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return total


def read_whole(path: str) -> bytearray:
    """Read all of ``path`` into a new bytearray."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        done = 0
        while done < size:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                break
            done += n
        if done != size:
            del view
            del buf[done:]
        return buf
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: tmp file, fsync, rename, fsync dir."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write_parts(tmp, [data], fsync=fsync)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(directory)
