"""Restores read straight into the caller's tensors: by byte ranges, raw and compressed chunks of one segment,
and across ranks (``RankStore.restore(into=...)``), with every checksum still verified.

Real files (LocalTier) and, for the ranks, threads with their own event loops coordinating through a real
c10d HashStore (as in tests/asymstore/multirank/test_store.py). tests/asymcheck/fsdp2/test_resume_inplace.py resumes
FSDP2 across real processes the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asymstore import AsymStore, CorruptVersionError, LocalTier
from asymstore.errors import DestinationMismatchError
from asymstore.format.manifest import Manifest
from asymstore.multirank import RankStore
from tests.support.ranks import run_ranks, store


def tensors(step: int, rank: int = 0) -> dict[str, torch.Tensor]:
    """A segment of raw and compressed chunks under ``compression="always"``: noise, zeros, a small tensor."""
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {"rand": torch.randn(50_000, generator=g), "zero": torch.zeros(70_000) + step,
            "small": torch.arange(5.0) + step + rank}


def destinations() -> dict[str, torch.Tensor]:
    return {"rand": torch.full((50_000,), -1.0), "zero": torch.full((70_000,), -1.0), "small": torch.full((5,), -1.0)}


def chunks(root: Path, step: int) -> dict[str, list[dict[str, Any]]]:
    manifest = json.loads((root / f"v{step:012d}" / "MANIFEST.json").read_text())
    return {name: entry["chunks"] for name, entry in manifest["tensors"].items()}


def flip(root: Path, step: int, name: str) -> None:
    """Flip one byte in the middle of tensor ``name``'s first chunk of ``step``."""
    chunk = chunks(root, step)[name][0]
    seg = root / f"v{step:012d}" / chunk["segment"]
    data = bytearray(seg.read_bytes())
    data[chunk["offset"] + chunk["length"] // 2] ^= 0x40
    seg.write_bytes(bytes(data))


async def save(root: Path, steps: list[int]) -> None:
    async with AsymStore([LocalTier(root)], segment_bytes=1 << 20, compression="always") as s:
        for step in steps:
            await s.put_many(step, tensors(step))
            await s.commit(step)


def test_a_segment_of_raw_and_compressed_chunks_is_read_into_the_destinations_bit_exact(tmp_path: Path) -> None:
    import asyncio

    asyncio.run(save(tmp_path, [1]))
    kinds = {name: {c["codec"] for c in cs} for name, cs in chunks(tmp_path, 1).items()}
    assert kinds["small"] == {"raw"} and kinds["rand"] != {"raw"} and kinds["zero"] != {"raw"}
    assert len({c["segment"] for cs in chunks(tmp_path, 1).values() for c in cs}) == 1  # one mixed segment
    into = destinations()
    ptrs = {k: v.data_ptr() for k, v in into.items()}

    async def go() -> Any:
        async with AsymStore([LocalTier(tmp_path)], read_only=True) as s:
            return await s.restore(into=into)

    ckpt = asyncio.run(go())
    for name, want in tensors(1).items():
        assert ckpt.tensors[name] is into[name] and into[name].data_ptr() == ptrs[name]
        assert torch.equal(into[name], want), name


@pytest.mark.parametrize("damaged", ["rand", "small"])  # a compressed chunk (staged, decoded at once), a raw one
def test_a_corrupt_chunk_read_by_ranges_is_detected_and_the_previous_version_fills_the_destinations(
        tmp_path: Path, damaged: str) -> None:
    import asyncio

    asyncio.run(save(tmp_path, [1, 2]))
    flip(tmp_path, 2, damaged)
    into = destinations()

    async def go() -> Any:
        async with AsymStore([LocalTier(tmp_path)], read_only=True) as s:
            return await s.restore(into=into)

    ckpt = asyncio.run(go())
    assert ckpt.step == 1
    assert any("step 2" in f and damaged in f for f in ckpt.fallbacks), ckpt.fallbacks
    for name, want in tensors(1).items():
        assert torch.equal(into[name], want), name
    only = destinations()

    async def just_two() -> Any:
        async with AsymStore([LocalTier(tmp_path)], read_only=True) as s:
            return await s.restore(step=2, into=only)

    with pytest.raises(CorruptVersionError, match=damaged):
        asyncio.run(just_two())


def commit_ranks(root: Path, kv: Any, steps: list[int]) -> None:
    async def rank_fn(rank: int) -> None:
        async with RankStore(root, rank=rank, world_size=2, kv=kv, timeout_s=3.0, segment_bytes=1 << 20,
                             compression="always") as s:
            for step in steps:
                await s.put_many(step, tensors(step, rank))
                await s.commit(step)

    out = run_ranks(2, rank_fn)
    assert out == {0: None, 1: None}, out


def restore_ranks(root: Path, kv: Any, into: Any) -> dict[int, Any]:
    async def rank_fn(rank: int) -> Any:
        async with store(root, rank, 2, kv) as s:
            return await s.restore(into=into(rank))

    return run_ranks(2, rank_fn)


def test_every_rank_reads_its_shard_into_its_tensors_and_a_corrupt_chunk_on_one_makes_all_fall_back(
        tmp_path: Path) -> None:
    kv = dist.HashStore()
    commit_ranks(tmp_path, kv, [1, 2])
    dests = {r: destinations() for r in range(2)}
    ptrs = {r: {k: v.data_ptr() for k, v in d.items()} for r, d in dests.items()}
    restored = restore_ranks(tmp_path, kv, lambda r: dests[r])
    for r in range(2):
        assert restored[r].step == 2 and not restored[r].fallbacks
        for name, want in tensors(2, r).items():
            assert restored[r].tensors[name] is dests[r][name] and dests[r][name].data_ptr() == ptrs[r][name]
            assert torch.equal(dests[r][name], want), (r, name)
    flip(tmp_path / "rank-00001", 2, "rand")  # rank 0's step 2 verifies, and is read into its tensors first
    restored = restore_ranks(tmp_path, kv, lambda r: dests[r])
    for r in range(2):
        assert restored[r].step == 1, restored[r]
        assert any("global step 2" in f for f in restored[r].fallbacks)
        for name, want in tensors(1, r).items():  # rank 0's tensors hold step 1 again, not a mixture
            assert torch.equal(dests[r][name], want), (r, name)


def test_destinations_refused_on_one_rank_are_refused_on_every_rank_without_trying_older_versions(
        tmp_path: Path) -> None:
    kv = dist.HashStore()
    commit_ranks(tmp_path, kv, [1, 2])
    seen: dict[int, list[int]] = {0: [], 1: []}
    live = destinations()  # rank 0's live tensors: they fit, and must not be written

    def into(rank: int) -> Any:
        def fn(manifest: Manifest) -> dict[str, torch.Tensor]:
            seen[rank].append(manifest.step)
            if rank == 1:
                raise ValueError("the live model has another layer")
            return live
        return fn

    out = restore_ranks(tmp_path, kv, into)
    for r in range(2):
        assert isinstance(out[r], DestinationMismatchError), out[r]
        assert "refused" in str(out[r]) or r == 1
        assert seen[r] == [2], seen  # no older version is tried: it would not fit either
    assert isinstance(out[1].__cause__, ValueError)  # the refusing rank raises its own error, with its cause
    for name, before in destinations().items():  # agreed before any read: the fitting rank read nothing either
        assert torch.equal(live[name], before), name


def test_a_refusal_reaches_a_rank_that_loaded_before_the_go_at_once(tmp_path: Path) -> None:
    """Rank 0's destinations refuse the version; rank 1 restores into fresh tensors, so it loaded before the go and
    waits for the next word: it raises the refusal naming rank 0 (not a timeout), and no older version is tried."""
    import time

    kv = dist.HashStore()
    commit_ranks(tmp_path, kv, [1, 2])
    seen: list[int] = []

    def refuse(manifest: Manifest) -> dict[str, torch.Tensor]:
        seen.append(manifest.step)
        raise ValueError("the live model has another layer")

    started = time.monotonic()
    out = restore_ranks(tmp_path, kv, lambda r: refuse if r == 0 else None)
    assert isinstance(out[0], DestinationMismatchError) and isinstance(out[0].__cause__, ValueError), out
    assert isinstance(out[1], DestinationMismatchError) and "rank(s) [0] refused" in str(out[1]), out
    assert seen == [2] and time.monotonic() - started < 8  # restore_timeout_s is 10 s


@pytest.mark.parametrize("inplace", [False, True], ids=["fresh", "into"])
def test_a_rank_reads_before_the_go_only_when_it_writes_into_nothing_live(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inplace: bool) -> None:
    """Without ``into`` every rank has loaded and verified its shard when the coordinator says go (the go costs the
    agreement no round trip); with ``into`` no rank has read a byte before it (every destination was checked)."""
    from asymstore.multirank.protocol import RestoreRound

    kv = dist.HashStore()

    async def commit(rank: int) -> None:
        async with store(tmp_path, rank, 2, kv) as s:
            await s.put_many(0, {"w": torch.arange(4.0) + rank})
            await s.commit(0)

    assert run_ranks(2, commit) == {0: None, 1: None}
    at_go: list[list[int]] = []
    real_go = RestoreRound.go

    def go(self: RestoreRound, k: int, msg: Any) -> None:
        at_go.append(self.wire.missing(self.key("result", k), range(self.world_size)))  # who has not loaded yet
        real_go(self, k, msg)

    monkeypatch.setattr(RestoreRound, "go", go)

    async def restore(rank: int) -> torch.Tensor:
        async with store(tmp_path, rank, 2, kv) as s:
            into = {"w": torch.full((4,), -1.0)} if inplace else None
            ckpt = await s.restore(into=into)
            return ckpt.tensors["w"].clone()

    out = run_ranks(2, restore)
    assert all(torch.equal(out[r], torch.arange(4.0) + r) for r in range(2)), out
    assert at_go == ([[0, 1]] if inplace else [[]]), at_go
