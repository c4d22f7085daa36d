"""``AsymStore.adopt_known``: tensors staged with the checksums the caller holds, nothing hashed.

A version staged that way must read back exactly as one staged by ``adopt`` (same manifest
checksums, same bytes), a referencing tier must reference the chunks its previous version holds,
and a tier that cannot reference must get every byte. Bad input is refused with a typed error
and stages nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.errors import DuplicateNameError, InvalidValueError
from asymstore.format.tensors import chunk_checksums
from asymstore.protocols import KnownBytesStore
from asymstore.values import KnownChunks
from tests.support.store import store_kw

CHUNK = 4096


def known(t: torch.Tensor, chunk: int = CHUNK) -> KnownChunks:
    return KnownChunks(t, chunk, chunk_checksums(t, chunk))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(numel=st.integers(1, 5000), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
       seed=st.integers(0, 2**16))
def test_known_chunks_stage_as_adopt_would_and_reference_on_the_next_version(
        tmp_path_factory: pytest.TempPathFactory, numel: int, dtype: torch.dtype, seed: int) -> None:
    asyncio.run(stage_twice(tmp_path_factory.mktemp("known"), numel, dtype, seed))


async def stage_twice(root: Path, numel: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(numel, generator=g) * 100).to(dtype)
    async with AsymStore([LocalTier(root)], chunk_bytes=CHUNK, keep_last=None, **store_kw()) as store:
        assert isinstance(store, KnownBytesStore)
        await store.adopt(1, "base", base.clone())
        await store.put(1, "x", torch.ones(3))
        first = (await store.commit(1)).manifest
        await store.adopt_known(2, {"base": known(base.clone())})
        await store.put(2, "x", torch.zeros(3))
        second = (await store.commit(2)).manifest
        assert [c.raw_checksum or c.checksum for c in second.tensors["base"].chunks] == \
            [c.raw_checksum or c.checksum for c in first.tensors["base"].chunks]
        assert all(c.segment.endswith("@1") for c in second.tensors["base"].chunks if c.raw_length)
        for step in (1, 2):
            got = (await store.restore(step)).tensors["base"]
            assert torch.equal(got.view(-1).view(torch.uint8), base.view(-1).view(torch.uint8))


async def test_a_tier_without_references_writes_the_known_bytes(tmp_path: Path) -> None:
    base = torch.arange(3000, dtype=torch.float32)
    async with AsymStore([host_tier(16 << 20)], chunk_bytes=CHUNK, keep_last=None, **store_kw()) as store:
        for step in (1, 2, 3):
            await store.adopt_known(step, {"base": known(base.clone())})
            manifest = (await store.commit(step)).manifest
            assert not manifest.references and manifest.written_bytes >= base.numel() * 4
            assert torch.equal((await store.restore(step)).tensors["base"], base)


async def test_bad_known_chunks_are_refused_and_stage_nothing(tmp_path: Path) -> None:
    t = torch.arange(3000, dtype=torch.float32)
    async with AsymStore([LocalTier(tmp_path)], chunk_bytes=CHUNK, **store_kw()) as store:
        with pytest.raises(InvalidValueError, match="chunks of"):
            await store.adopt_known(1, {"a": known(t, 2 * CHUNK)})
        with pytest.raises(InvalidValueError, match="checksum"):
            await store.adopt_known(1, {"a": KnownChunks(t, CHUNK, chunk_checksums(t, CHUNK)[:-1])})
        with pytest.raises(InvalidValueError, match="checksum"):
            await store.adopt_known(1, {"a": KnownChunks(t, CHUNK, ("nothex",) * 3)})
        with pytest.raises(InvalidValueError):
            await store.adopt_known(1, {"a": known(t.view(30, 100).t())})  # not contiguous
        with pytest.raises(InvalidValueError):  # one bad entry: the good one is not staged either
            await store.adopt_known(1, {"good": known(t), "bad": KnownChunks(t, CHUNK, ())})
        await store.put(1, "good", t)  # the name is free
        with pytest.raises(DuplicateNameError):
            await store.adopt_known(1, {"good": known(t)})
        await store.commit(1)
        assert torch.equal((await store.restore(1)).tensors["good"], t)
