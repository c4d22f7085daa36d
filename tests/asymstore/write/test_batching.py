"""Batched flushing and the cost model: segment size, per-tier codec choices, calibration, damage."""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from asymstore import AsymStore, LocalTier, TierCalibration, host_tier
from asymstore.format.checksum import StreamingChecksum, checksum
from asymstore.format.codec import RAW, PlaneCodec
from asymstore.format.manifest import MANIFEST_NAME, seal_document
from asymstore.format.names import version_dirname
from asymstore.format.proof import SegmentProof, check_chunk_proof, chunks_digest
from asymstore.fsck import check
from asymstore.policy.calibration import CACHE_ENV, CalibrationCache, calibrate, default_cache_path
from asymstore.policy.costmodel import MIN_SEGMENT_BYTES, fit, optimal_segment_bytes
from asymstore.write.segments import SegmentBuilder, VersionPlan
from asymstore.write.staging import stage
from tests.support.forge import reprove
from tests.support.tensors import assert_same

MIB = 1 << 20
FAST = TierCalibration.from_throughput(1e12, 1e-6)  # memory-like: nothing is worth compressing
SLOW = TierCalibration.from_throughput(1e6, 20e-3)  # 1 MB/s, 20 ms per write: compress what shrinks


def bf16_state(n: int, numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}


def read_manifest(root: Path, step: int) -> dict[str, object]:
    doc: dict[str, object] = json.loads((root / version_dirname(step) / MANIFEST_NAME).read_bytes())
    return doc


def codecs(doc: dict[str, object]) -> set[str]:
    tensors = doc["tensors"]
    assert isinstance(tensors, dict)
    return {c["codec"] for t in tensors.values() for c in t["chunks"]}


# -- the formula -------------------------------------------------------------


def test_segment_size_is_sqrt_a_n_over_c_within_bounds() -> None:
    a, c, n = 5e-3, 2e-9, 10 << 30
    expected = math.sqrt(a * n / c)  # 164 MB
    got = optimal_segment_bytes(a, c, n, max_bytes=1 << 30)
    assert got % 4096 == 0 and expected <= got < expected + 4096
    assert optimal_segment_bytes(a, c, n, max_bytes=64 * MIB) == 64 * MIB  # memory cap
    assert optimal_segment_bytes(1e-9, c, n, max_bytes=1 << 30) == MIN_SEGMENT_BYTES  # floor
    assert optimal_segment_bytes(a, c, 10_000, max_bytes=1 << 30) == 12_288  # never more than the version


def test_fit_recovers_latency_and_bandwidth() -> None:
    a, b = 2e-3, 1 / 500e6
    got_a, got_b = fit(64 << 10, 8 << 20, a + b * (64 << 10), a + b * (8 << 20))
    assert got_a == pytest.approx(a) and got_b == pytest.approx(b)
    assert min(fit(1000, 2000, 0.5, 0.1)) > 0  # noise never yields negative costs


# -- per tier decisions ------------------------------------------------------


async def test_fast_tier_stores_raw_and_slow_tier_compresses(tmp_path: Path) -> None:
    fast, slow = LocalTier(tmp_path / "fast", name="fast"), LocalTier(tmp_path / "slow", name="slow")
    state = bf16_state(4, 256 << 10)  # 512 KiB each: worth sampling
    async with AsymStore([fast, slow], durable=fast, calibrations={"fast": FAST, "slow": SLOW}) as store:
        await store.put_many(7, state)
        result = await store.commit(7)
        await store.flushed(7)
        status = store.status()
    f, s = result.flush["fast"], status["slow"].last_flush
    assert s is not None and status["fast"].last_flush is f
    assert (f.chunks_compressed, f.chunks_raw, f.stored_bytes) == (0, 4, f.raw_bytes)
    assert (s.chunks_compressed, s.chunks_raw) == (4, 0)
    assert s.stored_bytes < 0.8 * s.raw_bytes and s.compress_seconds > 0
    assert s.calibration is SLOW and f.segment_bytes_source == s.segment_bytes_source == "cost-model"
    assert codecs(read_manifest(tmp_path / "fast", 7)) == {RAW}
    assert codecs(read_manifest(tmp_path / "slow", 7)) == {"zstd-planes:2"}
    async with AsymStore([LocalTier(tmp_path / "slow")]) as store:  # the compressed copy alone restores
        ckpt = await store.restore()
    for name, t in state.items():
        assert_same(ckpt.tensors[name], t)


