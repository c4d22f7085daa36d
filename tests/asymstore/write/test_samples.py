"""Compression samples remembered across versions: taken once every few versions; stored bytes the version's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asymstore import AsymStore, LocalTier, TierCalibration
from asymstore.format import codec as codec_module
from asymstore.format.codec import RAW, Sample
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import version_dirname
from asymstore.write.samples import REUSE_VERSIONS, SampleMemory
from tests.support.tensors import assert_same as assert_same_tensor

SLOW = TierCalibration.from_throughput(1e6, 20e-3)  # 1 MB/s: every chunk is worth sampling


def state(step: int, kind: str, numel: int = 40_000) -> dict[str, torch.Tensor]:
    """Two tensors whose compressibility depends on ``kind`` (the same names and shapes at every step)."""
    g = torch.Generator().manual_seed(step)
    if kind == "zeros":
        w = torch.zeros(numel)
    elif kind == "random":
        w = torch.randint(-(2**31), 2**31 - 1, (numel,), dtype=torch.int32, generator=g).view(torch.float32)
    else:  # small weights: the exponent plane compresses
        w = torch.randn(numel, generator=g) * 0.02
    return {"w": w, "small": torch.full((300,), float(step))}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert_same_tensor(got[name], tensor)


def codecs_of(root: Path, step: int) -> dict[str, str]:
    doc = json.loads((root / version_dirname(step) / MANIFEST_NAME).read_bytes())
    return {name: t["chunks"][0]["codec"] for name, t in doc["tensors"].items() if t.get("chunks")}


async def test_a_chunk_is_sampled_once_every_reuse_versions_not_at_every_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = codec_module.sample

    def counted(*args: object, **kwargs: object) -> Sample:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("asymstore.write.segments.sample", counted)
    versions = REUSE_VERSIONS + 2
    per_version: list[int] = []
    async with AsymStore([LocalTier(tmp_path, name="t")], calibrations={"t": SLOW}, keep_last=None) as store:
        for step in range(1, versions + 1):
            before = len(calls)
            await store.put_many(step, state(step, "small"))
            await store.commit(step)
            per_version.append(len(calls) - before)
        assert per_version[0] > 0  # the first version samples its chunks
        # then nothing until the samples are REUSE_VERSIONS versions old, when they are taken again
        assert per_version[1:REUSE_VERSIONS] == [0] * (REUSE_VERSIONS - 1)
        assert per_version[REUSE_VERSIONS] == per_version[0]
        for step in (1, REUSE_VERSIONS // 2, versions):  # every version compressed alike and exact
            assert codecs_of(tmp_path, step)["w"] != RAW
            assert_same((await store.restore(step)).tensors, state(step, "small"))


async def test_a_remembered_sample_never_brings_an_older_versions_bytes(tmp_path: Path) -> None:
    """A chunk small enough to be sampled whole carries its encoded form; the memory keeps only the estimate."""
    async with AsymStore([LocalTier(tmp_path, name="t")], calibrations={"t": SLOW}, keep_last=None) as store:
        for step in (1, 2, 3):  # "small" at 300 elements is sampled whole: its encoding is that version's
            await store.put_many(step, state(step, "small", numel=1000))
            await store.commit(step)
        for step in (1, 2, 3):
            assert_same((await store.restore(step)).tensors, state(step, "small", numel=1000))


async def test_a_tensor_that_stops_compressing_is_stored_raw_on_an_old_sample(tmp_path: Path) -> None:
    """The sample said compress (zeros); the next version's bytes do not shrink: stored raw, restored exactly."""
    async with AsymStore([LocalTier(tmp_path, name="t")], calibrations={"t": SLOW}, keep_last=None) as store:
        await store.put_many(1, state(1, "zeros"))
        await store.commit(1)
        await store.put_many(2, state(2, "random"))
        await store.commit(2)
        assert codecs_of(tmp_path, 1)["w"] != RAW
        assert codecs_of(tmp_path, 2)["w"] == RAW
        assert_same((await store.restore(2)).tensors, state(2, "random"))
        assert_same((await store.restore(1)).tensors, state(1, "zeros"))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(["zeros", "random", "small"]), min_size=2, max_size=5))
async def test_any_sequence_of_versions_restores_exactly(tmp_path_factory: pytest.TempPathFactory,
                                                         kinds: list[str]) -> None:
    root = tmp_path_factory.mktemp("seq")
    async with AsymStore([LocalTier(root, name="t")], calibrations={"t": SLOW}, keep_last=None) as store:
        for step, kind in enumerate(kinds, start=1):
            await store.put_many(step, state(step, kind, numel=20_000))
            await store.commit(step)
        for step, kind in enumerate(kinds, start=1):
            assert_same((await store.restore(step)).tensors, state(step, kind, numel=20_000))


def test_memory_forgets_old_samples_and_keeps_no_encoded_bytes() -> None:
    memory = SampleMemory(reuse_versions=3)
    v = memory.next_version()
    smp = Sample(4, 100, 50, 1e-4, (True, False, False, False), encoded=object())  # type: ignore[arg-type]
    memory.remember(("w", 0, 100, 4), v, smp)
    got = memory.recall(("w", 0, 100, 4), v)
    assert got is not None and got.encoded is None and got.mask == smp.mask and got.ratio == smp.ratio
    assert memory.recall(("w", 0, 101, 4), v) is None  # another size: another chunk
    for _ in range(2):
        v = memory.next_version()
        assert memory.recall(("w", 0, 100, 4), v) is not None
    v = memory.next_version()  # three versions on: sampled again
    assert memory.recall(("w", 0, 100, 4), v) is None
    while v % 3:
        v = memory.next_version()
    assert len(memory) == 0  # and forgotten within reuse_versions more: the memory stays about one version large
    with pytest.raises(ValueError, match="reuse_versions"):
        SampleMemory(0)
