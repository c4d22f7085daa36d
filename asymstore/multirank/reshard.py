"""Restoring a multi-rank version on another number of ranks, reading only the byte ranges each rank needs.

A :class:`~asymstore.multirank.RankStore` whose ``reshard`` is set restores a global version written
by N ranks on M ranks (see :meth:`~asymstore.multirank.RankStore.restore`). Each rank verifies every
old shard's manifest against the global manifest and parses its tensor layouts, asks ``reshard``
which piece of each sharded tensor it holds now, plans the overlapping chunks
(:func:`asymstore.read.reshardplan.plan_piece`) and reads each old shard's chunks once, a segment's
in one request (at most :data:`READ_BATCH_BYTES` each, :data:`READS_IN_FLIGHT` at a time), verifying
each chunk before its bytes reach the new pieces. Tensors held whole and the JSON meta come from old
rank ``rank % N``. A shard without layouts (DeepSpeed's) is refused.

Guide: ``docs/guides/fsdp2.md`` (Resuming on another number of ranks).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asymstore.errors import AsymstoreError, CorruptVersionError, LayoutError, VersionNotFoundError, describe
from asymstore.format.globalmanifest import GlobalManifest, shard_digest
from asymstore.format.manifest import Chunk, Manifest
from asymstore.format.pieces import LAYOUT_KEY, TensorLayout, layout_meta, read_layouts
from asymstore.format.replicas import is_sliced
from asymstore.multirank.rootlayout import is_single_root
from asymstore.read.reshardplan import PieceRead, plan_piece, strides
from asymstore.read.verify import decode_one, read_manifest, verify_segment
from asymstore.tiers.protocol import ReadIntoTier, Tier
from asymstore.values import Checkpoint, Targets

if TYPE_CHECKING:
    import torch

    from asymstore.multirank.job import Job

logger = logging.getLogger(__name__)

READ_BATCH_BYTES = 64 << 20
"""At most this many bytes of one segment's chunks in one read request (a larger chunk is read alone)."""

READS_IN_FLIGHT = 3
"""Read batches in flight at once, across the old shards: the read-ahead is at most this many batches."""


@dataclass
class _Fill:
    """One byte range ``[start, stop)`` of an old rank's stored tensor, to land in ``dst`` (a view of a new tensor).

    With ``flat`` (the range is exactly the elements of ``dst`` in order, and ``dst`` is contiguous), each
    chunk's part is copied straight into its place; otherwise the range lands in ``dst`` as the strided box
    ``shape`` of an old piece of row-major ``strides`` at once: straight from the chunk when one chunk holds
    it all, else through ``staging`` once every chunk of it is verified.
    """

    start: int
    stop: int
    dst: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    flat: bool
    left: int = 0
    staging: bytearray | None = None


@dataclass
class _Need:
    """A chunk of an old shard to read and verify once, and the parts of it the fills want."""

    chunk: Chunk
    name: str  # a tensor stored in it (named in errors)
    parts: list[tuple[_Fill, int, int, int]] = field(default_factory=list)  # (fill, tensor position, raw lo, hi)


def _positions(entry_pieces: list[tuple[Chunk, int, int]]) -> list[int]:
    """Each piece's first byte in the tensor."""
    out, pos = [], 0
    for _, lo, hi in entry_pieces:
        out.append(pos)
        pos += hi - lo
    return out


def _land(fill: _Fill, raw: memoryview, at: int, lo: int, hi: int) -> None:
    """Copy what ``fill`` wants of a verified chunk's raw bytes ``[lo, hi)``, tensor bytes from ``at``."""
    a, b = max(fill.start, at), min(fill.stop, at + hi - lo)
    if a >= b:
        return
    src = raw[lo + a - at:lo + b - at]
    if fill.flat:
        _bytes_of(fill.dst)[a - fill.start:b - fill.start].copy_(_u8(src))
        return
    if a == fill.start and b == fill.stop:  # one chunk holds the whole range: straight from it
        _strided_copy(fill, src)
        return
    if fill.staging is None:
        fill.staging = bytearray(fill.stop - fill.start)
        fill.left = fill.stop - fill.start
    fill.staging[a - fill.start:b - fill.start] = src
    fill.left -= b - a
    if fill.left == 0:
        _strided_copy(fill, memoryview(fill.staging))
        fill.staging = None


