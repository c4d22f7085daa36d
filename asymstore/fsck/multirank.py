"""fsck of the multi-rank layout (:mod:`asymstore.multirank.layout`).

Every rank directory is checked like a single tier (its entries are named
``rank-NNNNN/…``). Then each global manifest ``global/v….json`` is checked
against the rank directories:

- ``committed``: it parses, and every rank's shard it lists is committed in that
  rank's directory with the same content digest.
- ``corrupt``: it does not parse, or a shard it lists is missing, corrupt or
  has another digest. The version cannot be restored.
- ``partial``: a step whose rank shards exist (committed in their rank
  directories) but that no global manifest references: a multi-rank commit
  that did not complete on every rank (a rank died or timed out). Listed as
  ``global/v….json`` with the ranks that have and lack their shard. Also a
  ``global/.tmp-*`` file: a global manifest that was being written.
- ``orphaned``: the same for a step older than the newest global version
  (shards retention had not removed yet when a rank stopped, or a commit that
  failed before newer ones succeeded): never restorable, safe to remove.

``newest restorable`` is the newest committed global step, ``LATEST`` is
``global/LATEST``. ``repair`` removes partial and orphaned shards and temporary files,
moves corrupt global manifests to ``global/.quarantine/``, repairs every
rank directory as a single tier, and rewrites ``global/LATEST``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from asymstore.errors import ManifestError
from asymstore.fileio import atomic_write, read_whole
from asymstore.fsck import FsckReport, Progress, VersionReport, _check_latest, _quarantine
from asymstore.fsck import check as check_tier
from asymstore.fsck import repair as repair_tier
from asymstore.layout import LATEST, QUARANTINE, TMP_PREFIX, fsync_dir, version_dirname
from asymstore.manifest import MANIFEST_NAME, Manifest
from asymstore.multirank import layout
from asymstore.multirank.errors import GlobalManifestError
from asymstore.multirank.globalmanifest import GlobalManifest, shard_digest
from asymstore.rootlock import DirLock

logger = logging.getLogger(__name__)


@dataclass
class MultiRankFsckReport(FsckReport):
    """An :class:`asymstore.fsck.FsckReport` of a multi-rank root.

    Attributes:
        ranks: rank -> the report of its directory.
        partial_steps: step -> ranks holding a committed shard of it that no global manifest uses,
            newer than the newest global version (an incomplete multi-rank commit).
        stale_steps: the same for steps older than the newest global version (``orphaned``).
    """

    ranks: dict[int, FsckReport] = field(default_factory=dict)
    partial_steps: dict[int, list[int]] = field(default_factory=dict)
    stale_steps: dict[int, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return the single-tier schema plus ``layout``, ``ranks``, ``partial_steps`` and ``stale_steps``."""
        return super().to_json() | {"layout": "multirank", "ranks": sorted(self.ranks),
                                    "partial_steps": {str(k): v for k, v in sorted(self.partial_steps.items())},
                                    "stale_steps": {str(k): v for k, v in sorted(self.stale_steps.items())}}


def _shard_ok(rank_report: FsckReport | None, rank_dir: str | None, step: int, digest: str) -> str | None:
    """Return None when rank shard ``step`` is committed with ``digest``, else the problem."""
    if rank_report is None or rank_dir is None:
        return "its rank directory is missing"
    entry = next((e for e in rank_report.entries if e.step == step and e.name == version_dirname(step)), None)
    if entry is None:
        return f"shard {step} is missing"
    if not entry.ok:
        return f"shard {step} is {entry.status}: {'; '.join(entry.problems)}"
    try:
        manifest = Manifest.from_json(read_whole(os.path.join(rank_dir, version_dirname(step), MANIFEST_NAME)))
    except (ManifestError, OSError) as exc:
        return f"shard {step}: {exc}"
    if shard_digest(manifest) != digest:
        return f"shard {step} has another digest than the global manifest lists"
    return None


def _check_global(gdir: str, name: str, step: int, ranks: dict[int, FsckReport],
                  dirs: dict[int, str]) -> tuple[VersionReport, GlobalManifest | None]:
    report = VersionReport(f"{layout.GLOBAL_DIR}/{name}", "committed", step)
    try:
        g = layout.read_global(gdir, step)
    except (GlobalManifestError, OSError) as exc:
        report.status = "corrupt"
        report.problems.append(f"bad global manifest: {exc}")
        return report, None
    report.nbytes = g.nbytes
    for shard in g.shards:
        problem = _shard_ok(ranks.get(shard.rank), dirs.get(shard.rank), shard.step, shard.digest)
        if problem:
            report.status = "corrupt"
            report.problems.append(f"rank {shard.rank}: {problem}")
    return report, g


