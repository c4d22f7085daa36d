"""RankStore.read_manifest: this rank's shard manifest of the newest (or a given) global version, no tensor read."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asymstore.errors import NoCheckpointError, VersionNotFoundError


def test_a_rank_store_reads_its_shard_manifest_of_the_newest_global_version(tmp_path: Path) -> None:
    from asymstore.multirank import RankStore

    async def run() -> None:
        async with RankStore(tmp_path / "multi", rank=0, world_size=1, compression="never") as s:
            with pytest.raises(NoCheckpointError):
                await s.read_manifest()
            for step in (1, 2):
                await s.put(step, "w", torch.full((8,), float(step)))
                await s.commit(step, {"user": {"step": step}})
            newest = await s.read_manifest()
            assert newest.step == 2 and newest.meta["user"] == {"step": 2} and "w" in newest.tensors
            assert (await s.read_manifest(1)).meta["user"] == {"step": 1}
            with pytest.raises(VersionNotFoundError):
                await s.read_manifest(5)

    asyncio.run(run())
