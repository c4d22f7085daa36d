"""fsck of a multi-rank root: global manifests checked against the shards where they live.

A global manifest names the placement record it was committed under
(:mod:`asymstore.format.placement`): every rank's tier locations and host (a version 1 manifest has
its shards in ``ROOT/rank-NNNNN/``, which are always checked). Each location is checked once like a
single tier, then each global version is ``committed`` (every shard verifies somewhere), ``corrupt``
(some shard is bad in every location, all of them seen), or ``unreachable`` (no copy verified and
some location could not be seen from here: never repaired); shards no global manifest lists are
``partial`` or ``orphaned``. ``node_local`` judges only the locations this node holds. ``repair``
removes partial and orphaned shards and temporary files, quarantines corrupt global manifests and
rewrites ``global/LATEST`` (never ``global/`` with ``node_local``).

Guide: ``docs/guides/fsck.md`` (Split layouts).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from asymstore.errors import AsymstoreError, GlobalManifestError, ManifestError
from asymstore.format import placement
from asymstore.format.globalmanifest import GlobalManifest, shard_digest
from asymstore.format.manifest import MANIFEST_NAME, Manifest
from asymstore.format.names import (
    LATEST,
    QUARANTINE,
    TMP_PREFIX,
    is_uri,
    parse_version_dirname,
    rank_dirname,
    version_dirname,
)
from asymstore.format.parse import parse_manifest
from asymstore.format.placement import Placement
from asymstore.fsck.directory import check_latest, quarantine
from asymstore.fsck.report import FsckReport, Progress, VersionReport
from asymstore.fsck.tier import check_tier, repair_tier
from asymstore.io.files import atomic_write, fsync_dir, read_whole
from asymstore.io.rootlock import DirLock
from asymstore.multirank import globaldir
from asymstore.runtime.sync import run_sync
from asymstore.tiers.local import LocalTier

logger = logging.getLogger(__name__)


@dataclass
class MultiRankFsckReport(FsckReport):
    """An :class:`asymstore.fsck.FsckReport` of a multi-rank root.

    Attributes:
        ranks: rank -> the report of its directory under the root.
        partial_steps: step -> ranks holding a committed shard of it that no global manifest uses,
            newer than the newest global version (an incomplete multi-rank commit).
        stale_steps: the same for steps older than the newest global version (``orphaned``).
        locations: every shard location examined -> its single-tier report (None: not seen, see
            ``unseen``).
        unseen: location -> why it could not be examined from here.
        shard_dirs: (rank, step) -> the seen directories holding that unused shard (what repair removes).
        refused: what ``repair`` will not touch and why (an ``unreachable`` version).
        node_local: the paths of a per-node check (empty: the whole root).
    """

    ranks: dict[int, FsckReport] = field(default_factory=dict)
    partial_steps: dict[int, list[int]] = field(default_factory=dict)
    stale_steps: dict[int, list[int]] = field(default_factory=dict)
    locations: dict[str, FsckReport | None] = field(default_factory=dict)
    unseen: dict[str, str] = field(default_factory=dict)
    shard_dirs: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    node_local: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Return the single-tier schema plus the multi-rank fields (see docs/guides/fsck.md)."""
        return super().to_json() | {
            "layout": "multirank", "ranks": sorted(self.ranks), "node_local": self.node_local,
            "partial_steps": {str(k): v for k, v in sorted(self.partial_steps.items())},
            "stale_steps": {str(k): v for k, v in sorted(self.stale_steps.items())},
            "locations": {loc: (rep is not None) for loc, rep in sorted(self.locations.items())},
            "unseen": dict(sorted(self.unseen.items())), "refused": self.refused}


@dataclass(frozen=True)
class _Holder:
    """One place that holds a rank's shards."""

    location: str | None  # a directory, a URI, or None (memory)
    host: str
    what: str  # for messages: "rank 2's local tier"


