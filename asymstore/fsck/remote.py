"""fsck on a remote tier location (``file://``, ``s3://``, ``hdfs://``): the checks and repairs of a directory tier.

Versions are verified through :mod:`asymstore.read.verify`, exactly as restore
reads them. Statuses are those of :mod:`asymstore.fsck`; on an object store a
version prefix without a manifest is ``orphaned`` (an upload cut short), or
``in_progress`` while a live writer holds the root's lease. Repair takes the
writer lease itself, so it never races a live writer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyarrow.fs as pafs

from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import LATEST, QUARANTINE, parse_version_dirname, retention_leftover
from asymstore.fsck.report import FsckReport, Progress, VersionReport
from asymstore.io.rootlock import LOCK_NAME, is_leftover_name
from asymstore.read.verify import check_version
from asymstore.runtime.sync import run_sync
from asymstore.tiers.remote.tier import RemoteTier

logger = logging.getLogger(__name__)

LOST_MANIFEST = ("no manifest, yet older versions are committed: not a retention leftover but a version that lost "
                 "its manifest (repair moves it to .quarantine/)")


def check_remote(uri: str, *, deep: bool = False, progress: Callable[[int], Progress] | None = None) -> FsckReport:
    """Examine every entry under a remote tier's root.

    Raises:
        FileNotFoundError: the root does not exist.
    """
    return run_sync(_check(uri, deep, progress))


def _files(tier: RemoteTier, path: str) -> list[pafs.FileInfo]:
    return list(tier.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False)))


async def _check(uri: str, deep: bool, progress: Callable[[int], Progress] | None) -> FsckReport:
    import asyncio

    tier = RemoteTier(uri)
    root_info = await asyncio.to_thread(tier.fs.get_file_info, tier.root)
    if root_info.type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{uri} is not a tier root (no such directory or prefix)")
    listing = sorted(await asyncio.to_thread(_files, tier, tier.root), key=lambda i: i.base_name)
    holder = await asyncio.to_thread(tier._lease.holder)
    contents = {i.base_name: await asyncio.to_thread(_files, tier, i.path) for i in listing
                if i.type == pafs.FileType.Directory and parse_version_dirname(i.base_name) is not None}
    total = sum(f.size or 0 for fs in contents.values() for f in fs if f.base_name != MANIFEST_NAME)
    tick = progress(total) if deep and progress else None
    with_manifest = [s for n, fs in contents.items() if MANIFEST_NAME in {f.base_name for f in fs}
                     for s in [parse_version_dirname(n)] if s is not None]
    entries: list[VersionReport] = []
    for info in listing:
        name = info.base_name
        step = parse_version_dirname(name)
        if name in contents and step is not None:
            files = {f.base_name for f in contents[name]}
            if MANIFEST_NAME not in files:
                if holder:
                    entries.append(VersionReport(name, "in_progress", step))
                elif retention_leftover(step, with_manifest):
                    entries.append(VersionReport(name, "orphaned", step, problems=[
                        "no manifest: an upload cut short or an interrupted delete"]))
                else:
                    entries.append(VersionReport(name, "corrupt", step, problems=[LOST_MANIFEST]))
                continue
            report = VersionReport(name, "committed", step)
            manifest, problems = await check_version(tier, step, deep=deep, progress=tick)
            if problems:
                report.status = "corrupt"
                report.problems += problems
            if manifest is not None:
                report.nbytes = manifest.stored_bytes
                report.unreferenced = sorted(files - {s.name for s in manifest.segments} - {MANIFEST_NAME})
                report.problems += [f"unreferenced file {f}" for f in report.unreferenced]
            entries.append(report)
        elif is_leftover_name(name):
            if holder:
                entries.append(VersionReport(name, "in_progress", None))
            else:
                entries.append(VersionReport(name, "partial", None, problems=["left by a writer that is gone"]))
        elif name == QUARANTINE and info.type == pafs.FileType.Directory:
            entries += [VersionReport(f"{QUARANTINE}/{q.base_name}", "quarantined", None)
                        for q in sorted(await asyncio.to_thread(_files, tier, info.path), key=lambda q: q.base_name)]
        elif name not in (LATEST, LOCK_NAME):
            logger.debug("fsck: ignoring %s", name)
    committed = {e.step for e in entries if e.status == "committed" and e.step is not None}
    newest = max(committed) if committed else None
    latest = await tier.read_latest()
    problem = None
    if latest is None and newest is not None:
        problem = f"missing or unreadable; newest restorable version is {newest}"
    elif latest is not None and latest not in committed:
        problem = f"points to step {latest}, which is not a committed version"
    elif latest is not None and latest != newest:
        problem = f"says {latest}, newest restorable version is {newest}"
    return FsckReport(uri, deep, entries, latest, problem, newest, writer=holder)


def repair_remote(report: FsckReport) -> list[str]:
    """Fix what ``report`` found on a remote root, holding its writer lease; return the actions.

    Raises:
        RootLockedError: a live writer holds the root.
    """
    return run_sync(_repair(report))


async def _repair(report: FsckReport) -> list[str]:
    import asyncio

    tier = RemoteTier(report.root, lease_wait_s=0)
    await tier.lock_root()
    actions: list[str] = []
    try:
        for e in report.entries:
            if e.status == "corrupt" and e.step is not None and LOST_MANIFEST not in e.problems:
                await tier.quarantine(e.step)  # (a version that lost its manifest: the sweep below moves it)
                actions.append(f"moved corrupt {e.name} to {QUARANTINE}/")
            elif e.status == "committed" and e.unreferenced:
                for f in e.unreferenced:
                    src, dest = tier._p(e.name, f), tier._p(QUARANTINE, f"{e.name}-{f}")

                    def move(src: str = src, dest: str = dest) -> None:
                        tier.fs.create_dir(tier._p(QUARANTINE), recursive=True)
                        tier.fs.move(src, dest)
                    await asyncio.to_thread(move)
                    actions.append(f"moved unreferenced {e.name}/{f} to {QUARANTINE}/")
        # after quarantines (a marker store leaves the segments behind); what the report calls orphaned (older than
        # every committed version) is removed, any other version without a manifest moved aside, as it reports
        committed = [e.step for e in report.entries if e.status in ("committed", "corrupt") and e.step is not None
                     and LOST_MANIFEST not in e.problems]  # those with a manifest, as the report judged them
        for swept in await tier.sweep_leftovers(oldest_kept=min(committed) if committed else None):
            actions.append(f"removed leftover {swept.name}" if swept.action == "removed"
                           else f"moved {swept.name} to {QUARANTINE}/ ({swept.reason})")
        if report.latest_problem and report.newest_restorable is not None:
            await tier.write_latest(report.newest_restorable)
            actions.append(f"set LATEST to {report.newest_restorable}")
        elif report.latest_problem:
            await asyncio.to_thread(tier.fs.delete_file, tier._p(LATEST))
            actions.append("removed LATEST (no restorable version)")
    finally:
        await tier.unlock_root()
    for line in actions:
        logger.info("fsck repair: %s", line)
    return actions
