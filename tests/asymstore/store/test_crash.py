"""Crash consistency: real child processes SIGKILLed at each commit phase, and at random moments.

Each child (tests/procs/store_child.py) commits versions into a LocalTier with
keep_last=2 and dies by SIGKILL. The parent then checks what the disk holds
with fsck (--json), restores in a fresh store (bit-exact against the
deterministic tensors of that step), repairs, checks again, and resumes.

Importing torch costs a child ~3 s of CPU, so every child of this module is
started at once by the ``children`` fixture and the imports overlap.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asymstore import AsymStore, LocalTier, TierError
from asymstore.errors import ManifestError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import LATEST, TMP_PREFIX, version_dirname
from asymstore.format.parse import parse_manifest
from asymstore.io.rootlock import LOCK_NAME
from asymstore.testing import PHASES, CrashingLocalTier, FailingLocalTier
from asymstore.values import Checkpoint
from tests.support.store import (
    committed_steps,
    fsck_json,
    make_state,
    same_state,
    spawn,
    step_of,
    store_kw,
)

KILLED = -signal.SIGKILL

# (phase, after, compression): the tier passes the phase ``after`` times, then the process dies there
CASES = [
    ("segments_written", 1, "never"), ("segments_written", 3, "always"),
    ("manifest_half", 2, "never"), ("manifest_half", 4, "always"),
    ("published", 1, "never"), ("published", 3, "always"),
    ("retention", 0, "never"), ("retention", 2, "always"),
]
RANDOM_RUNS = 3

Children = dict[tuple[str, int], tuple[Path, "subprocess.Popen[str]"]]


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> Any:
    procs: Children = {}
    for phase, after, compression in CASES:
        root = tmp_path_factory.mktemp(f"crash-{phase}-{after}")
        procs[(phase, after)] = (root, spawn("crash", str(root), phase, str(after), str(after + 4), compression))
    for run in range(RANDOM_RUNS):
        root = tmp_path_factory.mktemp(f"loop-{run}")
        procs[("loop", run)] = (root, spawn("loop", str(root)))
    yield procs
    for _, proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@dataclass
class Expected:
    reported: list[int]  # steps the child printed as committed
    committed: list[int]  # version directories with a manifest
    partial: list[int]
    orphaned: list[int]
    latest: int  # what LATEST says
    restorable: int  # the newest fully committed version


def expected(phase: str, after: int) -> Expected:
    done = [step_of(i) for i in range(after)]
    if phase in ("segments_written", "manifest_half"):  # commit #after died before its publish
        return Expected(done, done[-2:], [step_of(after)], [], done[-1], done[-1])
    if phase == "published":  # commit #after is published; LATEST and retention never ran for it
        return Expected(done, [*done[-2:], step_of(after)], [], [], done[-1], step_of(after))
    # retention: commit #after+2 published and LATEST updated; died deleting version #after
    done = [step_of(i) for i in range(after + 2)]
    return Expected(done, [step_of(after + 1), step_of(after + 2)], [], [step_of(after)],
                    step_of(after + 2), step_of(after + 2))


def entries(report: dict[str, Any], status: str) -> list[dict[str, Any]]:
    return [v for v in report["versions"] if v["status"] == status]


def steps_with(report: dict[str, Any], status: str) -> list[int]:
    return sorted(v["step"] for v in entries(report, status))


async def restore(root: Path, step: int | None = None) -> tuple[Checkpoint, dict[str, list[int]]]:
    async with AsymStore([LocalTier(root)], **store_kw()) as store:
        return await store.restore(step), store.versions()


def assert_restored(ckpt: Checkpoint, step: int) -> None:
    assert ckpt.step == step
    assert ckpt.meta == {"step": step}
    assert not ckpt.fell_back, ckpt.fallbacks
    assert same_state(ckpt.tensors, make_state(step))


async def repair_and_recheck(root: Path, step: int, *, dirty: bool = True) -> dict[str, Any]:
    """fsck --repair exits 0, a plain and a deep fsck then exit 0, and ``step`` still restores."""
    rc, fixed = fsck_json("--repair", str(root))
    assert rc == 0, fixed["problems"]
    assert fixed["ok"] is True
    assert bool(fixed["repaired"]) is dirty, fixed["repaired"]  # repair acts only when there is something to do
    rc, plain = fsck_json(str(root))
    assert rc == 0 and plain["problems"] == [] and plain["repaired"] == []
    rc, deep = fsck_json("--deep", str(root))
    assert rc == 0, deep["problems"]
    assert {v["status"] for v in deep["versions"]} == {"committed"}
    assert deep["latest"] == deep["newest_restorable"] == step
    ckpt, _ = await restore(root)
    assert_restored(ckpt, step)
    return deep


async def resume(root: Path, last: int) -> None:
    """A restarted job commits the next step on top of the crashed root; retention works again."""
    nxt = last + 10
    async with AsymStore([LocalTier(root)], keep_last=2, **store_kw()) as store:
        await store.put_many(nxt, make_state(nxt))
        await store.commit(nxt, meta={"step": nxt})
        assert store.versions()[store.tiers[0].name] == [last, nxt]
    ckpt, _ = await restore(root)
    assert_restored(ckpt, nxt)
    rc, report = fsck_json("--deep", str(root))
    assert rc == 0, report["problems"]


@pytest.mark.parametrize(("phase", "after", "compression"), CASES)
async def test_sigkill_at_phase(children: Children, phase: str, after: int, compression: str) -> None:
    root, proc = children[(phase, after)]
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == KILLED, f"child exited {proc.returncode}, not by SIGKILL:\n{err}"
    exp = expected(phase, after)
    assert committed_steps(out) == exp.reported

    rc, report = fsck_json(str(root))
    assert rc == 1
    assert report["ok"] is False
    assert steps_with(report, "committed") == exp.committed
    assert steps_with(report, "partial") == exp.partial
    assert steps_with(report, "orphaned") == exp.orphaned
    assert len(report["versions"]) == len(exp.committed) + len(exp.partial) + len(exp.orphaned)
    assert report["latest"] == exp.latest
    assert report["newest_restorable"] == exp.restorable
    if phase == "published":
        assert report["latest_problem"] == f"says {exp.latest}, newest restorable version is {exp.restorable}"
    else:
        assert report["latest_problem"] is None
    assert all(v["ok"] for v in entries(report, "committed"))

    # the leftovers are exactly what the phase promises
    nbytes = entries(report, "committed")[0]["nbytes"]
    if phase in ("segments_written", "manifest_half"):
        (tmp,) = [root / v["name"] for v in entries(report, "partial")]
        assert tmp.name.startswith(f"{TMP_PREFIX}{version_dirname(exp.partial[0])}-")
        segs = [p for p in tmp.iterdir() if p.name != MANIFEST_NAME]
        assert segs and all(p.stat().st_size > 0 for p in segs)
        if compression == "never":  # every segment written in full (same size as any other version)
            assert sum(p.stat().st_size for p in segs) == nbytes
        manifest = tmp / MANIFEST_NAME
        if phase == "segments_written":
            assert not manifest.exists()
        else:
            good = (root / version_dirname(exp.restorable) / MANIFEST_NAME).stat().st_size
            assert 0 < manifest.stat().st_size < good
            with pytest.raises(ManifestError):
                parse_manifest(manifest.read_bytes())
    if phase == "retention":
        orphan = root / version_dirname(exp.orphaned[0])
        assert not (orphan / MANIFEST_NAME).exists()
        segs = list(orphan.iterdir())  # segments not deleted yet
        assert segs and all(p.stat().st_size > 0 for p in segs)
        if compression == "never":
            assert sum(p.stat().st_size for p in segs) == nbytes

    ckpt, versions = await restore(root)
    assert versions == {f"local:{root}": exp.committed}
    assert_restored(ckpt, exp.restorable)
    # the first store opened on the root (one writer: the dead one's lock is gone) swept every leftover
    _, swept = fsck_json(str(root))
    assert steps_with(swept, "partial") == steps_with(swept, "orphaned") == []
    assert len(swept["versions"]) == len(exp.committed)
    for step in exp.committed:  # every committed version is whole, not just the newest
        older, _ = await restore(root, step)
        assert_restored(older, step)

    deep = await repair_and_recheck(root, exp.restorable, dirty=phase == "published")  # only LATEST to fix
    assert steps_with(deep, "committed") == exp.committed
    assert sorted(os.listdir(root)) == sorted([LATEST, LOCK_NAME, *(version_dirname(s) for s in exp.committed)])
    await resume(root, exp.restorable)


@pytest.mark.parametrize("run", range(RANDOM_RUNS))
async def test_sigkill_at_random_moment(children: Children, run: int) -> None:
    root, proc = children[("loop", run)]
    assert proc.stdin is not None and proc.stdout is not None
    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(0.0, 0.3)
    why = f"seed {seed}, delay {delay:.3f} s"
    assert proc.stdout.readline() == "ready\n", f"child not ready (exit status {proc.poll()})"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    first = proc.stdout.readline()  # at least one version is committed before the kill
    assert first.startswith("committed "), why
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == KILLED, why
    reported = committed_steps(first + out)
    last = reported[-1]

    rc, report = fsck_json(str(root))
    statuses = {v["status"] for v in report["versions"]}
    assert statuses <= {"committed", "partial", "orphaned"}, (why, report["problems"])
    leftovers = statuses - {"committed"} or report["latest_problem"] is not None
    assert rc == (1 if leftovers else 0), (why, report["problems"])
    assert report["ok"] is (rc == 0)
    # the step being committed at the kill may or may not have reached its publish
    assert report["newest_restorable"] in (last, last + 10), why
    committed = steps_with(report, "committed")
    assert set(committed) <= set(reported) | {last + 10}, why
    assert last in committed, why

    ckpt, _ = await restore(root)
    assert ckpt.step == report["newest_restorable"], why
    assert_restored(ckpt, ckpt.step)

    await repair_and_recheck(root, ckpt.step, dirty=report["latest_problem"] is not None)  # leftovers: swept
    await resume(root, ckpt.step)


# -- the helpers themselves, in process --------------------------------------------------------


async def commit_steps(store: AsymStore, *steps: int) -> None:
    for step in steps:
        await store.put_many(step, make_state(step))
        await store.commit(step, meta={"step": step})


@pytest.mark.parametrize("phase", ["segments_written", "manifest_half"])
async def test_failed_commit_leaves_previous_version(tmp_path: Path, phase: Any) -> None:
    tier = FailingLocalTier(tmp_path, fail_at=phase, after=2)
    async with AsymStore([tier], keep_last=2, **store_kw()) as store:
        await commit_steps(store, 10, 20)
        await store.put_many(30, make_state(30))
        with pytest.raises(TierError, match="injected failure"):
            await store.commit(30, meta={"step": 30})
        assert tier.faults == 1
        assert store.newest_step == 20
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME, LATEST, version_dirname(10), version_dirname(20)]  # aborted
        rc, report = fsck_json(str(tmp_path))
        assert rc == 0 and report["newest_restorable"] == 20
        ckpt = await store.restore()
        assert_restored(ckpt, 20)
        await store.commit(30, meta={"step": 30})  # the staged step is kept; a retry succeeds
    ckpt, versions = await restore(tmp_path)
    assert_restored(ckpt, 30)
    assert versions == {f"local:{tmp_path}": [20, 30]}


async def test_failed_latest_update_still_commits(tmp_path: Path) -> None:
    tier = FailingLocalTier(tmp_path, fail_at="published", after=1)
    async with AsymStore([tier], keep_last=2, **store_kw()) as store:
        await commit_steps(store, 10, 20)  # the LATEST update of 20 fails; the store only logs it
        assert tier.faults == 1
    rc, report = fsck_json(str(tmp_path))
    assert rc == 1
    assert report["latest"] == 10 and report["newest_restorable"] == 20
    ckpt, _ = await restore(tmp_path)
    assert_restored(ckpt, 20)


async def test_failed_retention_is_retried(tmp_path: Path) -> None:
    tier = FailingLocalTier(tmp_path, fail_at="retention", after=0)
    async with AsymStore([tier], keep_last=2, **store_kw()) as store:
        await commit_steps(store, 10, 20, 30)
        assert tier.faults == 1
        rc, report = fsck_json(str(tmp_path))
        assert rc == 1
        assert steps_with(report, "orphaned") == [10]
        assert steps_with(report, "committed") == [20, 30]
        await commit_steps(store, 40)  # the next retention pass removes what was left
    rc, report = fsck_json("--deep", str(tmp_path))
    assert rc == 0, report["problems"]
    assert steps_with(report, "committed") == [30, 40]
    assert len(report["versions"]) == 2


def test_fault_tiers_check_arguments(tmp_path: Path) -> None:
    assert PHASES == ("segments_written", "manifest_half", "published", "retention")
    with pytest.raises(ValueError, match="unknown phase"):
        CrashingLocalTier(tmp_path, crash_at="sometime")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="after"):
        FailingLocalTier(tmp_path, fail_at="published", after=-1)
    tier = CrashingLocalTier(tmp_path, crash_at="retention", after=3, name="t", keep_last=1)
    assert (tier.name, tier.keep_last, tier.after, tier.faults) == ("t", 1, 3, 0)