class _Locations:
    """Examines each location once and answers: does it hold shard (rank, step) with this digest?"""

    def __init__(self, root: str, deep: bool, progress: Callable[[int], Progress] | None,
                 node_local: Sequence[str]) -> None:
        self.root, self.deep, self.progress = root, deep, progress
        self.node_local = [os.path.abspath(p) for p in node_local]
        self.host = placement.this_host()
        self.reports: dict[str, FsckReport | None] = {}
        self.unseen: dict[str, str] = {}
        self.trusted: set[str] = set()  # what it lacks is lacking where it lives

    def _under(self, path: str, parents: Sequence[str]) -> bool:
        return any(os.path.commonpath([path, p]) == p for p in parents)

    def examine(self, holder: _Holder) -> FsckReport | None:
        """The single-tier report of ``holder``'s location, or None when it cannot be seen (see ``unseen``)."""
        loc = holder.location
        if loc is None:
            return None
        if loc in self.reports:
            return self.reports[loc]
        report: FsckReport | None = None
        if self.node_local and (is_uri(loc) or not self._under(loc, self.node_local)):
            self.unseen[loc] = "not on this node (a per-node check examines only the --node-local paths)"
        elif is_uri(loc):
            try:
                report = check_tier(loc, deep=self.deep, progress=self.progress)
                self.trusted.add(loc)
            except (OSError, ValueError, AsymstoreError) as exc:
                self.unseen[loc] = f"the remote did not answer: {str(exc)[:200]}"
        elif not os.path.isabs(loc):
            self.unseen[loc] = "not an absolute path"
        elif not os.path.isdir(loc) and not (self._under(loc, [self.root]) or self.node_local):
            self.unseen[loc] = (f"does not exist on this machine ({self.host}); it is local to {holder.host}: "
                                f"check it there with --node-local")
        else:
            if self.node_local or self._under(loc, [self.root]) or holder.host == self.host:
                self.trusted.add(loc)
            else:
                self.unseen[loc] = (f"recorded on host {holder.host}, this is {self.host}: a directory of that "
                                    f"name here may be another disk (copies found here still count)")
            if os.path.isdir(loc):
                report = check_tier(loc, deep=self.deep, progress=self.progress)
        self.reports[loc] = report
        return report

    def copy_problem(self, holder: _Holder, step: int, digest: str) -> tuple[bool, str]:
        """Whether ``holder`` has shard ``step`` verifying with ``digest``; else (False, why)."""
        loc = holder.location
        if loc is None:
            return False, f"{holder.what}: in process memory on {holder.host}, not readable from here"
        report = self.examine(holder)
        if report is None:
            return False, f"{holder.what} {loc}: {self.unseen.get(loc, 'missing')}"
        entry = next((e for e in report.entries if e.step == step and e.name == version_dirname(step)), None)
        if entry is None:
            return False, f"{holder.what} {loc}: shard {step} is missing"
        if not entry.ok:
            return False, f"{holder.what} {loc}: shard {step} is {entry.status}: {'; '.join(entry.problems)}"
        try:
            manifest = self._manifest(loc, step)
        except (ManifestError, OSError, AsymstoreError) as exc:
            return False, f"{holder.what} {loc}: shard {step}: {exc}"
        if shard_digest(manifest) != digest:
            return False, f"{holder.what} {loc}: shard {step} has another digest than the global manifest lists"
        return True, ""

    def _manifest(self, loc: str, step: int) -> Manifest:
        if not is_uri(loc):
            return parse_manifest(read_whole(os.path.join(loc, version_dirname(step), MANIFEST_NAME)))
        from asymstore.tiers.remote.tier import RemoteTier

        async def read() -> bytes:
            return await RemoteTier(loc).read_manifest(step)

        return parse_manifest(run_sync(read()))


def _holders(root: str, g: GlobalManifest, places: dict[str, Placement | GlobalManifestError],
             rank: int) -> list[_Holder] | str:
    """Every place holding ``rank``'s shards of ``g``, or why they cannot be known."""
    in_root = _Holder(os.path.join(root, rank_dirname(rank)), "", f"rank {rank}'s directory")
    if g.placement is None:
        return [in_root]
    found = places.get(g.placement)
    if isinstance(found, GlobalManifestError):
        return f"its placement record {placement.placement_filename(g.placement)}: {found}"
    assert found is not None
    holders = [_Holder(t.location, r.host, f"rank {r.rank}'s {t.kind} tier {t.name!r}") for r, t in found.holders(rank)]
    if os.path.isdir(in_root.location or "") and all(h.location != in_root.location for h in holders):
        holders.append(in_root)
    return holders


