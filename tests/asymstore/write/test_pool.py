"""The host pipeline's pool (asymstore/write/pool.py): same bytes as one thread, failures, the memory bound."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asymstore import AsymStore, LocalTier, TierCalibration, host_tier
from asymstore.errors import TierError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import TMP_PREFIX, version_dirname
from asymstore.policy.compression import Compression
from asymstore.testing import FailingSegmentTier
from asymstore.tiers.protocol import Buffer, Tier
from asymstore.write import segments, staging
from asymstore.write.pool import MAX_DEFAULT_THREADS, default_threads, host_cpus, quota_cpus
from tests.support.tensors import assert_same, random_tensor

_CAL = TierCalibration.from_throughput(500e6, 0.001)  # given: the same decisions in every store
_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.int16]


def _store(tiers: Sequence[Tier], threads: int, **kw: Any) -> AsymStore:
    return AsymStore(tiers, pipeline_threads=threads, calibration_cache=False,
                     calibrations={t.name: _CAL for t in tiers}, **kw)


async def _commit(tier: Tier, threads: int, steps: list[dict[str, torch.Tensor]], **kw: Any) -> list[Any]:
    results = []
    async with _store([tier], threads, **kw) as store:
        for step, tensors in enumerate(steps):
            if len(tensors) >= 32:
                await store.put_many(step, tensors)  # packs
            else:
                for name, t in tensors.items():
                    await store.put(step, name, t)
            results.append(await store.commit(step))
    return results


def _version_files(root: str, step: int) -> dict[str, bytes]:
    vdir = os.path.join(root, version_dirname(step))
    out = {}
    for name in sorted(os.listdir(vdir)):
        with open(os.path.join(vdir, name), "rb") as f:
            data = f.read()
        if name == MANIFEST_NAME:
            doc = json.loads(data)
            doc.pop("created")  # the commit's wall-clock time, and the checksum that covers it
            doc.pop("manifest_checksum")
            data = json.dumps(doc, sort_keys=True).encode()
        out[name] = data
    return out


@st.composite
def _versions(draw: st.DrawFn) -> list[dict[str, torch.Tensor]]:
    steps = []
    for step in range(draw(st.integers(1, 2))):
        tensors = {}
        for i in range(draw(st.integers(1, 8))):
            dtype = draw(st.sampled_from(_DTYPES))
            numel = draw(st.sampled_from([0, 1, 7, 1000, 40_000, 70_000, 150_000]))
            t = random_tensor(dtype, (numel,), seed=draw(st.integers(0, 2**16)))
            if numel and draw(st.booleans()):  # 4 random bits a byte: zstd shrinks it (else stored raw)
                t = (t.view(torch.uint8) & 0x0F).view(dtype)
            tensors[f"s{step}.t{i}"] = t
        if draw(st.booleans()):  # a batch of small tensors: packs
            for i in range(40):
                tensors[f"s{step}.small{i}"] = random_tensor(torch.float32, (draw(st.integers(0, 300)),), seed=i)
        steps.append(tensors)
    return steps


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_versions(), threads=st.integers(2, 6),
       segment_bytes=st.sampled_from([None, 64 << 10, 200 << 10, 1 << 20]),
       chunk_bytes=st.sampled_from([None, 32 << 10, 100_000]),
       compression=st.sampled_from(["never", "always"]),  # "auto" decides from timings: not the same twice
       memory=st.sampled_from([256 << 10, 1 << 20, 256 << 20]))
def test_pool_writes_the_same_segments_and_manifests_as_one_thread(
        steps: list[dict[str, torch.Tensor]], threads: int, segment_bytes: int | None, chunk_bytes: int | None,
        compression: Compression, memory: int) -> None:
    kw: dict[str, Any] = {"segment_bytes": segment_bytes, "chunk_bytes": chunk_bytes, "compression": compression,
                          "flush_memory_bytes": memory, "keep_last": None}
    with tempfile.TemporaryDirectory() as root:
        one, many = os.path.join(root, "one"), os.path.join(root, "many")
        first = asyncio.run(_commit(LocalTier(one), 1, steps, **kw))
        pooled = asyncio.run(_commit(LocalTier(many), threads, steps, **kw))
        for step in range(len(steps)):
            assert first[step].flush[f"local:{one}"].pipeline_threads == 1
            assert pooled[step].flush[f"local:{many}"].pipeline_threads == threads
            assert _version_files(one, step) == _version_files(many, step)

        async def restore() -> dict[str, torch.Tensor]:
            async with _store([LocalTier(many)], threads) as store:
                return dict((await store.restore()).tensors)
        restored = asyncio.run(restore())
    assert set(restored) == set(steps[-1])
    for name, t in steps[-1].items():
        assert_same(restored[name], t)


@pytest.mark.parametrize("kind", ["host-shm", "host-memory"])
async def test_pool_writes_host_tiers_like_one_thread(kind: str, shm_dir: str) -> None:
    """The shared-memory tier takes writes from the pool's threads; process memory gets them in order."""
    tensors = {f"t{i}": random_tensor(torch.float32, (30_000 + i,), seed=i) for i in range(12)}
    manifests = []
    for threads in (1, 4):
        path = os.path.join(shm_dir, f"t{threads}") if kind == "host-shm" else None
        tier = host_tier(64 << 20, path=path)
        async with _store([tier], threads, segment_bytes=100 << 10, flush_memory_bytes=1 << 20) as store:
            await store.put_many(3, tensors)
            result = await store.commit(3)
            assert result.flush[tier.name].pipeline_threads == threads
            assert result.flush[tier.name].segments > 4
            doc = json.loads(await tier.read_manifest(3))
            doc.pop("created")
            doc.pop("manifest_checksum")
            manifests.append(doc)
            ckpt = await store.restore()
        for name, t in tensors.items():
            assert_same(ckpt.tensors[name], t)
    assert manifests[0] == manifests[1]


