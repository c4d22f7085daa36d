"""Round trips through the store for every dtype and shape class, and concurrent puts."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.format.checksum import checksum
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.parse import parse_manifest
from tests.support.tensors import DTYPES, SHAPES, assert_same, random_tensor


@pytest.fixture(params=["local", "host-memory", "host-shm"])
def tiers(request: pytest.FixtureRequest, tmp_path: object) -> list[object]:
    root = str(tmp_path)
    if request.param == "local":
        return [LocalTier(os.path.join(root, "disk"))]
    if request.param == "host-memory":
        return [host_tier(capacity_bytes=64 << 20)]
    return [host_tier(capacity_bytes=64 << 20, path=os.path.join(root, "shm"))]


async def test_every_dtype_and_shape_round_trips(tiers: list[object]) -> None:
    expected: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            expected[f"{dtype}.{j}"] = random_tensor(dtype, shape, seed=i * 100 + j)
    async with AsymStore(tiers) as store:  # type: ignore[arg-type]
        await store.put_many(1, expected)
        await store.commit(1)
        ckpt = await store.restore()
    assert ckpt.step == 1
    assert set(ckpt.tensors) == set(expected)
    for name, tensor in expected.items():
        assert_same(ckpt.tensors[name], tensor)


async def test_non_contiguous_and_views_restore_as_values(tmp_path: object) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    inputs = {
        "transposed": base.transpose(0, 2),
        "strided": base[:, ::2, 1::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "neg_view": torch._neg_view(torch.randn(4)),
        "requires_grad": torch.randn(3, requires_grad=True),
    }
    async with AsymStore([LocalTier(str(tmp_path))]) as store:
        await store.put_many(0, inputs)
        await store.commit(0)
        ckpt = await store.restore()
    for name, tensor in inputs.items():
        restored = ckpt.tensors[name]
        assert restored.is_contiguous()
        assert not restored.requires_grad
        assert_same(restored, tensor.detach().resolve_conj().resolve_neg().contiguous())


async def test_put_copies_so_later_writes_do_not_leak(tmp_path: object) -> None:
    t = torch.zeros(1000)
    async with AsymStore([LocalTier(str(tmp_path))]) as store:
        await store.put(0, "w", t)
        t.add_(1)  # the caller moves on before commit
        await store.commit(0)
        ckpt = await store.restore()
    assert torch.count_nonzero(ckpt.tensors["w"]) == 0


async def test_hundreds_of_concurrent_puts(tmp_path: object) -> None:
    tensors = {f"layer.{i}.w": torch.full((i % 17 + 1, 3), float(i)) for i in range(400)}
    tensors["big"] = torch.randn(1 << 19)  # 2 MiB: staged in a thread
    async with AsymStore([LocalTier(str(tmp_path))], segment_bytes=1 << 20) as store:
        await asyncio.gather(*(store.put(3, n, t) for n, t in reversed(list(tensors.items()))))
        result = await store.commit(3)
        ckpt = await store.restore()
    assert len(result.manifest.segments) >= 3  # 2 MiB + a bit in 1 MiB segments
    for name, tensor in tensors.items():
        assert_same(ckpt.tensors[name], tensor)


async def test_large_tensor_split_into_chunks_and_segments(tmp_path: object) -> None:
    big = torch.randn(3 << 18)  # 3 MiB
    async with AsymStore([LocalTier(str(tmp_path))], segment_bytes=1 << 20) as store:
        await store.put(0, "big", big)
        result = await store.commit(0)
        ckpt = await store.restore()
    entry = result.manifest.tensors["big"]
    assert len(entry.chunks) == 3
    assert len({c.segment for c in entry.chunks}) == 3
    assert_same(ckpt.tensors["big"], big)


async def test_manifest_is_json_with_checksums_and_meta(tmp_path: object) -> None:
    meta = {"lr": 1e-3, "note": "ünïcode", "nested": {"a": [1, 2, None, True]}}
    async with AsymStore([LocalTier(str(tmp_path))]) as store:
        await store.put(5, "w", torch.ones(4))
        await store.commit(5, meta=meta)
        ckpt = await store.restore()
    assert ckpt.meta == meta
    raw = (tmp_path / "v000000000005" / MANIFEST_NAME).read_bytes()  # type: ignore[operator]
    doc = json.loads(raw)
    assert doc["format"] == "asymstore.manifest" and doc["format_version"] == 5  # segments proved by their chunks
    # the manifest's own checksum: xxh3 of every byte before its closing key
    cut = raw.rindex(b',"manifest_checksum":')
    assert raw[cut:] == b',"manifest_checksum":"' + checksum(raw[:cut]).encode() + b'"}'
    chunk = doc["tensors"]["w"]["chunks"][0]
    assert len(chunk["checksum"]) == 16 and chunk["codec"] == "raw"
    assert parse_manifest(raw).step == 5
    assert b"pickle" not in raw and not any(f.endswith((".pt", ".pkl")) for f in os.listdir(tmp_path / "v000000000005"))  # type: ignore[operator]


async def test_retention_keeps_last_and_latest(tmp_path: object) -> None:
    async with AsymStore([LocalTier(str(tmp_path))], keep_last=2) as store:
        for step in (1, 4, 9, 10):
            await store.put(step, "w", torch.tensor(step))
            await store.commit(step)
        assert store.versions() == {f"local:{tmp_path}": [9, 10]}
        assert await store.tiers[0].read_latest() == 10
        old = await store.restore(step=9)
    assert old.tensors["w"].item() == 9
    assert sorted(os.listdir(tmp_path)) == [".lock", "LATEST", "v000000000009", "v000000000010"]


async def test_store_reopens_and_continues(tmp_path: object) -> None:
    async with AsymStore([LocalTier(str(tmp_path))]) as store:
        await store.put(1, "w", torch.tensor(1))
        await store.commit(1)
    async with AsymStore([LocalTier(str(tmp_path))]) as store:
        assert store.newest_step == 1
        await store.put(2, "w", torch.tensor(2))
        await store.commit(2)
        assert (await store.restore()).step == 2
        assert (await store.restore(step=1)).tensors["w"].item() == 1


async def test_two_tiers_commit_to_both_and_restore_from_fastest(tmp_path: object) -> None:
    host = host_tier(capacity_bytes=1 << 20)
    disk = LocalTier(str(tmp_path))
    async with AsymStore([host, disk]) as store:
        assert store.durable_tier is disk
        await store.put(0, "w", torch.arange(10))
        result = await store.commit(0)
        assert result.tiers == [host.name, disk.name]
        ckpt = await store.restore()
        assert ckpt.tier == host.name
    async with AsymStore([host_tier(capacity_bytes=1 << 20), LocalTier(str(tmp_path))]) as store:
        ckpt = await store.restore()  # a new process has an empty host tier: disk answers
        assert ckpt.tier == disk.name and torch.equal(ckpt.tensors["w"], torch.arange(10))


async def test_host_tier_too_small_is_skipped_not_fatal(tmp_path: object) -> None:
    host = host_tier(capacity_bytes=1024)
    async with AsymStore([host, LocalTier(str(tmp_path))]) as store:
        await store.put(0, "w", torch.zeros(4096))
        result = await store.commit(0)
        assert result.tiers == [f"local:{tmp_path}"]
        assert host.high_water_bytes <= 1024
        assert (await store.restore()).step == 0


async def test_background_tier_after_durable_flushes(tmp_path: object) -> None:
    first = LocalTier(str(tmp_path / "a"))  # type: ignore[operator]
    second = LocalTier(str(tmp_path / "b"), name="second")  # type: ignore[operator]
    async with AsymStore([first, second], durable=first) as store:
        await store.put(0, "w", torch.ones(3))
        await store.commit(0)
        await store.flushed(0)
        assert store.versions()["second"] == [0]
    async with AsymStore([LocalTier(str(tmp_path / "b"))]) as store:  # type: ignore[operator]
        assert torch.equal((await store.restore()).tensors["w"], torch.ones(3))
