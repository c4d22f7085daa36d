"""Small metadata files read with aiofiles: manifests and ``LATEST`` hints.

These are plain, bounded reads where an async file object is all that is
needed. The data path (segment files) does not use aiofiles: it needs
O_DIRECT with aligned buffers, ``writev`` over many buffers, a strict fsync
order and the caller's own buffers, which :mod:`asymstore.io.files` gives it
(see docs/dependencies.md). Writes of small files stay on
:func:`asymstore.io.files.atomic_write` as well: aiofiles has no fsync.

Every file read here is untrusted: :func:`~asymstore.io.files.check_regular`
checks it (a regular file, not a symlink, within the size cap) before it is
opened for reading, the descriptor read is checked again (the path may have
been swapped in between), and no more than the cap is ever read.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat

import aiofiles

from asymstore.errors import CorruptVersionError
from asymstore.io.files import check_directory, check_regular

logger = logging.getLogger(__name__)


def _open_regular(path: str, flags: int) -> int:
    """Open ``path`` without following a symlink or blocking, and refuse anything but a regular file.

    Used as the ``opener`` of :func:`aiofiles.open`, so it runs in aiofiles' thread.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptVersionError(f"{path} is a symlink; only regular files are read") from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CorruptVersionError(f"{path} is not a regular file")
    return fd


async def read_small(path: str, max_size: int, *, directory: str | None = None) -> bytes:
    """Return the bytes of a small regular file, at most ``max_size`` of them.

    Args:
        path: the file.
        max_size: the most bytes accepted; a larger file is refused before it is read.
        directory: when given, checked first to be a real directory (not a symlink to one).

    Raises:
        FileNotFoundError: the file (or ``directory``) does not exist.
        CorruptVersionError: not a regular file, a symlink, or larger than ``max_size``.
        OSError: the read failed.
    """
    def check() -> int:
        if directory is not None:
            check_directory(directory)
        return check_regular(path, max_size=max_size)

    size = await asyncio.to_thread(check)
    async with aiofiles.open(path, "rb", opener=_open_regular) as f:
        data = await f.read(size + 1)
        if len(data) > size:  # it grew after the check: read on, never past the cap
            data += await f.read(max_size + 1 - len(data))
    if len(data) > max_size:
        raise CorruptVersionError(f"{path} has more than the {max_size} bytes accepted")
    return data