def test_tiers_that_both_compress_share_the_encoded_chunks() -> None:
    staged = {n: stage(t, 1 * MIB) for n, t in bf16_state(3, 512 << 10).items()}
    plan = VersionPlan(1, staged, {}, 0.0, codec=PlaneCodec(threads=0), tiers=2)
    first = SegmentBuilder(plan, plan.plan_tier("a", SLOW))
    second = SegmentBuilder(plan, plan.plan_tier("b", SLOW))
    for builder in (first, second):
        while builder.next_segment() is not None:
            pass
    assert first.stats.chunks_compressed == second.stats.chunks_compressed == 3
    assert first.stats.compress_seconds > 0 and second.stats.compress_seconds == 0  # reused, not redone
    assert first.manifest().tensors == second.manifest().tensors


@pytest.mark.parametrize("segment_bytes", [None, 256 << 10])
def test_a_tier_reservation_bounds_what_the_version_stores_alignment_padding_included(
        segment_bytes: int | None) -> None:
    """Many large-enough chunks of odd sizes: each is aligned to 4 KiB in its segment, and the reservation covers it.

    A peer holder (and any tier that enforces it) refuses a version whose segments exceed what was reserved.
    """
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(64 << 10 | (i * 37 + 1), generator=g) for i in range(300)}  # 256 KiB + odd
    staged = {n: stage(t, 1 * MIB) for n, t in tensors.items()}
    plan = VersionPlan(1, staged, {}, 0.0, codec=PlaneCodec(threads=0))
    tier_plan = plan.plan_tier("memory", FAST, policy="never", segment_bytes=segment_bytes)
    builder = SegmentBuilder(plan, tier_plan)
    stored = 0
    while (seg := builder.next_segment()) is not None:
        stored += seg.size
    manifest = builder.manifest().to_json()
    assert stored >= plan.chunks_nbytes
    assert stored + len(manifest) <= tier_plan.reserve_bytes, (stored, len(manifest), tier_plan.reserve_bytes)


def test_incompressible_data_stays_raw_even_on_a_slow_tier() -> None:
    g = torch.Generator().manual_seed(3)
    noise = torch.randint(0, 256, (2 * MIB,), dtype=torch.uint8, generator=g)
    plan = VersionPlan(1, {"noise": stage(noise, MIB)}, {}, 0.0, codec=PlaneCodec(threads=0))
    assert plan.plan_tier("slow", SLOW).masks == [None, None]


async def test_user_segment_bytes_overrides_the_cost_model(tmp_path: Path) -> None:
    state = bf16_state(8, 128 << 10)  # 8 x 256 KiB
    async with AsymStore([LocalTier(tmp_path)], segment_bytes=600 << 10, calibrations={f"local:{tmp_path}": SLOW},
                         ) as store:
        await store.put_many(1, state)
        stats = (await store.commit(1)).flush[f"local:{tmp_path}"]
    assert (stats.segment_bytes, stats.segment_bytes_source) == (600 << 10, "override")
    manifest = read_manifest(tmp_path, 1)
    segments = manifest["segments"]
    assert isinstance(segments, list) and len(segments) == stats.segments
    assert all(seg["size"] <= 600 << 10 for seg in segments)


async def test_cost_model_segment_size_follows_the_calibration(tmp_path: Path) -> None:
    cal = TierCalibration(latency_s=1e-3, seconds_per_byte=1e-9, exposed_seconds_per_byte=1e-8)
    state = bf16_state(64, 128 << 10)  # 64 x 256 KiB = 16 MiB
    async with AsymStore([LocalTier(tmp_path, name="t")], calibrations={"t": cal}, compression="never") as store:
        await store.put_many(1, state)
        stats = (await store.commit(1)).flush["t"]
    expected = optimal_segment_bytes(1e-3, 1e-8, 16 * MIB, max_bytes=128 * MIB)  # sqrt(1e-3 * 16 MiB / 1e-8) ~ 1.3 MB
    assert stats.segment_bytes == expected and stats.segment_bytes_source == "cost-model"
    # chunks are never split across segments: each segment is within one 256 KiB chunk of B
    assert math.ceil(16 * MIB / expected) <= stats.segments <= math.ceil(16 * MIB / (expected - (256 << 10)))


