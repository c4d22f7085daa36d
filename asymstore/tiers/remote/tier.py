"""RemoteTier: versions on any pyarrow filesystem (``hdfs://``, ``s3://``, ``file://``).

Layout is that of :mod:`asymstore.format.names` under the URI's path. A version is published by
``rename`` (HDFS, ``file://``: a ``.tmp-v…-id/`` directory renamed to ``v…``, never onto an
existing one) or by ``marker`` (object stores: segments first, the manifest last in one PUT as the
commit marker). Every upload is verified and every operation retried on transient errors only
(:class:`asymstore.tiers.remote.retry.RetryPolicy`).

Setup (HDFS's libhdfs included), publishing and retries: docs/guides/store.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import pyarrow.fs as pafs

from asymstore.errors import CorruptVersionError, StepCommittedError, TierError, VersionNotFoundError
from asymstore.format.checksum import StreamingChecksum
from asymstore.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, validate_segment_name
from asymstore.format.names import LATEST, QUARANTINE, TMP_PREFIX, parse_version_dirname, version_dirname
from asymstore.io.rootlock import Swept, is_leftover_name, orphan_verdict
from asymstore.tiers.protocol import Buffer
from asymstore.tiers.remote.fs import open_filesystem, read_all, write_all
from asymstore.tiers.remote.lease import RemoteLease
from asymstore.tiers.remote.retry import RetryPolicy

__all__ = ["RemoteTier", "open_filesystem"]

logger = logging.getLogger(__name__)

_MARKER_SCHEMES = {"s3", "gs", "gcs", "abfs", "abfss", "az"}


class RemoteTier:
    """A tier on a remote (or any pyarrow) filesystem.

    Args:
        uri: ``s3://bucket/prefix?endpoint_override=host:port&scheme=http``,
            ``hdfs://namenode:port/path`` or ``file:///path``.
        name: the tier's name in reports (default ``remote:<uri without query>``).
        keep_last: this tier's retention; None uses the store's.
        publish: ``"rename"`` or ``"marker"``; default by scheme (see module doc).
        verify: ``"checksum"`` (read back and hash every upload) or ``"size"``.
        part_size: bytes per write call (S3 uploads parts of this size in parallel).
        parallel_segments: segments uploaded at once.
        retry: the retry policy.
        filesystem: an already built pyarrow filesystem (then ``uri`` gives only the path).
        lease_ttl_s: lifetime of the writer lease (one writer per root, see
            :mod:`asymstore.tiers.remote.lease`); renewed every third of it while open.
        lease_wait_s: how long ``open`` waits for another writer's lease to lapse.
        **options: S3 options (``endpoint_override``, ``scheme``, ``access_key``, ...).
    """

    persistent = True

    def __init__(self, uri: str, *, name: str | None = None, keep_last: int | None = None,
                 publish: str | None = None, verify: str = "checksum", part_size: int = 16 << 20,
                 parallel_segments: int = 4, retry: RetryPolicy | None = None,
                 filesystem: pafs.FileSystem | None = None, lease_ttl_s: float = 30.0,
                 lease_wait_s: float = 40.0, **options: Any) -> None:
        """Build the filesystem client; nothing is contacted before ``open``."""
        self.uri = _locator(uri, options)
        """The location as fsck takes it (the URI, with ``endpoint_override``/``scheme`` given as options)."""
        if filesystem is not None:
            parts = urlsplit(uri)
            self.fs, self.root = filesystem, (f"{parts.netloc}{parts.path}" if parts.scheme else uri).rstrip("/")
            scheme = parts.scheme or "file"
        else:
            self.fs, self.root, scheme = open_filesystem(uri, **options)
        self.scheme = scheme
        self.publish_mode = publish or ("marker" if scheme in _MARKER_SCHEMES else "rename")
        if self.publish_mode not in ("rename", "marker") or verify not in ("checksum", "size"):
            raise ValueError("publish must be 'rename' or 'marker'; verify 'checksum' or 'size'")
        self.verify = verify
        self.part_size = part_size
        self.parallel_segments = max(1, parallel_segments)
        self.retry = retry or RetryPolicy()
        self.keep_last = keep_last
        safe = urlunsplit(urlsplit(uri)._replace(query=""))
        self.name = name or f"remote:{safe}"
        self._lease = RemoteLease(self.fs, self.root, ttl_s=lease_ttl_s, wait_s=lease_wait_s)
        self._renewer: asyncio.Task[None] | None = None
        self._active: set[str] = set()  # this writer's temporary names in flight

    def __repr__(self) -> str:
        """Return a short description."""
        return f"RemoteTier({self.name!r}, publish={self.publish_mode!r})"

    @property
    def lease(self) -> RemoteLease:
        """The writer lease of the root (``ttl_s`` and ``wait_s`` may be changed before ``open``)."""
        return self._lease

    def _p(self, *names: str) -> str:
        return "/".join((self.root, *names))

    async def _io(self, what: str, fn: Any) -> Any:
        return await self.retry.run(f"{self.name}: {what}", fn)

    async def open(self) -> None:
        """Create the root directory (a no-op on object stores)."""
        await self._io("create root", lambda: self.fs.create_dir(self.root, recursive=True))

    async def close(self) -> None:
        """Nothing to release (pyarrow filesystems close with the process)."""

    async def lock_root(self) -> None:
        """Take the root's writer lease and keep renewing it until :meth:`unlock_root`."""
        await asyncio.to_thread(self._lease.acquire)
        self._renewer = asyncio.ensure_future(self._renew_forever())

    async def _renew_forever(self) -> None:
        while self._lease.held:
            await asyncio.sleep(self._lease.ttl_s / 3)
            try:
                await asyncio.to_thread(self._lease.renew)
            except OSError as exc:  # the remote is down: the next renewal tries again
                logger.warning("%s: renewing the writer lease failed: %s", self.name, exc)

    async def unlock_root(self) -> None:
        """Stop renewing and delete the writer lease."""
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        try:
            await asyncio.to_thread(self._lease.release)
        except OSError as exc:
            logger.warning("%s: could not delete the writer lease (it lapses by itself): %s", self.name, exc)

    async def sweep_leftovers(self, *, oldest_kept: int | None = None) -> list[Swept]:
        """Remove dead writers' leftovers (only while holding the lease), quarantine what may be data.

        Temporary directories and files (``.tmp-*``, ``LATEST`` temp files) that
        are not this writer's own are removed. A version prefix without a
        manifest (an upload cut short by a crash, a retention delete cut short,
        or a committed version that lost its manifest) is removed only when it
        is older than ``oldest_kept`` (the oldest version retention keeps, given
        while a retention rule is in force: :func:`asymstore.io.rootlock.orphan_verdict`);
        any other one is moved under ``.quarantine/`` with a WARNING naming it and why.
        """
        if not self._lease.held:
            return []
        active = set(self._active)

        def sweep() -> list[Swept]:
            swept = []
            sel = pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
            listing = list(self.fs.get_file_info(sel))
            has_manifest = {info.base_name: self.fs.get_file_info(f"{info.path}/{MANIFEST_NAME}").type
                            == pafs.FileType.File for info in listing
                            if parse_version_dirname(info.base_name) is not None
                            and info.type == pafs.FileType.Directory}
            for info in listing:
                name = info.base_name
                if name in active:
                    continue
                step = parse_version_dirname(name)
                orphan = name in has_manifest and not has_manifest[name]
                if not (orphan or is_leftover_name(name)):
                    continue
                action, reason = orphan_verdict(step, oldest_kept) if orphan and step is not None else (
                    "removed", "a temporary entry of a writer that is gone")
                if action == "quarantined":
                    dest = self._move_aside(info.path, name)
                    logger.warning("%s: %s: %s; moved to %s, not deleted", self.name, info.path, reason, dest)
                    swept.append(Swept(name, "quarantined", reason, dest))
                    continue
                if info.type == pafs.FileType.Directory:
                    self.fs.delete_dir(info.path)
                else:
                    self.fs.delete_file(info.path)
                swept.append(Swept(name, "removed", reason, info.path))
            return swept
        try:
            swept = await asyncio.to_thread(sweep)
        except OSError as exc:
            logger.info("%s: sweeping leftovers failed (will retry after the next commit): %s", self.name, exc)
            return []
        for entry in swept:
            if entry.action == "removed":
                logger.info("%s: removed leftover %s (%s)", self.name, entry.name, entry.reason)
        return swept

    def _move_aside(self, path: str, name: str) -> str:
        """Move the prefix ``path`` under ``.quarantine/`` (file by file where directories cannot be renamed)."""
        dest = self._p(QUARANTINE, f"{name}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
        self.fs.create_dir(self._p(QUARANTINE), recursive=True)
        if self.publish_mode == "rename":
            self.fs.move(path, dest)
            return dest
        for f in self.fs.get_file_info(pafs.FileSelector(path, recursive=True)):
            if f.type == pafs.FileType.File:
                self.fs.move(f.path, f"{dest}/{f.path[len(path):].lstrip('/')}")
        self.fs.delete_dir(path)
        return dest

    async def list_versions(self) -> list[int]:
        """Return steps whose ``v…/MANIFEST.json`` exists, ascending."""
        def listing() -> list[int]:
            sel = pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
            steps = {}
            for info in self.fs.get_file_info(sel):
                step = parse_version_dirname(info.base_name)
                if step is not None and info.type == pafs.FileType.Directory:
                    steps[self._p(info.base_name, MANIFEST_NAME)] = step
            if not steps:
                return []
            found = self.fs.get_file_info(list(steps))
            return sorted(steps[i.path] for i in found if i.type == pafs.FileType.File)
        result: list[int] = await self._io("list versions", listing)
        return result

    async def begin(self, step: int, nbytes: int) -> _RemoteWriter:
        """Start a version: a fresh temporary directory (rename) or the version prefix (marker)."""
        vdir = self._p(version_dirname(step))
        manifest = f"{vdir}/{MANIFEST_NAME}"
        info = await self._io("stat manifest", lambda: self.fs.get_file_info(manifest))
        if info.type == pafs.FileType.File:
            raise StepCommittedError(f"step {step} is already committed on {self.name}")
        if self.publish_mode == "marker":
            target = vdir
        else:
            target = self._p(f"{TMP_PREFIX}{version_dirname(step)}-{uuid.uuid4().hex[:8]}")
        self._active.add(target.rsplit("/", 1)[-1])
        await self._io("create dir", lambda: self.fs.create_dir(target, recursive=True))
        return _RemoteWriter(self, step, target)

    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest bytes of ``step``."""
        path = self._p(version_dirname(step), MANIFEST_NAME)
        try:
            return bytes(await self._io("read manifest", lambda: read_all(self.fs, path, max_size=MAX_MANIFEST_BYTES)))
        except TierError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise VersionNotFoundError(f"step {step} not on {self.name}") from exc
            raise

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Return one segment's bytes (read with a large buffer, not a stream; of ``size`` bytes when given)."""
        path = self._p(version_dirname(step), validate_segment_name(name))
        result: Buffer = await self._io(f"read {name}", lambda: read_all(self.fs, path, expected_size=size))
        return result

    async def stat_segment(self, step: int, name: str, size: int) -> None:
        """Check that segment ``name`` exists with ``size`` bytes, without reading it."""
        path = self._p(version_dirname(step), validate_segment_name(name))
        info = await self._io(f"stat {name}", lambda: self.fs.get_file_info(path))
        if info.type != pafs.FileType.File:
            raise TierError(f"segment {name} of step {step} missing on {self.name}")
        if info.size != size:
            raise CorruptVersionError(f"{path} has {info.size} bytes, the manifest says {size}")

    async def delete_version(self, step: int) -> None:
        """Delete the manifest first, then the rest of the version."""
        vdir = self._p(version_dirname(step))

        def delete() -> None:
            try:
                self.fs.delete_file(f"{vdir}/{MANIFEST_NAME}")
            except FileNotFoundError:
                pass
            try:
                self.fs.delete_dir(vdir)
            except FileNotFoundError:
                pass
        await self._io("delete version", delete)

    async def quarantine(self, step: int) -> None:
        """Move a corrupt version under ``.quarantine/`` (marker stores: move its manifest there)."""
        vdir = self._p(version_dirname(step))
        dest = self._p(QUARANTINE, f"{version_dirname(step)}-{time.strftime('%Y%m%dT%H%M%S')}")

        def move() -> None:
            self.fs.create_dir(self._p(QUARANTINE), recursive=True)
            if self.publish_mode == "rename":
                self.fs.move(vdir, dest)
            else:
                self.fs.move(f"{vdir}/{MANIFEST_NAME}", f"{dest}-{MANIFEST_NAME}")
        await self._io("quarantine", move)
        logger.warning("moved corrupt step %d on %s to %s", step, self.name, dest)

    def calibration_key(self) -> str:
        """Identify the remote location for the calibration cache."""
        return f"{self.name}:{self.publish_mode}:{self.verify}"

    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Time one verified upload per size under a scratch prefix, then remove it."""
        scratch = self._p(f"{TMP_PREFIX}calibrate-{uuid.uuid4().hex[:8]}")
        data = memoryview(os.urandom(max(sizes, default=0)))
        self._active.add(scratch.rsplit("/", 1)[-1])

        def probe() -> list[float]:
            times = []
            try:
                self.fs.create_dir(scratch, recursive=True)
                for i, size in enumerate(sizes):
                    path = f"{scratch}/probe-{i}.bin"
                    t0 = time.perf_counter()
                    write_all(self.fs, path, [data[:size]], self.part_size)
                    if self.verify == "checksum":
                        read_all(self.fs, path)
                    times.append(time.perf_counter() - t0)
            finally:
                try:
                    self.fs.delete_dir(scratch)
                except OSError:
                    pass
            return times
        try:
            result: list[float] = await asyncio.to_thread(probe)
        finally:
            self._active.discard(scratch.rsplit("/", 1)[-1])
        return result

    async def write_latest(self, step: int) -> None:
        """Write the LATEST hint (one PUT on object stores; tmp file and rename elsewhere)."""
        data = f"{step}\n".encode()
        latest = self._p(LATEST)

        def write() -> None:
            if self.publish_mode == "marker":
                write_all(self.fs, latest, [data], self.part_size)
                return
            tmp = self._p(f".{LATEST}.{uuid.uuid4().hex[:12]}.tmp")
            write_all(self.fs, tmp, [data], self.part_size)
            try:
                self.fs.move(tmp, latest)
            except OSError:  # HDFS will not rename onto an existing file: a hint may vanish briefly
                self.fs.delete_file(latest)
                self.fs.move(tmp, latest)
        await self._io("write LATEST", write)

    async def read_latest(self) -> int | None:
        """Return the LATEST hint, or None."""
        try:
            data = await self._io("read LATEST", lambda: read_all(self.fs, self._p(LATEST)))
            return int(bytes(data).decode().strip())
        except (TierError, ValueError, UnicodeDecodeError):
            return None


class _RemoteWriter:
    def __init__(self, tier: RemoteTier, step: int, target: str) -> None:
        self.tier = tier
        self.step = step
        self.target = target
        self.uploads: list[asyncio.Task[None]] = []
        self.sem = asyncio.Semaphore(tier.parallel_segments)

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        path = f"{self.target}/{validate_segment_name(name)}"
        self.uploads.append(asyncio.ensure_future(self._upload(path, parts)))
        await asyncio.sleep(0)

    async def _upload(self, path: str, parts: Sequence[Buffer]) -> None:
        async with self.sem:
            expected = StreamingChecksum(parts).hexdigest() if self.tier.verify == "checksum" else ""
            size = sum(len(p) for p in parts)

            def put_and_verify() -> None:
                write_all(self.tier.fs, path, parts, self.tier.part_size)
                info = self.tier.fs.get_file_info(path)
                if info.size != size:
                    raise OSError(f"upload of {path} has {info.size} bytes, expected {size}")  # retried
                if expected and StreamingChecksum([read_all(self.tier.fs, path)]).hexdigest() != expected:
                    raise OSError(f"upload of {path} read back with a different checksum")  # retried
            await self.tier._io(f"upload {path}", put_and_verify)

    async def publish(self, manifest: bytes) -> None:
        try:
            await asyncio.gather(*self.uploads)
        except BaseException:
            await asyncio.gather(*self.uploads, return_exceptions=True)
            raise
        tier = self.tier
        await tier._io("write manifest", lambda: write_all(
            tier.fs, f"{self.target}/{MANIFEST_NAME}", [manifest], tier.part_size))
        if tier.publish_mode == "marker":
            got = await tier._io("verify manifest", lambda: read_all(tier.fs, f"{self.target}/{MANIFEST_NAME}"))
            if bytes(got) != manifest:
                raise CorruptVersionError(f"manifest of step {self.step} on {tier.name} read back differently")
            self._done()
            return
        dest = tier._p(version_dirname(self.step))

        def rename() -> None:
            info = tier.fs.get_file_info(f"{dest}/{MANIFEST_NAME}")
            if info.type == pafs.FileType.File:
                raise FileExistsError(dest)
            if tier.fs.get_file_info(dest).type == pafs.FileType.Directory:
                tier.fs.delete_dir(dest)  # orphaned leftovers of an interrupted delete
            tier.fs.move(self.target, dest)
        try:
            await tier._io("publish", rename)
        except TierError as exc:
            if not isinstance(exc.__cause__, FileExistsError):
                raise
            # an earlier attempt may have renamed it and lost the answer: the same manifest there is our commit
            there = await tier._io("read manifest", lambda: read_all(tier.fs, f"{dest}/{MANIFEST_NAME}"))
            if bytes(there) != manifest:
                raise StepCommittedError(f"step {self.step} is already committed on {tier.name}") from exc
            logger.info("%s: step %d was already published by an earlier attempt", tier.name, self.step)
            await self.abort()
        self._done()

    def _done(self) -> None:
        self.tier._active.discard(self.target.rsplit("/", 1)[-1])

    async def abort(self) -> None:
        for task in self.uploads:
            task.cancel()
        await asyncio.gather(*self.uploads, return_exceptions=True)
        target = self.target
        try:
            await asyncio.to_thread(self.tier.fs.delete_dir, target)
        except FileNotFoundError:
            pass
        except OSError as exc:  # best effort: the next sweep removes what is left
            logger.warning("could not remove %s after an aborted commit: %s", target, exc)
            return
        self._done()


def _locator(uri: str, options: dict[str, Any]) -> str:
    """``uri`` as fsck can reach it again: the query keeps only where the store is, never credentials.

    ``endpoint_override``, ``scheme`` and ``region`` (from the URI's query or the options) are kept;
    ``access_key``, ``secret_key``, ``session_token`` and anything else are dropped (fsck takes
    credentials from the environment, as pyarrow does).
    """
    parts = urlsplit(uri)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items() if k in _LOCATOR_KEYS}
    query |= {k: str(options[k]) for k in _LOCATOR_KEYS if k in options}
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query, safe=":/"), ""))


_LOCATOR_KEYS = ("endpoint_override", "scheme", "region")