def check_multirank(root: str, *, deep: bool = False,
                    progress: Callable[[int], Progress] | None = None) -> MultiRankFsckReport:
    """Examine a multi-rank root (every rank directory and the global manifests)."""
    root = os.path.abspath(root)
    gdir = os.path.join(root, layout.GLOBAL_DIR)
    dirs = layout.rank_dirs(root)
    ranks = {r: check_tier(d, deep=deep, progress=progress) for r, d in dirs.items()}
    entries: list[VersionReport] = []
    for r, rep in ranks.items():
        entries += [replace(e, name=f"{layout.rank_dirname(r)}/{e.name}") for e in rep.entries]
    used: set[tuple[int, int]] = set()
    good: set[int] = set()
    for name in sorted(os.listdir(gdir)):
        path = os.path.join(gdir, name)
        step = layout.parse_global_filename(name)
        if step is not None:
            report, g = _check_global(gdir, name, step, ranks, dirs)
            entries.append(report)
            if g is not None:
                used |= {(s.rank, s.step) for s in g.shards}
            else:  # its shards are accounted for by the corrupt entry
                used |= {(r, step) for r in ranks}
            if report.status == "committed":
                good.add(step)
        elif name.startswith(TMP_PREFIX):
            vstep = layout.parse_global_filename(name[len(TMP_PREFIX):].rsplit("-", 1)[0])
            entries.append(VersionReport(f"{layout.GLOBAL_DIR}/{name}", "partial", vstep,
                                         problems=["a global manifest that was never published"]))
        elif name.startswith(f".{LATEST}.") and name.endswith(".tmp"):
            entries.append(VersionReport(f"{layout.GLOBAL_DIR}/{name}", "orphaned", None,
                                         problems=["leftover of a LATEST update"]))
        elif name == QUARANTINE and os.path.isdir(path):
            entries += [VersionReport(f"{layout.GLOBAL_DIR}/{QUARANTINE}/{q}", "quarantined",
                                      layout.parse_global_filename(q.split("-")[0]))
                        for q in sorted(os.listdir(path))]
    unused: dict[int, list[int]] = {}
    for r, rep in ranks.items():
        for e in rep.entries:
            if e.status == "committed" and e.step is not None and (r, e.step) not in used:
                unused.setdefault(e.step, []).append(r)
    newest = max(good) if good else None
    partial = {s: have for s, have in unused.items() if newest is None or s > newest}
    stale = {s: have for s, have in unused.items() if s not in partial}
    world = max(len(dirs), 1)
    for step, have in sorted(partial.items()):
        lacking = [r for r in range(world) if r not in have]
        entries.append(VersionReport(
            f"{layout.GLOBAL_DIR}/{layout.global_filename(step)}", "partial", step,
            problems=[f"rank shard(s) of rank(s) {have} committed but no global manifest: a multi-rank commit "
                      f"that did not complete" + (f" (rank(s) {lacking} have no shard)" if lacking else "")]))
    for step, have in sorted(stale.items()):
        entries.append(VersionReport(
            f"{layout.GLOBAL_DIR}/{layout.global_filename(step)}", "orphaned", step,
            problems=[f"rank shard(s) of rank(s) {have} that no global version uses, older than the newest "
                      f"one: left by retention on a rank that stopped early, or by an incomplete commit"]))
    latest, latest_problem = _check_latest(gdir, newest, set(good))
    rank_latest = [f"{layout.rank_dirname(r)}/{LATEST}: {rep.latest_problem}"
                   for r, rep in ranks.items() if rep.latest_problem]
    if latest_problem:
        latest_problem = f"{layout.GLOBAL_DIR}/{LATEST}: {latest_problem}"
    if rank_latest:
        latest_problem = "; ".join([*([latest_problem] if latest_problem else []), *rank_latest])
    return MultiRankFsckReport(root, deep, entries, latest, latest_problem, newest, ranks=ranks,
                               partial_steps=partial, stale_steps=stale)


def _delete_shard(vdir: str) -> None:
    manifest = os.path.join(vdir, MANIFEST_NAME)
    if os.path.exists(manifest):
        os.unlink(manifest)
        fsync_dir(vdir)
    shutil.rmtree(vdir, ignore_errors=True)


def repair_multirank(report: MultiRankFsckReport) -> list[str]:
    """Fix what ``report`` found; return one line per action (see the module docstring)."""
    gdir = os.path.join(report.root, layout.GLOBAL_DIR)
    lock = DirLock(gdir)
    lock.acquire()  # the coordinator's lock: never repair under a live job
    try:
        return _repair(report, gdir)
    finally:
        lock.release()


def _repair(report: MultiRankFsckReport, gdir: str) -> list[str]:
    root = report.root
    dirs = layout.rank_dirs(root)
    actions: list[str] = []
    for kind, steps in (("partial", report.partial_steps), ("orphaned", report.stale_steps)):
        for step, have in sorted(steps.items()):
            for r in have:
                _delete_shard(os.path.join(dirs[r], version_dirname(step)))
                actions.append(f"removed {kind} shard {layout.rank_dirname(r)}/{version_dirname(step)}")
    for r, d in dirs.items():
        rep = check_tier(d, deep=report.deep)
        actions += [f"{layout.rank_dirname(r)}: {a}" for a in repair_tier(rep)]
    for e in report.entries:
        if not e.name.startswith(f"{layout.GLOBAL_DIR}/"):
            continue
        path = os.path.join(root, e.name)
        if e.status == "corrupt" and os.path.exists(path):
            dest = _quarantine(gdir, path, os.path.basename(e.name))
            actions.append(f"moved corrupt {e.name} to {dest}")
        elif e.status in ("partial", "orphaned") and os.path.isfile(path):
            os.unlink(path)
            actions.append(f"removed {e.status} {e.name}")
    latest = os.path.join(gdir, LATEST)
    if report.newest_restorable is None:
        if os.path.exists(latest):
            os.unlink(latest)
            actions.append(f"removed {layout.GLOBAL_DIR}/{LATEST} (no restorable version)")
    elif report.latest != report.newest_restorable:
        atomic_write(latest, f"{report.newest_restorable}\n".encode())
        actions.append(f"set {layout.GLOBAL_DIR}/{LATEST} to {report.newest_restorable}")
    fsync_dir(gdir)
    for line in actions:
        logger.info("fsck repair: %s", line)
    return actions


__all__ = ["MultiRankFsckReport", "Progress", "check_multirank", "repair_multirank"]
