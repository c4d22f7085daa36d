"""How a segment's checksum proves its bytes: one xxh3 pass per byte (format 5), or a second pass (formats 1-4).

A segment's bytes are its chunks' stored bytes and the zero padding that aligns them. Every chunk
already carries the checksum of its stored bytes, taken where the bytes were hot (at staging for a
raw chunk, by the encoder for a compressed one). Format 5 lets a segment be proved by those:

- ``"bytes"`` (every format): ``checksum`` is the xxh3 of the segment's bytes, one more pass over them
  at write time (a peer tier's receiver checks it on arrival, before it has the manifest);
- ``"chunks"`` (format 5): ``checksum`` is :func:`chunks_digest` of the segment's chunk spans
  (offset, stored length, chunk checksum) and its size, computed from the manifest's own entries, so
  no byte is hashed twice. The bytes verify when every chunk hashes to its checksum and every byte
  no chunk covers is zero (:func:`check_chunk_proof`): the same coverage as the whole-bytes checksum.

Guide: docs/concepts/format.md ("One hash pass").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import xxhash

from asymstore.errors import CorruptVersionError

if TYPE_CHECKING:
    from asymstore.format.checksum import Buffer

SegmentProof = Literal["bytes", "chunks"]
"""What a segment's ``checksum`` is taken over (see the module docstring)."""

PROOFS: tuple[SegmentProof, ...] = ("bytes", "chunks")

Span = tuple[int, int, str]
"""One chunk's place in its segment: offset, stored length, checksum of the stored bytes."""


def chunks_digest(spans: Iterable[Span], size: int) -> str:
    """The ``"chunks"`` proof of a segment of ``size`` bytes whose chunks are ``spans`` (any order; empty ones skipped).

    One span per stored place: a pack shared by many tensors counts once.
    """
    h = xxhash.xxh3_64()
    for offset, length, digest in sorted({s for s in spans if s[1] > 0}):
        h.update(f"{offset}:{length}:{digest};".encode())
    h.update(f"size:{size}".encode())
    return str(h.hexdigest())


def check_chunk_proof(name: str, size: int, expected: str, spans: list[Span], data: Buffer, *,
                      whole: bool) -> None:
    """Verify a ``"chunks"``-proved segment's bytes ``data`` (one xxh3 pass over the chunks).

    Args:
        name: the segment (for the messages).
        size: its size in the manifest.
        expected: its ``checksum`` in the manifest.
        spans: its chunks' spans (:meth:`~asymstore.format.manifest.Manifest.segment_spans`).
        data: its bytes.
        whole: ``spans`` are every chunk of the segment (the manifest that wrote it): the proof is
            recomputed and the bytes between chunks must be zero. False for a segment referenced from an
            earlier version, whose other chunks belong to that version's manifest: only these chunks
            are checked.

    Raises:
        CorruptVersionError: a chunk's bytes, the padding, the size or the proof do not match.
    """
    view = memoryview(data).cast("B")
    if len(view) != size:
        raise CorruptVersionError(f"segment {name}: {len(view)} bytes, manifest says {size}")
    if whole and chunks_digest(spans, size) != expected:
        raise CorruptVersionError(f"segment {name}: checksum mismatch (its chunks are not the ones it was "
                                  "written with)")
    at = 0
    for offset, length, digest in spans:
        if offset + length > size:
            raise CorruptVersionError(f"segment {name}: a chunk at {offset} of {length} bytes ends past its end")
        if whole and offset > at and view[at:offset] != bytes(offset - at):
            raise CorruptVersionError(f"segment {name}: checksum mismatch (non-zero padding at {at})")
        if xxhash.xxh3_64_hexdigest(view[offset:offset + length]) != digest:
            raise CorruptVersionError(f"segment {name}: checksum mismatch (the chunk at {offset})")
        at = max(at, offset + length)
    if whole and at < size and view[at:size] != bytes(size - at):
        raise CorruptVersionError(f"segment {name}: checksum mismatch (non-zero padding at {at})")