def _read_placements(gdir: str, globals_: list[GlobalManifest]) -> dict[str, Placement | GlobalManifestError]:
    out: dict[str, Placement | GlobalManifestError] = {}
    for g in globals_:
        if g.placement is not None and g.placement not in out:
            try:
                out[g.placement] = globaldir.read_placement(gdir, g.placement)
            except FileNotFoundError:
                out[g.placement] = GlobalManifestError("missing")
            except (GlobalManifestError, OSError) as exc:
                out[g.placement] = GlobalManifestError(str(exc))
    return out


def _judge(report: VersionReport, g: GlobalManifest, locs: _Locations,
           holders_of: Callable[[int], list[_Holder] | str]) -> None:
    """Set ``report``'s status from where ``g``'s shards are (see the module docstring)."""
    unreachable: list[str] = []
    for shard in g.shards:
        holders = holders_of(shard.rank)
        if isinstance(holders, str):
            unreachable.append(f"rank {shard.rank}: {holders}")
            continue
        if locs.node_local and not any(h.location is not None and not is_uri(h.location)
                                       and locs._under(h.location, locs.node_local) for h in holders):
            continue  # a per-node check: this shard lives on other nodes only
        why: list[str] = []
        seen_all = True
        ok = False
        for h in holders:
            good, problem = locs.copy_problem(h, shard.step, shard.digest)
            if good:
                ok = True
                break
            why.append(problem)
            if h.location is None or h.location not in locs.trusted:
                seen_all = False
        if ok:
            continue
        if locs.node_local and not all(h.location is not None and not is_uri(h.location)
                                       and locs._under(h.location, locs.node_local) for h in holders):
            continue  # judged on this node's copies only when the shard lives nowhere else
        if seen_all:
            report.status = "corrupt"
            report.problems.append(f"rank {shard.rank}: no verified copy of shard {shard.step}: " + "; ".join(why))
        else:
            unreachable.append(f"rank {shard.rank}: " + "; ".join(why or ["no location recorded"]))
    if report.status != "corrupt" and unreachable:
        report.status = "unreachable"
        report.problems += unreachable


@dataclass
class _GlobalEntry:
    """One ``global/v….json``: its report, and the manifest when it parses."""

    step: int
    manifest: GlobalManifest | None
    report: VersionReport


def check_multirank(root: str, *, deep: bool = False, progress: Callable[[int], Progress] | None = None,
                    node_local: Sequence[str] = ()) -> MultiRankFsckReport:
    """Examine a multi-rank root: every global manifest against its shards where they live.

    Args:
        root: the multi-rank root (with ``global/``).
        deep: verify every checksum of every shard examined.
        progress: see :func:`asymstore.fsck.check`.
        node_local: a per-node check: examine only the shard locations under these paths.
    """
    root = os.path.abspath(root)
    gdir = os.path.join(root, globaldir.GLOBAL_DIR)
    locs = _Locations(root, deep, progress, node_local)
    dirs: dict[int, str] = {} if node_local else globaldir.rank_dirs(root)
    ranks = _check_rank_dirs(dirs, locs)
    globals_, extra = _scan_global_dir(gdir, node_local=bool(node_local))
    used, holders_by_rank = _judge_globals(root, gdir, globals_, locs, ranks)
    entries = sorted((g.report for g in globals_), key=lambda e: e.name)
    good = {e.step for e in entries if e.status == "committed" and e.step is not None}
    unreachable = {e.step for e in entries if e.status == "unreachable" and e.step is not None}
    entries += _location_entries(root, locs, dirs, ranks)
    unused, shard_dirs = _unused_shards(_shard_copies(dirs, ranks, holders_by_rank, locs), used)
    top = max(good | unreachable) if good | unreachable else None
    partial = {s: have for s, have in unused.items() if top is None or s > top}
    stale = {s: have for s, have in unused.items() if s not in partial}
    parsed = [g.manifest for g in globals_ if g.manifest is not None]
    world = parsed[-1].world_size if parsed else max(len(dirs), 1)
    entries += _unused_entries(partial, stale, world)
    entries += extra
    latest, latest_problem = (None, None) if node_local else check_latest(gdir, top, set(good | unreachable))
    refused = [f"{e.name}: not touched, a shard cannot be seen from here: {'; '.join(e.problems)}"
               for e in entries if e.status == "unreachable"]
    return MultiRankFsckReport(root, deep, entries, latest, _latest_problems(latest_problem, ranks),
                               max(good) if good else None, ranks=ranks, partial_steps=partial,
                               stale_steps=stale, locations=dict(locs.reports), unseen=dict(locs.unseen),
                               shard_dirs=shard_dirs, refused=refused, node_local=list(locs.node_local))


