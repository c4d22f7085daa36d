"""LocalTier: versions as directories of real files, fsynced, published by rename."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TypeVar

import aiofiles.os

from asymstore.errors import AsymstoreError, CorruptVersionError, StepCommittedError, TierError, VersionNotFoundError
from asymstore.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, validate_segment_name
from asymstore.format.names import LATEST, QUARANTINE, TMP_PREFIX, parse_version_dirname, version_dirname
from asymstore.format.parse import parse_manifest
from asymstore.io.files import (
    atomic_write,
    check_directory,
    check_regular,
    fsync_dir,
    quarantine_entry,
    read_large,
    read_ranges,
    write_parts,
)
from asymstore.io.probes import filesystem_key, probe_directory
from asymstore.io.rootlock import DirLock, Swept, sweep_directory
from asymstore.io.smallfiles import read_small
from asymstore.tiers.protocol import Buffer

T = TypeVar("T")
logger = logging.getLogger(__name__)

_LATEST_MAX_BYTES = 64  # a step number and a newline; anything longer is not a LATEST this tier wrote
_NO_REFERENCES = re.compile(rb'^\{"format":"asymstore\.manifest","format_version":[123],')
"""The head of a manifest written before format 4 (it references nothing: not parsed to find out)."""
Ref = tuple[int, str]
"""A referenced segment: (the step whose directory holds it, its file name)."""


class LocalTier:
    """A directory on a local filesystem; see :mod:`asymstore.format.names` for the layout.

    Segments and the manifest are written into a temporary directory and
    fsynced; the version is published by renaming that directory to its final
    name and fsyncing the root. A rename onto an existing version fails, so a
    committed version is never overwritten.

    Args:
        root: the directory (created if missing).
        name: the tier's name in reports (default: ``"local:<root>"``).
        keep_last: this tier's retention; None uses the store's.
        fsync: flush files and directories (turn off only for tmpfs).
        direct_reads: read large segments with O_DIRECT (turn off only for tmpfs, whose files are memory:
            there the bounce buffer would be a second copy).
    """

    persistent = True

    def __init__(self, root: str | os.PathLike[str], *, name: str | None = None,
                 keep_last: int | None = None, fsync: bool = True, direct_reads: bool = True) -> None:
        """Create a tier over ``root``; nothing touches the disk before ``open``."""
        self.root = os.path.abspath(os.fspath(root))
        self.name = name or f"local:{self.root}"
        self.keep_last = keep_last
        self.fsync = fsync
        self.direct_reads = direct_reads
        self._lock = DirLock(self.root)
        self._active: set[str] = set()  # this writer's temporary names in flight
        # references (format 4): what each committed version references (read once per version), what the
        # versions being written will, and the directories of deleted versions kept for them (the sweep's to spare)
        self._refs: dict[int, frozenset[Ref]] = {}
        self._pins: dict[int, frozenset[Ref]] = {}
        self._retained: set[str] = set()
        self._listed = False  # ``_refs`` holds every committed version's references (listed since open)
        self._latest: int | None = None  # the step this tier last wrote into LATEST (None: not known yet)
        self._refs_lock = asyncio.Lock()  # a delete decides what to keep, and a hold checks and pins, one at a time

    def __repr__(self) -> str:
        """Return a short description."""
        return f"{type(self).__name__}({self.root!r})"

    def _vdir(self, step: int) -> str:
        return os.path.join(self.root, version_dirname(step))

    async def open(self) -> None:
        """Create the root directory if needed."""
        await aiofiles.os.makedirs(self.root, exist_ok=True)

    async def close(self) -> None:
        """Nothing to release (the root lock is the store's to give up: :meth:`unlock_root`)."""

    async def lock_root(self) -> None:
        """Take the root's writer lock (see :mod:`asymstore.io.rootlock`)."""
        await asyncio.to_thread(self._lock.acquire)

    async def unlock_root(self) -> None:
        """Give the writer lock up."""
        self._lock.release()

    async def sweep_leftovers(self, *, oldest_kept: int | None = None) -> list[Swept]:
        """Remove dead writers' leftovers (only while holding the root; a no-op otherwise).

        A version directory without a manifest is removed only when older than
        ``oldest_kept`` (the oldest version retention keeps, given while a
        retention rule is in force), else moved to ``.quarantine/``; see
        :func:`asymstore.io.rootlock.sweep_directory`.
        """
        if not self._lock.held:
            return []
        # the live set, not a copy: a delete this writer starts meanwhile marks its directory before the
        # manifest goes, and the sweep looks again right before it acts on a directory without one
        # once every committed version's references are known (listed since open, kept up to date by each
        # publish, delete and quarantine), the sweep spares what they name without listing the root again: a
        # version that lost its manifest meanwhile still spares its referenced segments (more kept, never less)
        try:
            needed = self._needed_known() if self._listed else await self._needed()
        except (AsymstoreError, OSError) as exc:  # what committed versions reference is unknown: sweep nothing now
            logger.warning("%s: not sweeping: the references of its versions cannot be read: %s", self.name, exc)
            return []
        self._retained.update(version_dirname(o) for o in needed)
        return await asyncio.to_thread(sweep_directory, self.root, self._active, oldest_kept=oldest_kept,
                                       fsync=self.fsync, keep=self._retained)

    async def list_versions(self) -> list[int]:
        """Return the steps whose directory holds a manifest, ascending."""
        return await asyncio.to_thread(self._list_sync)

    def _list_sync(self) -> list[int]:
        steps = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for entry in entries:
            step = parse_version_dirname(entry.name)
            # a real directory holding a regular manifest: symlinks are never followed out of the root
            if step is not None and entry.is_dir(follow_symlinks=False) and _is_regular(
                    os.path.join(entry.path, MANIFEST_NAME)):
                steps.append(step)
        return sorted(steps)

    async def begin(self, step: int, nbytes: int) -> _DirWriter:
        """Create the temporary directory of version ``step``."""
        tmp = os.path.join(self.root, f"{TMP_PREFIX}{version_dirname(step)}-{uuid.uuid4().hex[:8]}")
        manifest = os.path.join(self._vdir(step), MANIFEST_NAME)

        def make() -> bool:  # one thread hop for the check and the directory
            if os.path.exists(manifest):
                return False
            os.makedirs(tmp)
            return True
        self._active.add(os.path.basename(tmp))
        try:
            made = await asyncio.to_thread(make)
        except BaseException:
            self._active.discard(os.path.basename(tmp))
            raise
        if not made:
            self._active.discard(os.path.basename(tmp))
            raise StepCommittedError(f"step {step} is already committed on {self.name}")
        return _DirWriter(self, step, tmp)

    async def read_manifest(self, step: int) -> bytes:
        """Return the manifest of ``step`` (a regular file of at most MAX_MANIFEST_BYTES, never followed)."""
        path = os.path.join(self._vdir(step), MANIFEST_NAME)
        try:
            return await read_small(path, MAX_MANIFEST_BYTES, directory=self._vdir(step))
        except FileNotFoundError as exc:
            raise VersionNotFoundError(f"step {step} not on {self.name}") from exc
        except OSError as exc:
            raise TierError(f"reading {path}: {exc}") from exc

    async def read_segment(self, step: int, name: str, size: int | None = None) -> Buffer:
        """Return the bytes of one segment: a regular file, of ``size`` bytes when given (checked before reading)."""
        path = os.path.join(self._vdir(step), validate_segment_name(name))

        def read() -> Buffer:
            check_regular(path, expected_size=size)
            return self._read_segment_file(path)
        return await self._segment_io(step, name, path, read)

    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        """Read ranges of one segment straight into caller buffers, hashing them as they land.

        See :func:`asymstore.io.files.read_ranges`; returns the ranges' digests.
        """
        path = os.path.join(self._vdir(step), validate_segment_name(name))

        return await self._segment_io(step, name, path, lambda: read_ranges(path, size, ranges, hashes=True,
                                                                                 direct=self.direct_reads))

    async def _segment_io(self, step: int, name: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (reading segment ``name`` at ``path``) in a thread, after checking the version directory.

        Raises:
            TierError: the segment is missing, or the read failed.
        """
        def run() -> T:
            check_directory(self._vdir(step))
            return fn()
        try:
            return await asyncio.to_thread(run)
        except FileNotFoundError as exc:
            raise TierError(f"segment {name} of step {step} missing on {self.name}") from exc
        except OSError as exc:
            raise TierError(f"reading {path}: {exc}") from exc

    async def stat_segment(self, step: int, name: str, size: int) -> None:
        """Check that segment ``name`` is a regular file of ``size`` bytes, without reading it."""
        path = os.path.join(self._vdir(step), validate_segment_name(name))

        def stat_it() -> None:
            check_directory(self._vdir(step))
            check_regular(path, expected_size=size)
        try:
            await asyncio.to_thread(stat_it)
        except FileNotFoundError as exc:
            raise TierError(f"segment {name} of step {step} missing on {self.name}") from exc

    def _write_segment_file(self, path: str, parts: Sequence[Buffer]) -> None:
        """Create one segment file durably (blocking; subclasses change the I/O engine)."""
        write_parts(path, parts, fsync=self.fsync)

    def _read_segment_file(self, path: str) -> Buffer:
        """Read one whole segment file (blocking; a large one bypasses the page cache)."""
        return read_large(path)

    async def delete_version(self, step: int) -> None:
        """Delete a version: manifest (fsynced away) first, then segments, then the directory.

        Segments that other versions reference (format 4) stay, in the directory,
        until the last of those versions is deleted; the segments this version
        referenced are then removed where no version needs them any more.
        """
        async with self._refs_lock:
            refs = await self._references()
            mine = refs.get(step, frozenset())
            needed = self._needed_known(exclude=step)  # from the listing just made (one listing per delete)
            keep = needed.get(step, set())
            if keep:
                self._retained.add(version_dirname(step))
            await asyncio.to_thread(self._delete_sync, self._vdir(step), keep)
            self._refs.pop(step, None)
            for origin in sorted({o for o, _ in mine}):
                await asyncio.to_thread(self._collect_sync, origin, needed.get(origin, set()))

    def _delete_sync(self, vdir: str, keep: Set[str] = frozenset()) -> None:
        # Idempotent: another deleter may race this one (a retention of the multi-rank layer beside the
        # sweep after a publish, which removes a version directory once its manifest is gone); a version
        # that is gone is deleted, never an error.
        manifest = os.path.join(vdir, MANIFEST_NAME)
        name = os.path.basename(vdir)
        self._active.add(name)  # a sweep in another thread leaves it alone while it has no manifest
        try:
            try:
                os.unlink(manifest)
            except FileNotFoundError:
                pass
            else:
                if self.fsync:
                    with contextlib.suppress(FileNotFoundError):  # the sweep took the directory meanwhile
                        fsync_dir(vdir)
            if keep:
                self._remove_unneeded(vdir, keep)
            else:
                shutil.rmtree(vdir, ignore_errors=True)
        finally:
            self._active.discard(name)
        if self.fsync:
            fsync_dir(self.root)

    def _remove_unneeded(self, vdir: str, keep: Set[str]) -> None:
        """Remove every entry of the manifest-less ``vdir`` but the segments ``keep`` (referenced elsewhere)."""
        try:
            entries = list(os.scandir(vdir))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name in keep and entry.is_file(follow_symlinks=False):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        if self.fsync:
            fsync_dir(vdir)

    def _collect_sync(self, origin: int, keep: Set[str]) -> None:
        """Remove what is left of deleted version ``origin`` that no version references any more."""
        vdir = self._vdir(origin)
        if os.path.lexists(os.path.join(vdir, MANIFEST_NAME)) or not os.path.isdir(vdir):
            return  # still a version (or gone)
        name = os.path.basename(vdir)
        if keep:
            self._remove_unneeded(vdir, keep)
            return
        self._active.add(name)
        try:
            shutil.rmtree(vdir, ignore_errors=True)
        finally:
            self._active.discard(name)
            self._retained.discard(name)
        if self.fsync:
            fsync_dir(self.root)

    async def _references(self) -> dict[int, frozenset[Ref]]:
        """What each committed version references (its manifest read once; one that is unreadable: nothing)."""
        steps = set(await asyncio.to_thread(self._list_sync))
        for gone in set(self._refs) - steps:
            del self._refs[gone]
        for step in sorted(steps - set(self._refs)):
            try:
                data = await self.read_manifest(step)
                if _NO_REFERENCES.match(data):
                    self._refs[step] = frozenset()
                    continue
                manifest = await asyncio.to_thread(parse_manifest, data)
            except (AsymstoreError, OSError) as exc:  # a version that cannot be read is lost whatever it referenced
                logger.warning("%s: cannot read step %d's manifest for its references: %s", self.name, step, exc)
                continue
            self._refs[step] = frozenset((o, f) for o, names in manifest.references.items() for f in names)
        self._listed = True
        return self._refs

    async def _needed(self, exclude: int | None = None) -> dict[int, set[str]]:
        """Step -> its segments that a committed version (but ``exclude``) or one being written references."""
        await self._references()
        return self._needed_known(exclude)

    def _needed_known(self, exclude: int | None = None) -> dict[int, set[str]]:
        """:meth:`_needed` from the references known now (``_refs``, as the last listing and publishes left them)."""
        out: dict[int, set[str]] = {}
        for step, refs in [*self._refs.items(), *self._pins.items()]:
            if step == exclude:
                continue
            for origin, name in refs:
                out.setdefault(origin, set()).add(name)
        return out

    async def hold_references(self, step: int, refs: Mapping[int, Set[str]]) -> bool:
        """Keep the segments ``refs`` for version ``step`` if every one is here, committed (see ReferencingTier)."""
        async with self._refs_lock:
            return await self._hold(step, frozenset((o, n) for o, names in refs.items() for n in names))

    async def _hold(self, step: int, wanted: frozenset[Ref]) -> bool:
        committed = set(await asyncio.to_thread(self._list_sync))
        needed = await self._needed()

        def held() -> bool:
            for origin, name in wanted:
                if origin >= step or not _is_regular(os.path.join(self._vdir(origin), validate_segment_name(name))):
                    return False
                if origin not in committed and name not in needed.get(origin, set()):
                    return False  # a leftover of a deleted version that nothing keeps: about to go
            return True
        if not await asyncio.to_thread(held):
            return False
        self._pins[step] = wanted
        return True

    async def release_references(self, step: int) -> None:
        """Forget what was held for ``step`` (its write failed)."""
        self._pins.pop(step, None)

    async def quarantine(self, step: int) -> None:
        """Move a corrupt version into ``.quarantine/`` under the root.

        Segments other versions reference stay where they are (hard-linked into
        ``.quarantine/`` beside the manifest): those versions are judged on their own.
        """
        async with self._refs_lock:
            keep = (await self._needed(exclude=step)).get(step, set())
            if keep:
                self._retained.add(version_dirname(step))
            await asyncio.to_thread(self._quarantine_sync, step, keep)
            self._refs.pop(step, None)

    def _quarantine_sync(self, step: int, keep: Set[str] = frozenset()) -> None:
        qdir = os.path.join(self.root, QUARANTINE)
        os.makedirs(qdir, exist_ok=True)
        dest = os.path.join(qdir, f"{version_dirname(step)}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
        if keep:  # a copy by hard links, then the version goes as a delete would (manifest first)
            os.makedirs(dest)
            for entry in os.scandir(self._vdir(step)):
                if entry.is_file(follow_symlinks=False):
                    os.link(entry.path, os.path.join(dest, entry.name))
            if self.fsync:
                fsync_dir(dest)
            self._delete_sync(self._vdir(step), keep)
            logger.warning("moved corrupt step %d on %s to %s (segments other versions reference kept)", step,
                           self.name, dest)
            return
        os.rename(self._vdir(step), dest)
        if self.fsync:
            fsync_dir(qdir)
            fsync_dir(self.root)
        logger.warning("moved corrupt step %d on %s to %s", step, self.name, dest)

    def calibration_key(self) -> str:
        """Identify the filesystem under the root (and the fsync setting) for the calibration cache."""
        return filesystem_key("local", self.root, fsync=self.fsync)

    async def probe_writes(self, sizes: Sequence[int]) -> list[float]:
        """Time one segment write (this tier's I/O engine) per size in a scratch directory under the root."""
        scratch = f"{TMP_PREFIX}calibrate-{uuid.uuid4().hex[:8]}"
        self._active.add(scratch)
        try:
            return await asyncio.to_thread(probe_directory, self.root, sizes, fsync=self.fsync,
                                           write=self._write_segment_file, scratch=scratch)
        finally:
            self._active.discard(scratch)

    async def write_latest(self, step: int) -> None:
        """Atomically replace the LATEST hint (tmp file, rename), without an fsync of its own.

        LATEST is a hint (restore and fsck trust manifests), so it costs a version no fsync: the
        rename is atomic for every reader at once, and becomes durable with the next fsync of the
        root (the next version's publish, or a retention delete). After a power loss it may name an
        older step, or be missing or empty, as any stale hint: readers ignore what does not parse.
        """
        if step == self._latest:  # the publish of ``step`` wrote it already, in its own thread hop
            return
        data = f"{step}\n".encode()
        # tmp file then rename (removing the tmp file on failure), in one thread
        await asyncio.to_thread(atomic_write, os.path.join(self.root, LATEST), data, fsync=False)
        self._latest = step

    async def read_latest(self) -> int | None:
        """Return the LATEST hint, or None (missing, unreadable, not a regular file or too long)."""
        try:
            text = (await read_small(os.path.join(self.root, LATEST), _LATEST_MAX_BYTES)).decode()
            return int(text.strip())
        except (OSError, ValueError, UnicodeDecodeError, CorruptVersionError):
            return None


class _DirWriter:
    """Writes segments into a temporary directory and publishes it by rename."""

    def __init__(self, tier: LocalTier, step: int, tmp: str) -> None:
        self.tier = tier
        self.step = step
        self.tmp = tmp

    async def write_segment(self, name: str, parts: Sequence[Buffer]) -> None:
        await asyncio.to_thread(self.write_segment_blocking, name, parts)

    def write_segment_blocking(self, name: str, parts: Sequence[Buffer]) -> None:
        """Write one segment file (its own file: any number of threads at once; ThreadedWriter)."""
        path = os.path.join(self.tmp, validate_segment_name(name))
        try:
            self.tier._write_segment_file(path, parts)
        except OSError as exc:
            raise TierError(f"writing {path}: {exc}") from exc

    async def publish(self, manifest: bytes) -> None:
        # a step newer than the one LATEST names (as this tier last wrote it) is written there in the
        # publish's own thread hop, after the root's fsync: write_latest then has nothing left to do
        latest = self.tier._latest
        newer = latest is not None and self.step > latest
        try:
            wrote = await asyncio.to_thread(self._publish_sync, manifest, newer)
            if wrote:
                self.tier._latest = self.step
            self.tier._active.discard(os.path.basename(self.tmp))
            self.tier._refs[self.step] = self.tier._pins.pop(self.step, frozenset())
        except FileExistsError as exc:
            raise StepCommittedError(f"step {self.step} is already committed on {self.tier.name}") from exc
        except OSError as exc:
            raise TierError(f"publishing step {self.step} on {self.tier.name}: {exc}") from exc

    def _publish_sync(self, manifest: bytes, latest: bool = False) -> bool:
        """Publish the version; with ``latest``, then replace LATEST by its step. Return whether LATEST was."""
        write_parts(os.path.join(self.tmp, MANIFEST_NAME), [manifest], fsync=self.tier.fsync)
        if self.tier.fsync:
            fsync_dir(self.tmp)
        dest = self.tier._vdir(self.step)
        if os.path.exists(dest):
            if os.path.exists(os.path.join(dest, MANIFEST_NAME)):
                raise FileExistsError(dest)
            # a directory of this step without a manifest, not swept (it appeared after open): it may be a
            # committed version that lost its manifest, so it is moved aside, never deleted here
            moved = quarantine_entry(self.tier.root, dest, os.path.basename(dest), fsync=self.tier.fsync)
            logger.warning("%s had no manifest when step %d was published over it; moved to %s", dest, self.step,
                           moved)
        os.rename(self.tmp, dest)
        if self.tier.fsync:
            fsync_dir(self.tier.root)
        if not latest:
            return False
        try:  # the version is committed: a hint that cannot be written now is written by write_latest
            atomic_write(os.path.join(self.tier.root, LATEST), f"{self.step}\n".encode(), fsync=False)
        except OSError as exc:
            logger.warning("%s: step %d is committed, but LATEST was not replaced: %s", self.tier.name, self.step, exc)
            return False
        return True

    async def abort(self) -> None:
        self.tier._pins.pop(self.step, None)
        await asyncio.to_thread(shutil.rmtree, self.tmp, True)
        if not os.path.lexists(self.tmp):
            self.tier._active.discard(os.path.basename(self.tmp))  # else the next sweep retries it


def _is_regular(path: str) -> bool:
    """True when ``path`` is a regular file itself (not a symlink, FIFO or directory)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
