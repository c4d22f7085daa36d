"""One writer per root: the lock a store holds on each directory tier, and the sweep it makes safe.

A store opening a directory-backed tier takes an exclusive ``flock`` on ``ROOT/.lock`` until it
closes; the kernel drops it when the process dies, and a second live writer gets
:class:`~asymstore.errors.RootLockedError` naming the holder recorded in the file. Holding it, the
writer knows every ``.tmp-*`` entry it did not create belongs to a dead writer:
:func:`sweep_directory` removes those, and moves a version directory without a manifest to
``.quarantine/`` unless an interrupted retention delete left it. Each entry swept is a
:class:`Swept`. The lock file is never removed (two writers could then lock two files of one name).

The rules for users: docs/guides/store.md.
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass
from typing import Literal

from asymstore.errors import RootLockedError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import LATEST, LAYOUT_FILE, TMP_PREFIX, parse_version_dirname
from asymstore.io.files import fsync_dir, in_flight, quarantine_entry

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_HOLDER_MAX_BYTES = 4096

SweepAction = Literal["removed", "quarantined"]
"""What a sweep did with a leftover: removed it, or moved it to ``.quarantine/`` (its bytes kept)."""


@dataclass(frozen=True)
class Swept:
    """One entry a sweep of dead writers' leftovers removed or moved aside.

    Attributes:
        name: the entry's name in the root.
        action: ``"removed"`` or ``"quarantined"``.
        reason: why, in words.
        path: where it is now (under ``.quarantine/``), or where it was (removed).
    """

    name: str
    action: SweepAction
    reason: str
    path: str


def orphan_verdict(step: int, oldest_kept: int | None) -> tuple[SweepAction, str]:
    """What to do with version directory ``step`` found without a manifest, and why.

    Retention deletes only versions older than the oldest it keeps, manifest
    first; so a manifest-less version older than ``oldest_kept`` (given only
    while a retention rule is in force) is what an interrupted delete left, and
    is removed. Any other one (no rule in force, or newer than that) may be
    the only copy of a committed version that lost its manifest, or a commit
    cut short: it is quarantined, never deleted.
    """
    if oldest_kept is not None and step < oldest_kept:
        return "removed", (f"no manifest, older than step {oldest_kept}, the oldest version retention keeps: "
                           "an interrupted retention delete")
    if oldest_kept is None:
        return "quarantined", ("no manifest and no retention rule in force that would have deleted it (a version "
                               "that lost its manifest, or a commit cut short)")
    return "quarantined", (f"no manifest, yet not older than step {oldest_kept}, the oldest version retention "
                           "keeps: no retention delete left it (a version that lost its manifest, or a commit cut "
                           "short)")


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
        self._pid = os.getpid()  # the process that took the lock (a forked child only closes its copy)

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
        self._pid = os.getpid()

    def release(self) -> None:
        """Drop the lock: unlocked, then closed.

        A child forked meanwhile (a data loader's worker) holds a copy of the descriptor: closing this
        one alone would leave the lock held until that child exits. A forked child that releases its
        copy only closes it (the lock is the parent's).
        """
        if self._fd is not None:
            if self._pid == os.getpid():
                with contextlib.suppress(OSError):
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
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


_SMALL_FILES = (LATEST, LAYOUT_FILE)
"""The root's small files, replaced by :func:`~asymstore.io.files.atomic_write` (temporary ``.NAME.<id>.tmp``)."""


def is_leftover_name(name: str) -> bool:
    """True for names only a writer in progress makes: ``.tmp-*`` entries and the small files' temp files."""
    return name.startswith(TMP_PREFIX) or (name.endswith(".tmp") and any(
        name.startswith(f".{small}.") for small in _SMALL_FILES))


def sweep_directory(root: str, active: Collection[str] = (), *, oldest_kept: int | None = None,
                    fsync: bool = True, keep: Collection[str] = ()) -> list[Swept]:
    """Remove what dead writers left in ``root``, moving aside what may be data; return what was swept.

    Call it only while holding the root's :class:`DirLock`: then every
    temporary entry not in ``active`` (this writer's own in-flight names)
    belongs to a writer that is gone. Removed: ``.tmp-*`` files and
    directories and ``LATEST`` temp files. A version directory without a
    manifest is judged by :func:`orphan_verdict`: removed only when older than
    ``oldest_kept`` (the oldest version retention keeps; pass it only while a
    retention rule is in force), else moved to ``.quarantine/`` with a WARNING
    naming it and why. Symlinks are unlinked, never followed. Committed
    versions are never touched, nor the version directories named in ``keep``
    (deleted versions whose segments committed versions reference, format 4).
    """
    swept: list[Swept] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return swept
    for entry in entries:
        name = entry.name
        if name in active or name in keep or in_flight(entry.path):  # this writer's own, or kept for references
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        step = parse_version_dirname(name)
        orphan = step is not None and is_dir and not os.path.lexists(os.path.join(entry.path, MANIFEST_NAME))
        if not (is_leftover_name(name) or orphan):
            continue
        action, reason = orphan_verdict(step, oldest_kept) if orphan and step is not None else (
            "removed", "a temporary entry of a writer that is gone")
        if name in active or name in keep:  # this writer began deleting it since the check above (manifest first)
            continue
        if action == "quarantined":
            try:
                dest = quarantine_entry(root, entry.path, name, fsync=fsync)
            except OSError as exc:
                logger.warning("could not move %s aside: %s", entry.path, exc)
                continue
            logger.warning("%s: %s; moved to %s, not deleted", entry.path, reason, dest)
            swept.append(Swept(name, "quarantined", reason, dest))
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
        swept.append(Swept(name, "removed", reason, entry.path))
    if swept:
        if fsync:
            fsync_dir(root)
        removed = sorted(s.name for s in swept if s.action == "removed")
        if removed:
            logger.info("removed %d leftover(s) of dead writers in %s: %s", len(removed), root, ", ".join(removed))
    return swept
