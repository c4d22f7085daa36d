"""fsck of a directory tier (``LocalTier`` or ``host_tier(path=...)``): check every entry, repair what is safe."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from asymstore.errors import AsymstoreError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import (
    LATEST,
    QUARANTINE,
    TMP_PREFIX,
    parse_version_dirname,
    retention_leftover,
    version_dirname,
)
from asymstore.format.parse import parse_manifest
from asymstore.fsck.report import FsckReport, Progress, VersionReport
from asymstore.io.files import atomic_write, fsync_dir, quarantine_entry, read_whole
from asymstore.io.rootlock import DirLock, is_leftover_name
from asymstore.policy.retention import KeepBest, Retention, recorded_rules
from asymstore.read.verify import check_version
from asymstore.runtime.sync import run_sync
from asymstore.tiers.location import from_location
from asymstore.tiers.protocol import Tier

logger = logging.getLogger(__name__)


def check_directory(root: str, *, deep: bool = False, progress: Callable[[int], Progress] | None = None) -> FsckReport:
    """Examine every entry of the directory tier at ``root`` (see :func:`asymstore.fsck.check`).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root} is not a directory")
    return run_sync(_check_dir(root, deep, progress))


def repair_directory(report: FsckReport) -> list[str]:
    """Fix what ``report`` found on a directory tier, under its writer lock (see :func:`asymstore.fsck.repair`).

    Raises:
        RootLockedError: a live writer holds the root.
    """
    lock = DirLock(report.root)
    lock.acquire()  # never repair under a live writer: its commit in progress would look partial
    try:
        return _repair_dir(report)
    finally:
        lock.release()


async def check_version_dir(tier: Tier, path: str, name: str, step: int, deep: bool, progress: Progress | None,
                            committed: list[int], metas: dict[int, dict[str, Any]],
                            referenced: Mapping[int, Mapping[str, list[int]]] | None = None) -> VersionReport:
    """One version directory, through the verification path restore uses (:mod:`asymstore.read.verify`).

    ``referenced``: step -> its segment files -> the committed versions that reference them (format 4):
    a directory without a manifest that committed versions reference is ``retained`` (its segments are
    verified through those versions); the segments of a committed one they reference are not unreferenced.
    """
    report = VersionReport(name, "committed", step)
    users = (referenced or {}).get(step, {})
    if os.path.isdir(path) and not os.path.islink(path) and not os.path.lexists(os.path.join(path, MANIFEST_NAME)):
        if users:
            report.status = "retained"
            versions = sorted({v for vs in users.values() for v in vs})
            report.referenced_by = versions
            missing = sorted(set(users) - set(os.listdir(path)))
            report.unreferenced = sorted(set(os.listdir(path)) - set(users))
            report.problems += [f"segment {f} missing, referenced by step(s) {users[f]}" for f in missing]
            report.problems += [f"unreferenced file {f}" for f in report.unreferenced]
            return report
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
    metas[step] = manifest.meta
    if users:
        report.referenced_by = sorted({v for vs in users.values() for v in vs})
    if os.path.isdir(path) and not os.path.islink(path):
        listed = {s.name for s in manifest.segments if s.origin is None} | set(users)
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


async def _check_dir(root: str, deep: bool, progress: Callable[[int], Progress] | None) -> FsckReport:
    names = sorted(os.listdir(root))
    versions = [n for n in names if parse_version_dirname(n) is not None and os.path.lexists(os.path.join(root, n))]
    tick = progress(_deep_total(root, versions)) if deep and progress else None
    holder = DirLock(root).holder()  # a live writer: its temporary entries are work in progress
    tier = from_location(root, read_only=True)
    with_manifest = sorted(s for s in (parse_version_dirname(n) for n in versions)
                           if s is not None and os.path.lexists(os.path.join(root, version_dirname(s), MANIFEST_NAME)))
    entries: list[VersionReport] = []
    metas: dict[int, dict[str, Any]] = {}  # each committed version's meta: its retention record
    referenced = await references_of(tier, with_manifest)
    for name in names:
        path = os.path.join(root, name)
        step = parse_version_dirname(name)
        if name in versions and step is not None:
            entries.append(await check_version_dir(tier, path, name, step, deep, tick, with_manifest, metas,
                                                   referenced))
        elif is_leftover_name(name) and holder is not None:
            entries.append(VersionReport(name, "in_progress", None, problems=[]))
        elif name.startswith(TMP_PREFIX):
            vstep = parse_version_dirname(name[len(TMP_PREFIX):].split("-")[0])
            entries.append(VersionReport(name, "partial", vstep, problems=["a commit that never published"]))
        elif is_leftover_name(name):  # a LATEST or layout record update cut short (atomic_write's temporary file)
            what = LATEST if name.startswith(f".{LATEST}.") else "layout record"
            entries.append(VersionReport(name, "orphaned", None, problems=[f"leftover of a {what} update"]))
        elif name == QUARANTINE and os.path.isdir(path):
            for q in sorted(os.listdir(path)):
                entries.append(VersionReport(f"{QUARANTINE}/{q}", "quarantined", parse_version_dirname(q[:13])))
    good = [e.step for e in entries if e.status == "committed" and e.step is not None]
    newest = max(good) if good else None
    latest, latest_problem = check_latest(root, newest, {e.step for e in entries if e.status == "committed"})
    mark_retention(entries, metas)
    return FsckReport(root, deep, entries, latest, latest_problem, newest, writer=holder)