class _MeteredTier(LocalTier):
    """A real LocalTier that records how many segment bytes are being written at once, and by which threads."""

    def __init__(self, root: str, *, delay_s: float = 0.0, barrier: threading.Barrier | None = None) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self.barrier = barrier
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.threads: set[str] = set()

    def _write_segment_file(self, path: str, parts: Sequence[Buffer]) -> None:
        size = sum(len(p) for p in parts)
        with self.lock:
            self.now += size
            self.most = max(self.most, self.now)
            self.threads.add(threading.current_thread().name)
        try:
            if self.barrier is not None:
                self.barrier.wait()  # BrokenBarrierError unless another segment write runs at the same time
            time.sleep(self.delay_s)
            super()._write_segment_file(path, parts)
        finally:
            with self.lock:
                self.now -= size


async def test_pool_writes_segments_at_the_same_time(tmp_path: object) -> None:
    tier = _MeteredTier(str(tmp_path), barrier=threading.Barrier(2, timeout=10))
    tensors = {f"t{i}": random_tensor(torch.float32, (16_384,), seed=i) for i in range(6)}  # 64 KiB each
    async with _store([tier], 3, segment_bytes=64 << 10, flush_memory_bytes=1 << 20, compression="never") as store:
        await store.put_many(0, tensors)
        await store.commit(0)
        ckpt = await store.restore()
    assert all(name.startswith("asymstore-pipeline") for name in tier.threads)
    for name, t in tensors.items():
        assert_same(ckpt.tensors[name], t)


@pytest.mark.parametrize("compression", ["never", "always"])
async def test_segments_in_flight_stay_within_the_flush_memory_budget(tmp_path: object, compression: str) -> None:
    seg = 64 << 10
    budget = 3 * seg
    tier = _MeteredTier(str(tmp_path), delay_s=0.02)
    tensors = {f"t{i}": random_tensor(torch.float32, (16_384,), seed=i) for i in range(24)}  # 64 KiB each
    async with _store([tier], 8, segment_bytes=seg, flush_memory_bytes=budget, compression=compression,
                      chunk_bytes=seg) as store:
        await store.put_many(0, tensors)
        result = await store.commit(0)
        ckpt = await store.restore()
    stats = result.flush[tier.name]
    assert stats.segments == 24
    assert seg < tier.most <= budget  # several at once, never more than the budget
    assert tier.most <= stats.inflight_peak_bytes <= budget  # and reported
    for name, t in tensors.items():
        assert_same(ckpt.tensors[name], t)


