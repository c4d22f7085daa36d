"""Loading one verified version from one tier: into fresh tensors, or straight into the caller's.

``load_version(tier, step, into=...)`` reads each chunk of a tensor named in ``into`` straight into
its memory where the tier can read into caller buffers
(:class:`~asymstore.tiers.protocol.ReadIntoTier`), verifying checksums on the destination; other
destinations get one copy from a decoded host tensor. Every check of :mod:`asymstore.read.verify`
applies, and ``into`` is checked against the manifest before any byte is written
(:class:`~asymstore.errors.DestinationMismatchError`). A load that fails part way leaves the
caller (``AsymStore.restore``) to load an older version into the same tensors.

How the bytes travel: docs/concepts/data-path.md.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from asymstore.errors import CorruptVersionError, DestinationMismatchError
from asymstore.format.manifest import Chunk, Manifest
from asymstore.read.verify import READ_AHEAD, decode_one, physical_memory_bytes, read_manifest, verify_segment
from asymstore.tiers.protocol import ReadIntoTier, Tier

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch

    Into: TypeAlias = Mapping[str, torch.Tensor] | Callable[[Manifest], Mapping[str, torch.Tensor]]
    """Destinations: name -> tensor, or a function of the candidate version's manifest that returns them."""


def _targets(manifest: Manifest, into: Mapping[str, torch.Tensor]) -> dict[str, memoryview]:
    """Writable byte views of the destinations that can be filled in place; check every destination."""
    from asymstore.format.tensors import as_bytes, dtype_name

    views = {}
    for name, dest in into.items():
        entry = manifest.tensors.get(name)
        if entry is None:
            raise DestinationMismatchError(f"{name!r} is not stored in step {manifest.step}")
        if dtype_name(dest.dtype) != entry.dtype or tuple(dest.shape) != entry.shape:
            raise DestinationMismatchError(f"{name!r}: the destination is {dtype_name(dest.dtype)} "
                                           f"{list(dest.shape)}, step {manifest.step} stores {entry.dtype} "
                                           f"{list(entry.shape)}")
        if dest.device.type == "cpu" and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg():
            views[name] = as_bytes(dest.detach())
    return views


_Direct = list[tuple[str, Chunk, memoryview]]
"""Chunks of one segment read into place: (tensor or pack label, chunk, where its bytes land)."""


class _SegmentPlan:
    """What one segment's ranged read fills: raw chunks into their destinations, other chunks into scratch.

    ``direct`` chunks are raw and land where they belong (a destination
    tensor, a pack's buffer): verified there, by the digests the tier hashed
    as they landed or by a pass right after. ``staged`` chunks (compressed,
    or with no destination to land in) land in scratch buffers of their
    stored length; those with a destination (``decode``: the destination's
    slice) are verified and decoded into it as soon as their segment is read,
    beside the other reads; the rest by :func:`decode_tensors`, like a chunk
    of a whole segment.
    """

    __slots__ = ("decode", "direct", "staged")

    def __init__(self) -> None:
        """Nothing planned yet."""
        self.direct: _Direct = []
        self.staged: _Direct = []
        self.decode: list[memoryview | None] = []  # per staged chunk: its destination slice, or None

def resolve_into(manifest: Manifest, into: Into | None) -> dict[str, torch.Tensor]:
    """The destinations for ``manifest``: ``into`` itself, or what ``into(manifest)`` returns.

    Raises:
        DestinationMismatchError: ``into(manifest)`` raised (the error is its cause); nothing was written.
    """
    if into is None:
        return {}
    if callable(into):
        try:
            return dict(into(manifest))
        except Exception as exc:
            raise DestinationMismatchError(f"step {manifest.step}: the destinations were refused: {exc}") from exc
    return dict(into)


async def check_destinations(tier: Tier, step: int, into: Into | None) -> None:
    """Check ``into`` against the manifest of ``step`` on ``tier``; read no tensor byte and write none.

    What :func:`load_version` checks before it writes anything, alone: a
    collective restore agrees on it across ranks before any rank reads.

    Raises:
        DestinationMismatchError: a name of ``into`` is not stored or has another dtype or shape, or
            ``into(manifest)`` raised (its cause).
        CorruptVersionError: the manifest fails verification.
        VersionNotFoundError: the tier does not hold ``step``.
        TierError: the tier failed to read.
    """
    if into is None:
        return
    manifest = await read_manifest(tier, step)
    _targets(manifest, resolve_into(manifest, into))


