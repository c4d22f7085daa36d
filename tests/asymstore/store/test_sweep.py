"""Sweeping with judgment: a version directory without a manifest is removed only when retention would have
deleted it — a retention rule in force (keep_last, keep_every, keep_best) and the directory older than the oldest
version retention keeps: what an interrupted retention delete leaves. Every other one — a committed version whose
manifest a person, a disk or a tool lost, under no retention at all or newer than the oldest kept version — is moved
to ``.quarantine/`` (bytes intact) and reported: a WARNING naming the path and why, ``status()[tier].quarantined``,
the entries ``sweep_leftovers`` returns, and fsck. At open and after each publish; on a directory tier, a
shared-memory host_tier(path=...) and a remote tier. Real directories with fsync, /dev/shm, a real pyarrow file://
filesystem and the loopback moto S3 server.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.format.names import version_dirname
from asymstore.fsck import check, repair
from asymstore.io.rootlock import sweep_directory
from asymstore.tiers.remote.tier import RemoteTier

STEPS = [1, 2, 3, 4, 5]


def tensor(step: int) -> torch.Tensor:
    return torch.arange(1024, dtype=torch.float32) + step


async def commit_all(tier: Any, **rules: Any) -> None:
    async with AsymStore([tier], **{"keep_last": None, **rules}, segment_bytes=1 << 20, compression="never") as s:
        for step in STEPS:
            await s.put(step, "w", tensor(step))
            await s.commit(step)


async def reopen(tier: Any, **rules: Any) -> tuple[list[int], int, list[str]]:
    """Open a store on ``tier`` with ``rules``; return the versions listed, the step restored, what was quarantined."""
    async with AsymStore([tier], **{"keep_last": None, **rules}, segment_bytes=1 << 20, compression="never") as s:
        ckpt = await s.restore()
        assert torch.equal(ckpt.tensors["w"], tensor(ckpt.step))
        return await tier.list_versions(), ckpt.step, s.status()[tier.name].quarantined


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def warned(caplog: pytest.LogCaptureFixture, *words: str) -> bool:
    return any(r.levelno == logging.WARNING and all(w in r.getMessage() for w in words) for r in caplog.records)


def test_under_no_retention_the_oldest_version_that_lost_its_manifest_is_quarantined_not_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "t"
    asyncio.run(commit_all(LocalTier(root)))
    (root / "v000000000001" / "MANIFEST.json").unlink()  # the oldest: what a retention delete would look like
    segments = files(root / "v000000000001")
    with caplog.at_level(logging.WARNING):
        listed, newest, quarantined = asyncio.run(reopen(LocalTier(root), keep_last=None))
    assert listed == [2, 3, 4, 5] and newest == 5
    [moved] = list((root / ".quarantine").iterdir())
    assert moved.name.startswith("v000000000001-") and files(moved) == segments  # every byte still there
    assert quarantined == [str(moved)]
    assert warned(caplog, str(root / "v000000000001"), "no retention rule", str(moved))
    report = check(str(root))
    assert [(e.name, e.status) for e in report.entries if e.name.startswith(".quarantine/")] == [
        (f".quarantine/{moved.name}", "quarantined")]


def test_a_committed_version_that_lost_its_manifest_is_quarantined_not_deleted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "t"
    asyncio.run(commit_all(LocalTier(root)))
    segments = files(root / "v000000000003")
    del segments["MANIFEST.json"]
    (root / "v000000000003" / "MANIFEST.json").unlink()
    with caplog.at_level(logging.WARNING):
        listed, newest, quarantined = asyncio.run(reopen(LocalTier(root)))
    assert listed == [1, 2, 4, 5] and newest == 5
    [moved] = list((root / ".quarantine").iterdir())
    assert moved.name.startswith("v000000000003-") and files(moved) == segments
    assert quarantined == [str(moved)]
    assert warned(caplog, "v000000000003")
    report = check(str(root))
    assert [e.status for e in report.entries if e.name.startswith(".quarantine/")] == ["quarantined"]


@pytest.mark.parametrize(("rules", "gone"), [({"keep_last": 2}, 3), ({"keep_last": None, "keep_every": 2}, 1)],
                         ids=["keep_last", "keep_every"])
def test_under_retention_one_older_than_the_oldest_kept_version_is_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, rules: dict[str, Any], gone: int) -> None:
    root = tmp_path / "t"
    # every version written (keep_every's pins recorded); then keep_last=2 keeps 4 and 5, so 3 is older than the
    # oldest kept; keep_every=2 with keep_last=None keeps all, so only 1 is older than the oldest kept (2)
    asyncio.run(commit_all(LocalTier(root), keep_every=rules.get("keep_every")))
    (root / f"v00000000000{gone}" / "MANIFEST.json").unlink()
    with caplog.at_level(logging.INFO):
        listed, _, quarantined = asyncio.run(reopen(LocalTier(root), **rules))
    assert listed == [s for s in STEPS if s != gone]
    assert not (root / f"v00000000000{gone}").exists() and not (root / ".quarantine").exists()
    assert quarantined == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"v00000000000{gone}" in r.getMessage() for r in caplog.records)  # said at INFO: removed


def test_under_retention_one_newer_than_the_oldest_kept_version_is_quarantined(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "t"
    asyncio.run(commit_all(LocalTier(root)))
    (root / "v000000000004" / "MANIFEST.json").unlink()  # keep_last=3 keeps 2, 3, 5: 4 is newer than 2
    with caplog.at_level(logging.WARNING):
        listed, _, quarantined = asyncio.run(reopen(LocalTier(root), keep_last=3))
    assert listed == [1, 2, 3, 5]
    [moved] = list((root / ".quarantine").iterdir())
    assert moved.name.startswith("v000000000004-") and quarantined == [str(moved)]
    assert warned(caplog, str(root / "v000000000004"), "oldest version retention keeps")


async def test_the_sweep_says_what_it_removed_and_what_it_moved_aside(tmp_path: Path) -> None:
    root = tmp_path / "t"
    await commit_all(LocalTier(root))
    for step in (1, 4):
        (root / f"v00000000000{step}" / "MANIFEST.json").unlink()
    (root / ".tmp-v000000000009-dead").mkdir()
    tier = LocalTier(root)
    await tier.open()
    await tier.lock_root()
    try:
        swept = {e.name: e for e in await tier.sweep_leftovers(oldest_kept=2)}
    finally:
        await tier.unlock_root()
    assert {n: e.action for n, e in swept.items()} == {
        "v000000000001": "removed", "v000000000004": "quarantined", ".tmp-v000000000009-dead": "removed"}
    assert Path(swept["v000000000004"].path).parent == root / ".quarantine"
    assert "older than step 2" in swept["v000000000001"].reason


async def test_the_sweep_after_a_publish_judges_the_same_way(tmp_path: Path) -> None:
    root = tmp_path / "t"
    async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20, compression="never") as s:
        for step in (1, 2):
            await s.put(step, "w", tensor(step))
            await s.commit(step)
        (root / "v000000000001" / "MANIFEST.json").unlink()  # lost while the store is open
        await s.put(3, "w", tensor(3))
        await s.commit(3)
        [moved] = list((root / ".quarantine").iterdir())
        assert moved.name.startswith("v000000000001-") and any(moved.iterdir())
        assert s.status()[s.tiers[0].name].quarantined == [str(moved)]


def test_a_shared_memory_tier_quarantines_the_same_way(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    root = Path(shm_dir) / "host"
    asyncio.run(commit_all(host_tier(64 << 20, path=root)))
    (root / "v000000000001" / "MANIFEST.json").unlink()
    with caplog.at_level(logging.WARNING):
        listed, newest, quarantined = asyncio.run(reopen(host_tier(64 << 20, path=root)))
    assert listed == [2, 3, 4, 5] and newest == 5
    [moved] = list((root / ".quarantine").iterdir())
    assert moved.name.startswith("v000000000001-") and any(moved.iterdir()) and quarantined == [str(moved)]
    assert warned(caplog, "v000000000001", "no retention rule")


def test_fsck_calls_a_lost_manifest_corrupt_and_repair_moves_it_aside(tmp_path: Path) -> None:
    root = tmp_path / "t"
    asyncio.run(commit_all(LocalTier(root)))
    (root / "v000000000004" / "MANIFEST.json").unlink()
    (root / "v000000000001" / "MANIFEST.json").unlink()
    report = check(str(root))
    status = {e.name: e.status for e in report.entries}
    assert status["v000000000004"] == "corrupt" and status["v000000000001"] == "orphaned"
    repair(report)
    assert not (root / "v000000000001").exists() and not (root / "v000000000004").exists()
    [moved] = list((root / ".quarantine").iterdir())
    assert moved.name.startswith("v000000000004") and any(moved.iterdir())
    assert check(str(root)).ok


def _remote_files(tier: RemoteTier, prefix: str) -> list[str]:
    sel = pafs.FileSelector(f"{tier.root}/{prefix}", allow_not_found=True, recursive=True)
    return sorted(i.path[len(tier.root) + len(prefix) + 2:] for i in tier.fs.get_file_info(sel)
                  if i.type == pafs.FileType.File)


@pytest.mark.parametrize("keep_last", [None, 4])
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_remote_prefixes_get_the_same_judgment(tmp_path: Path, kind: str, keep_last: int | None,
                                               caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
                                               ) -> None:
    if kind == "file":
        (tmp_path / "remote").mkdir()
        uri = (tmp_path / "remote").as_uri()
    else:
        uri = request.getfixturevalue("s3_uri")
    asyncio.run(commit_all(RemoteTier(uri)))
    tier = RemoteTier(uri)
    tier.fs.delete_file(f"{tier.root}/v000000000003/MANIFEST.json")  # a committed version loses its manifest
    tier.fs.delete_file(f"{tier.root}/v000000000001/MANIFEST.json")  # the oldest: a retention delete cut short?
    segments = {s: _remote_files(tier, f"v00000000000{s}") for s in (1, 3)}
    assert all(segments.values())
    with caplog.at_level(logging.WARNING):
        listed, newest, quarantined = asyncio.run(reopen(RemoteTier(uri), keep_last=keep_last))
    assert listed == [2, 4, 5] and newest == 5
    assert _remote_files(tier, "v000000000001") == [] and _remote_files(tier, "v000000000003") == []
    moved = _remote_files(tier, ".quarantine")
    # keep_last=4 keeps 2, 4 and 5: 1 is older than the oldest kept (removed), 3 is not; with no rule, neither is
    aside = [3] if keep_last == 4 else [1, 3]
    assert [m.split("/", 1)[1] for m in moved] == [f for s in aside for f in segments[s]]
    assert sorted(m.split("/", 1)[0].split("-")[0] for m in moved) == sorted(
        f"v00000000000{s}" for s in aside for _ in segments[s])
    assert len(quarantined) == len(aside)
    assert warned(caplog, "v000000000003") and warned(caplog, "v000000000001") is (keep_last is None)


async def test_an_interrupted_layout_record_update_is_swept_at_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    await commit_all(LocalTier(root))
    stray = root / ".LAYOUT.json.0123456789ab.tmp"  # a crash between atomic_write's write and its rename
    stray.write_text("{")
    other = root / ".LAYOUT.json.notes"  # not a name a writer makes: left alone
    other.write_text("mine")
    async with AsymStore([LocalTier(root)], keep_last=None) as store:
        assert store.versions()[f"local:{root}"] == STEPS
    assert not stray.exists() and other.read_text() == "mine"


def test_a_sweep_in_another_thread_leaves_a_small_file_being_written_alone(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from asymstore.io import files
    from asymstore.io.rootlock import sweep_directory

    seen: list[list[str]] = []
    write = files.write_parts

    def write_then_sweep(path: str, parts: Any, *, fsync: bool = True) -> None:
        write(path, parts, fsync=fsync)
        sweep_directory(str(tmp_path))  # a post-publish sweep, between atomic_write's write and its rename
        seen.append(sorted(p.name for p in tmp_path.iterdir()))

    monkeypatch.setattr(files, "write_parts", write_then_sweep)
    files.atomic_write(str(tmp_path / "LAYOUT.json"), b"{}")
    assert len(seen) == 1 and seen[0][0].startswith(".LAYOUT.json.") and seen[0][0].endswith(".tmp"), seen
    assert (tmp_path / "LAYOUT.json").read_bytes() == b"{}"
    assert [p.name for p in tmp_path.iterdir()] == ["LAYOUT.json"]


async def test_a_manifest_less_directory_found_at_publish_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20, compression="never") as store:
        await store.put(1, "w", tensor(1))
        await store.commit(1)
        stray = root / version_dirname(2)  # appeared after the open's sweep
        stray.mkdir()
        (stray / "seg-000000.bin").write_bytes(b"only copy")
        await store.put(2, "w", tensor(2))
        await store.commit(2)
        assert (await store.restore()).step == 2
    moved = list((root / ".quarantine").iterdir())
    assert len(moved) == 1 and (moved[0] / "seg-000000.bin").read_bytes() == b"only copy"


async def test_a_sweep_in_another_thread_leaves_a_version_being_deleted_alone(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention (or the multi-rank job's) deletes a version on this tier while a background tier's sweep runs."""
    import shutil

    root = tmp_path / "root"
    await commit_all(LocalTier(root))
    tier = LocalTier(root)
    swept: list[Any] = []
    rmtree = shutil.rmtree

    def rmtree_after_a_sweep(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(version_dirname(2)) and not swept:  # the manifest is gone, the segments not yet
            swept.append(sweep_directory(str(root), tier._active, oldest_kept=None))
        rmtree(path, *args, **kwargs)

    async with AsymStore([tier], keep_last=None) as store:
        monkeypatch.setattr(shutil, "rmtree", rmtree_after_a_sweep)
        await tier.delete_version(2)
        await store.refresh()
        assert store.versions()[tier.name] == [1, 3, 4, 5]
    assert swept == [[]]  # the sweep saw a version without a manifest and left it to its deleter
    assert not (root / ".quarantine").exists() and not (root / version_dirname(2)).exists()


def test_a_lock_given_back_is_free_while_a_child_forked_with_it_lives(tmp_path: Path) -> None:
    """A data loader's worker forked while a store held its root inherits the descriptor; closing the store frees the
    root all the same (the next job does not wait for the workers to exit)."""
    import os
    import signal

    from asymstore.io.rootlock import DirLock

    lock = DirLock(str(tmp_path))
    lock.acquire()
    child = os.fork()
    if child == 0:  # the worker: holds a copy of the descriptor until it is killed
        signal.pause()
        os._exit(0)
    try:
        lock.release()
        again = DirLock(str(tmp_path))
        again.acquire()  # RootLockedError while the child lives, before the fix
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