# -- many small tensors, one big one -----------------------------------------


async def test_ten_thousand_small_tensors_make_few_segments(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    state = {f"layer.{i}.p": torch.randn(1024, generator=g) for i in range(10_000)}  # 4 KiB each
    async with AsymStore([LocalTier(tmp_path)]) as store:
        await store.put_many(1, state)
        result = await store.commit(1)
        ckpt = await store.restore()
    stats = result.flush[store.tiers[0].name]
    files = os.listdir(tmp_path / version_dirname(1))
    assert len(files) == stats.segments + 1  # segments and the manifest
    assert stats.segment_bytes >= MIN_SEGMENT_BYTES
    assert stats.segments <= math.ceil(stats.stored_bytes / (stats.segment_bytes - 4096))  # each one filled to B
    assert stats.segments <= 40  # 40 MiB in segments of >= 1 MiB, not 10,000 files
    # staged in bulk: packs of many tensors each, one chunk (and one checksum) per pack, 10,000 tensors listed
    assert len(result.manifest.tensors) == 10_000 and 1 <= len(result.manifest.packs) <= 40
    assert stats.chunks_raw + stats.chunks_compressed == len(result.manifest.packs)
    for name, t in state.items():
        assert_same(ckpt.tensors[name], t)


@pytest.mark.parametrize("proof", ["bytes", "chunks"])
def test_compressed_segments_stream_without_a_second_copy_of_the_version(proof: SegmentProof) -> None:
    big = (torch.randn(16 * MIB) * 0.02).to(torch.bfloat16)  # 32 MiB
    plan = VersionPlan(1, {"big": stage(big, 512 << 10)}, {}, 0.0, codec=PlaneCodec(threads=0))
    tier_plan = plan.plan_tier("slow", SLOW, segment_bytes=2 * MIB)
    builder = SegmentBuilder(plan, tier_plan, proof=proof)
    tracemalloc.start()
    try:
        digests = []
        while (seg := builder.next_segment()) is not None:
            assert seg.size <= 2 * MIB
            if proof == "bytes":
                digests.append(StreamingChecksum(seg.parts).hexdigest() == seg.checksum)
            else:  # proved by its chunks: the bytes verify against them (one pass, here in the test)
                data = b"".join(seg.parts)
                spans = [(c.offset, c.length, c.checksum) for c in builder._chunks if c.segment == seg.name]
                check_chunk_proof(seg.name, seg.size, seg.checksum, spans, data, whole=True)
                digests.append(seg.checksum == chunks_digest(spans, seg.size))
                del data
            del seg  # written, dropped
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(digests) and builder.stats.chunks_compressed == 64
    assert peak < 8 * MIB  # about one segment of compressed output, not the 32 MiB version
    assert builder.stats.stored_bytes < 0.8 * builder.stats.raw_bytes


# -- damage to a compressed chunk ------------------------------------------------


def _forge_plane_damage(root: Path, step: int) -> str:
    """Flip a byte in the raw-stored plane of the first compressed chunk, then fix the stored checksums.

    Only decoding and the raw checksum can now tell; returns the damaged tensor's name.
    """
    mpath = root / version_dirname(step) / MANIFEST_NAME
    doc = json.loads(mpath.read_bytes())
    name, entry = next((n, e) for n, e in doc["tensors"].items() if e["chunks"][0]["codec"] != RAW)
    chunk = entry["chunks"][0]
    spath = root / version_dirname(step) / chunk["segment"]
    data = bytearray(spath.read_bytes())
    low, _ = struct.unpack_from("<2Q", data, chunk["offset"])
    assert low & 1 == 0  # plane 0 (mantissa noise) is stored raw
    data[chunk["offset"] + 16 + 3] ^= 0x01
    spath.write_bytes(data)
    chunk["checksum"] = checksum(memoryview(data)[chunk["offset"]:chunk["offset"] + chunk["length"]])
    reprove(doc, chunk["segment"], data)
    mpath.write_bytes(seal_document(doc))  # a forger can re-seal the manifest too: only the chunks can tell
    return str(name)


@pytest.mark.parametrize("forged", [False, True])
async def test_corrupt_compressed_chunk_is_found_by_fsck_and_restore_falls_back(tmp_path: Path, forged: bool) -> None:
    name = f"local:{tmp_path}"
    async with AsymStore([LocalTier(tmp_path)], calibrations={name: SLOW}, keep_last=None) as store:
        for step in (1, 2):
            await store.put_many(step, bf16_state(3, 256 << 10, seed=step))
            result = await store.commit(step)
            assert result.flush[name].chunks_compressed == 3
    if forged:
        tensor = _forge_plane_damage(tmp_path, 2)
        problem = "raw checksum mismatch"
    else:
        doc = read_manifest(tmp_path, 2)
        tensors = doc["tensors"]
        assert isinstance(tensors, dict)
        tensor, entry = next(iter(tensors.items()))
        chunk = entry["chunks"][0]
        with open(tmp_path / version_dirname(2) / chunk["segment"], "r+b") as f:
            f.seek(chunk["offset"] + chunk["length"] - 10)  # inside the compressed exponent plane
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x20]))
        problem = "stored checksum mismatch"

    assert check(str(tmp_path)).ok  # sizes are right: only --deep reads the bytes
    report = check(str(tmp_path), deep=True)
    (bad,) = [e for e in report.entries if e.step == 2]
    assert bad.status == "corrupt"
    assert any(f"tensor {tensor!r}" in p and problem in p for p in bad.problems), bad.problems
    assert report.newest_restorable == 1

    async with AsymStore([LocalTier(tmp_path)]) as store:
        ckpt = await store.restore()
    assert ckpt.step == 1 and ckpt.fell_back and problem in ckpt.fallbacks[0]
    for n, t in bf16_state(3, 256 << 10, seed=1).items():
        assert_same(ckpt.tensors[n], t)


