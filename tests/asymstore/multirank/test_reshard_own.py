"""A version of slices on tiers of each rank's own: each rank loads its own shard, or the restore is refused.

Real tiers and real shards (committed through an AsymStore, their digests in a global manifest): the
rank's copy that verifies against the global digest is loaded from the first tier holding one (a
corrupt or foreign copy moves to the next, noted), nothing of another rank is read; on another
number of ranks such a version is refused with a LayoutError naming why (no rank could read the
slices of ranks that are gone).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asymstore import LocalTier, host_tier
from asymstore.errors import CorruptVersionError, LayoutError
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo, shard_digest
from asymstore.format.pieces import LAYOUT_KEY, MeshInfo, TensorLayout, layout_meta
from asymstore.format.replicas import REPLICAS_KEY, ReplicaClaim
from asymstore.multirank import sliceexchange
from asymstore.multirank.reshard import restore_resharded
from asymstore.multirank.store import RankStore
from asymstore.store import AsymStore
from asymstore.tiers.protocol import Tier
from asymstore.values import Checkpoint

STEP = 4
CLAIM = ReplicaClaim(2, "cd" * 8, True).to_json()


async def commit(tier: Tier, rank: int, whole: torch.Tensor, extra: float = 0.0) -> str:
    """Rank ``rank``'s shard of ``whole`` (its rows, sliced) at STEP on ``tier``; returns its digest."""
    lay = TensorLayout.sharded(whole.shape, "float32", MeshInfo((2,), (0, 1), (rank,)), ("S(0)",))
    async with AsymStore([tier], keep_last=None) as store:
        await store.put_many(STEP, {"w": whole.narrow(0, lay.offsets[0], lay.shape[0]) + extra,
                                    "rng": torch.tensor([rank])})
        result = await store.commit(STEP, {LAYOUT_KEY: layout_meta({"w": lay}), REPLICAS_KEY: CLAIM})
    return shard_digest(result.manifest)


def global_of(digests: list[str], world: int = 2) -> GlobalManifest:
    return GlobalManifest(STEP, world, tuple(ShardInfo(r, STEP, d, 8, 2, {REPLICAS_KEY: CLAIM})
                                             for r, d in enumerate(digests)))


def test_each_rank_loads_its_own_shard_from_the_first_tier_that_verifies(tmp_path: Path) -> None:
    whole = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    fast, foreign, disk = LocalTier(tmp_path / "fast"), LocalTier(tmp_path / "foreign"), LocalTier(tmp_path / "disk")
    digest = asyncio.run(commit(disk, 1, whole))
    asyncio.run(commit(foreign, 1, whole, extra=1.0))  # a copy of step 4 whose digest is another
    asyncio.run(commit(fast, 1, whole))
    seg = next((tmp_path / "fast").rglob("*.bin"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x01  # and one whose bytes are damaged
    seg.write_bytes(bytes(data))
    g = global_of(["0" * 16, digest])
    store = RankStore(tmp_path / "root", rank=1, world_size=2, tiers=[fast, foreign, disk, host_tier(1 << 20)])

    async def restore(g: GlobalManifest) -> Checkpoint:
        for t in store.tiers:
            await t.open()
        try:
            return await restore_resharded(store.job, store.tiers, g, lambda old: {})
        finally:
            for t in store.tiers:
                await t.close()

    ckpt = asyncio.run(restore(g))
    assert sliceexchange.needs_exchange(ckpt)  # its own slices, their layouts kept: the ranks exchange the rest
    assert ckpt.tier == disk.name and torch.equal(ckpt.tensors["w"], whole[2:])
    assert len(ckpt.fallbacks) == 2 and ckpt.fallbacks[0].startswith(fast.name), ckpt.fallbacks
    assert "digest differs" in ckpt.fallbacks[1]
    with pytest.raises(CorruptVersionError, match="rank 1's shard 4"):  # no copy has the digest recorded
        asyncio.run(restore(global_of(["0" * 16, "f" * 16])))


def test_slices_on_tiers_of_each_ranks_own_are_not_restored_on_another_number_of_ranks(tmp_path: Path) -> None:
    g = global_of(["0" * 16, "1" * 16])
    for world in (1, 3):
        store = RankStore(tmp_path / "root", rank=0, world_size=world, tiers=[LocalTier(tmp_path / "own")])
        with pytest.raises(LayoutError, match=f"cannot be restored on {world} rank"):
            asyncio.run(restore_resharded(store.job, store.tiers, g, lambda old: {}))