_ALIGN = 64  # byte alignment of each fresh tensor in its block (a cache line; every dtype's itemsize divides it)


def fresh_block(nbytes: int) -> mmap.mmap:
    """Fresh private anonymous memory of ``nbytes`` (at least one byte).

    The kernel zeroes its pages as they are first written, in the thread
    that writes them (the reads run in several threads at once); no pass in
    user space does. No ``MADV_HUGEPAGE``: with THP ``defrag=madvise`` its
    faults may compact memory in the faulting thread, measured here at 10x
    the 4 KiB faults it saves when memory was fragmented.
    """
    return mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _fresh_destinations(manifest: Manifest, into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh tensors for the raw tensors ``into`` leaves out, so every segment can be read straight into place.

    They are built in bulk: views of one fresh block (:func:`fresh_block`),
    each at a 64-byte aligned offset, so the restored state costs one
    allocation rather than one per tensor, and no allocator keeps or zeroes
    any of it. The block is freed once every tensor built on it is.
    """
    import torch

    from asymstore.format.codec import RAW
    from asymstore.format.tensors import dtype_from_name

    wanted = [(name, entry) for name, entry in manifest.tensors.items()
              if name not in into and entry.pack_offset is None and entry.chunks
              and all(c.codec == RAW for c in entry.chunks)]
    offsets = []
    total = 0
    for _, entry in wanted:
        offsets.append(total)
        total += -(-entry.nbytes // _ALIGN) * _ALIGN
    block = fresh_block(total)
    out: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for (name, entry), offset in zip(wanted, offsets, strict=True):
        dtype = dtypes.get(entry.dtype)
        if dtype is None:
            dtype = dtypes[entry.dtype] = dtype_from_name(entry.dtype)
        if not entry.nbytes:
            out[name] = torch.empty(entry.shape, dtype=dtype)
            continue
        t = torch.frombuffer(block, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=offset)
        out[name] = t.view(entry.shape)
    return out


def _pack_buffers(manifest: Manifest) -> dict[Chunk, memoryview]:
    """One fresh buffer per pack for its raw bytes (verified there; its tensors are views of it or copied out).

    Packs, like staged chunks, are found by the chunk itself, never by its
    place: a chunk of no bytes (an empty tensor, a pack of empty tensors)
    shares its segment and offset with the chunk stored after it.
    """
    import torch

    from asymstore.format.tensors import as_bytes

    return {p: as_bytes(torch.empty(p.raw_length, dtype=torch.uint8)) for p in manifest.packs}


def pack_label(index: int, pack: Chunk) -> str:
    """How errors name a pack (fsck names its tensors too)."""
    return f"pack {index} ({pack.raw_length} bytes of small tensors)"


def _direct_ranges(manifest: Manifest, targets: Mapping[str, memoryview],
                   packs: Mapping[Chunk, memoryview]) -> dict[str, _SegmentPlan]:
    """How each segment is read by ranges: raw chunks into their destinations, the others into scratch.

    A raw pack lands whole in its buffer of ``packs``. A segment with no raw
    chunk that lands in place is left out (read whole: nothing is saved by
    ranges there).
    """
    import torch

    from asymstore.format.codec import RAW
    from asymstore.format.tensors import as_bytes

    plans: dict[str, _SegmentPlan] = {s.name: _SegmentPlan() for s in manifest.segments}

    def scratch(n: int) -> memoryview:
        return as_bytes(torch.empty(n, dtype=torch.uint8)) if n else memoryview(bytearray())

    for name, entry in manifest.tensors.items():
        if entry.pack_offset is not None:
            continue
        dest = targets.get(name)
        pos = 0
        for c in entry.chunks:
            plan = plans[c.segment]
            if dest is not None and c.codec == RAW:
                plan.direct.append((name, c, dest[pos:pos + c.raw_length]))
            else:
                plan.staged.append((name, c, scratch(c.length)))
                plan.decode.append(None if dest is None else dest[pos:pos + c.raw_length])
            pos += c.raw_length
    for i, pack in enumerate(manifest.packs):
        plan = plans[pack.segment]
        if pack.codec == RAW:
            plan.direct.append((pack_label(i, pack), pack, packs[pack]))
        else:
            plan.staged.append((pack_label(i, pack), pack, scratch(pack.length)))
            plan.decode.append(None)  # decoded into its buffer before its tensors are built: decode_tensors
    # a segment where nothing lands in a destination is read whole (its tensors are views of it)
    return {seg: plan for seg, plan in plans.items() if plan.direct or any(d is not None for d in plan.decode)}


async def load_version(tier: Tier, step: int, into: Into | None = None) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Read, verify and decode every tensor of ``step`` from ``tier`` (named ones into ``into``).

    ``into`` may also be a function of the manifest (checked before any byte
    is read) that returns the destinations. With destinations given and a
    tier that reads into caller buffers, the other raw tensors are read
    straight into fresh tensors too (built in bulk), so no segment is staged
    whole and copied. A tier whose ``prefers_read_into`` is true (shared
    memory: a whole-segment read is a copy there too) is read that way
    without destinations as well: every raw tensor is a fresh one, hashed as
    its bytes land rather than in a second pass over a staged segment.

    Returns:
        The manifest, and name -> tensor: the destination tensor itself for names in ``into``.

    Raises:
        DestinationMismatchError: a name of ``into`` is not stored, or has another dtype or shape.
        CorruptVersionError: the manifest, a segment or a chunk fails verification,
            or the version declares more bytes than this machine has memory.
        VersionNotFoundError: the tier does not hold ``step``.
        TierError: the tier failed to read.
    """
    manifest = await read_manifest(tier, step)
    dests = resolve_into(manifest, into)
    packed = sum(e.nbytes for e in manifest.tensors.values() if e.pack_offset is not None)
    fresh = (manifest.nbytes - packed + sum(p.raw_length for p in manifest.packs)
             - sum(e.nbytes for n in dests if (e := manifest.tensors.get(n)) is not None and e.pack_offset is None))
    if fresh > physical_memory_bytes():
        raise CorruptVersionError(f"step {step} on {tier.name} declares {manifest.nbytes} bytes of tensors, "
                                  "more than this machine's memory")
    targets = _targets(manifest, dests)  # every destination checked before any is allocated or written
    if isinstance(tier, ReadIntoTier) and (dests or getattr(tier, "prefers_read_into", False)):
        fresh_dests = _fresh_destinations(manifest, dests)
        targets.update(_targets(manifest, fresh_dests))
        dests.update(fresh_dests)
    packs = _pack_buffers(manifest)
    direct = _direct_ranges(manifest, targets, packs) if isinstance(tier, ReadIntoTier) else {}
    sem = asyncio.Semaphore(READ_AHEAD)

    staged: dict[Chunk, memoryview] = {}

    async def fetch(name: str, size: int) -> tuple[str, memoryview | None]:
        async with sem:
            plan = direct.get(name)
            if plan is not None:
                assert isinstance(tier, ReadIntoTier)
                digests = await tier.read_segment_into(*manifest.locate(name), size, [
                    (c.offset, view) for _, c, view in (*plan.direct, *plan.staged)])
                if digests is not None:  # hashed by the tier as the bytes landed (staged ones: checked on decode)
                    _check_digests(plan.direct, digests[:len(plan.direct)])
                    if any(d is not None for d in plan.decode):
                        await asyncio.to_thread(_decode_staged, plan)
                else:  # verified right away, while this segment's bytes are still warm, and beside the next reads
                    await asyncio.to_thread(_verify_in_place, plan)
                for (_, c, view), dest in zip(plan.staged, plan.decode, strict=True):
                    if dest is None:
                        staged[c] = view
                return name, None
            data = await tier.read_segment(*manifest.locate(name), size)
            verify_segment(manifest, name, data, deep=False)
            return name, memoryview(data).cast("B") if len(data) else memoryview(bytearray())

    segments = dict(await asyncio.gather(*(fetch(s.name, s.size) for s in manifest.segments)))
    return manifest, await asyncio.to_thread(decode_tensors, manifest, segments, targets, dests, packs, staged)


def _check_digests(items: _Direct, digests: list[str]) -> None:
    if len(digests) != len(items):
        raise CorruptVersionError(f"the tier returned {len(digests)} digests for {len(items)} chunks")
    for (name, chunk, _), digest in zip(items, digests, strict=True):
        if digest != chunk.checksum:  # raw chunks only here: the stored bytes are the raw bytes
            raise CorruptVersionError(f"{name}: chunk in {chunk.segment} at {chunk.offset}: stored checksum mismatch")


def _verify_in_place(plan: _SegmentPlan) -> None:
    for name, chunk, view in plan.direct:
        decode_one(name, chunk, view, None)  # raw: checks the length and the checksum of the destination bytes
    _decode_staged(plan)


def _decode_staged(plan: _SegmentPlan) -> None:
    """Verify and decode each staged chunk that has a destination into it (from its scratch buffer)."""
    for (name, chunk, view), dest in zip(plan.staged, plan.decode, strict=True):
        if dest is not None:
            decode_one(name, chunk, view, dest)


def decode_tensors(manifest: Manifest, segments: Mapping[str, memoryview | None],
                   targets: Mapping[str, memoryview] | None = None,
                   into: Mapping[str, torch.Tensor] | None = None,
                   packs: Mapping[Chunk, memoryview] | None = None,
                   staged: Mapping[Chunk, memoryview] | None = None) -> dict[str, torch.Tensor]:
    """Verify and decode every tensor of ``manifest`` from its segments (None: read by ranges).

    A segment read by ranges has each chunk either already verified in its
    destination, or its stored bytes in ``staged`` (by segment and offset),
    verified and decoded here (keyed by the chunk itself). ``packs`` holds a buffer per pack
    (:func:`_pack_buffers`; made here when not given): every pack is
    verified (and decoded) into its buffer before any tensor is built from it.
    """
    import torch

    from asymstore.format.codec import RAW
    from asymstore.format.tensors import as_bytes, dtype_from_name, from_bytes

    targets = targets or {}
    into = into or {}
    staged = staged or {}
    if packs is None:
        packs = _pack_buffers(manifest)

    def stored_bytes(chunk: Chunk) -> memoryview | None:
        """The chunk's stored bytes to verify and decode, or None: verified in its destination already."""
        whole = segments[chunk.segment]
        if whole is not None:
            return whole[chunk.offset:chunk.offset + chunk.length]
        return staged.get(chunk)

    for i, pack in enumerate(manifest.packs):
        stored = stored_bytes(pack)
        if stored is not None:
            decode_one(pack_label(i, pack), pack, stored, packs[pack])
    out: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    frombuffer = torch.frombuffer
    for name, entry in manifest.tensors.items():
        dest = targets.get(name)
        dtype = dtypes.get(entry.dtype)
        if dtype is None:
            dtype = dtypes[entry.dtype] = dtype_from_name(entry.dtype)
        offset = entry.pack_offset
        if offset is not None:  # a view of its verified pack, or copied out of it into the destination
            pack = entry.chunks[0]
            data = packs[pack]
            if dest is not None:
                dest[:] = data[offset:offset + entry.nbytes]
                out[name] = into[name]
            elif name in into:  # not fillable in place (GPU, non-contiguous): one copy from the pack
                into[name].copy_(from_bytes(data[offset:offset + entry.nbytes], dtype, list(entry.shape)))
                out[name] = into[name]
            elif not entry.nbytes:
                out[name] = torch.empty(entry.shape, dtype=dtype)
            else:
                t = frombuffer(data, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=offset)
                out[name] = t if len(entry.shape) == 1 else t.view(entry.shape)
            continue
        # one raw chunk and no destination: the tensor is a view of the segment; else decode every chunk into place
        single = dest is None and len(entry.chunks) == 1 and entry.chunks[0].codec == RAW
        # torch.empty, not bytearray: no zero-fill pass over fresh memory before the chunks land
        buf: memoryview = dest if dest is not None else as_bytes(
            torch.empty(0 if single else entry.nbytes, dtype=torch.uint8))
        pos = 0
        for chunk in entry.chunks:
            target = buf[pos:pos + chunk.raw_length]
            stored = stored_bytes(chunk)
            if stored is not None:  # None: read straight into the destination and verified there already
                raw = decode_one(name, chunk, stored, None if single else target)
                if single:
                    buf = raw
            pos += chunk.raw_length
        if name in into:
            if dest is None:  # not fillable in place (GPU, non-contiguous): one copy from the decoded bytes
                into[name].copy_(from_bytes(buf, dtype, list(entry.shape)))
            out[name] = into[name]
        else:
            out[name] = from_bytes(buf, dtype, list(entry.shape))
    return out
