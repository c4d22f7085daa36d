"""Reading one version back from one tier, verifying every byte on the way."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asymstore.checksum import StreamingChecksum
from asymstore.codec import RAW, decode_chunk
from asymstore.errors import AsymstoreError, CorruptVersionError
from asymstore.manifest import Manifest
from asymstore.tensorbytes import as_bytes, dtype_from_name, from_bytes
from asymstore.tiers.base import Buffer, Tier

logger = logging.getLogger(__name__)

_READ_AHEAD = 4  # segments read concurrently


@dataclass
class Checkpoint:
    """A restored version.

    Attributes:
        step: the version's step.
        tensors: name -> tensor, bit-exact with dtype and shape as put.
        meta: the user's JSON metadata.
        tier: name of the tier it was read from.
        manifest: the version's parsed manifest.
        fallbacks: one line per newer version or faster tier that was tried
            and failed verification before this one; empty when none failed.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    tier: str
    manifest: Manifest
    fallbacks: list[str] = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        """True when a newer or faster copy failed and this one was used instead."""
        return bool(self.fallbacks)


async def read_manifest(tier: Tier, step: int) -> Manifest:
    """Read and parse the manifest of ``step`` on ``tier``."""
    manifest = Manifest.from_json(await tier.read_manifest(step))
    if manifest.step != step:
        raise CorruptVersionError(f"manifest of step {step} on {tier.name} says step {manifest.step}")
    return manifest


def verify_segment(manifest: Manifest, name: str, data: Buffer, *, deep: bool) -> None:
    """Check a segment's size, and with ``deep`` its whole-file checksum.

    Raises:
        CorruptVersionError: it does not match the manifest.
    """
    entry = next(s for s in manifest.segments if s.name == name)
    if len(data) != entry.size:
        raise CorruptVersionError(f"segment {name}: {len(data)} bytes, manifest says {entry.size}")
    if deep and StreamingChecksum([memoryview(data)]).hexdigest() != entry.checksum:
        raise CorruptVersionError(f"segment {name}: checksum mismatch")


async def load_version(tier: Tier, step: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Read, verify and decode every tensor of ``step`` from ``tier``.

    Raises:
        CorruptVersionError: the manifest, a segment or a chunk fails verification.
        VersionNotFoundError: the tier does not hold ``step``.
        TierError: the tier failed to read.
    """
    manifest = await read_manifest(tier, step)
    sem = asyncio.Semaphore(_READ_AHEAD)

    async def fetch(name: str) -> tuple[str, memoryview]:
        async with sem:
            data = await tier.read_segment(step, name)
            verify_segment(manifest, name, data, deep=False)
            return name, memoryview(data).cast("B") if len(data) else memoryview(bytearray())

    segments = dict(await asyncio.gather(*(fetch(s.name) for s in manifest.segments)))
    return manifest, await asyncio.to_thread(_decode_all, manifest, segments)


def _decode_all(manifest: Manifest, segments: dict[str, memoryview]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, entry in manifest.tensors.items():
        dtype = dtype_from_name(entry.dtype)
        # one raw chunk: the tensor is a view of the segment; else decode every chunk into place
        single = len(entry.chunks) == 1 and entry.chunks[0].codec == RAW
        # torch.empty, not bytearray: no zero-fill pass over fresh memory before the chunks land
        buf: memoryview = as_bytes(torch.empty(0 if single else entry.nbytes, dtype=torch.uint8))
        target = buf
        pos = 0
        for chunk in entry.chunks:
            stored = segments[chunk.segment][chunk.offset:chunk.offset + chunk.length]
            try:
                raw = decode_chunk(chunk, stored, None if single else target[pos:pos + chunk.raw_length])
            except CorruptVersionError as exc:
                raise CorruptVersionError(f"{name}: chunk in {chunk.segment} at {chunk.offset}: {exc}") from exc
            if single:
                buf = raw
            pos += chunk.raw_length
        out[name] = from_bytes(buf, dtype, list(entry.shape))
    return out


def describe(exc: BaseException) -> str:
    """Return a one-line reason for a failed load."""
    if isinstance(exc, AsymstoreError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc!r}"