async def references_of(tier: Tier, committed: list[int]) -> dict[int, dict[str, list[int]]]:
    """Step -> its segment files -> the committed versions that reference them (format 4; unreadable ones: none)."""
    out: dict[int, dict[str, list[int]]] = {}
    for step in committed:
        try:
            manifest = parse_manifest(await tier.read_manifest(step))
        except (AsymstoreError, OSError):
            continue  # check_version_dir reports it
        for origin, files in manifest.references.items():
            for f in files:
                out.setdefault(origin, {}).setdefault(f, []).append(step)
    return out


def check_latest(root: str, newest: int | None, committed: set[int | None]) -> tuple[int | None, str | None]:
    """Check the ``LATEST`` hint of ``root`` against the committed versions: ``(its step, the problem or None)``."""
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


def quarantine(root: str, path: str, label: str) -> str:
    """Move ``path`` aside into ``root``'s ``.quarantine/`` under ``label``; return where it went."""
    return quarantine_entry(root, path, label, fsync=False)


def quarantine_linked(root: str, path: str, label: str, step: int, users: list[int]) -> str:
    """Put a hard-linked copy of version ``step``'s directory aside; keep only the segments ``users`` reference.

    Its manifest goes first (it is no version any more), then every file no
    version of ``users`` references. Returns where the copy went.
    """
    needed: set[str] = set()
    for user in users:
        data = read_whole(os.path.join(root, version_dirname(user), MANIFEST_NAME))
        needed |= parse_manifest(data).references.get(step, frozenset())
    qdir = os.path.join(root, QUARANTINE)
    os.makedirs(qdir, exist_ok=True)
    dest = os.path.join(qdir, f"{label}-linked-{os.getpid()}-{len(os.listdir(qdir))}")
    os.makedirs(dest)
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            os.link(entry.path, os.path.join(dest, entry.name))
    fsync_dir(dest)
    manifest = os.path.join(path, MANIFEST_NAME)
    if os.path.lexists(manifest):
        os.unlink(manifest)
    fsync_dir(path)
    for entry in os.scandir(path):
        if entry.name not in needed and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
    fsync_dir(path)
    return dest


def _repair_dir(report: FsckReport) -> list[str]:
    root = report.root
    actions: list[str] = []
    sound = {e.step for e in report.entries if e.status in ("committed", "superseded") and not e.problems}
    for e in report.entries:
        path = os.path.join(root, e.name)
        users = [s for s in e.referenced_by if s in sound]  # versions that stay and read segments of this one
        if e.status in ("partial", "orphaned"):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
            actions.append(f"removed {e.status} {e.name}")
        elif e.status == "corrupt" and users and os.path.isdir(path):
            # versions that verify read segments of it (format 4): a copy by hard links goes aside, the manifest goes
            assert e.step is not None
            dest = quarantine_linked(root, path, e.name, e.step, users)
            actions.append(f"moved corrupt {e.name} to {dest} (its segments that steps {users} reference stay)")
        elif e.status == "corrupt":
            actions.append(f"moved corrupt {e.name} to {quarantine(root, path, e.name)}")
        elif e.status == "retained" and not users and os.path.isdir(path):  # its users are all being moved aside
            actions.append(f"moved {e.name}, kept for corrupt versions only, to {quarantine(root, path, e.name)}")
        elif e.status in ("committed", "retained") and e.unreferenced:
            for f in e.unreferenced:
                dest = quarantine(root, os.path.join(path, f), f"{e.name}-{f}")
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


def mark_retention(entries: list[VersionReport], metas: dict[int, dict[str, Any]], *, persistent: bool = True) -> None:
    """Say which recorded retention rule keeps each committed version (``VersionReport.kept_by``).

    The rules are those the newest version recorded (a version records the
    rules in force when it was committed, :mod:`asymstore.policy.retention`);
    versions of a store that records none get no reason.
    """
    rules = next((r for s in sorted(metas, reverse=True) if (r := recorded_rules(metas[s])) is not None), None)
    if rules is None:
        return
    try:
        best = rules.get("keep_best")
        policy = Retention(rules.get("keep_last"), rules.get("keep_every"),
                           KeepBest(best["metric"], best["mode"], best["k"]) if isinstance(best, dict) else None)
    except (KeyError, TypeError, ValueError):  # a damaged record says nothing
        return
    kept = policy.kept({s: policy.note_of(m) for s, m in metas.items()}, persistent=persistent)
    for e in entries:
        if e.status == "committed" and e.step is not None:
            e.kept_by = kept.get(e.step, [])