def _u8(buf: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf`` (no copy; read-only buffers are only read)."""
    import warnings

    import torch

    if not len(buf):
        return torch.empty(0, dtype=torch.uint8)
    if buf.readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer of a read-only buffer: only read from here
            return torch.frombuffer(buf, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous tensor ``t``, as a flat uint8 view."""
    import torch

    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _strided_copy(fill: _Fill, src: memoryview) -> None:
    """Copy the box ``fill.shape`` (strided as the old piece) held by the bytes ``src`` into ``fill.dst``."""
    data = _u8(src).view(fill.dst.dtype)
    fill.dst.copy_(data.as_strided(fill.shape, fill.strides))


async def read_range(tier: Tier, manifest: Manifest, name: str, start: int, stop: int,
                     packs: dict[Chunk, memoryview] | None = None) -> bytearray:
    """Bytes ``[start, stop)`` of tensor ``name`` of ``manifest``, reading and verifying only the chunks they touch.

    A packed tensor reads and verifies its whole pack; ``packs`` (when given)
    keeps the last pack verified, for the packed tensors after it.

    Raises:
        CorruptVersionError: a chunk or segment fails verification.
        TierError: the tier failed to read.
    """
    out = bytearray(stop - start)
    entry = manifest.tensors[name]
    packed = entry.pack_offset is not None
    touched: dict[str, list[tuple[Chunk, int, int, int]]] = {}  # segment -> (chunk, tensor position, raw range)
    pos = 0
    for chunk, lo, hi in entry.pieces():
        if pos < stop and pos + hi - lo > start:
            raw = packs.get(chunk) if packs is not None and packed else None
            if raw is None:
                touched.setdefault(chunk.segment, []).append((chunk, pos, lo, hi))
            else:
                _copy_range(out, start, stop, raw, pos, lo, hi)
        pos += hi - lo
    sizes = {s.name: s.size for s in manifest.segments}
    for segment, chunks in touched.items():
        if isinstance(tier, ReadIntoTier):
            stored = [memoryview(bytearray(c.length)) for c, *_ in chunks]
            await tier.read_segment_into(*manifest.locate(segment), sizes[segment],
                                         [(c.offset, buf) for (c, *_), buf in zip(chunks, stored, strict=True)])
        else:
            data = await tier.read_segment(*manifest.locate(segment), sizes[segment])
            verify_segment(manifest, segment, data, deep=False)
            view = memoryview(data).cast("B")
            stored = [view[c.offset:c.offset + c.length] for c, *_ in chunks]
        for (chunk, at, lo, hi), buf in zip(chunks, stored, strict=True):
            raw = decode_one(name, chunk, buf, None)
            _copy_range(out, start, stop, raw, at, lo, hi)
            if packs is not None and packed:
                packs.clear()
                packs[chunk] = raw  # by value: an empty pack shares its place with the next
    return out


def _copy_range(out: bytearray, start: int, stop: int, raw: memoryview, at: int, lo: int, hi: int) -> None:
    """Copy what ``[start, stop)`` wants of the piece at tensor position ``at``: raw bytes ``[lo, hi)``."""
    a, b = max(start, at), min(stop, at + hi - lo)
    out[a - start:b - start] = raw[lo + a - at:lo + b - at]


class ShardSet:
    """The shards of one global version: manifests, layouts and a tier to read each from.

    Args:
        g: the global manifest.
        tiers_for: rank -> (tiers to read its shard from, whether to open and close them here).
    """

    def __init__(self, g: GlobalManifest, tiers_for: Callable[[int], tuple[Sequence[Tier], bool]]) -> None:
        """Nothing is read before :meth:`open`."""
        self.g = g
        self._tiers_for = tiers_for
        self.manifests: dict[int, Manifest] = {}
        self.layouts: dict[int, dict[str, TensorLayout]] = {}
        self.tiers: dict[int, Tier] = {}
        self._opened: list[Tier] = []

    @classmethod
    def of_job(cls, job: Job, tiers: Sequence[Tier], g: GlobalManifest) -> ShardSet:
        """The shards as ``job``'s rank sees them: its own ``tiers`` (open already), the others' peer tiers.

        A single-process version of the root (:func:`~asymstore.multirank.rootlayout.is_single_root`)
        is read by every rank from the root itself.
        """
        if is_single_root(g):
            from asymstore.tiers.location import from_location

            return cls(g, lambda r: ([from_location(job.root, read_only=True)], True))
        return cls(g, lambda r: (tiers, False) if r == job.rank else (job.peer_tiers(r), True))

    @classmethod
    def of_root(cls, root: str, g: GlobalManifest) -> ShardSet:
        """The shards under a multi-rank root on this machine, read without any job running."""
        from asymstore.tiers.location import rank_tier

        return cls(g, lambda r: ([rank_tier(root, r)], True))

    async def open(self) -> None:
        """Read and check every rank's shard manifest (its digest against the global manifest) and layouts.

        Raises:
            CorruptVersionError: a shard is missing or differs from its digest.
            LayoutError: a shard's layouts are malformed.
        """
        for rank in range(self.g.world_size):
            step, reasons = self.g.shard(rank).step, []
            candidates, own = self._tiers_for(rank)
            for tier in candidates:
                if own:
                    await tier.open()
                    self._opened.append(tier)
                try:
                    manifest = await read_manifest(tier, step)
                except (AsymstoreError, OSError) as exc:
                    reasons.append(f"{tier.name}: {describe(exc)}")
                    continue
                if shard_digest(manifest) != self.g.shard(rank).digest:
                    reasons.append(f"{tier.name}: shard {step} digest differs from the global manifest")
                    continue
                self.manifests[rank], self.tiers[rank] = manifest, tier
                self.layouts[rank] = read_layouts(manifest)
                break
            else:
                raise CorruptVersionError(f"rank {rank}'s shard {step}: " + ("; ".join(reasons) or "no tier"))

    async def close(self) -> None:
        """Close the tiers opened here."""
        for tier in self._opened:
            try:
                await tier.close()
            except (AsymstoreError, OSError) as exc:  # pragma: no cover - closing a read-only peer tier
                logger.debug("closing %s: %s", tier.name, exc)

    async def tensor(self, rank: int, name: str) -> torch.Tensor:
        """The whole stored tensor ``name`` of old rank ``rank``."""
        return (await self.fill({}, [name], rank))[name]

    async def piece(self, name: str, want: TensorLayout) -> torch.Tensor:
        """This rank's new piece ``want`` of global tensor ``name``, from the overlapping old pieces."""
        return (await self.fill({name: want}, [], 0))[name]

    async def fill(self, wanted: Mapping[str, TensorLayout], whole: Sequence[str],
                   source: int) -> dict[str, torch.Tensor]:
        """New pieces ``wanted`` of global tensors, and the stored tensors ``whole`` of old rank ``source``.

        Every piece is planned first; then each old shard's chunks are read
        once, a segment's together (see the module docstring), verified, and
        their overlaps copied into the new tensors.

        Raises:
            CorruptVersionError: a chunk or segment fails verification.
            LayoutError: the old pieces do not cover a wanted piece exactly.
            TierError: a tier failed to read.
        """
        import torch

        from asymstore.format.tensors import dtype_from_name

        out: dict[str, torch.Tensor] = {}
        needs: dict[int, dict[Chunk, _Need]] = {}
        for name, want in wanted.items():
            dest = out[name] = torch.empty(want.shape, dtype=dtype_from_name(want.dtype))
            old = {r: layouts[name] for r, layouts in self.layouts.items() if name in layouts}
            for read in plan_piece(want, old):
                box = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(read.lo, read.hi, want.offsets, strict=True))
                self._want(needs, read.rank, name, _fill_of(read, dest[box], old[read.rank].shape))
        for name in whole:
            entry = self.manifests[source].tensors[name]
            dest = out[name] = torch.empty(list(entry.shape), dtype=dtype_from_name(entry.dtype))
            if entry.nbytes:
                self._want(needs, source, name,
                           _Fill(0, entry.nbytes, dest, tuple(entry.shape), strides(entry.shape), True))
        sem = asyncio.Semaphore(READS_IN_FLIGHT)
        await asyncio.gather(*(self._read_shard(rank, list(chunks.values()), sem)
                               for rank, chunks in sorted(needs.items())))
        return out

    def _want(self, needs: dict[int, dict[Chunk, _Need]], rank: int, name: str, fill: _Fill) -> None:
        """Note the chunks of old rank ``rank``'s tensor ``name`` that hold ``fill``'s range."""
        entry = self.manifests[rank].tensors[name]
        if fill.stop > entry.nbytes:  # read_layouts matched the layouts to the entries: never here
            raise LayoutError(f"{name}: bytes [{fill.start}, {fill.stop}) wanted of rank {rank}'s "
                              f"{entry.nbytes}-byte piece")
        pieces = entry.pieces()
        at = _positions(pieces)
        shard = needs.setdefault(rank, {})
        for i in range(max(0, bisect.bisect_right(at, fill.start) - 1), len(pieces)):
            if at[i] >= fill.stop:
                break
            chunk, lo, hi = pieces[i]
            if at[i] + hi - lo <= fill.start:
                continue
            need = shard.get(chunk)  # by value: an empty chunk shares its place with the next
            if need is None:
                need = shard[chunk] = _Need(chunk, name)
            need.parts.append((fill, at[i], lo, hi))

    async def _read_shard(self, rank: int, needs: list[_Need], sem: asyncio.Semaphore) -> None:
        """Read, verify and land old rank ``rank``'s chunks ``needs``: per segment, in offset order, batched.

        The chunks of one batch are verified and copied in a thread while the
        next batch is read.
        """
        manifest, tier = self.manifests[rank], self.tiers[rank]
        sizes = {s.name: s.size for s in manifest.segments}
        by_segment: dict[str, list[_Need]] = {}
        for need in needs:
            by_segment.setdefault(need.chunk.segment, []).append(need)
        landing: asyncio.Future[None] | None = None
        slabs: list[memoryview | None] = [None, None]  # reused: batch k lands from one while k + 1 reads into the other
        turn = 0
        for segment, group in sorted(by_segment.items()):
            group.sort(key=lambda n: n.chunk.offset)
            if isinstance(tier, ReadIntoTier):
                for batch in _batches(group):
                    direct = [_direct_view(n) for n in batch]
                    slab, turn = slabs[turn % 2], turn + 1
                    total = sum(n.chunk.length for n, d in zip(batch, direct, strict=True) if d is None)
                    if total and (slab is None or len(slab) < total):
                        slab = slabs[(turn - 1) % 2] = _scratch(max(total, min(READ_BATCH_BYTES, 2 * total)))
                    bufs, at = [], 0
                    for n, d in zip(batch, direct, strict=True):
                        if d is None:
                            assert slab is not None
                            d = slab[at:at + n.chunk.length]
                            at += n.chunk.length
                        bufs.append(d)
                    async with sem:
                        digests = await tier.read_segment_into(*manifest.locate(segment), sizes[segment],
                                                               [(n.chunk.offset, b) for n, b in zip(batch, bufs,
                                                                                                    strict=True)])
                    if landing is not None:
                        await landing
                    landed = [d is not None for d in direct]
                    landing = asyncio.ensure_future(asyncio.to_thread(_verify_and_land, batch, bufs, digests, landed))
            else:
                async with sem:
                    data = await tier.read_segment(*manifest.locate(segment), sizes[segment])
                verify_segment(manifest, segment, data, deep=False)
                view = memoryview(data).cast("B")
                if landing is not None:
                    await landing
                landing = asyncio.ensure_future(asyncio.to_thread(
                    _verify_and_land, group, [view[n.chunk.offset:n.chunk.offset + n.chunk.length] for n in group],
                    None, None))
        if landing is not None:
            await landing
        unfilled = {id(f) for n in needs for f, *_ in n.parts if f.staging is not None}
        if unfilled:  # the chunks of a tensor cover its bytes (parse checks): never here
            raise CorruptVersionError(f"rank {rank}'s shard: {len(unfilled)} range(s) not filled by their chunks")


