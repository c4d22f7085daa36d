"""Check and repair a directory-backed tier (``LocalTier`` or ``HostTier(path=...)``).

Each entry of the root gets a status:

- ``committed``: a version directory with a valid manifest whose segments are
  all present with the right sizes (and, with ``deep``, the right checksums).
- ``corrupt``: a version directory whose manifest is unreadable, or whose
  segments are missing, truncated or fail a checksum.
- ``partial``: a ``.tmp-*`` directory left by a commit that never published.
- ``orphaned``: a version directory without a manifest (a delete that was
  interrupted after removing the manifest), or a stray temporary file.
- ``quarantined``: a corrupt version moved aside earlier; informational.

``repair`` removes partial and orphaned data, moves corrupt versions and
files that no manifest references into ``.quarantine/`` (nothing that might
hold data is deleted), and rewrites ``LATEST`` to the newest version that
verifies. A committed version that verifies is never touched. Do not repair
while a process is writing to the same root: its in-progress commit would be
removed as partial.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import (
    LATEST,
    QUARANTINE,
    TMP_PREFIX,
    fsync_dir,
    parse_version_dirname,
    quarantine_entry,
    retention_leftover,
    version_dirname,
)
from asymstore.io.files import atomic_write, read_whole
from asymstore.io.rootlock import DirLock, is_leftover_name
from asymstore.read.verify import check_version
from asymstore.tiers.local import LocalTier
from asymstore.tiers.protocol import Tier

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
T = TypeVar("T")
Progress = Callable[[int], None]


@dataclass
class VersionReport:
    """The verdict on one entry of the root."""

    name: str
    status: str
    step: int | None
    nbytes: int = 0
    problems: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True for a committed version without problems, a quarantined entry, or a live writer's work."""
        return self.status in ("committed", "quarantined", "in_progress") and not self.problems


@dataclass
class FsckReport:
    """The verdict on a whole root; ``to_json()`` gives the documented schema."""

    root: str
    deep: bool
    entries: list[VersionReport]
    latest: int | None
    latest_problem: str | None
    newest_restorable: int | None
    repaired: list[str] = field(default_factory=list)
    writer: str | None = None
    """The live writer holding the root while it was checked (None: nobody)."""

    @property
    def ok(self) -> bool:
        """True when every entry verifies and LATEST is right."""
        return self.latest_problem is None and all(e.ok for e in self.entries)

    @property
    def problems(self) -> list[str]:
        """Every problem, one line each."""
        lines = [f"{e.name}: {e.status}: {p}" for e in self.entries for p in e.problems]
        if self.latest_problem:
            lines.append(f"{LATEST}: {self.latest_problem}")
        return lines

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict (see README, 'fsck --json')."""
        return {
            "schema": SCHEMA_VERSION,
            "root": self.root,
            "deep": self.deep,
            "ok": self.ok,
            "latest": self.latest,
            "latest_problem": self.latest_problem,
            "newest_restorable": self.newest_restorable,
            "versions": [asdict(e) | {"ok": e.ok} for e in self.entries],
            "problems": self.problems,
            "repaired": self.repaired,
            "writer": self.writer,
        }


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, also when an event loop already runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _check_version(tier: Tier, path: str, name: str, step: int, deep: bool,
                         progress: Progress | None, committed: list[int]) -> VersionReport:
    """One version directory, through the verification path restore uses (:mod:`asymstore.read.verify`)."""
    report = VersionReport(name, "committed", step)
    if os.path.isdir(path) and not os.path.islink(path) and not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
        if retention_leftover(step, committed):
            report.status = "orphaned"
            report.problems.append("no manifest: a retention delete that was interrupted")
        else:
            report.status = "corrupt"
            report.problems.append("no manifest, yet older versions are committed: not a retention leftover but a "
                                   "version that lost its manifest (repair moves it to .quarantine/)")
        return report
    manifest, problems = await check_version(tier, step, deep=deep, progress=progress)
    if problems:
        report.status = "corrupt"
        report.problems += problems
    if manifest is None:
        return report
    report.nbytes = manifest.stored_bytes
    if os.path.isdir(path) and not os.path.islink(path):
        listed = {s.name for s in manifest.segments}
        report.unreferenced = sorted(set(os.listdir(path)) - listed - {MANIFEST_NAME})
        for f in report.unreferenced:
            report.problems.append(f"unreferenced file {f}")
    return report


def _deep_total(root: str, names: list[str]) -> int:
    total = 0
    for name in names:
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False) and entry.name != MANIFEST_NAME:
                total += entry.stat(follow_symlinks=False).st_size
    return total


def is_uri(location: str) -> bool:
    """True for a tier URI (``file://``, ``s3://``, ``hdfs://`` ...), False for a plain directory path."""
    return "://" in location


def check(root: str, *, deep: bool = False, progress: Callable[[int], Progress] | None = None,
          node_local: Sequence[str] = ()) -> FsckReport:
    """Examine every entry of ``root`` and return the report.

    Args:
        root: the tier's directory.
        deep: verify every segment and chunk checksum (reads all data); compressed
            chunks are decoded and their raw checksum verified too.
        progress: called with the total byte count to verify; returns a
            callback that receives the bytes verified as they are.
        node_local: a multi-rank root only: examine just the shard locations under these
            paths (a per-node check, see :mod:`asymstore.fsck.multirank`).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        ValueError: ``node_local`` given for a root that is not multi-rank.
    """
    if is_uri(root):
        from asymstore.fsck.remote import check_remote

        return check_remote(root, deep=deep, progress=progress)
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root} is not a directory")
    if os.path.isdir(os.path.join(root, "global")):  # a multi-rank root: rank-NNNNN/ shards + global/ manifests
        from asymstore.fsck.multirank import check_multirank

        return check_multirank(root, deep=deep, progress=progress, node_local=node_local)
    if node_local:
        raise ValueError(f"{root} is not a multi-rank root: --node-local applies to multi-rank roots only")
    return run_sync(_check_dir(root, deep, progress))


