"""One writer per root: the lock a store holds on each directory tier, and the sweep it makes safe.

A store that opens a directory-backed tier (``LocalTier``, ``NVMeTier``,
``HostTier(path=...)``, the multi-rank ``global/`` directory) takes an
exclusive ``flock`` on ``ROOT/.lock`` and keeps it until it closes. The
kernel drops the lock when the process dies, however it dies, so a crashed
writer never blocks the next one; a second live writer gets
:class:`~asymstore.errors.RootLockedError` naming the root and the holder
(pid, host, start time, command) recorded in the lock file.

Holding the lock, the writer knows that every ``.tmp-*`` entry it did not
create itself belongs to a dead writer, and :func:`sweep_directory` removes
those, ``LATEST`` temp files and version directories left without a manifest
by an interrupted delete. The store sweeps at open and after each publish.

The lock file is never removed (removing it would let two writers lock two
different files of the same name).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Collection

from asymstore.errors import RootLockedError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import LATEST, TMP_PREFIX, parse_version_dirname, retention_leftover
from asymstore.io.files import fsync_dir, quarantine_entry

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_HOLDER_MAX_BYTES = 4096


def holder_info() -> dict[str, object]:
    """Describe this process as a lock holder (JSON-ready)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
            "command": " ".join(sys.argv)[:200]}


def describe_holder(raw: bytes) -> str:
    """Return a one-line description of the holder recorded in a lock file's bytes."""
    try:
        info = json.loads(raw[:_HOLDER_MAX_BYTES].decode())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {int(info['pid'])} on {str(info['host'])[:64]} since {since} ({str(info['command'])[:120]})"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError):
        return "an unknown process (the lock file does not say)"


class DirLock:
    """An exclusive, non-blocking ``flock`` on ``ROOT/.lock``.

    Args:
        root: the directory (must exist before :meth:`acquire`).
    """

    def __init__(self, root: str) -> None:
        """Describe the lock; nothing is taken before :meth:`acquire`."""
        self.root = root
        self.path = os.path.join(root, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock and record this process as its holder.

        Raises:
            RootLockedError: another writer (another process, or another store
                of this process) holds it.
        """
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            raise RootLockedError(f"cannot open the lock file {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, _HOLDER_MAX_BYTES, 0) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else b""
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RootLockedError(f"{self.root} is being written by {describe_holder(holder)}; "
                                      "one writer per root (close that store, or use another root)") from exc
            raise RootLockedError(f"cannot lock {self.path}: {exc}") from exc
        data = json.dumps(holder_info()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the file releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def holder(self) -> str | None:
        """Return who holds the lock now (None when nobody does); never takes it for long."""
        if self._fd is not None:
            return describe_holder(os.pread(self._fd, _HOLDER_MAX_BYTES, 0))
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return describe_holder(os.pread(fd, _HOLDER_MAX_BYTES, 0))
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


def is_leftover_name(name: str) -> bool:
    """True for names only a writer in progress makes: ``.tmp-*`` entries and ``LATEST`` temp files."""
    return name.startswith(TMP_PREFIX) or (name.startswith(f".{LATEST}.") and name.endswith(".tmp"))


def sweep_directory(root: str, active: Collection[str] = (), *, fsync: bool = True) -> list[str]:
    """Remove what dead writers left in ``root``; return the names removed or moved aside.

    Call it only while holding the root's :class:`DirLock`: then every
    temporary entry not in ``active`` (this writer's own in-flight names)
    belongs to a writer that is gone. Removed: ``.tmp-*`` files and
    directories, ``LATEST`` temp files, and version directories without a
    manifest that a retention delete cut short (older than the oldest
    committed version, :func:`asymstore.format.names.retention_leftover`). A version
    directory without a manifest that retention cannot have been deleting
    (a committed version whose manifest was lost) is moved to ``.quarantine/``
    with a WARNING, never deleted. Symlinks are unlinked, never followed.
    Committed versions are never touched.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    committed = [s for s in (parse_version_dirname(e.name) for e in entries if e.is_dir(follow_symlinks=False)
                             and os.path.lexists(os.path.join(e.path, MANIFEST_NAME))) if s is not None]
    for entry in entries:
        name = entry.name
        if name in active:
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        step = parse_version_dirname(name)
        orphan = step is not None and is_dir and not os.path.lexists(os.path.join(entry.path, MANIFEST_NAME))
        if not (is_leftover_name(name) or orphan):
            continue
        if orphan and step is not None and not retention_leftover(step, committed):
            try:
                dest = quarantine_entry(root, entry.path, name, fsync=fsync)
            except OSError as exc:
                logger.warning("could not move %s aside: %s", entry.path, exc)
                continue
            logger.warning("%s: version directory %s has no manifest but is no retention leftover (a version "
                           "older than it is committed): moved to %s, not deleted", root, name, dest)
            removed.append(name)
            continue
        try:
            if is_dir:
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not remove leftover %s: %s", entry.path, exc)
            continue
        removed.append(name)
    if removed:
        if fsync:
            fsync_dir(root)
        logger.info("removed %d leftover(s) of dead writers in %s: %s", len(removed), root, ", ".join(sorted(removed)))
    return removed