def _scratch(size: int) -> memoryview:
    """``size`` writable bytes, not zeroed (every byte read into is overwritten by the read)."""
    import torch

    return memoryview(torch.empty(size, dtype=torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _batches(group: list[_Need]) -> list[list[_Need]]:
    """``group`` (one segment's chunks, in offset order) in runs of at most :data:`READ_BATCH_BYTES` each."""
    out: list[list[_Need]] = []
    size = 0
    for need in group:
        if not out or (size + need.chunk.length > READ_BATCH_BYTES and out[-1]):
            out.append([])
            size = 0
        out[-1].append(need)
        size += need.chunk.length
    return out


def _verify_and_land(batch: Sequence[_Need], bufs: Sequence[memoryview], digests: list[str] | None,
                     landed: Sequence[bool] | None) -> None:
    """Verify each chunk of ``batch`` (its stored bytes ``bufs``), then copy its parts into the fills.

    ``digests`` (from the tier, hashed as the bytes landed) stand for a
    second hash pass over a raw chunk. A chunk ``landed`` was read straight
    into its place in a new tensor (:func:`_direct_view`): it is only verified.

    Raises:
        CorruptVersionError: a chunk fails verification.
    """
    if digests is not None and len(digests) != len(batch):
        raise CorruptVersionError(f"the tier returned {len(digests)} digests for {len(batch)} chunks")
    for i, (need, buf) in enumerate(zip(batch, bufs, strict=True)):
        chunk = need.chunk
        if digests is not None and digests[i] != chunk.checksum:
            raise CorruptVersionError(f"{need.name}: chunk in {chunk.segment} at {chunk.offset}: "
                                      "stored checksum mismatch")
        if digests is not None and _plain(chunk):
            raw = buf  # raw, and its stored bytes hashed as they landed: verified
        else:
            raw = decode_one(need.name, chunk, buf, None)
        if landed is not None and landed[i]:
            continue
        for fill, at, lo, hi in need.parts:
            _land(fill, raw, at, lo, hi)


def _direct_view(need: _Need) -> memoryview | None:
    """Where in a new tensor a chunk can be read straight to, verified there before the tensor is returned.

    Only a raw chunk of one tensor (not a pack) wanted by one fill that takes
    all of it, contiguously; None otherwise (read into scratch, verified, then copied).
    """
    if len(need.parts) != 1 or not _plain(need.chunk) or not need.chunk.length:
        return None
    fill, at, lo, hi = need.parts[0]
    if not fill.flat or lo != 0 or hi != need.chunk.raw_length or at < fill.start or at + hi > fill.stop:
        return None
    dest = _bytes_of(fill.dst)[at - fill.start:at + hi - fill.start]
    return memoryview(dest.numpy()).cast("B")  # type: ignore[arg-type]


def _plain(chunk: Chunk) -> bool:
    """Whether ``chunk`` is stored raw, its raw bytes the stored bytes (one checksum, no codec)."""
    return (chunk.codec == "raw" and chunk.length == chunk.raw_length
            and (chunk.raw_checksum is None or chunk.raw_checksum == chunk.checksum))


def _fill_of(read: PieceRead, dst: torch.Tensor, old_shape: Sequence[int]) -> _Fill:
    """The fill of ``dst`` (a box of a new piece) from ``read`` of an old piece of ``old_shape``."""
    flat = dst.is_contiguous() and read.stop - read.start == math.prod(read.shape) * dst.element_size()
    return _Fill(read.start, read.stop, dst, read.shape, strides(old_shape), flat)


async def restore_resharded(job: Job, tiers: Sequence[Tier], g: GlobalManifest, targets: Targets) -> Checkpoint:
    """This rank's state of global version ``g`` (written by another number of ranks); see the module docstring.

    A version of slices on tiers only their own ranks read (not under the shared root) is not read
    here: each rank loads its own shard (:func:`restore_own_slices`) and the ranks exchange the slices
    (:mod:`.sliceexchange`).

    Raises:
        CorruptVersionError: an old shard is missing, differs from its digest, or fails verification.
        LayoutError: the old pieces do not fit together, or ``targets`` refused them; or the version's slices
            are on tiers only their own ranks read and this job has another number of ranks.
    """
    if is_sliced([s.summary for s in g.shards]) and not job.shards_under_root and not is_single_root(g):
        if g.world_size != job.world_size:
            raise LayoutError(f"global step {g.step} holds slices of a replicated state on tiers only their own "
                              f"{g.world_size} rank(s) read: it cannot be restored on {job.world_size} rank(s)")
        return await restore_own_slices(job, tiers, g)
    shards = ShardSet.of_job(job, tiers, g)
    try:
        await shards.open()
        source = job.rank % g.world_size
        unplaced = [r for r, m in shards.manifests.items() if LAYOUT_KEY not in m.meta]
        if unplaced:  # e.g. DeepSpeed's flat ZeRO partitions: taking them whole would be wrong
            raise LayoutError(f"the shards of rank(s) {unplaced[:8]} of global step {g.step} record no tensor "
                              f"layout (meta[{LAYOUT_KEY!r}]): they cannot be resharded")
        layouts = shards.layouts[source]
        sharded = {name: lay for name, lay in layouts.items() if not lay.is_whole or lay.mesh is not None}
        try:
            wanted = dict(targets(sharded))
        except AsymstoreError as exc:
            raise LayoutError(f"the live model does not take the pieces of global step {g.step}: {exc}") from exc
        if set(wanted) != set(sharded):
            raise LayoutError(f"the live model places {sorted(set(wanted) ^ set(sharded))[:5]} differently")
        got = await shards.fill(wanted, [name for name in layouts if name not in wanted], source)
        tensors = {name: got[name] for name in layouts}
        manifest = shards.manifests[source]
        meta = dict(manifest.meta)
        new_layouts = {name: wanted.get(name) or lay for name, lay in layouts.items()}
        meta[LAYOUT_KEY] = layout_meta(new_layouts)
        nbytes = sum(m.nbytes for m in shards.manifests.values())
        logger.info("rank %d: global step %d of %d rank(s) resharded for %d rank(s) (%d tensor(s) re-cut, "
                    "%d byte(s) in the old shards)", job.rank, g.step, g.world_size, job.world_size,
                    len(wanted), nbytes)
        how = f"slices of {g.world_size} rank(s)" if g.world_size == job.world_size and is_sliced(
            [s.summary for s in g.shards]) else f"resharded from {g.world_size} rank(s)"
        return Checkpoint(manifest.step, tensors, meta, how, manifest, [])
    finally:
        await shards.close()


async def restore_own_slices(job: Job, tiers: Sequence[Tier], g: GlobalManifest) -> Checkpoint:
    """This rank's own shard of ``g`` as stored (its slices, layouts in ``meta``), from its first tier that verifies.

    For a version of slices on tiers only their own ranks read (node-local disks, shared memory, the
    peer replica of this rank's shard after a node loss): the ranks then exchange their slices
    (:mod:`.sliceexchange`). Each tier is tried in order; a copy that is missing, fails
    verification, or differs from the digest ``g`` records moves to the next (``fallbacks``).

    Raises:
        CorruptVersionError: no tier holds a copy of the shard that verifies.
    """
    from asymstore.read.load import load_version

    shard = g.shard(job.rank)
    fallbacks: list[str] = []
    missing: list[str] = []
    for tier in tiers:
        try:
            manifest, tensors = await load_version(tier, shard.step)
        except VersionNotFoundError:
            missing.append(tier.name)
            continue
        except (AsymstoreError, OSError) as exc:
            fallbacks.append(f"{tier.name}: shard {shard.step}: {describe(exc)}")
            continue
        if shard_digest(manifest) != shard.digest:
            fallbacks.append(f"{tier.name}: shard {shard.step} digest differs from the global manifest")
            continue
        logger.info("rank %d: its own slices of global step %d from %s (%d byte(s)); the ranks exchange the rest",
                    job.rank, g.step, tier.name, manifest.nbytes)
        return Checkpoint(manifest.step, tensors, dict(manifest.meta), tier.name, manifest, fallbacks)
    raise CorruptVersionError(f"rank {job.rank}'s shard {shard.step} of global step {g.step}: "
                              + "; ".join([*fallbacks, *(f"{t}: not held" for t in missing)] or ["no tier"]))