def _check_rank_dirs(dirs: dict[int, str], locs: _Locations) -> dict[int, FsckReport]:
    """Check every ``ROOT/rank-NNNNN/`` as a single tier; they count as seen locations."""
    ranks = {r: check_tier(d, deep=locs.deep, progress=locs.progress) for r, d in dirs.items()}
    for r, d in dirs.items():
        locs.reports[d] = ranks[r]
        locs.trusted.add(d)
    return ranks


def _scan_global_dir(gdir: str, *, node_local: bool) -> tuple[list[_GlobalEntry], list[VersionReport]]:
    """Read ``global/``: the global manifests (each parsed or reported corrupt), and what else lies there."""
    globals_: list[_GlobalEntry] = []
    extra: list[VersionReport] = []
    for name in sorted(os.listdir(gdir)):
        path = os.path.join(gdir, name)
        step = globaldir.parse_global_filename(name)
        if step is not None:
            report = VersionReport(f"{globaldir.GLOBAL_DIR}/{name}", "committed", step)
            g: GlobalManifest | None = None
            try:
                g = globaldir.read_global(gdir, step)
            except (GlobalManifestError, OSError) as exc:
                report.status = "corrupt"
                report.problems.append(f"bad global manifest: {exc}")
            globals_.append(_GlobalEntry(step, g, report))
        elif name.startswith(TMP_PREFIX) and not node_local:
            vstep = globaldir.parse_global_filename(name[len(TMP_PREFIX):].rsplit("-", 1)[0])
            extra.append(VersionReport(f"{globaldir.GLOBAL_DIR}/{name}", "partial", vstep,
                                       problems=["a global manifest that was never published"]))
        elif name.startswith(f".{LATEST}.") and name.endswith(".tmp") and not node_local:
            extra.append(VersionReport(f"{globaldir.GLOBAL_DIR}/{name}", "orphaned", None,
                                       problems=["leftover of a LATEST update"]))
        elif name == QUARANTINE and os.path.isdir(path):
            extra += [VersionReport(f"{globaldir.GLOBAL_DIR}/{QUARANTINE}/{q}", "quarantined",
                                    globaldir.parse_global_filename(q.split("-")[0]))
                      for q in sorted(os.listdir(path))]
    return globals_, extra


class _HolderLog:
    """Looks up where a global version's shards are (:func:`_holders`), noting every holder seen per rank."""

    def __init__(self, root: str, places: dict[str, Placement | GlobalManifestError]) -> None:
        self.root, self.places = root, places
        self.by_rank: dict[int, list[_Holder]] = {}

    def of(self, g: GlobalManifest) -> Callable[[int], list[_Holder] | str]:
        """The holders of ``g``'s shards, by rank (what :func:`_judge` asks)."""
        return functools.partial(self._holders, g)

    def _holders(self, g: GlobalManifest, rank: int) -> list[_Holder] | str:
        found = _holders(self.root, g, self.places, rank)
        if not isinstance(found, str):
            known = self.by_rank.setdefault(rank, [])
            known += [h for h in found if h not in known]
        return found


