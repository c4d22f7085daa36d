"""What ranks exchange of slices kept on their own tiers (asymstore.multirank.sliceexchange), on real shards.

Each rank's shard is committed to a real memory tier and loaded back (as a restore loads it); the
payloads and manifests then go through the checks a receiver makes. Properties: every rank assembles
the whole tensors bit-exact from any slicing (rows of 1 to 9, packs of small tensors, ranks holding no
rows); one flipped byte anywhere in a peer's payload, a truncated payload, or a manifest that is not
the one the global manifest records is a SliceExchangeError, never a tensor.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asymstore import host_tier
from asymstore.errors import SliceExchangeError
from asymstore.format.globalmanifest import GlobalManifest, ShardInfo, shard_digest
from asymstore.format.pieces import LAYOUT_KEY, MeshInfo, TensorLayout, layout_meta
from asymstore.format.replicas import REPLICAS_KEY, ReplicaClaim
from asymstore.multirank import sliceexchange
from asymstore.read.load import load_version
from asymstore.store import AsymStore
from asymstore.values import Checkpoint

STEP = 7


def shards(tensors: dict[str, torch.Tensor], world: int, small: int) -> tuple[GlobalManifest, list[Checkpoint]]:
    """Each rank's shard of ``tensors`` (sliced by rows) plus ``small`` whole tensors, committed and loaded back."""
    claim = ReplicaClaim(world, "ab" * 8, True).to_json()

    async def one(rank: int) -> Checkpoint:
        layouts = {n: TensorLayout.sharded(t.shape, str(t.dtype).removeprefix("torch."),
                                           MeshInfo((world,), tuple(range(world)), (rank,)), ("S(0)",))
                   for n, t in tensors.items()}
        put = {n: t.narrow(0, layouts[n].offsets[0], layouts[n].shape[0]).clone() for n, t in tensors.items()}
        put.update({f"whole/{i}": torch.full((3,), float(rank * 100 + i)) for i in range(small)})
        tier = host_tier(64 << 20)
        async with AsymStore([tier], keep_last=None, compression="never") as store:
            await store.put_many(STEP, put)
            await store.commit(STEP, {LAYOUT_KEY: layout_meta(layouts), REPLICAS_KEY: claim})
            manifest, loaded = await load_version(tier, STEP)
        return Checkpoint(STEP, loaded, dict(manifest.meta), f"host:{rank}", manifest)

    own = [asyncio.run(one(r)) for r in range(world)]
    g = GlobalManifest(STEP, world, tuple(ShardInfo(r, STEP, shard_digest(c.manifest), c.manifest.nbytes,
                                                    len(c.tensors), {REPLICAS_KEY: claim})
                                          for r, c in enumerate(own)))
    return g, own


def assemble(g: GlobalManifest, own: list[Checkpoint], rank: int,
             payloads: dict[int, Any] | None = None) -> Checkpoint:
    """Rank ``rank``'s side of the exchange: every peer's manifest checked, its payload taken."""
    asm = sliceexchange.Assembler(g, own[rank], rank)
    for src, ckpt in enumerate(own):
        if src == rank:
            continue
        manifest = sliceexchange.check_manifest(g, src, ckpt.manifest.to_json())
        data = (payloads or {}).get(src, sliceexchange.payload(ckpt))
        asm.take(src, manifest, memoryview(bytes(data)))
    return asm.result("host")


tensor_sets = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 5), st.sampled_from([torch.float32, torch.bfloat16, torch.int64])),
    min_size=1, max_size=6)


def make(specs: list[tuple[int, int, torch.dtype]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": (torch.randn(rows, cols, generator=g) * 100).to(dtype)
            for i, (rows, cols, dtype) in enumerate(specs)}


@settings(max_examples=8, deadline=None)
@given(specs=tensor_sets, world=st.integers(2, 4), small=st.sampled_from([0, 40]), seed=st.integers(0, 99))
def test_every_rank_assembles_the_whole_tensors_bit_exact(specs: list[tuple[int, int, torch.dtype]], world: int,
                                                         small: int, seed: int) -> None:
    tensors = make(specs, seed)
    g, own = shards(tensors, world, small)  # small=40: the slices are packed with the whole tensors
    assert all(sliceexchange.needs_exchange(c) for c in own)
    for rank in range(world):
        done = assemble(g, own, rank)
        assert not sliceexchange.needs_exchange(done)
        for name, t in tensors.items():
            got = done.tensors[name]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
        for i in range(small):  # what the rank holds whole stays its own
            assert torch.equal(done.tensors[f"whole/{i}"], own[rank].tensors[f"whole/{i}"])
        assert LAYOUT_KEY not in done.meta or not done.meta[LAYOUT_KEY].get("tensors")


@settings(max_examples=8, deadline=None)
@given(specs=tensor_sets, small=st.sampled_from([0, 40]), where=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7))
def test_a_flipped_byte_in_a_peers_slices_is_refused(specs: list[tuple[int, int, torch.dtype]], small: int,
                                                    where: float, bit: int) -> None:
    tensors = make([(max(rows, 2), cols, dtype) for rows, cols, dtype in specs], 1)  # rank 1 holds rows
    g, own = shards(tensors, 2, small)
    data = sliceexchange.payload(own[1])
    data[int(where * len(data))] ^= 1 << bit
    with pytest.raises(SliceExchangeError, match="differ from the checksum"):
        assemble(g, own, 0, {1: data})
    with pytest.raises(SliceExchangeError, match="bytes of slices"):
        assemble(g, own, 0, {1: sliceexchange.payload(own[1])[:-1]})


def test_a_peers_manifest_that_is_not_the_global_manifests_is_refused() -> None:
    tensors = make([(4, 3, torch.float32)], 2)
    g, own = shards(tensors, 2, 0)
    other, _ = shards(make([(4, 3, torch.float32)], 3), 2, 0)  # the same shapes, other bytes: another digest
    with pytest.raises(SliceExchangeError, match="digest"):
        sliceexchange.check_manifest(other, 1, own[1].manifest.to_json())
    with pytest.raises(SliceExchangeError, match="does not parse"):
        sliceexchange.check_manifest(g, 1, own[1].manifest.to_json()[:-5])
    assert sliceexchange.check_manifest(g, 1, own[1].manifest.to_json()) == own[1].manifest
