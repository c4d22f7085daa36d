"""Background tiers read an adopted version from the durable memory tier's own copy, not from a private one.

The owner of adopted tensors gets its memory back at commit and refills it at once (as a training loop
refills its host slots); every version a slower tier writes must still hold exactly its own step's bytes,
read from the memory tier's segments (process memory or shared-memory files) with no copy taken. Where
the memory tier cannot lend every chunk as it was staged (a compressed chunk), the store copies as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asymstore import AsymStore, host_tier
from asymstore.testing import SlowLocalTier

FAST = {"segment_bytes": 256 << 10}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=g), "b": torch.randn(77, generator=g).bfloat16(),
            "i": torch.arange(10, dtype=torch.int64) + seed, "e": torch.zeros(0)}


@pytest.mark.parametrize("memory", ["process", "shm"])
async def test_each_version_a_slow_tier_writes_is_read_from_the_memory_tiers_copy(tmp_path: Path, memory: str) -> None:
    slow = SlowLocalTier(os.path.join(str(tmp_path), "slow"), delay_s=0.05)
    host = host_tier(64 << 20, path=tmp_path / "shm" if memory == "shm" else None)
    owned = tensors(0)
    releases = []
    expect: dict[int, dict[str, torch.Tensor]] = {}
    async with AsymStore([host, slow], durable=host.name, backlog=2, compression="never",
                         **FAST) as store:  # type: ignore[arg-type]
        for step in range(1, 7):
            for k, v in tensors(step).items():
                owned[k].copy_(v)
            expect[step] = {k: v.clone() for k, v in owned.items()}
            await store.adopt_many(step, owned, release=lambda step=step: releases.append(step))
            await store.commit(step)
            assert releases[-1] == step  # the owner has its memory back at each commit...
            for t in owned.values():  # ...and scribbles over it while the slow tier may still be writing
                t.fill_(7)
            if step % 3 == 0:
                await store.flushed(step)
        await store.flushed()
        assert store._copy_buffers.allocations == 0  # no private copy was ever taken
        written = store.versions()[slow.name]
        assert written and not store._background._holds  # every view was closed once the slow tier was done
    async with AsymStore([slow], read_only=True, keep_last=100) as reader:
        for step in written:
            got = (await reader.restore(step)).tensors
            assert all(torch.equal(got[k], expect[step][k]) for k in expect[step]), step


async def test_a_chunk_the_memory_tier_compressed_is_copied_for_the_slow_tier_instead(tmp_path: Path) -> None:
    slow = SlowLocalTier(os.path.join(str(tmp_path), "slow"), delay_s=0.05)
    host = host_tier(64 << 20)
    owned = tensors(3)
    expect = {k: v.clone() for k, v in owned.items()}
    async with AsymStore([host, slow], durable=host.name, compression="always",
                         **FAST) as store:  # type: ignore[arg-type]
        await store.adopt_many(3, owned, release=lambda: None)
        manifest = (await store.commit(3)).manifest
        assert any(c.codec != "raw" for e in manifest.tensors.values() for c in e.chunks)
        for t in owned.values():
            t.fill_(7)
        await store.flushed(3)
        assert store._copy_buffers.allocations == 1  # not lent: copied, as before
    async with AsymStore([slow], read_only=True) as reader:
        got = (await reader.restore(3)).tensors
    assert all(torch.equal(got[k], expect[k]) for k in expect)


def test_a_tier_whose_views_are_copies_is_never_borrowed_from() -> None:
    """Device memory is lent as a host copy, on the store's loop: the store copies off the loop instead."""
    from asymstore.write.lending import lend_from

    class DeviceViews:
        lends_copies = True

        def view_segment(self, step: int, name: str, size: int | None = None) -> object:
            raise AssertionError("a segment was borrowed from a tier that lends copies")

    assert lend_from(DeviceViews(), None, None, {}) is None  # type: ignore[arg-type]
    assert host_tier(1 << 20).lends_copies is False  # type: ignore[attr-defined]


async def test_closing_with_versions_still_queued_closes_every_view(tmp_path: Path) -> None:
    """Versions the slow tier never writes (skipped for newer ones, or dropped at close) still give their views back."""
    slow = SlowLocalTier(os.path.join(str(tmp_path), "slow"), delay_s=0.3)
    host = host_tier(64 << 20)
    store = AsymStore([host, slow], durable=host.name, backlog=1, compression="never",
                      **FAST)  # type: ignore[arg-type]
    await store.open()
    for step in range(1, 5):
        await store.adopt_many(step, {k: v.clone() for k, v in tensors(step).items()}, release=lambda: None)
        await store.commit(step)
    memory: Any = host  # its versions and their open views
    assert any(v.views for v in memory._mem.values())  # the slow tier still reads some version's segments
    await store.close()
    assert not store._background._holds and not any(v.views for v in memory._mem.values())
    assert store._copy_buffers.allocations == 0