def _judge_globals(root: str, gdir: str, globals_: list[_GlobalEntry], locs: _Locations,
                   ranks: dict[int, FsckReport]) -> tuple[set[tuple[int, int]], dict[int, list[_Holder]]]:
    """Judge every parsed global manifest on its shards (sets each one's report).

    Returns:
        The (rank, step) shards the manifests use, and every holder of a rank's shards they named.
    """
    log = _HolderLog(root, _read_placements(gdir, [g.manifest for g in globals_ if g.manifest is not None]))
    used: set[tuple[int, int]] = set()
    for entry in globals_:
        g = entry.manifest
        if g is None:
            used |= {(r, entry.step) for r in ranks}  # its shards are accounted for by the corrupt entry
            continue
        entry.report.nbytes = g.nbytes
        used |= {(s.rank, s.step) for s in g.shards}
        _judge(entry.report, g, locs, log.of(g))
    return used, log.by_rank


def _shard_copies(dirs: dict[int, str], ranks: dict[int, FsckReport], holders_by_rank: dict[int, list[_Holder]],
                  locs: _Locations) -> dict[tuple[int, int], list[str]]:
    """The committed shard copies in the locations seen: (rank whose shard it is, step) -> locations."""
    copies: dict[tuple[int, int], list[str]] = {}
    for r, d in dirs.items():
        for e in ranks[r].entries:
            if e.status == "committed" and e.step is not None:
                copies.setdefault((r, e.step), []).append(d)
    for rank, holders in holders_by_rank.items():
        for h in holders:
            if h.location is None or h.location not in locs.trusted or h.location in dirs.values():
                continue
            rep = locs.reports.get(h.location)
            for e in rep.entries if rep is not None else []:
                if e.status == "committed" and e.step is not None:
                    copies.setdefault((rank, e.step), []).append(h.location)
    return copies


def _location_entries(root: str, locs: _Locations, dirs: dict[int, str],
                      ranks: dict[int, FsckReport]) -> list[VersionReport]:
    """The entries of the shard locations: every one of the rank directories, the problems of the others."""
    entries: list[VersionReport] = []
    for loc, rep in locs.reports.items():
        if rep is None or loc in dirs.values():
            continue
        entries += [replace(e, name=f"{_label(root, loc)}/{e.name}") for e in rep.entries
                    if e.status != "committed" or e.problems]
    for r, rep in ranks.items():
        entries += [replace(e, name=f"{rank_dirname(r)}/{e.name}") for e in rep.entries]
    return entries


def _unused_shards(copies: dict[tuple[int, int], list[str]], used: set[tuple[int, int]]
                   ) -> tuple[dict[int, list[int]], dict[tuple[int, int], list[str]]]:
    """The shards no global manifest uses: step -> ranks holding one, and (rank, step) -> where."""
    unused: dict[int, list[int]] = {}
    shard_dirs: dict[tuple[int, int], list[str]] = {}
    for (r, step), where in sorted(copies.items()):
        if (r, step) not in used:
            unused.setdefault(step, []).append(r)
            shard_dirs[(r, step)] = sorted(set(where))
    return unused, shard_dirs


def _unused_entries(partial: dict[int, list[int]], stale: dict[int, list[int]], world: int) -> list[VersionReport]:
    """An entry per step of unused shards: ``partial`` (newer than the newest global version) or ``orphaned``."""
    entries: list[VersionReport] = []
    for step, have in sorted(partial.items()):
        lacking = [r for r in range(world) if r not in have]
        entries.append(VersionReport(
            f"{globaldir.GLOBAL_DIR}/{globaldir.global_filename(step)}", "partial", step,
            problems=[f"rank shard(s) of rank(s) {have} committed but no global manifest: a multi-rank commit "
                      f"that did not complete" + (f" (rank(s) {lacking} have no shard)" if lacking else "")]))
    for step, have in sorted(stale.items()):
        entries.append(VersionReport(
            f"{globaldir.GLOBAL_DIR}/{globaldir.global_filename(step)}", "orphaned", step,
            problems=[f"shard(s) of rank(s) {have} that no global version uses, older than the newest "
                      f"one: left by retention on a rank that stopped early, or by an incomplete commit"]))
    return entries


