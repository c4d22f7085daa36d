"""The one verification path of a stored version, shared by restore and fsck so they never disagree.

Everything read from a tier is untrusted: the manifest (bounded by
:data:`~asymstore.format.manifest.MAX_MANIFEST_BYTES`, self-checksum first, then every rule of
:func:`~asymstore.format.parse.parse_manifest`), each segment (a regular file of exactly the
declared size; with ``deep``, its whole checksum) and each chunk (stored checksum, bounded decoding,
raw checksum; a pack once). Every failure is a :class:`~asymstore.errors.CorruptVersionError` (or
its :class:`~asymstore.errors.ManifestError`): restore falls back, fsck reports ``corrupt``.
Importing this module does not import torch (fsck starts fast); decoding does.

What each hostile file gets: docs/concepts/threat-model.md.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from asymstore.errors import CorruptVersionError
from asymstore.format.checksum import StreamingChecksum
from asymstore.format.manifest import Chunk, Manifest
from asymstore.format.parse import parse_manifest
from asymstore.format.proof import check_chunk_proof
from asymstore.tiers.protocol import Buffer, StatTier, Tier

READ_AHEAD = 4
"""Segments read concurrently."""


async def read_manifest(tier: Tier, step: int) -> Manifest:
    """Read, check and parse the manifest of ``step`` on ``tier``.

    Raises:
        VersionNotFoundError: the tier does not hold ``step``.
        ManifestError, CorruptVersionError: the manifest is damaged or names another step.
        TierError: the tier failed to read.
    """
    manifest = parse_manifest(await tier.read_manifest(step))
    if manifest.step != step:
        raise CorruptVersionError(f"manifest of step {step} on {tier.name} says step {manifest.step}")
    return manifest


def verify_segment(manifest: Manifest, name: str, data: Buffer, *, deep: bool) -> None:
    """Check a segment's size, and with ``deep`` its whole checksum (or its proof by chunks: format 5).

    Raises:
        CorruptVersionError: it does not match the manifest.
    """
    entry = next(s for s in manifest.segments if s.name == name)
    if len(data) != entry.size:
        raise CorruptVersionError(f"segment {name}: {len(data)} bytes, manifest says {entry.size}")
    if not deep:
        return
    if entry.proof == "chunks":  # a referenced one: only the chunks this version uses are its to check
        check_chunk_proof(name, entry.size, entry.checksum, manifest.segment_spans(name), data,
                          whole=entry.origin is None)
    elif StreamingChecksum([memoryview(data)]).hexdigest() != entry.checksum:
        raise CorruptVersionError(f"segment {name}: checksum mismatch")


def decode_one(name: str, chunk: Chunk, stored: memoryview, out: memoryview | None) -> memoryview:
    """Verify and decode one chunk of tensor ``name`` (into ``out`` when given).

    Raises:
        CorruptVersionError: any checksum, size or decoding failure, named by tensor, segment and offset.
    """
    from asymstore.format.codec import decode_chunk  # imports torch

    try:
        return decode_chunk(chunk, stored, out)
    except CorruptVersionError as exc:
        raise CorruptVersionError(f"{name}: chunk in {chunk.segment} at {chunk.offset}: {exc}") from exc
    except (ValueError, MemoryError, OverflowError) as exc:
        raise CorruptVersionError(f"{name}: chunk in {chunk.segment} at {chunk.offset} does not decode: "
                                  f"{type(exc).__name__}: {exc}") from exc


def verify_chunks(manifest: Manifest, segment: str, data: memoryview) -> list[str]:
    """Verify (and decode, into scratch memory of at most one chunk) every chunk stored in ``segment``.

    Returns:
        One problem line per chunk that fails; empty when all verify.
    """
    problems = []
    members: dict[Chunk, list[str]] = {}  # a pack (by value: an empty one shares its place): the tensors it holds
    for tname, entry in manifest.tensors.items():
        if entry.pack_offset is not None:
            pack = entry.chunks[0]
            if pack.segment == segment:
                members.setdefault(pack, []).append(tname)
            continue
        for c in entry.chunks:
            if c.segment != segment:
                continue
            try:
                decode_one(tname, c, data[c.offset:c.offset + c.length], None)
            except CorruptVersionError as exc:
                problems.append(f"tensor {tname!r}: {exc}")
    for i, pack in enumerate(manifest.packs):
        if pack.segment != segment:
            continue
        try:  # once for all its tensors
            decode_one(f"pack {i}", pack, data[pack.offset:pack.offset + pack.length], None)
        except CorruptVersionError as exc:
            names = members.get(pack, [])
            shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            problems.append(f"tensor {names[0]!r}: {exc} (one checksum covers the {len(names)} packed tensors "
                            f"{shown})" if names else f"{exc} (a pack that holds no tensor)")
    return problems


def physical_memory_bytes() -> int:
    """Bytes of physical memory on this machine (a bound on what a restore may allocate)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 50


async def check_version(tier: Tier, step: int, *, deep: bool,
                        progress: Callable[[int], None] | None = None) -> tuple[Manifest | None, list[str]]:
    """Verify ``step`` on ``tier`` as restore would, without keeping its tensors (fsck).

    Shallow: the manifest, and every segment's presence and size. Deep: also
    every segment checksum and every chunk (read one segment at a time).

    Returns:
        The manifest (None when it is unreadable) and one line per problem (empty: the version verifies).
    """
    from asymstore.errors import AsymstoreError

    try:
        manifest = await read_manifest(tier, step)
    except AsymstoreError as exc:
        return None, [f"bad manifest: {exc}"]
    problems: list[str] = []
    for seg in manifest.segments:
        try:
            if not deep and isinstance(tier, StatTier):
                await tier.stat_segment(*manifest.locate(seg.name), seg.size)
                continue
            data = memoryview(await tier.read_segment(*manifest.locate(seg.name), seg.size)).cast("B")
            verify_segment(manifest, seg.name, data, deep=False)
        except (AsymstoreError, OSError) as exc:
            problems.append(f"segment {seg.name}: {exc}")
            continue
        if deep:  # the whole-segment checksum, then every chunk: the problems name the damaged tensors
            try:
                verify_segment(manifest, seg.name, data, deep=True)
            except CorruptVersionError as exc:
                problems.append(str(exc))
            problems.extend(await asyncio.to_thread(verify_chunks, manifest, seg.name, data))
            if progress:
                progress(seg.size)
    return manifest, problems
