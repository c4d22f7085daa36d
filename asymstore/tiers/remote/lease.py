"""One writer per remote root: a lease object, since object stores and HDFS have no ``flock``.

``ROOT/.lock`` holds JSON ``{"token", "pid", "host", "since", "expires"}``. A writer takes the lease
when there is none, when it has expired, or when its holder is a dead process on this host; it
renews it every ``ttl_s/3`` and deletes it on close. A lease held elsewhere is waited for up to
``wait_s``, then :class:`~asymstore.errors.RootLockedError` names the holder. A ``file://`` root
creates a missing lease with ``O_CREAT | O_EXCL``; object stores and HDFS offer no conditional
create, so there (and when taking over an expired lease) the lease is best effort against two
writers starting within the same second.

The rules for users: docs/guides/store.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import pyarrow.fs as pafs

from asymstore.errors import RootLockedError
from asymstore.io.rootlock import LOCK_NAME, holder_info

logger = logging.getLogger(__name__)

_MAX_BYTES = 4096


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


class RemoteLease:
    """The writer lease of one remote root (blocking calls: run them in a thread).

    Args:
        fs: the pyarrow filesystem.
        root: the root path on it.
        ttl_s: how long a lease lives without renewal.
        wait_s: how long :meth:`acquire` waits for a live holder's lease to lapse.
    """

    def __init__(self, fs: pafs.FileSystem, root: str, *, ttl_s: float = 30.0, wait_s: float = 40.0) -> None:
        """Describe the lease; nothing is contacted before :meth:`acquire`."""
        if ttl_s <= 0 or wait_s < 0:
            raise ValueError("ttl_s must be positive and wait_s non-negative")
        self.fs = fs
        self.path = f"{root}/{LOCK_NAME}"
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.token = uuid.uuid4().hex
        self.held = False

    def _read(self) -> dict[str, Any] | None:
        try:
            with self.fs.open_input_file(self.path) as f:
                raw = f.read(min(f.size(), _MAX_BYTES))
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw.decode())
            return doc if isinstance(doc, dict) else {}
        except (ValueError, UnicodeDecodeError):
            return {}  # unreadable: treated as expired

    def _write(self) -> None:
        doc = holder_info() | {"token": self.token, "expires": time.time() + self.ttl_s}
        with self.fs.open_output_stream(self.path) as out:
            out.write(json.dumps(doc).encode())

    def _create_exclusive(self) -> bool:
        """Create the lease file only if it does not exist (a local path); return whether this call created it."""
        doc = holder_info() | {"token": self.token, "expires": time.time() + self.ttl_s}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps(doc).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _blocker(self, doc: dict[str, Any] | None) -> str | None:
        """Why ``doc`` keeps us out, or None when the lease is free to take."""
        if not doc or doc.get("token") == self.token:
            return None
        try:
            expires, pid, host = float(doc["expires"]), int(doc["pid"]), str(doc["host"])
        except (KeyError, TypeError, ValueError):
            return None
        if expires <= time.time():
            return None
        if host == socket.gethostname() and not _pid_alive(pid):
            return None
        return f"pid {pid} on {host[:64]} (lease valid for {expires - time.time():.0f} s more)"

    def holder(self) -> str | None:
        """Describe the live writer holding the lease now, or None (no lease, expired, or a dead local holder)."""
        return self._blocker(self._read())

    def acquire(self) -> None:
        """Take the lease, waiting up to ``wait_s`` for a live holder's lease to lapse.

        Raises:
            RootLockedError: another writer holds it and keeps renewing it.
        """
        deadline = time.monotonic() + self.wait_s
        while True:
            doc = self._read()
            blocker = self._blocker(doc)
            if blocker is None:
                if doc is None and isinstance(self.fs, pafs.LocalFileSystem):
                    won = self._create_exclusive()  # a conditional create: one of two racing writers wins
                else:
                    self._write()
                    won = True
                if won and (self._read() or {}).get("token") == self.token:
                    self.held = True
                    return
                blocker = "another writer that took the lease at the same moment"
            if time.monotonic() >= deadline:
                raise RootLockedError(f"{self.path.rsplit('/', 1)[0]} is being written by {blocker}; "
                                      "one writer per root")
            logger.info("waiting for the writer lease %s held by %s", self.path, blocker)
            time.sleep(min(1.0, self.ttl_s / 3))

    def renew(self) -> None:
        """Extend the lease; a lease taken over meanwhile is reported and left alone."""
        if not self.held:
            return
        doc = self._read()
        if doc and doc.get("token") not in (None, self.token):
            self.held = False
            logger.error("the writer lease %s was taken over by pid %s on %s; this store no longer owns the root",
                         self.path, doc.get("pid"), doc.get("host"))
            return
        self._write()

    def release(self) -> None:
        """Delete the lease if it is still ours."""
        if not self.held:
            return
        self.held = False
        if (self._read() or {}).get("token") == self.token:
            try:
                self.fs.delete_file(self.path)
            except FileNotFoundError:
                pass