async def test_pool_compresses_chunks_at_the_same_time(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks planned compressed are encoded ahead of the layout on the pool's threads, two at once at least."""
    barrier = threading.Barrier(2, timeout=10)
    encoders: set[str] = set()
    real = segments.encode

    def encode(*args: Any, **kwargs: Any) -> Any:
        encoders.add(threading.current_thread().name)
        barrier.wait()  # BrokenBarrierError unless another chunk is being encoded at the same time
        return real(*args, **kwargs)

    tensors = {f"t{i}": (torch.randn(1 << 20) * 0.02).to(torch.bfloat16) for i in range(4)}  # 2 MiB each
    kw: dict[str, Any] = {"segment_bytes": 2 << 20, "flush_memory_bytes": 16 << 20, "compression": "always",
                          "chunk_bytes": 1 << 20}
    one, many = os.path.join(str(tmp_path), "one"), os.path.join(str(tmp_path), "many")
    await _commit(LocalTier(one), 1, [tensors], **kw)  # zstd with one worker per CPU
    monkeypatch.setattr(segments, "encode", encode)
    async with _store([LocalTier(many)], 3, **kw) as store:
        await store.put_many(0, tensors)
        result = await store.commit(0)
        ckpt = await store.restore()
    assert result.flush[f"local:{many}"].chunks_compressed == 8
    assert len(encoders) >= 2 and all(name.startswith("asymstore-pipeline") for name in encoders)
    for name, t in tensors.items():
        assert_same(ckpt.tensors[name], t)
    assert _version_files(one, 0) == _version_files(many, 0)  # one zstd worker per chunk: the same frames


async def test_pool_stages_large_tensors_on_its_threads(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """put and adopt copy and hash a large tensor on the pool's threads: the pool bounds them too."""
    hashers: set[str] = set()
    real = staging.checksum

    def checksum(data: Any) -> str:
        hashers.add(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr(staging, "checksum", checksum)
    tensors = {f"t{i}": random_tensor(torch.float32, (1 << 19,), seed=i) for i in range(3)}  # 2 MiB: not inline
    async with _store([LocalTier(str(tmp_path))], 3) as store:
        await store.put(0, "t0", tensors["t0"])
        await store.adopt_many(0, {"t1": tensors["t1"], "t2": tensors["t2"]})
        await store.commit(0)
        ckpt = await store.restore()
    assert hashers and all(name.startswith("asymstore-pipeline") for name in hashers)
    for name, t in tensors.items():
        assert_same(ckpt.tensors[name], t)


async def test_a_failed_pooled_write_keeps_the_last_version(tmp_path: object) -> None:
    root = str(tmp_path)
    tier = FailingSegmentTier(root, after=8, delay_s=0.05)  # step 0's 6 segments, then the 3rd of step 1 fails
    old = {f"t{i}": random_tensor(torch.bfloat16, (32_768,), seed=i) for i in range(6)}
    new = {name: t + 1 for name, t in old.items()}
    async with _store([tier], 4, segment_bytes=64 << 10, flush_memory_bytes=1 << 20, compression="never") as store:
        await store.put_many(0, old)
        await store.commit(0)
        await store.put_many(1, new)
        with pytest.raises(TierError, match="no space left"):
            await store.commit(1)
        assert tier.failed_in is not None and tier.failed_in.startswith("asymstore-pipeline")
        await asyncio.sleep(0.2)  # a straggling write would land in the aborted directory meanwhile
        assert not [e for e in os.listdir(root) if e.startswith(TMP_PREFIX)]
        assert await tier.list_versions() == [0]
        ckpt = await store.restore()
        assert ckpt.step == 0
        for name, t in old.items():
            assert_same(ckpt.tensors[name], t)
        await store.commit(1)  # the failure was once: the retry commits
        assert (await store.restore()).step == 1


def test_a_cgroup_quota_bounds_the_host_cpus(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "cpu.max")
    for text, cpus in [("max 100000\n", None), ("400000 100000\n", 4), ("150000 100000\n", 2),
                       ("1000 100000\n", 1), ("garbage\n", None)]:
        with open(path, "w") as f:
            f.write(text)
        assert quota_cpus(path) == cpus
    assert quota_cpus(os.path.join(str(tmp_path), "missing")) is None
    assert 1 <= host_cpus() <= len(os.sched_getaffinity(0))


def test_default_threads_leave_cores_to_training() -> None:
    assert default_threads(cpus=1, ranks=1) == 1
    assert default_threads(cpus=2, ranks=1) == 1  # a 2-core machine: the pipeline as it was
    assert default_threads(cpus=16, ranks=1) == 8
    assert default_threads(cpus=16, ranks=8) == 1
    assert default_threads(cpus=96, ranks=4) == MAX_DEFAULT_THREADS
    with pytest.raises(ValueError):
        AsymStore([LocalTier(tempfile.gettempdir())], pipeline_threads=0)