# -- calibration -------------------------------------------------------------


async def test_calibration_is_measured_once_then_cached_per_filesystem(tmp_path: Path) -> None:
    cache = CalibrationCache(tmp_path / "cache.json")
    first, second = LocalTier(tmp_path / "a"), LocalTier(tmp_path / "b")
    for tier in (first, second):
        await tier.open()
    measured = await calibrate(first, cache)
    assert measured.source == "measured" and measured.latency_s > 0 and measured.seconds_per_byte > 0
    assert measured.exposed_seconds_per_byte > measured.seconds_per_byte
    assert os.listdir(tmp_path / "a") == []  # the scratch directory is gone
    cached = await calibrate(second, cache)  # another root on the same filesystem
    assert cached.source == "cached" and cached.key == first.calibration_key()
    assert (cached.latency_s, cached.seconds_per_byte) == (measured.latency_s, measured.seconds_per_byte)
    again = await calibrate(second, cache, refresh=True)
    assert again.source == "measured"


async def test_store_uses_the_cache_file_and_given_calibrations_win(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cachedir"))
    assert default_cache_path() == str(tmp_path / "cachedir" / "calibration.json")
    async with AsymStore([host_tier(name="host"), LocalTier(tmp_path / "d", name="disk")],
                         calibrations={"host": FAST}) as store:
        status = store.status()
    host, disk = status["host"].calibration, status["disk"].calibration
    assert host is FAST
    assert disk is not None and disk.source in ("measured", "cached")
    doc = json.loads((tmp_path / "cachedir" / "calibration.json").read_bytes())
    assert doc["format"] == "asymstore.calibration" and disk.key in doc["entries"]
    assert status["disk"].versions == [] and status["disk"].last_flush is None


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path, name="t")
    with pytest.raises(ValueError, match="compression"):
        AsymStore([tier], compression="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tiers"):
        AsymStore([tier], calibrations={"other": FAST})
    with pytest.raises(ValueError):
        TierCalibration(-1.0, 1e-9, 1e-9)
