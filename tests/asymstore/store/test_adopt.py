"""AsymStore.adopt / adopt_many: the store takes the caller's memory without a copy and hands it back once."""

from __future__ import annotations

import os

import pytest
import torch

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.errors import DuplicateNameError, InvalidValueError, TierError
from asymstore.testing import FailingLocalTier, SlowLocalTier

FAST = {"compression": "never", "segment_bytes": 256 << 10}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=g), "b": torch.randn(77, generator=g).bfloat16(),
            "i": torch.arange(10, dtype=torch.int64)}


class Releases:
    """Counts release callbacks and remembers what the store had committed when each ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


async def test_adopted_tensors_are_committed_without_a_copy_and_released_once(tmp_path: object) -> None:
    data = tensors(1)
    expect = {k: v.clone() for k, v in data.items()}
    rel = Releases()
    async with AsymStore([LocalTier(os.path.join(str(tmp_path), "a"))], **FAST) as store:  # type: ignore[arg-type]
        await store.adopt_many(1, data, release=rel)
        staged = store._stager.pending[1].tensors
        assert all(staged[k] is not None and staged[k].tensor.data_ptr() == data[k].data_ptr()  # type: ignore[union-attr]
                   for k in data)  # the caller's memory itself, no private copy
        assert rel.calls == 0
        await store.commit(1)
        assert rel.calls == 1
        ckpt = await store.restore()
    assert all(torch.equal(ckpt.tensors[k], expect[k]) for k in expect)
    assert rel.calls == 1


async def test_a_write_to_adopted_memory_before_release_is_caught_by_the_checksums(tmp_path: object) -> None:
    data = tensors(2)
    async with AsymStore([LocalTier(os.path.join(str(tmp_path), "a"))], **FAST) as store:  # type: ignore[arg-type]
        await store.put(1, "w", torch.ones(3))
        await store.commit(1)
        await store.adopt_many(2, data)
        data["w"][0] += 1.0  # breaks the ownership rule: the bytes no longer match their checksum
        await store.commit(2)
        ckpt = await store.restore()
    assert ckpt.step == 1  # the damaged version is refused, never loaded
    assert ckpt.fallbacks and "checksum" in ckpt.fallbacks[0]


async def test_adopt_refuses_what_it_cannot_take_over_and_releases_at_once(tmp_path: object) -> None:
    rel = Releases()
    async with AsymStore([LocalTier(os.path.join(str(tmp_path), "a"))], **FAST) as store:  # type: ignore[arg-type]
        strided = torch.randn(64, 64).t()
        with pytest.raises(InvalidValueError, match="contiguous CPU"):
            await store.adopt_many(1, {"ok": torch.ones(4), "t": strided}, release=rel)
        assert rel.calls == 1
        with pytest.raises(InvalidValueError):
            await store.adopt(1, "p", torch.nn.Parameter(torch.ones(3)), release=rel)
        assert rel.calls == 2
        await store.put(1, "x", torch.ones(2))  # nothing of the refused batches was staged
        await store.commit(1)
        assert set((await store.restore()).tensors) == {"x"}


async def test_abandon_close_and_a_newer_commit_release_adopted_memory(tmp_path: object) -> None:
    a, b, c = Releases(), Releases(), Releases()
    store = AsymStore([LocalTier(os.path.join(str(tmp_path), "a"))], **FAST)  # type: ignore[arg-type]
    await store.open()
    await store.adopt_many(1, tensors(1), release=a)
    store.abandon(1)
    assert a.calls == 1
    await store.adopt_many(2, tensors(2), release=b)  # never committed: dropped by the commit of step 3
    await store.adopt_many(3, tensors(3))
    await store.commit(3)
    assert b.calls == 1
    await store.adopt_many(4, tensors(4), release=c)
    await store.close()
    assert (a.calls, b.calls, c.calls) == (1, 1, 1)


async def test_a_failed_commit_keeps_adopted_memory_until_abandon(tmp_path: object) -> None:
    rel = Releases()
    tier = FailingLocalTier(os.path.join(str(tmp_path), "a"), fail_at="segments_written")
    async with AsymStore([tier], **FAST) as store:  # type: ignore[arg-type]
        await store.adopt_many(1, tensors(1), release=rel)
        with pytest.raises(TierError):
            await store.commit(1)
        assert rel.calls == 0  # kept for a retry
        await store.commit(1)  # the fault fires once
        assert rel.calls == 1
        assert torch.equal((await store.restore()).tensors["w"], tensors(1)["w"])


async def test_background_tiers_get_a_private_copy_so_the_owner_gets_its_memory_back_at_commit(
        tmp_path: object) -> None:
    rel = Releases()
    data = tensors(5)
    expect = {k: v.clone() for k, v in data.items()}
    slow = LocalTier(os.path.join(str(tmp_path), "slow"))
    async with AsymStore([host_tier(64 << 20), LocalTier(os.path.join(str(tmp_path), "fast")), slow],
                         durable="local:" + os.path.join(str(tmp_path), "fast"), **FAST) as store:  # type: ignore[arg-type]
        await store.adopt_many(1, data, release=rel)
        await store.commit(1)
        assert rel.calls == 1
        for t in data.values():  # the owner reuses its buffer while the background tier may still be writing
            t.zero_()
        await store.flushed(1)
        assert 1 in store.versions()[slow.name]
    async with AsymStore([slow], read_only=True) as reader:
        got = (await reader.restore()).tensors
    assert all(torch.equal(got[k], expect[k]) for k in expect)


async def test_the_background_copy_reuses_one_buffer_and_never_while_a_tier_still_reads_it(tmp_path: object) -> None:
    """Consecutive versions' private copies share memory, given back only once every background tier is done."""
    slow = SlowLocalTier(os.path.join(str(tmp_path), "slow"), delay_s=0.05)
    owned = tensors(0)  # the owner's buffers, refilled every step as a training loop refills its slots
    rel = Releases()
    expect: dict[int, dict[str, torch.Tensor]] = {}
    disk = LocalTier(os.path.join(str(tmp_path), "fast"))  # a durable tier that lends nothing: the store copies
    async with AsymStore([disk, slow], durable=disk.name, backlog=2, **FAST) as store:  # type: ignore[arg-type]
        for step in range(1, 7):
            for k, v in tensors(step).items():
                owned[k].copy_(v)
            expect[step] = {k: v.clone() for k, v in owned.items()}
            await store.adopt_many(step, owned, release=rel)
            await store.commit(step)
            assert rel.calls == step  # the owner has its memory back at each commit
            if step % 2 == 0:  # let the slow tier catch up now and then, so its buffers come back
                await store.flushed(step)
        await store.flushed()
        buffers = store._copy_buffers
        assert buffers.reuses >= 2 and buffers.allocations < 6, (buffers.reuses, buffers.allocations)
        written = store.versions()[slow.name]
    async with AsymStore([slow], read_only=True, keep_last=100) as reader:
        for step in written:  # every version the slow tier has holds exactly its own step's bytes
            got = (await reader.restore(step)).tensors
            assert all(torch.equal(got[k], expect[step][k]) for k in expect[step]), step


