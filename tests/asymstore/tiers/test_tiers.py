"""One shared suite that every tier passes: round trip, publish atomicity, listing, deletion, bad names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from asymstore import AsymStore, BoundedTier, GPUTier, LocalTier, RootLockedError, Tier, host_tier
from asymstore.errors import DestinationMismatchError, ManifestError, StepCommittedError
from asymstore.fsck import check
from asymstore.tiers.nvme import NVMeTier
from asymstore.tiers.remote.tier import RemoteTier

TIERS = ["local", "host-memory", "host-shm", "gpu", "nvme-posix", "nvme-kvikio", "remote-file", "remote-s3"]


@pytest.fixture(params=[pytest.param(k, marks=pytest.mark.kvikio) if k == "nvme-kvikio" else k for k in TIERS])
def make_tier(request: pytest.FixtureRequest, tmp_path: object) -> Callable[[], Tier]:
    root = str(tmp_path)
    kind = request.param
    if kind == "local":
        return lambda: LocalTier(os.path.join(root, "local"))
    if kind == "host-memory":
        tier = host_tier(capacity_bytes=64 << 20)
        return lambda: tier  # one process-memory tier: "reopening" is the same object
    if kind == "gpu":
        gpu = GPUTier(capacity_bytes=64 << 20)  # the CPU device where CUDA is absent
        return lambda: gpu
    if kind == "host-shm":
        shm = request.getfixturevalue("shm_dir")
        return lambda: host_tier(capacity_bytes=64 << 20, path=shm)
    if kind == "nvme-posix":
        return lambda: NVMeTier(os.path.join(root, "nvme"), engine="posix", task_size=64 << 10)
    if kind == "nvme-kvikio":
        request.getfixturevalue("stub_libcuda")
        return lambda: NVMeTier(os.path.join(root, "nvme"), engine="kvikio", task_size=64 << 10)
    if kind == "remote-file":
        return lambda: RemoteTier(f"file://{root}/remote")
    uri = request.getfixturevalue("s3_uri")
    return lambda: RemoteTier(uri)


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "big": torch.randn(300_001, generator=g),  # odd size: exercises unaligned tails
        "bf16": torch.randn(77, 13, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(step),
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


async def test_round_trip_and_reopen(make_tier: Callable[[], Tier]) -> None:
    async with AsymStore([make_tier()], segment_bytes=512 << 10) as store:
        for step in (1, 2):
            await store.put_many(step, state(step))
            await store.commit(step)
        ckpt = await store.restore()
        assert ckpt.step == 2 and same(ckpt.tensors, state(2))
    tier = make_tier()
    if isinstance(tier, BoundedTier) and tier.path is None:  # GPUTier too
        return  # process memory is released when its store closes
    async with AsymStore([tier]) as store:
        assert list(store.versions().values()) == [[1, 2]]
        assert same((await store.restore(step=1)).tensors, state(1))
        assert await store.tiers[0].read_latest() == 2


async def test_unpublished_version_is_invisible_and_abort_cleans_up(make_tier: Callable[[], Tier]) -> None:
    tier = make_tier()
    await tier.open()
    writer = await tier.begin(7, 1024)
    await writer.write_segment("seg-000000.bin", [b"x" * 1000])
    assert 7 not in await tier.list_versions()  # written but not published
    await writer.abort()
    assert 7 not in await tier.list_versions()
    async with AsymStore([make_tier()]) as store:  # the step is still free to commit
        await store.put(7, "w", torch.ones(3))
        await store.commit(7)
        assert (await store.restore()).step == 7


async def test_publish_is_refused_for_a_committed_step(make_tier: Callable[[], Tier]) -> None:
    async with AsymStore([make_tier()]) as store:
        await store.put(3, "w", torch.ones(3))
        await store.commit(3)
        tier = store.tiers[0]
        with pytest.raises(StepCommittedError):
            writer = await tier.begin(3, 10)
            await writer.abort()
        assert torch.equal((await store.restore()).tensors["w"], torch.ones(3))


async def test_listing_and_deletion(make_tier: Callable[[], Tier]) -> None:
    async with AsymStore([make_tier()], keep_last=None) as store:
        for step in (2, 5, 11):
            await store.put(step, "w", torch.tensor(step))
            await store.commit(step)
        tier = store.tiers[0]
        assert await tier.list_versions() == [2, 5, 11]
        await tier.delete_version(5)
        assert await tier.list_versions() == [2, 11]
        await store.refresh()
        assert (await store.restore(step=2)).tensors["w"].item() == 2


async def test_retention_per_tier(make_tier: Callable[[], Tier]) -> None:
    tier = make_tier()
    tier.keep_last = 1
    async with AsymStore([tier], keep_last=5) as store:  # the tier's own keep_last wins
        for step in range(3):
            await store.put(step, "w", torch.tensor(step))
            await store.commit(step)
        assert await tier.list_versions() == [2]


@pytest.mark.parametrize("name", ["../escape.bin", "/abs.bin", "a/b.bin", ".hidden", "MANIFEST.json", ""])
async def test_bad_segment_names_never_escape(make_tier: Callable[[], Tier], name: str) -> None:
    tier = make_tier()
    await tier.open()
    writer = await tier.begin(1, 10)
    try:
        with pytest.raises(ManifestError):
            await writer.write_segment(name, [b"x"])
    finally:
        await writer.abort()
    with pytest.raises(ManifestError):
        await tier.read_segment(1, name)


# -- one writer per root, and what a dead writer leaves ------------------------

_KILLED_WRITER = """
import asyncio, os, signal, sys
import torch
from asymstore import AsymStore, host_tier, LocalTier
from asymstore.tiers.nvme import NVMeTier
from asymstore.tiers.remote.tier import RemoteTier

