"""Format 5: segments proved by their chunks' checksums (one hash pass per byte), still covering every byte."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asymstore.format.checksum as checksum_module
import asymstore.write.pool as pool_module
import asymstore.write.segments as segments_module
from asymstore import AsymStore, LocalTier
from asymstore.errors import ManifestError
from asymstore.format.manifest import MANIFEST_NAME, seal_document
from asymstore.format.names import version_dirname
from asymstore.format.parse import parse_manifest
from asymstore.format.proof import chunks_digest
from asymstore.fsck import check
from tests.support.tensors import assert_same

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


@st.composite
def states(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """A state of small and large tensors (packs, chunks of their own, padding between them)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(1, 36))):
        n = draw(st.sampled_from([0, 1, 3, 100, 5000, 20_000]))
        dtype = draw(st.sampled_from(DTYPES))
        g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
        out[f"t{i}"] = (torch.randint(0, 200, (n,), generator=g) if not dtype.is_floating_point
                        else torch.randn(n, generator=g)).to(dtype)
    return out


def commit(root: Path, state: dict[str, torch.Tensor], compression: str, threads: int) -> None:
    async def go() -> None:
        async with AsymStore([LocalTier(root)], compression=compression,  # type: ignore[arg-type]
                             chunk_bytes=64 << 10, segment_bytes=256 << 10, pipeline_threads=threads) as s:
            await s.put_many(1, state)
            await s.commit(1)
    asyncio.run(go())


@given(state=states(), compression=st.sampled_from(["never", "auto"]), threads=st.sampled_from([1, 2]),
       where=st.floats(0, 1, exclude_max=True), data=st.data())
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_every_byte_of_a_chunk_proved_segment_is_covered(state: dict[str, torch.Tensor], compression: str,
                                                          threads: int, where: float, data: Any) -> None:
    """Every segment is proved by its chunks; a flipped byte anywhere in it (chunk or padding) fails --deep."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        commit(root, state, compression, threads)
        vdir = root / version_dirname(1)
        manifest = parse_manifest((vdir / MANIFEST_NAME).read_bytes())
        assert manifest.segments and all(s.proof == "chunks" for s in manifest.segments)
        for seg in manifest.segments:
            assert seg.checksum == chunks_digest(manifest.segment_spans(seg.name), seg.size)
        assert check(str(root), deep=True).ok
        stored = [s for s in manifest.segments if s.size]
        if not stored:  # nothing but empty tensors: no byte to flip
            return
        seg = data.draw(st.sampled_from(stored))
        path = vdir / seg.name
        raw = bytearray(path.read_bytes())
        at = int(where * len(raw))
        raw[at] ^= 0x01
        path.write_bytes(raw)
        report = check(str(root), deep=True)
        (entry,) = report.entries
        assert entry.status == "corrupt" and any(seg.name in p for p in entry.problems), entry.problems


def test_a_commit_hashes_no_segment_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write path takes no second pass over a segment's bytes (its chunks were hashed at staging)."""
    hashed: list[int] = []
    real = checksum_module.StreamingChecksum

    class Counting(real):  # type: ignore[misc,valid-type]
        def update(self, data: Any) -> None:
            hashed.append(len(memoryview(data).cast("B")))
            super().update(data)

    monkeypatch.setattr(segments_module, "StreamingChecksum", Counting)
    monkeypatch.setattr(pool_module, "StreamingChecksum", Counting)
    state = {f"w{i}": torch.randn(300_000) for i in range(4)} | {f"b{i}": torch.randn(10) for i in range(40)}
    for threads in (1, 2):
        commit(tmp_path / str(threads), state, "never", threads)
    assert sum(hashed) == 0

    async def restore() -> dict[str, torch.Tensor]:
        async with AsymStore([LocalTier(tmp_path / "2")]) as s:
            return (await s.restore()).tensors
    got = asyncio.run(restore())
    for name, t in state.items():
        assert_same(got[name], t)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(format_version=4), "proof"),
    (lambda d: d["segments"][0].update(proof="crc32"), "proof"),
    (lambda d: d["segments"][0].update(proof=7), "proof"),
])
def test_a_proof_outside_format_5_or_unknown_is_refused(tmp_path: Path, edit: Any, match: str) -> None:
    commit(tmp_path, {"w": torch.randn(5000)}, "never", 1)
    doc = json.loads((tmp_path / version_dirname(1) / MANIFEST_NAME).read_bytes())
    assert doc["format_version"] == 5 and doc["segments"][0]["proof"] == "chunks"
    edit(doc)
    with pytest.raises(ManifestError, match=match):
        parse_manifest(seal_document(doc))


def test_a_chunk_list_not_the_one_written_fails_the_proof(tmp_path: Path) -> None:
    """A manifest that lost a chunk (re-sealed by a forger) no longer proves its segment: --deep says so."""
    commit(tmp_path, {"a": torch.randn(5000), "b": torch.randn(5000)}, "never", 1)
    path = tmp_path / version_dirname(1) / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    del doc["tensors"]["b"]
    path.write_bytes(seal_document(doc))
    report = check(str(tmp_path), deep=True)
    (entry,) = report.entries
    assert entry.status == "corrupt" and any("checksum mismatch" in p for p in entry.problems), entry.problems


def test_a_flipped_byte_in_the_padding_between_chunks_fails_the_proof(tmp_path: Path) -> None:
    """Padding is no chunk's: the proof still covers it (it must be zero), as a whole-bytes checksum does."""
    commit(tmp_path, {"small": torch.randn(3), "big": torch.randn(20_000), "big2": torch.randn(20_000)}, "never", 1)
    vdir = tmp_path / version_dirname(1)
    manifest = parse_manifest((vdir / MANIFEST_NAME).read_bytes())
    gaps = []
    for seg in manifest.segments:
        at = 0
        for offset, length, _ in manifest.segment_spans(seg.name):
            if offset > at:
                gaps.append((seg.name, at))
            at = max(at, offset + length)
    assert gaps, "the layout left no padding to flip"
    name, at = gaps[0]
    raw = bytearray((vdir / name).read_bytes())
    raw[at] ^= 0x80
    (vdir / name).write_bytes(raw)
    (entry,) = check(str(tmp_path), deep=True).entries
    assert entry.status == "corrupt" and any("padding" in p for p in entry.problems), entry.problems
