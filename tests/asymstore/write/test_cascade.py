"""The background cascade: dead remotes, back-pressure, cross-tier fallback, engines reading each other."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.errors import SnapshotSkippedError, TierError
from asymstore.format.names import version_dirname
from asymstore.fsck import check
from asymstore.testing_s3 import LoopbackS3
from asymstore.tiers.nvme import NVMeTier
from asymstore.tiers.protocol import Buffer, VersionWriter
from asymstore.tiers.remote.retry import RetryPolicy
from asymstore.tiers.remote.tier import RemoteTier

FAST = {"compression": "never", "segment_bytes": 256 << 10}


def state(step: int, n: int = 100_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(n // 10, generator=g).bfloat16(),
            "step": torch.tensor(step)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def test_dead_remote_never_blocks_and_catches_up(tmp_path: object, s3_server: LoopbackS3,
                                                       shm_dir: str) -> None:
    uri = s3_server.uri("cascade")
    nvme_root = os.path.join(str(tmp_path), "nvme")
    # a remote that gives a version up only after two 5 s back-offs: commits that waited for its retries
    # would return after it gave up; they must all return while it still retries (order, not a time bound)
    remote = RemoteTier(uri, retry=RetryPolicy(attempts=3, deadline_s=600.0, initial_s=5.0, max_backoff_s=5.0))
    tiers = [host_tier(64 << 20, path=shm_dir), NVMeTier(nvme_root, engine="posix"), remote]
    async with AsymStore(tiers, keep_last=3, **FAST) as store:  # type: ignore[arg-type]
        for step in range(3):
            await store.put_many(step, state(step))
            await store.commit(step)
        await store.flushed(timeout=30)
        assert store.status()[remote.name].newest == 2
        s3_server.stop()  # the remote dies, mid-stream
        for step in range(3, 8):
            await store.put_many(step, state(step))
            result = await asyncio.wait_for(store.commit(step), 300)  # (a hang guard: the remote never answers)
            assert remote.name not in result.tiers  # durable on NVMe, the remote is background work
        # every commit returned before the remote gave its first version up: none waited for its retries
        assert not store.status()[remote.name].last_error and store.status()[remote.name].newest == 2
        for _ in range(600):  # the flusher notices the outage on its own time (its first give-up takes ~10 s)
            status = store.status()[remote.name]
            if status.last_error:
                break
            await asyncio.sleep(0.1)
        assert status.newest == 2 and status.lag_versions == 5
        assert status.last_error and "Unavailable" in status.last_error and status.queue_depth >= 1
        with pytest.raises(TimeoutError):
            await store.flushed(tier=remote, timeout=0.5)
        s3_server.start()  # it comes back
        await store.flushed(timeout=60)
        status = store.status()[remote.name]
        assert status.newest == 7 and status.lag_versions == 0 and status.skipped >= 1
    async with AsymStore([RemoteTier(uri)], **FAST) as store:  # the remote alone: nothing lost
        versions = store.versions()[next(iter(store.versions()))]
        assert versions[-1] == 7 and len(versions) <= 3
        for step in versions:
            assert same((await store.restore(step=step)).tensors, state(step))
    fs, root = remote.fs, remote.root
    from pyarrow.fs import FileSelector
    leftovers = [i.base_name for i in fs.get_file_info(FileSelector(root)) if i.base_name != "LATEST"
                 and i.base_name not in {version_dirname(v) for v in versions}]
    assert leftovers == []  # no partial uploads left behind on the remote
    for root_dir in (shm_dir, nvme_root):
        assert check(root_dir, deep=True).ok


class SlowTier(LocalTier):
    """Fault injection: a persistent tier whose segment writes take ``delay`` seconds."""

    def __init__(self, root: str, delay: float) -> None:
        super().__init__(root, name="slow")
        self.delay = delay

    async def begin(self, step: int, nbytes: int) -> VersionWriter:
        writer = await super().begin(step, nbytes)
        delay = self.delay
        inner_write = writer.write_segment

        async def slow_write(name: str, parts: Sequence[Buffer]) -> None:
            await asyncio.sleep(delay)
            await inner_write(name, parts)

        writer.write_segment = slow_write  # type: ignore[method-assign]
        return writer


@pytest.mark.parametrize("policy", ["wait", "skip"])
async def test_back_pressure_with_a_pool_smaller_than_two_versions(tmp_path: object, policy: str) -> None:
    one = sum(t.numel() * t.element_size() for t in state(0).values())
    host = host_tier(int(one * 1.5), policy=policy)  # room for one version, not two
    slow = SlowTier(str(tmp_path), delay=0.6)
    async with AsymStore([host, slow], durable=host, keep_last=5, **FAST) as store:
        await store.put_many(0, state(0))
        await store.commit(0)  # durable in host memory; the slow tier has not got it yet
        await store.put_many(1, state(1))
        t0 = time.perf_counter()
        if policy == "wait":
            await store.commit(1)  # waits until step 0 reached the slow tier, then evicts it
            assert time.perf_counter() - t0 >= 0.3
            assert store.versions()[host.name] == [1]
        else:
            with pytest.raises(SnapshotSkippedError):
                await store.commit(1)  # full of a version nobody else has: skip, do not wait
            assert host.skipped == 1
            store.abandon(1)
        await store.flushed(timeout=30)
        assert host.high_water_bytes <= host.capacity_bytes
        expected = [0, 1] if policy == "wait" else [0]
        assert store.versions()["slow"] == expected
    async with AsymStore([LocalTier(str(tmp_path))], **FAST) as store:
        for step in expected:
            assert same((await store.restore(step=step)).tensors, state(step))


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


async def test_fallback_across_tiers_then_versions(tmp_path: object, shm_dir: str) -> None:
    disk = os.path.join(str(tmp_path), "disk")

    def tiers() -> list[object]:
        return [host_tier(64 << 20, path=shm_dir), NVMeTier(disk, engine="posix")]

    async with AsymStore(tiers(), **FAST) as store:  # type: ignore[arg-type]
        for step in (1, 2):
            await store.put_many(step, state(step))
            await store.commit(step)
    flip_byte(os.path.join(shm_dir, version_dirname(2), "seg-000000.bin"))
    async with AsymStore(tiers(), **FAST) as store:  # type: ignore[arg-type]
        ckpt = await store.restore()
        assert ckpt.step == 2 and ckpt.tier.startswith("nvme:") and len(ckpt.fallbacks) == 1
        assert same(ckpt.tensors, state(2))
    flip_byte(os.path.join(disk, version_dirname(2), "seg-000000.bin"))
    async with AsymStore(tiers(), **FAST) as store:  # type: ignore[arg-type]
        ckpt = await store.restore()
        assert ckpt.step == 1 and ckpt.tier.startswith("host:") and len(ckpt.fallbacks) == 2
        assert same(ckpt.tensors, state(1))


@pytest.mark.kvikio
async def test_kvikio_and_posix_engines_read_each_other(tmp_path: object, stub_libcuda: str) -> None:
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "b")
    big = {"x": torch.randn(3_000_001), "y": torch.arange(5).to(torch.int16)}  # unaligned sizes
    for root, engine in ((a, "kvikio"), (b, "posix")):
        async with AsymStore([NVMeTier(root, engine=engine, task_size=1 << 20)], compression="never") as store:
            await store.put_many(0, big)
            await store.commit(0)
    for root, engine in ((a, "posix"), (b, "kvikio")):
        tier = NVMeTier(root, engine=engine, task_size=1 << 20)
        assert tier.engine.name == engine
        async with AsymStore([tier]) as store:
            assert same((await store.restore()).tensors, big)
    for root in (a, b):
        assert check(root, deep=True).ok


class _Unlisting(LocalTier):
    """A LocalTier that cannot list its versions (a peer that is gone, a remote store that is down): a fault."""

    async def list_versions(self) -> list[int]:
        raise TierError(f"{self.name}: injected: cannot list")


async def test_a_tier_that_cannot_list_leaves_restores_to_the_others(tmp_path: Path) -> None:
    async with AsymStore([LocalTier(tmp_path / "a"), LocalTier(tmp_path / "b")], keep_last=None) as s:
        for step in (1, 2):
            await s.put_many(step, {"w": torch.full((4,), float(step))})
            await s.commit(step)
        await s.flushed()
    async with AsymStore([LocalTier(tmp_path / "a"), _Unlisting(tmp_path / "b")], keep_last=None) as s:
        ckpt = await s.restore()
        assert ckpt.step == 2 and ckpt.tier.startswith("local:")
        assert torch.equal(ckpt.tensors["w"], torch.full((4,), 2.0))
        status = s.status()[f"local:{tmp_path / 'b'}"]
        assert status.versions == [] and "cannot list" in (status.last_error or "")
    with pytest.raises(TierError, match="cannot list"):  # the durable tier must list: that is an error
        async with AsymStore([_Unlisting(tmp_path / "a"), LocalTier(tmp_path / "b")], keep_last=None):
            pass


async def test_a_disk_behind_a_memory_tier_warns_once_and_counts_the_versions_it_skips(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Memory first (durable), disk in the background: skipping is what it does at every fast step, not news."""
    from asymstore.testing import SlowLocalTier

    memory = host_tier(64 << 20)
    disk = SlowLocalTier(tmp_path, delay_s=0.3, name="disk")
    caplog.set_level("INFO", logger="asymstore.write.cascade")
    async with AsymStore([memory, disk], durable=memory, keep_last=2, **FAST) as store:
        for step in range(1, 8):  # the disk is busy with step 1 while steps 2..7 arrive: each replaces the last
            await store.put_many(step, state(step, 1000))
            await store.commit(step)
        await store.flushed(timeout=30)
        skipped = store.status()["disk"].skipped
        assert store.versions()["disk"][-1] == 7  # the newest reached the disk
    behind = [r for r in caplog.records if "is behind" in r.getMessage()]
    assert skipped >= 2 and len(behind) == skipped
    assert [r.levelname for r in behind] == ["WARNING"] + ["INFO"] * (skipped - 1)
    assert "status().skipped" in behind[0].getMessage()
