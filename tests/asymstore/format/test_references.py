"""Format 4: references to an earlier version's segments round-trip, and a manifest that misuses them is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymstore.errors import ManifestError
from asymstore.format.manifest import Chunk, Manifest, SegmentEntry, TensorEntry, reference_key, seal_document
from asymstore.format.parse import parse_manifest
from asymstore.format.proof import PROOFS

HEX = "0123456789abcdef"


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    """A manifest of ``step`` whose chunks are in its own segment or in segments of earlier steps."""
    step = draw(st.integers(1, 10**6))
    origins = draw(st.lists(st.integers(0, step - 1), max_size=3, unique=True))
    proofs = st.sampled_from(PROOFS)  # format 5: any segment, own or referenced, may be proved by its chunks
    segments = [SegmentEntry("seg-000000.bin", 1 << 20, HEX, proof=draw(proofs))]
    segments += [SegmentEntry(reference_key(o, f"seg-{i:06d}.bin"), 1 << 20, HEX, o, draw(proofs))
                 for o in origins for i in range(draw(st.integers(1, 2)))]
    tensors = {}
    for i, seg in enumerate(draw(st.lists(st.sampled_from(segments), min_size=1, max_size=6))):
        tensors[f"t{i}"] = TensorEntry("float32", (4,), 16, (Chunk(seg.name, 64 * i, 16, 16, HEX, "raw", HEX),))
    return Manifest(step, tensors, tuple(segments), {"k": 1}, 1.0)


@given(manifests())
@settings(max_examples=50, deadline=None, derandomize=True, database=None)
def test_references_round_trip(manifest: Manifest) -> None:
    data = manifest.to_json()
    back = parse_manifest(data)
    assert back.tensors == manifest.tensors and back.segments == manifest.segments
    assert back.references == manifest.references
    by_chunks = any(s.proof == "chunks" for s in manifest.segments)
    assert json.loads(data)["format_version"] == (5 if by_chunks else 4 if manifest.references else 2)
    for seg in back.segments:
        assert back.locate(seg.name) == ((seg.origin, seg.file) if seg.origin is not None else (back.step, seg.name))


def doc(step: int = 5, version: int = 4, seg_step: int | None = 3, chunk_step: int | None = 3) -> dict[str, Any]:
    seg: dict[str, Any] = {"name": "seg-000000.bin", "size": 64, "checksum": HEX}
    chunk: dict[str, Any] = {"segment": "seg-000000.bin", "offset": 0, "length": 16, "raw_length": 16,
                             "codec": "raw", "checksum": HEX, "raw_checksum": HEX}
    if seg_step is not None:
        seg["step"] = seg_step
    if chunk_step is not None:
        chunk["step"] = chunk_step
    return {"format": "asymstore.manifest", "format_version": version, "step": step, "created": 0.0,
            "checksum_algorithm": "xxh3_64", "meta": {}, "segments": [seg],
            "tensors": {"w": {"dtype": "float32", "shape": [4], "nbytes": 16, "chunks": [chunk]}}, "extra": {}}


def test_a_well_formed_reference_parses() -> None:
    manifest = parse_manifest(seal_document(doc()))
    assert manifest.references == {3: frozenset({"seg-000000.bin"})}
    assert manifest.locate(manifest.tensors["w"].chunks[0].segment) == (3, "seg-000000.bin")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seg_step": 5, "chunk_step": 5}, "references only earlier"),  # itself
    ({"seg_step": 9, "chunk_step": 9}, "references only earlier"),  # a later version
    ({"version": 3}, "references another version"),  # format 3 has no references
    ({"chunk_step": 2}, "unknown segment"),  # a chunk naming a step the segments do not list
    ({"chunk_step": None}, "unknown segment"),  # the step's own segment, which it does not have
    ({"seg_step": None}, "unknown segment"),  # a reference to a segment listed as its own
])
def test_a_manifest_that_misuses_references_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        parse_manifest(seal_document(doc(**kwargs)))
