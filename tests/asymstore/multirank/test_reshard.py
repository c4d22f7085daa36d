"""Resharding: a multi-rank version written by N ranks restored on M ranks, reading only the overlapping chunks.

In one process (ranks are threads with their own event loops, coordinating through a real c10d HashStore,
as in tests/asymstore/multirank/test_store.py): the pure overlap planner, the byte-range reader, and RankStore restores
2 -> 3 and 3 -> 2 of uneven Shard(0) pieces. tests/asymcheck/fsdp2/test_reshard.py runs FSDP2 across
real processes, 2 ranks -> 1 -> 2.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asymstore import AsymStore, LocalTier
from asymstore.errors import LayoutError
from asymstore.format.pieces import LAYOUT_KEY, MeshInfo, TensorLayout, layout_meta, parse_layout_meta, read_layouts
from asymstore.multirank import RankStore
from asymstore.multirank.reshard import read_range
from asymstore.read.reshardplan import plan_piece
from tests.support.ranks import run_ranks, store

GLOBAL = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)


def piece(world: int, rank: int, shape: Sequence[int] = (7, 3), dim: int = 0) -> TensorLayout:
    return TensorLayout.sharded(shape, "float32", MeshInfo((world,), tuple(range(world)), (rank,)), [f"S({dim})"])


def box(t: torch.Tensor, lay: TensorLayout) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(lay.offsets, lay.shape, strict=True))]


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (2, 1), (1, 2), (3, 4), (4, 3)])
def test_plan_piece_covers_each_new_piece_exactly_from_contiguous_row_ranges(old: int, new: int) -> None:
    olds = {r: piece(old, r) for r in range(old)}
    for rank in range(new):
        want = piece(new, rank)
        out = torch.full(want.shape, -1.0)
        for read in plan_piece(want, olds):
            src = box(GLOBAL, olds[read.rank]).reshape(-1).view(torch.uint8)[read.start:read.stop]
            rows = src.view(torch.float32).reshape(-1, 3)  # Shard(0): the bytes read are exactly whole rows
            assert rows.shape[0] == read.hi[0] - read.lo[0]
            out[read.lo[0] - want.offsets[0]:read.hi[0] - want.offsets[0]] = rows
        assert torch.equal(out, box(GLOBAL, want))


def test_plan_piece_on_a_column_shard_and_replicated_mesh_dims() -> None:
    cols = {r: piece(2, r, dim=1) for r in range(2)}  # columns [0, 2) and [2, 3)
    reads = plan_piece(piece(3, 1, dim=1), cols)  # column [1, 2)
    assert [(r.rank, r.lo, r.hi) for r in reads] == [(0, (0, 1), (7, 2))]
    assert (reads[0].start, reads[0].stop) == (1 * 4, (6 * 2 + 1 + 1) * 4)  # bounding run, strided inside
    hsdp = {r: TensorLayout.sharded((7, 3), "float32", MeshInfo((2, 2), (0, 1, 2, 3), divmod(r, 2)), ["R", "S(0)"])
            for r in range(4)}
    reads = plan_piece(TensorLayout.whole((7, 3), "float32"), hsdp)
    assert sorted(r.rank for r in reads) == [0, 1]  # replica 0 only: never the same rows twice
    with pytest.raises(LayoutError):
        plan_piece(TensorLayout.whole((7, 3), "float32"), {0: piece(2, 0)})  # rows [4, 7) missing
    with pytest.raises(LayoutError):
        plan_piece(TensorLayout.whole((7, 4), "float32"), {0: piece(1, 0)})


class CountingTier(LocalTier):
    """A LocalTier that records the segment ranges it is asked to read."""

    ranges: list[tuple[int, int]]

    async def read_segment_into(self, step: int, name: str, size: int,
                                ranges: Sequence[tuple[int, memoryview]]) -> None:
        self.ranges = [*getattr(self, "ranges", []), *((o, len(v)) for o, v in ranges)]
        await super().read_segment_into(step, name, size, ranges)


def test_read_range_reads_and_verifies_only_the_chunks_it_touches(tmp_path: Path) -> None:
    big = torch.arange(1000, dtype=torch.float32)  # 4000 bytes in chunks of 512

    async def go() -> tuple[bytearray, list[tuple[int, int]], Any]:
        async with AsymStore([LocalTier(tmp_path)], chunk_bytes=512, compression="never") as s:
            await s.put_many(1, {"big": big, "small": torch.ones(3)})
            result = await s.commit(1)
        tier = CountingTier(tmp_path)
        await tier.open()
        try:
            data = await read_range(tier, result.manifest, "big", 600, 700)
            return data, tier.ranges, result.manifest
        finally:
            await tier.close()

    data, ranges, manifest = asyncio.run(go())
    assert bytes(data) == big.view(torch.uint8)[600:700].numpy().tobytes()
    chunks = manifest.tensors["big"].chunks
    assert len(chunks) == 8  # [600, 700) lies in the second chunk, [512, 1024): only it is read
    assert ranges == [(chunks[1].offset, chunks[1].length)]


def commit_pieces(root: Path, world: int, step: int, layouts: Mapping[int, TensorLayout], *,
                  record: bool = True) -> None:
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> None:
        lay = layouts[rank]
        async with store(root, rank, world, kv) as s:
            await s.put_many(step, {"w": box(GLOBAL, lay).clone(), "rng": torch.tensor([rank, step])})
            meta: dict[str, Any] = {"rank": rank}
            if record:
                meta[LAYOUT_KEY] = layout_meta({"w": lay, "rng": TensorLayout.whole((2,), "int64")})
            await s.commit(step, meta)

    assert run_ranks(world, rank_fn) == dict.fromkeys(range(world))


def restore_on(root: Path, world: int, *, reshard: bool = True) -> dict[int, Any]:
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> Any:
        async with store(root, rank, world, kv) as s:
            if reshard:
                s.reshard = lambda old: {n: TensorLayout.sharded(lay.global_shape, lay.dtype,
                                                                 MeshInfo((world,), tuple(range(world)), (rank,)),
                                                                 lay.placements) for n, lay in old.items()}
            return await s.restore()

    return run_ranks(world, rank_fn)


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2)])
def test_rankstore_restores_a_version_of_another_world_size(tmp_path: Path, old: int, new: int) -> None:
    commit_pieces(tmp_path, old, 5, {r: piece(old, r) for r in range(old)})
    got = restore_on(tmp_path, new)
    for rank in range(new):
        ckpt = got[rank]
        assert not isinstance(ckpt, BaseException), ckpt
        want = piece(new, rank)
        assert ckpt.step == 5 and torch.equal(ckpt.tensors["w"], box(GLOBAL, want))
        assert torch.equal(ckpt.tensors["rng"], torch.tensor([rank % old, 5]))  # whole tensors: old rank % N
        assert ckpt.meta["rank"] == rank % old
        assert parse_layout_meta(ckpt.meta[LAYOUT_KEY])["w"] == want  # the meta describes the new piece
    plain = restore_on(tmp_path, new, reshard=False)
    assert all(type(plain[r]).__name__ == "WorldSizeMismatchError" for r in range(new))


def test_a_damaged_old_shard_fails_the_resharded_restore_on_every_rank(tmp_path: Path) -> None:
    commit_pieces(tmp_path, 2, 5, {r: piece(2, r) for r in range(2)})
    seg = next((tmp_path / "rank-00001" / "v000000000005").glob("seg-*"))
    data = bytearray(seg.read_bytes())
    data[0] ^= 0xFF
    seg.write_bytes(bytes(data))
    got = restore_on(tmp_path, 3)
    assert all(type(got[r]).__name__ == "CorruptVersionError" for r in range(3)), got


def test_replicated_tensors_come_from_old_rank_modulo_and_shards_without_layouts_are_refused(tmp_path: Path) -> None:
    commit_pieces(tmp_path / "ddp", 2, 3, {r: TensorLayout.whole((7, 3), "float32") for r in range(2)})
    got = restore_on(tmp_path / "ddp", 3)  # DDP-like: everything whole, nothing re-cut
    for rank in range(3):
        assert torch.equal(got[rank].tensors["w"], GLOBAL) and got[rank].meta["rank"] == rank % 2
    commit_pieces(tmp_path / "bare", 2, 3, {r: piece(2, r) for r in range(2)}, record=False)
    got = restore_on(tmp_path / "bare", 3)  # DeepSpeed-like: where the pieces belong is unknown
    assert all(type(got[r]).__name__ == "CorruptVersionError" and "no tensor layout" in str(got[r])
               for r in range(3)), got


def test_read_layouts_of_a_shard_written_before_layouts_is_whole(tmp_path: Path) -> None:
    async def go() -> Any:
        async with AsymStore([LocalTier(tmp_path)], compression="never") as s:
            await s.put_many(1, {"w": GLOBAL})
            return (await s.commit(1)).manifest

    assert read_layouts(asyncio.run(go()))["w"] == TensorLayout.whole((7, 3), "float32")


def test_a_job_that_shrank_retires_the_departed_ranks_shards_and_fsck_stays_clean(tmp_path: Path) -> None:
    from asymstore.fsck import check

    for step in (1, 2, 3):
        commit_pieces(tmp_path, 2, step, {r: piece(2, r) for r in range(2)})
    kv = dist.HashStore()
    whole = {"w": TensorLayout.whole((7, 3), "float32"), "rng": TensorLayout.whole((2,), "int64")}

    async def one(rank: int) -> list[tuple[int, bool, list[str]]]:
        seen = []
        async with store(tmp_path, rank, 1, kv, keep_last=3) as s:
            s.reshard = lambda old: {n: TensorLayout.whole(lay.global_shape, lay.dtype) for n, lay in old.items()}
            ckpt = await s.restore()
            assert torch.equal(ckpt.tensors["w"], GLOBAL)
            for step in range(4, 8):
                await s.put_many(step, {"w": GLOBAL.clone(), "rng": torch.tensor([0, step])})
                await s.commit(step, {"rank": 0, LAYOUT_KEY: layout_meta(whole)})
                report = check(str(tmp_path))
                # versions (a directory kept only for segments later shards reference has no manifest)
                left = sorted(p.parent.name for p in (tmp_path / "rank-00001").glob("v*/MANIFEST.json"))
                seen.append((step, report.ok, left))
        return seen

    seen = run_ranks(1, one)[0]
    assert not isinstance(seen, BaseException), seen
    # kept global versions: 2, 3, 4 after step 4 ... 5, 6, 7 after step 7; rank 1's old shards go with them
    assert [(step, ok) for step, ok, _ in seen] == [(s, True) for s in range(4, 8)]
    assert [left for _, _, left in seen] == [["v000000000002", "v000000000003"], ["v000000000003"], [], []]
    assert not (tmp_path / "rank-00001" / "LATEST").exists()
    assert not list((tmp_path / "rank-00001").glob("v*"))  # nothing kept for references once no shard is left


MANY = {"w": (13, 5, 0), "v": (13, 5, 1), "b": (11, 1, 0)}  # name -> (rows, cols, shard dim); "b" is 1-D


def many_piece(name: str, world: int, rank: int) -> TensorLayout:
    rows, cols, dim = MANY[name]
    shape = (rows,) if name == "b" else (rows, cols)
    dtype = "int64" if name == "b" else "float32"
    return TensorLayout.sharded(shape, dtype, MeshInfo((world,), tuple(range(world)), (rank,)), [f"S({dim})"])


def many_global(name: str) -> torch.Tensor:
    rows, cols, _ = MANY[name]
    if name == "b":
        return torch.arange(rows, dtype=torch.int64) * 1_000_003
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + (0.5 if name == "v" else 0.25)


def commit_many(root: Path, world: int, step: int, *, small: int) -> None:
    """Three sharded tensors (rows and columns) in chunks of 24 bytes over segments of 256, and ``small`` whole ones.

    With ``small`` >= 32, ``put_many`` packs the tensors of at most 64 KiB: every tensor lands in packs.
    """
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> None:
        lays = {n: many_piece(n, world, rank) for n in MANY}
        state = {n: box(many_global(n), lay).clone() for n, lay in lays.items()}
        for i in range(small):
            state[f"s{i}"] = torch.tensor([rank, step, i])
            lays[f"s{i}"] = TensorLayout.whole((3,), "int64")
        async with RankStore(root, rank=rank, world_size=world, kv=kv, timeout_s=3.0, restore_timeout_s=10.0,
                             segment_bytes=256, chunk_bytes=24, compression="never") as s:
            await s.put_many(step, state)
            await s.commit(step, {"rank": rank, LAYOUT_KEY: layout_meta(lays)})

    assert run_ranks(world, rank_fn) == dict.fromkeys(range(world))


def restore_many(root: Path, world: int) -> dict[int, Any]:
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> Any:
        async with RankStore(root, rank=rank, world_size=world, kv=kv, timeout_s=3.0, restore_timeout_s=10.0,
                             segment_bytes=256, chunk_bytes=24, compression="never") as s:
            s.reshard = lambda old: {n: many_piece(n, world, rank) for n in old}
            return await s.restore()

    return run_ranks(world, rank_fn)


@pytest.mark.parametrize("small", [0, 40])
@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (3, 2)])
def test_resharded_restore_reads_each_chunk_once_a_segment_at_a_time_and_is_bit_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: int, new: int, small: int) -> None:
    commit_many(tmp_path, old, 4, small=small)
    calls: list[tuple[str, list[tuple[int, int]]]] = []
    real = LocalTier.read_segment_into

    async def counting(self: LocalTier, step: int, name: str, size: int,
                       ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
        calls.append((f"{self.root}/{name}", [(o, len(v)) for o, v in ranges]))
        return await real(self, step, name, size, ranges)

    monkeypatch.setattr(LocalTier, "read_segment_into", counting)
    got = restore_many(tmp_path, new)
    for rank in range(new):
        ckpt = got[rank]
        assert not isinstance(ckpt, BaseException), ckpt
        for name in MANY:
            want = box(many_global(name), many_piece(name, new, rank))
            assert ckpt.tensors[name].dtype == want.dtype and torch.equal(ckpt.tensors[name], want), name
        for i in range(small):  # whole (and packed) tensors: from old rank rank % N
            assert torch.equal(ckpt.tensors[f"s{i}"], torch.tensor([rank % old, 4, i]))
    per_rank = len(calls) / new
    segments = {seg for seg, _ in calls}
    assert per_rank <= len(segments), calls  # one read per (old shard, segment) touched, per new rank
    for rank_calls in ([c for c in calls if c[0] == seg] for seg in segments):
        for _, ranges in rank_calls:  # offset order, each chunk (or pack) once
            assert ranges == sorted(set(ranges)), ranges


@pytest.mark.parametrize("digests", [True, False])
@pytest.mark.parametrize("small", [0, 40])
def test_a_corrupt_chunk_in_one_old_shard_fails_the_regrouped_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small: int, digests: bool) -> None:
    commit_many(tmp_path, 2, 4, small=small)
    if not digests:  # a tier that does not hash as it reads: the chunks are hashed after the read
        real = LocalTier.read_segment_into

        async def unhashed(self: LocalTier, step: int, name: str, size: int,
                           ranges: Sequence[tuple[int, memoryview]]) -> list[str] | None:
            await real(self, step, name, size, ranges)
            return None

        monkeypatch.setattr(LocalTier, "read_segment_into", unhashed)
        fine = restore_many(tmp_path, 1)[0]
        assert not isinstance(fine, BaseException), fine
        assert all(torch.equal(fine.tensors[n], many_global(n)) for n in MANY)
    for seg in (tmp_path / "rank-00001" / "v000000000004").glob("seg-*"):  # rank 1's pieces, packed or not
        data = bytearray(seg.read_bytes())
        data[0] ^= 0x01
        seg.write_bytes(bytes(data))
    got = restore_many(tmp_path, 1)
    assert type(got[0]).__name__ == "CorruptVersionError", got