kind, where = sys.argv[1], sys.argv[2]
if kind == "host-shm":
    tier = host_tier(capacity_bytes=64 << 20, path=where)
elif kind.startswith("nvme"):
    tier = NVMeTier(where, engine="posix")  # same layout as kvikio's; the parent's writer uses its own engine
elif kind.startswith("remote"):
    tier = RemoteTier(where)
else:
    tier = LocalTier(where)

async def main() -> None:
    store = AsymStore([tier], segment_bytes=512 << 10)
    await store.open()
    await store.put(1, "w", torch.full((1000,), 1.0))
    await store.commit(1)
    writer = await tier.begin(2, 1 << 20)  # a commit in flight, as the kill finds it
    await writer.write_segment("seg-000000.bin", [b"x" * 4096])
    print("writing", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_one_writer_per_root(make_tier: Callable[[], Tier]) -> None:
    first = make_tier()
    if isinstance(first, BoundedTier) and first.path is None:
        pytest.skip("process memory: nothing another writer could share")
    async with AsymStore([first]) as store:
        second = make_tier()
        if isinstance(second, RemoteTier):
            second.lease.wait_s = 0.5
        with pytest.raises(RootLockedError, match=f"pid {os.getpid()} on "):
            async with AsymStore([second]):
                pass
        await store.put(1, "w", torch.ones(3))
        await store.commit(1)  # the refused writer changed nothing
        assert (await store.restore()).step == 1
    async with AsymStore([make_tier()]) as store:  # the root is free again once the first store closed
        assert (await store.restore()).step == 1


async def test_killed_writer_leaves_nothing_after_the_next_publish(make_tier: Callable[[], Tier],
                                                                   request: pytest.FixtureRequest) -> None:
    tier = make_tier()
    if isinstance(tier, BoundedTier) and tier.path is None:
        pytest.skip("process memory dies with the writer")
    where = tier.path if isinstance(tier, BoundedTier) else (
        tier.root if isinstance(tier, LocalTier) else request.getfixturevalue("s3_uri")
        if tier.scheme == "s3" else f"file://{tier.root}")
    assert where is not None
    child = subprocess.run([sys.executable, "-c", _KILLED_WRITER, request.node.callspec.params["make_tier"], where],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL and child.stdout == "writing\n", child.stderr[-2000:]
    before = check(where)
    assert {e.status for e in before.entries} - {"committed"}, "the kill left nothing to sweep"
    async with AsymStore([tier]) as store:
        assert (await store.restore()).step == 1
        await store.put(2, "w", torch.full((1000,), 2.0))
        await store.commit(2)
        after = check(where, deep=True)
        assert after.ok and after.writer is not None, after.problems
        assert [(e.status, e.step) for e in after.entries] == [("committed", 1), ("committed", 2)], after.entries
        assert torch.equal((await store.restore()).tensors["w"], torch.full((1000,), 2.0))


# -- restore into the caller's tensors -------------------------------------------


async def test_restore_into_fills_the_callers_tensors(make_tier: Callable[[], Tier]) -> None:
    async with AsymStore([make_tier()], segment_bytes=512 << 10, keep_last=None) as store:
        for step in (1, 2):
            await store.put_many(step, state(step))
            await store.commit(step)
        dest = {k: torch.empty_like(v) for k, v in state(2).items()}
        ptrs = {k: v.data_ptr() for k, v in dest.items()}
        ckpt = await store.restore(into=dest)
        assert ckpt.step == 2 and all(ckpt.tensors[k] is dest[k] for k in dest)
        assert {k: v.data_ptr() for k, v in dest.items()} == ptrs and same(dest, state(2))
        partial = {"bf16": torch.empty(13, 77, dtype=torch.bfloat16).t()}  # not contiguous: one copy
        ckpt = await store.restore(step=1, into=partial)
        assert ckpt.tensors["bf16"] is partial["bf16"] and torch.equal(partial["bf16"], state(1)["bf16"])
        assert same({k: v for k, v in ckpt.tensors.items() if k != "bf16"},
                    {k: v for k, v in state(1).items() if k != "bf16"})
        for bad in ({"big": torch.zeros(300_000)}, {"big": torch.zeros(300_001, dtype=torch.float64)},
                    {"nope": torch.zeros(3)}):
            with pytest.raises(DestinationMismatchError):
                await store.restore(into=bad)
            assert not next(iter(bad.values())).any()  # checked before any byte was written


@pytest.mark.parametrize("compression", ["never", "always"])
async def test_restore_into_verifies_on_the_destination_and_falls_back(tmp_path: object, compression: str) -> None:
    root = os.path.join(str(tmp_path), "local")
    big = {step: {"w": torch.randn(3_000_001, generator=torch.Generator().manual_seed(step)),
                  "b": torch.full((5,), float(step))} for step in (1, 2)}
    async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=64 << 20, compression=compression) as store:
        for step in (1, 2):
            await store.put_many(step, big[step])
            await store.commit(step)
    seg = os.path.join(root, "v000000000002", "seg-000000.bin")
    size = os.path.getsize(seg)
    assert compression == "always" or size >= 8 << 20  # large enough for the O_DIRECT window path
    with open(seg, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    dest = {k: torch.empty_like(v) for k, v in big[2].items()}
    async with AsymStore([LocalTier(root)]) as store:
        ckpt = await store.restore(into=dest)
    assert ckpt.step == 1 and ckpt.fell_back and "checksum mismatch" in ckpt.fallbacks[0]
    assert torch.equal(dest["w"], big[1]["w"]) and torch.equal(dest["b"], big[1]["b"])  # all of step 1, nothing of 2


async def test_restore_into_from_shared_memory_hashes_as_it_reads_and_falls_back(shm_dir: str) -> None:
    big = {step: {"w": torch.randn(1_000_003, generator=torch.Generator().manual_seed(step))} for step in (1, 2)}
    async with AsymStore([host_tier(1 << 30, path=shm_dir)], keep_last=None, compression="never") as store:
        for step in (1, 2):
            await store.put_many(step, big[step])
            await store.commit(step)
    seg = os.path.join(shm_dir, "v000000000002", "seg-000000.bin")
    with open(seg, "r+b") as f:  # one bit, deep inside the second MiB piece hashed while reading
        f.seek(1_500_000)
        byte = f.read(1)
        f.seek(1_500_000)
        f.write(bytes([byte[0] ^ 0x10]))
    dest = {"w": torch.empty(1_000_003)}
    async with AsymStore([host_tier(1 << 30, path=shm_dir)], read_only=True) as store:
        ckpt = await store.restore(into=dest)
    assert ckpt.step == 1 and "checksum mismatch" in ckpt.fallbacks[0]
    assert torch.equal(dest["w"], big[1]["w"])