async def _check_dir(root: str, deep: bool, progress: Callable[[int], Progress] | None) -> FsckReport:
    names = sorted(os.listdir(root))
    versions = [n for n in names if parse_version_dirname(n) is not None and os.path.lexists(os.path.join(root, n))]
    tick = progress(_deep_total(root, versions)) if deep and progress else None
    holder = DirLock(root).holder()  # a live writer: its temporary entries are work in progress
    tier = LocalTier(root, fsync=False)
    with_manifest = sorted(s for s in (parse_version_dirname(n) for n in versions)
                           if s is not None and os.path.lexists(os.path.join(root, version_dirname(s), MANIFEST_NAME)))
    entries: list[VersionReport] = []
    for name in names:
        path = os.path.join(root, name)
        step = parse_version_dirname(name)
        if name in versions and step is not None:
            entries.append(await _check_version(tier, path, name, step, deep, tick, with_manifest))
        elif is_leftover_name(name) and holder is not None:
            entries.append(VersionReport(name, "in_progress", None, problems=[]))
        elif name.startswith(TMP_PREFIX):
            vstep = parse_version_dirname(name[len(TMP_PREFIX):].split("-")[0])
            entries.append(VersionReport(name, "partial", vstep, problems=["a commit that never published"]))
        elif name.startswith(f".{LATEST}.") and name.endswith(".tmp"):
            entries.append(VersionReport(name, "orphaned", None, problems=["leftover of a LATEST update"]))
        elif name == QUARANTINE and os.path.isdir(path):
            for q in sorted(os.listdir(path)):
                entries.append(VersionReport(f"{QUARANTINE}/{q}", "quarantined", parse_version_dirname(q[:13])))
    good = [e.step for e in entries if e.status == "committed" and e.step is not None]
    newest = max(good) if good else None
    latest, latest_problem = _check_latest(root, newest, {e.step for e in entries if e.status == "committed"})
    return FsckReport(root, deep, entries, latest, latest_problem, newest, writer=holder)


def _check_latest(root: str, newest: int | None, committed: set[int | None]) -> tuple[int | None, str | None]:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None, (f"missing; newest restorable version is {newest}" if newest is not None else None)
    try:
        latest = int(read_whole(path).decode().strip())
    except (ValueError, UnicodeDecodeError):
        return None, "unreadable (not a step number)"
    if latest not in committed:
        return latest, f"points to step {latest}, which is not a committed version"
    if latest != newest:
        return latest, f"says {latest}, newest restorable version is {newest}"
    return latest, None


def _quarantine(root: str, path: str, label: str) -> str:
    return quarantine_entry(root, path, label, fsync=False)


def repair(report: FsckReport) -> list[str]:
    """Fix what ``report`` found; return one line per action taken.

    Never touches a committed version without problems. Corrupt versions and
    unreferenced files are moved to ``.quarantine/``; partial and orphaned
    data is removed; LATEST is rewritten to the newest restorable version.
    Takes the root's writer lock (the writer lease on a remote root) first.

    Raises:
        RootLockedError: a live writer holds the root.
    """
    from asymstore.fsck.multirank import MultiRankFsckReport, repair_multirank

    if is_uri(report.root):
        from asymstore.fsck.remote import repair_remote

        return repair_remote(report)
    lock = DirLock(report.root)
    lock.acquire()  # never repair under a live writer: its commit in progress would look partial
    try:
        if isinstance(report, MultiRankFsckReport):
            return repair_multirank(report)
        return _repair_dir(report)
    finally:
        lock.release()


def _repair_dir(report: FsckReport) -> list[str]:
    root = report.root
    actions: list[str] = []
    for e in report.entries:
        path = os.path.join(root, e.name)
        if e.status in ("partial", "orphaned"):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
            actions.append(f"removed {e.status} {e.name}")
        elif e.status == "corrupt":
            actions.append(f"moved corrupt {e.name} to {_quarantine(root, path, e.name)}")
        elif e.status == "committed" and e.unreferenced:
            for f in e.unreferenced:
                dest = _quarantine(root, os.path.join(path, f), f"{e.name}-{f}")
                actions.append(f"moved unreferenced {e.name}/{f} to {dest}")
    if report.latest_problem:
        latest = os.path.join(root, LATEST)
        if report.newest_restorable is None:
            if os.path.exists(latest):
                os.unlink(latest)
            actions.append("removed LATEST (no restorable version)")
        else:
            atomic_write(latest, f"{report.newest_restorable}\n".encode())
            actions.append(f"set LATEST to {report.newest_restorable}")
    if actions:
        fsync_dir(root)
    for line in actions:
        logger.info("fsck repair: %s", line)
    return actions
