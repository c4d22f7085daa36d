"""What a LocalTier commit makes durable, and in which order: LATEST costs no fsync of its own.

LATEST is a hint (restore and fsck trust manifests). Its replacement is atomic (tmp file, rename)
and is made durable by the next fsync of the root, which the next version's publish does anyway,
so a version pays for the segments, the manifest and one publish, not for the hint too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asymstore import AsymStore, LocalTier
from asymstore.format.names import LATEST, version_dirname

Event = tuple[str, str]


def record(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[Event]:
    """Record every fsync (of a file or a directory, by path) and every rename, in order (``os`` is one module)."""
    events: list[Event] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        events.append(("rename", os.fspath(dst)))

    def rename(src: str, dst: str) -> None:
        real_rename(src, dst)
        events.append(("rename", os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    return events


async def commit(store: AsymStore, step: int) -> None:
    await store.put(step, "w", torch.arange(4096, dtype=torch.float32) + step)
    await store.commit(step)


async def test_latest_is_renamed_without_an_fsync_and_made_durable_by_the_next_publish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(os.path.realpath(tmp_path)) / "t"
    async with AsymStore([LocalTier(root)], keep_last=2, compression="never") as store:
        await commit(store, 1)
        events = record(monkeypatch, tmp_path)
        await commit(store, 2)
        await commit(store, 3)
    latest, v2, v3 = str(root / LATEST), str(root / version_dirname(2)), str(root / version_dirname(3))
    renames = [dst for kind, dst in events if kind == "rename"]
    assert renames.count(latest) == 2  # LATEST replaced once per version
    fsyncs = [path for kind, path in events if kind == "fsync"]
    assert not any(os.path.basename(p).startswith(f".{LATEST}.") for p in fsyncs)  # its tmp file: never fsynced
    # the root is fsynced exactly when a version is published (or retention deletes one), never for LATEST alone
    i_latest2 = events.index(("rename", latest))  # LATEST = 2
    i_v3 = events.index(("rename", v3))  # version 3 published
    assert events.index(("rename", v2)) < i_latest2 < i_v3
    assert ("fsync", str(root)) not in events[i_latest2 + 1:i_v3]  # nothing made LATEST = 2 durable on its own
    # LATEST = 2 is durable once version 3 is: the root's fsync after version 3's rename covers both renames
    assert ("fsync", str(root)) in events[i_v3 + 1:]
    assert (root / LATEST).read_text() == "3\n"


async def test_a_commit_fsyncs_segments_manifest_and_directories_but_not_latest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(os.path.realpath(tmp_path)) / "t"
    async with AsymStore([LocalTier(root)], keep_last=None, compression="never") as store:
        await commit(store, 1)
        events = record(monkeypatch, tmp_path)
        await commit(store, 2)
    fsynced = [path for kind, path in events if kind == "fsync"]
    v2 = str(root / version_dirname(2))
    tmp = [p for p in fsynced if os.path.basename(os.path.dirname(p)).startswith(".tmp-")]
    # the segment(s) and the manifest, in the temporary directory, then that directory, then the root
    assert tmp and all(os.path.dirname(p) == os.path.dirname(tmp[0]) for p in tmp)
    assert fsynced[len(tmp):] == [os.path.dirname(tmp[0]), str(root)], fsynced
    assert events[-1] == ("rename", str(root / LATEST))  # last, after the root's fsync: a hint, not durable yet
    assert os.path.isdir(v2)


@pytest.mark.parametrize("left", ["missing", "empty", "zeros", "older", "ahead"])
async def test_what_a_power_loss_can_leave_of_latest_never_decides_a_restore(tmp_path: Path, left: str) -> None:
    """LATEST not yet durable when the power went: gone, empty, unwritten blocks, or the step before.

    Restore and fsck go by the manifests; the hint is reported, and the next commit writes it again.
    """
    from tests.support.store import fsck_json

    root = tmp_path / "t"
    async with AsymStore([LocalTier(root)], keep_last=3, compression="never") as store:
        for step in (1, 2, 3):
            await commit(store, step)
    latest = root / LATEST
    if left == "missing":
        latest.unlink()
    else:
        latest.write_bytes({"empty": b"", "zeros": b"\0\0", "older": b"2\n", "ahead": b"4\n"}[left])
    rc, report = fsck_json(str(root))
    assert report["newest_restorable"] == 3 and report["latest_problem"] is not None and rc == 1
    async with AsymStore([LocalTier(root)], keep_last=3, compression="never") as store:
        ckpt = await store.restore()
        assert ckpt.step == 3 and not ckpt.fell_back
        assert torch.equal(ckpt.tensors["w"], torch.arange(4096, dtype=torch.float32) + 3)
        await commit(store, 5)
    assert latest.read_text() == "5\n"
    rc, report = fsck_json(str(root))
    assert rc == 0 and report["latest_problem"] is None


def count_hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the function of every ``asyncio.to_thread`` (a thread hop of the store's loop), in order."""
    import asyncio

    hops: list[str] = []
    real = asyncio.to_thread

    async def to_thread(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    return hops


async def test_a_commit_lists_the_root_once_per_delete_and_writes_latest_in_the_publish_hop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a steady version under keep_last: LATEST replaced in the publish's own thread hop (no hop of its own), the
    # retention delete lists the root once (was twice), the sweep after the publish spares what the versions
    # reference as known without listing the root again (was once more): 2 listings per commit, not 4
    root = tmp_path / "t"
    async with AsymStore([LocalTier(root)], keep_last=2, compression="never") as store:
        for step in (1, 2, 3):
            await commit(store, step)
        hops = count_hops(monkeypatch)
        for step in (4, 5, 6):
            before = len(hops)
            await commit(store, step)
            mine = hops[before:]
            assert mine.count("_list_sync") == 2, mine  # the delete's and the store's list_versions
            assert "atomic_write" not in mine, mine
            assert mine.count("_publish_sync") == 1 and mine.count("sweep_directory") == 1, mine
            assert (root / LATEST).read_text() == f"{step}\n"
            assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == [
                version_dirname(step - 1), version_dirname(step)]
    async with AsymStore([LocalTier(root)], keep_last=2, compression="never") as store:
        ckpt = await store.restore()
        assert ckpt.step == 6 and torch.equal(ckpt.tensors["w"], torch.arange(4096, dtype=torch.float32) + 6)


async def test_latest_that_the_publish_cannot_replace_is_written_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the version is committed whatever happens to the hint: a failure to replace LATEST in the publish's hop
    # is logged, and write_latest replaces it right after (in a hop of its own)
    from asymstore.io import files
    from asymstore.tiers import local

    root = tmp_path / "t"
    async with AsymStore([LocalTier(root)], keep_last=3, compression="never") as store:
        await commit(store, 1)
        real = files.atomic_write
        failed: list[str] = []

        def once(path: str, data: bytes, **kw: Any) -> None:
            if not failed:
                failed.append(path)
                raise OSError(28, "No space left on device")
            real(path, data, **kw)

        monkeypatch.setattr(local, "atomic_write", once)
        await store.put(2, "w", torch.arange(4096, dtype=torch.float32) + 2)
        await store.commit(2)
        assert failed == [str(root / LATEST)]
        assert (root / LATEST).read_text() == "2\n"
        assert sorted(await store.tiers[0].list_versions()) == [1, 2]

