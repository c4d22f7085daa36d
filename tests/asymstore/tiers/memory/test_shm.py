"""host_tier on /dev/shm: versions survive a killed process, and capacity is never exceeded."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from asymstore import AsymStore, CapacityError, VersionNotFoundError, host_tier
from tests.support.store import committed_steps, fsck_json, make_state, same_state, spawn, store_kw


async def version_bytes() -> int:
    """Bytes a host_tier reserves for one version of ``make_state`` (segments plus a manifest bound)."""
    host = host_tier()
    async with AsymStore([host], **store_kw()) as store:
        await store.put_many(10, make_state(10))
        await store.commit(10, meta={"step": 10})
    assert host.high_water_bytes > 0
    return host.high_water_bytes


def shm_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and f.parent != Path(path))


async def test_restart_restores_from_shm(shm_dir: str) -> None:
    size = await version_bytes()
    capacity = size * 5 // 2  # room for two versions
    child = spawn("shm", shm_dir, "3", str(capacity))
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, err
    assert committed_steps(out) == [10, 20, 30]

    host = host_tier(capacity, path=shm_dir)
    async with AsymStore([host], keep_last=None, **store_kw()) as store:
        assert store.versions() == {host.name: [20, 30]}  # 10 was evicted for 30
        assert store.durable_tier is host and not host.persistent
        assert host.used_bytes == shm_bytes(shm_dir) > 0  # what the dead process left is accounted for
        ckpt = await store.restore()
        assert (ckpt.step, ckpt.tier, ckpt.meta, ckpt.fell_back) == (30, host.name, {"step": 30}, False)
        assert same_state(ckpt.tensors, make_state(30))
        assert same_state((await store.restore(20)).tensors, make_state(20))

        await store.put_many(40, make_state(40))  # training goes on after the restart
        await store.commit(40, meta={"step": 40})
        assert store.versions() == {host.name: [30, 40]}
        assert host.used_bytes <= capacity and host.high_water_bytes <= capacity
    assert shm_bytes(shm_dir) <= capacity
    rc, report = fsck_json("--deep", shm_dir)
    assert rc == 0, report["problems"]
    assert report["latest"] == 40


@pytest.mark.parametrize("where", ["shm", "memory"])
async def test_capacity_eviction(request: pytest.FixtureRequest, where: str) -> None:
    shm_dir: str = request.getfixturevalue("shm_dir") if where == "shm" else ""
    size = await version_bytes()
    capacity = size * 5 // 2
    host = host_tier(capacity, path=shm_dir or None)
    async with AsymStore([host], keep_last=None, **store_kw()) as store:
        for step in (10, 20, 30, 40):
            await store.put_many(step, make_state(step))
            result = await store.commit(step, meta={"step": step})
            assert result.tiers == [host.name]
            assert len(await host.list_versions()) <= 2
            assert host.used_bytes <= capacity
            if where == "shm":
                assert shm_bytes(shm_dir) <= capacity
        assert store.versions() == {host.name: [30, 40]}
        assert size < host.high_water_bytes <= capacity  # two versions were held at once, never three
        ckpt = await store.restore()
        assert ckpt.step == 40 and same_state(ckpt.tensors, make_state(40))
        with pytest.raises(VersionNotFoundError):
            await store.restore(20)


async def test_version_larger_than_capacity(shm_dir: str) -> None:
    size = await version_bytes()
    host = host_tier(size * 3 // 2, path=shm_dir)
    async with AsymStore([host], keep_last=None, **store_kw()) as store:
        await store.put_many(10, make_state(10))
        await store.commit(10, meta={"step": 10})
        big = make_state(20) | {"extra": make_state(21)["w"]}
        await store.put_many(20, big)
        with pytest.raises(CapacityError):
            await store.commit(20)
        assert host.used_bytes <= host.capacity_bytes and host.high_water_bytes <= host.capacity_bytes
        ckpt = await store.restore()
        assert ckpt.step == 10 and same_state(ckpt.tensors, make_state(10))
    assert [e for e in os.listdir(shm_dir) if e.startswith(".tmp-")] == []
