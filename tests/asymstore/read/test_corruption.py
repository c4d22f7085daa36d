"""Damaged versions on disk: fsck names them, restore falls back, repair quarantines, good data survives."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.errors import StepCommittedError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import LATEST, QUARANTINE, version_dirname
from asymstore.format.parse import parse_manifest
from asymstore.values import Checkpoint
from tests.support.store import fsck_json, make_state, same_state, store_kw

STEPS = (10, 20, 30)


async def commit(root: Path, *steps: int, compression: str = "never") -> None:
    async with AsymStore([LocalTier(root)], keep_last=None, **store_kw(compression)) as store:
        for step in steps:
            await store.put_many(step, make_state(step))
            await store.commit(step, meta={"step": step})


async def restore(root: Path, step: int | None = None) -> Checkpoint:
    async with AsymStore([LocalTier(root)], **store_kw()) as store:
        return await store.restore(step)


def check(ckpt: Checkpoint, step: int, *, fell_back: bool = False, salt: int = 0) -> None:
    assert ckpt.step == step
    assert ckpt.fell_back is fell_back, ckpt.fallbacks
    assert same_state(ckpt.tensors, make_state(step, salt))


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in report["versions"]}


def last_segment(root: Path, step: int) -> tuple[Path, int]:
    """The last segment the manifest of ``step`` lists, and its size there."""
    vdir = root / version_dirname(step)
    seg = parse_manifest((vdir / MANIFEST_NAME).read_bytes()).segments[-1]
    assert (vdir / seg.name).stat().st_size == seg.size > 100
    return vdir / seg.name, seg.size


# each damages the newest version and returns a problem fsck must name
def flip_byte(root: Path, step: int) -> str:
    path, size = last_segment(root, step)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    return f"segment {path.name}: checksum mismatch"


def truncate(root: Path, step: int) -> str:
    path, size = last_segment(root, step)
    os.truncate(path, size - 100)
    return f"{path.name} has {size - 100} bytes, the manifest says {size}"


def remove_segment(root: Path, step: int) -> str:
    path, _ = last_segment(root, step)
    path.unlink()
    return f"segment {path.name} of step {step} missing"


def garbage_manifest(root: Path, step: int) -> str:
    (root / version_dirname(step) / MANIFEST_NAME).write_bytes(b'{"format": "asymstore.manifest", \x00\xff garbage')
    return "bad manifest: manifest is not strict JSON"


# damage -> (whether only --deep sees it)
DAMAGE: dict[str, tuple[Callable[[Path, int], str], bool]] = {
    "flipped_byte": (flip_byte, True),
    "truncated_segment": (truncate, False),
    "missing_segment": (remove_segment, False),
    "garbage_manifest": (garbage_manifest, False),
}


@pytest.mark.parametrize("compression", ["never", "always"])
@pytest.mark.parametrize("kind", DAMAGE)
async def test_damaged_newest_version(tmp_path: Path, kind: str, compression: str) -> None:
    damage, deep = DAMAGE[kind]
    flags = ["--deep"] if deep else []
    await commit(tmp_path, *STEPS, compression=compression)
    newest = version_dirname(30)
    problem = damage(tmp_path, 30)

    if deep:  # a plain fsck only checks sizes: a flipped byte needs --deep
        rc, report = fsck_json(str(tmp_path))
        assert rc == 0 and by_name(report)[newest]["status"] == "committed"
    rc, report = fsck_json(*flags, str(tmp_path))
    assert rc == 1
    assert report["ok"] is False
    bad = by_name(report)[newest]
    assert bad["status"] == "corrupt" and bad["ok"] is False
    assert any(problem in p for p in bad["problems"]), bad["problems"]
    assert [v["status"] for v in report["versions"]] == ["committed", "committed", "corrupt"]
    assert report["newest_restorable"] == 20
    assert report["latest"] == 30
    assert report["latest_problem"] == "points to step 30, which is not a committed version"
    assert any(p.startswith(f"{newest}: corrupt: ") for p in report["problems"])

    ckpt = await restore(tmp_path)
    check(ckpt, 20, fell_back=True)
    assert len(ckpt.fallbacks) == 1 and ckpt.fallbacks[0].startswith("step 30 on local:")

    rc, fixed = fsck_json("--repair", *flags, str(tmp_path))
    assert rc == 0, fixed["problems"]
    assert fixed["repaired"][0].startswith(f"moved corrupt {newest} to ")
    assert fixed["repaired"][-1] == "set LATEST to 20"
    rc, after = fsck_json("--deep", str(tmp_path))
    assert rc == 0, after["problems"]
    assert [(v["status"], v["step"]) for v in after["versions"]] == [
        ("quarantined", 30), ("committed", 10), ("committed", 20)]
    assert after["latest"] == 20
    (moved,) = os.listdir(tmp_path / QUARANTINE)
    assert moved.startswith(f"{newest}-")  # kept for inspection, not deleted
    check(await restore(tmp_path), 20)
    check(await restore(tmp_path, 10), 10)


@pytest.mark.parametrize(("content", "latest", "problem"), [
    ("99\n", 99, "points to step 99, which is not a committed version"),
    ("20\n", 20, "says 20, newest restorable version is 30"),
    ("not a step\n", None, "unreadable (not a step number)"),
    (None, None, "missing; newest restorable version is 30"),
])
async def test_bad_latest(tmp_path: Path, content: str | None, latest: int | None, problem: str) -> None:
    await commit(tmp_path, *STEPS)
    if content is None:
        (tmp_path / LATEST).unlink()
    else:
        (tmp_path / LATEST).write_text(content)
    rc, report = fsck_json(str(tmp_path))
    assert rc == 1
    assert report["latest"] == latest
    assert report["latest_problem"] == problem
    assert report["problems"] == [f"LATEST: {problem}"]
    assert all(v["ok"] for v in report["versions"])
    check(await restore(tmp_path), 30)  # LATEST is a hint: restore trusts manifests

    rc, fixed = fsck_json("--repair", str(tmp_path))
    assert rc == 0 and fixed["repaired"] == ["set LATEST to 30"]
    assert (tmp_path / LATEST).read_text() == "30\n"
    rc, after = fsck_json("--deep", str(tmp_path))
    assert rc == 0, after["problems"]
    for step in STEPS:
        check(await restore(tmp_path, step), step)


async def test_recommit_over_corrupt_newest(tmp_path: Path) -> None:
    await commit(tmp_path, *STEPS)
    seg, size = last_segment(tmp_path, 30)
    truncate(tmp_path, 30)
    redo = make_state(30, salt=1)  # training resumed from 20 computes a different step 30
    async with AsymStore([LocalTier(tmp_path)], keep_last=None, **store_kw()) as store:
        with pytest.raises(StepCommittedError):  # not known to be corrupt before a restore tried it
            await store.put_many(30, redo)
        ckpt = await store.restore()
        check(ckpt, 20, fell_back=True)
        assert store.newest_step == 20
        await store.put_many(30, redo)
        result = await store.commit(30, meta={"step": 30, "redo": True})
        assert result.tiers == [f"local:{tmp_path}"]
    (moved,) = os.listdir(tmp_path / QUARANTINE)  # the corrupt copy was moved aside, not overwritten
    assert moved.startswith(version_dirname(30))
    assert (tmp_path / QUARANTINE / moved / seg.name).stat().st_size == size - 100

    ckpt = await restore(tmp_path)
    check(ckpt, 30, salt=1)
    assert ckpt.meta == {"step": 30, "redo": True}
    rc, report = fsck_json("--deep", str(tmp_path))
    assert rc == 0, report["problems"]
    assert report["latest"] == 30
    assert sorted((v["status"], v["step"]) for v in report["versions"]) == [
        ("committed", 10), ("committed", 20), ("committed", 30), ("quarantined", 30)]


async def test_corrupt_fast_tier_restores_from_local(tmp_path: Path, shm_dir: str) -> None:
    local_root = tmp_path / "local"

    def tiers() -> list[Any]:
        return [host_tier(1 << 20, path=shm_dir, name="host"), LocalTier(local_root, name="disk")]

    async with AsymStore(tiers(), keep_last=None, **store_kw()) as store:
        for step in STEPS:
            await store.put_many(step, make_state(step))
            result = await store.commit(step, meta={"step": step})
            assert result.tiers == ["host", "disk"]
        assert store.versions() == {"host": list(STEPS), "disk": list(STEPS)}
    assert flip_byte(Path(shm_dir), 30).endswith("checksum mismatch")

    rc, report = fsck_json("--deep", shm_dir)
    assert rc == 1 and by_name(report)[version_dirname(30)]["status"] == "corrupt"
    async with AsymStore(tiers(), keep_last=None, **store_kw()) as store:
        ckpt = await store.restore()
        check(ckpt, 30, fell_back=True)
        assert ckpt.tier == "disk"  # same step, slower tier: no need to go back to step 20
        assert len(ckpt.fallbacks) == 1 and ckpt.fallbacks[0].startswith("step 30 on host:")
        older = await store.restore(20)
        check(older, 20)
        assert older.tier == "host"  # the fast tier still serves what verifies
    rc, report = fsck_json("--deep", str(local_root))
    assert rc == 0, report["problems"]