def _latest_problems(global_problem: str | None, ranks: dict[int, FsckReport]) -> str | None:
    """What is wrong with ``global/LATEST`` and each rank directory's ``LATEST``, in one line (None: nothing)."""
    problems = [f"{globaldir.GLOBAL_DIR}/{LATEST}: {global_problem}"] if global_problem else []
    problems += [f"{rank_dirname(r)}/{LATEST}: {rep.latest_problem}"
                 for r, rep in ranks.items() if rep.latest_problem]
    return "; ".join(problems) if problems else None


def _delete_shard(vdir: str) -> None:
    """Delete a shard as its tier's retention would: manifest first, then what no other shard there references."""
    step = parse_version_dirname(os.path.basename(vdir))
    if step is None:
        shutil.rmtree(vdir, ignore_errors=True)
        return
    run_sync(LocalTier(os.path.dirname(vdir)).delete_version(step))  # keeps segments later shards reference


def repair_multirank(report: MultiRankFsckReport) -> list[str]:
    """Fix what ``report`` found; return one line per action (see the module docstring).

    Raises:
        RootLockedError: a live job holds ``global/`` or a shard location.
    """
    gdir = os.path.join(report.root, globaldir.GLOBAL_DIR)
    if report.node_local:
        return _repair_locations(report)
    lock = DirLock(gdir)
    lock.acquire()  # the coordinator's lock: never repair under a live job
    try:
        return _repair(report, gdir)
    finally:
        lock.release()


def _label(root: str, path: str) -> str:
    """``path`` relative to the root when it is inside it, else as it is."""
    return os.path.relpath(path, root) if os.path.commonpath([path, root]) == root else path


def _repair_locations(report: MultiRankFsckReport) -> list[str]:
    """Repair every seen shard location as a single tier, after removing the unused shards there."""
    actions: list[str] = []
    for kind, steps in (("partial", report.partial_steps), ("orphaned", report.stale_steps)):
        for step, have in sorted(steps.items()):
            for r in have:
                for d in report.shard_dirs.get((r, step), []):
                    _delete_shard(os.path.join(d, version_dirname(step)))
                    actions.append(f"removed {kind} shard {_label(report.root, d)}/{version_dirname(step)}")
    for loc, rep in sorted(report.locations.items()):
        if rep is None or is_uri(loc) or not os.path.isdir(loc):
            continue
        if loc in report.unseen:  # another host's disk of the same name: not ours to repair
            continue
        actions += [f"{_label(report.root, loc)}: {a}" for a in repair_tier(check_tier(loc, deep=report.deep))]
    return actions


def _repair(report: MultiRankFsckReport, gdir: str) -> list[str]:
    root = report.root
    actions = _repair_locations(report)
    for e in report.entries:
        if not e.name.startswith(f"{globaldir.GLOBAL_DIR}/"):
            continue
        path = os.path.join(root, e.name)
        if e.status == "corrupt" and os.path.exists(path):
            dest = quarantine(gdir, path, os.path.basename(e.name))
            actions.append(f"moved corrupt {e.name} to {dest}")
        elif e.status in ("partial", "orphaned") and os.path.isfile(path):
            os.unlink(path)
            actions.append(f"removed {e.status} {e.name}")
    latest = os.path.join(gdir, LATEST)
    if report.refused:
        pass  # an unreachable version may be the newest: LATEST stays as the job wrote it
    elif report.newest_restorable is None:
        if os.path.exists(latest):
            os.unlink(latest)
            actions.append(f"removed {globaldir.GLOBAL_DIR}/{LATEST} (no restorable version)")
    elif report.latest != report.newest_restorable:
        atomic_write(latest, f"{report.newest_restorable}\n".encode())
        actions.append(f"set {globaldir.GLOBAL_DIR}/{LATEST} to {report.newest_restorable}")
    fsync_dir(gdir)
    for line in actions:
        logger.info("fsck repair: %s", line)
    return actions


__all__ = ["MultiRankFsckReport", "Progress", "check_multirank", "repair_multirank"]