async def test_closing_with_versions_still_queued_for_a_background_tier_gives_every_copy_back(
        tmp_path: object) -> None:
    """Versions the slow tier never writes (skipped for newer ones, or dropped at close) still end their holds."""
    slow = SlowLocalTier(os.path.join(str(tmp_path), "slow"), delay_s=0.3)
    disk = LocalTier(os.path.join(str(tmp_path), "fast"))  # lends nothing: the background tiers get copies
    store = AsymStore([disk, slow], durable=disk.name, backlog=1, **FAST)  # type: ignore[arg-type]
    await store.open()
    for step in range(1, 5):
        await store.adopt_many(step, {k: v.clone() for k, v in tensors(step).items()}, release=Releases())
        await store.commit(step)
    background = store._background
    assert background._holds  # versions 3 and 4 at least are still with the slow tier
    await store.close()
    assert not background._holds  # each ended: written, skipped for a newer one, or dropped at close
    assert store._copy_buffers.idle_bytes > 0 and store._copy_buffers.reuses >= 1


async def test_a_refused_batch_never_drops_what_an_earlier_call_adopted(tmp_path: object) -> None:
    first, second = Releases(), Releases()
    async with AsymStore([LocalTier(os.path.join(str(tmp_path), "a"))], **FAST) as store:  # type: ignore[arg-type]
        data = tensors(1)
        await store.adopt_many(1, {"w": data["w"]}, release=first)
        with pytest.raises(DuplicateNameError):
            await store.adopt_many(1, {"b": data["b"], "w": torch.zeros(3)}, release=second)
        assert (first.calls, second.calls) == (0, 1)
        await store.commit(1)
        got = (await store.restore()).tensors
    assert set(got) == {"w"} and torch.equal(got["w"], data["w"])  # the first batch, whole; nothing of the second
    assert first.calls == 1
