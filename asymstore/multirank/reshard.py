"""Restoring a multi-rank version on another number of ranks, reading only the byte ranges each rank needs.

A :class:`~asymstore.multirank.RankStore` whose ``reshard`` is set restores a
global version written by N ranks on a job of M ranks (see
:meth:`RankStore.restore`). Each rank

1. reads every old shard's manifest (through the peer tiers) and checks its
   digest against the global manifest, then parses each shard's tensor layouts
   (:func:`asymstore.format.pieces.read_layouts`);
2. asks ``reshard`` which piece of each sharded global tensor it holds now;
3. for each piece, plans the overlaps with the old pieces
   (:func:`asymstore.read.reshardplan.plan_piece`) and reads, from each old shard, only
   the chunks that hold the overlapping byte range, verifying their checksums
   (a chunk is the unit of verification, so the bytes read are those ranges
   rounded out to whole chunks), and copies the overlap into place;
4. takes every tensor held whole (RNG states, step counters, buffers) and the
   JSON meta from old rank ``rank % N``, with ``meta["layout"]`` rewritten to
   describe the new pieces.

A shard without layout metadata (DeepSpeed's, or one written before layouts
were recorded) is refused: where its pieces belong is unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from asymstore.api import Checkpoint, Targets
from asymstore.errors import AsymstoreError, CorruptVersionError, LayoutError, describe
from asymstore.format.globalmanifest import GlobalManifest, shard_digest
from asymstore.format.manifest import Chunk, Manifest
from asymstore.format.pieces import LAYOUT_KEY, TensorLayout, layout_meta, read_layouts
from asymstore.read.reshardplan import plan_piece, strides
from asymstore.read.verify import decode_one, read_manifest, verify_segment
from asymstore.tiers.protocol import ReadIntoTier, Tier

if TYPE_CHECKING:
    import torch

    from asymstore.multirank.job import Job

logger = logging.getLogger(__name__)



async def read_range(tier: Tier, manifest: Manifest, name: str, start: int, stop: int,
                     packs: dict[tuple[str, int], memoryview] | None = None) -> bytearray:
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
            raw = packs.get((chunk.segment, chunk.offset)) if packs is not None and packed else None
            if raw is None:
                touched.setdefault(chunk.segment, []).append((chunk, pos, lo, hi))
            else:
                _copy_range(out, start, stop, raw, pos, lo, hi)
        pos += hi - lo
    sizes = {s.name: s.size for s in manifest.segments}
    for segment, chunks in touched.items():
        if isinstance(tier, ReadIntoTier):
            stored = [memoryview(bytearray(c.length)) for c, *_ in chunks]
            await tier.read_segment_into(manifest.step, segment, sizes[segment],
                                         [(c.offset, buf) for (c, *_), buf in zip(chunks, stored, strict=True)])
        else:
            data = await tier.read_segment(manifest.step, segment, sizes[segment])
            verify_segment(manifest, segment, data, deep=False)
            view = memoryview(data).cast("B")
            stored = [view[c.offset:c.offset + c.length] for c, *_ in chunks]
        for (chunk, at, lo, hi), buf in zip(chunks, stored, strict=True):
            raw = decode_one(name, chunk, buf, None)
            _copy_range(out, start, stop, raw, at, lo, hi)
            if packs is not None and packed:
                packs.clear()
                packs[chunk.segment, chunk.offset] = raw
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
        self._packs: dict[int, dict[tuple[str, int], memoryview]] = {}  # per rank: the last pack verified

    @classmethod
    def of_job(cls, job: Job, tiers: Sequence[Tier], g: GlobalManifest) -> ShardSet:
        """The shards as ``job``'s rank sees them: its own ``tiers`` (open already), the others' peer tiers."""
        return cls(g, lambda r: (tiers, False) if r == job.rank else (job.peer_tiers(r), True))

    @classmethod
    def of_root(cls, root: str, g: GlobalManifest) -> ShardSet:
        """The shards under a multi-rank root on this machine, read without any job running."""
        import os

        from asymstore.multirank.globaldir import rank_dirname
        from asymstore.tiers.local import LocalTier

        return cls(g, lambda r: ([LocalTier(os.path.join(root, rank_dirname(r)), fsync=False)], True))

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
        from asymstore.format.tensors import dtype_from_name, from_bytes

        entry = self.manifests[rank].tensors[name]
        data = await read_range(self.tiers[rank], self.manifests[rank], name, 0, entry.nbytes,
                                self._packs.setdefault(rank, {}))
        return from_bytes(memoryview(data), dtype_from_name(entry.dtype), list(entry.shape))

    async def piece(self, name: str, want: TensorLayout) -> torch.Tensor:
        """This rank's new piece ``want`` of global tensor ``name``, from the overlapping old pieces."""
        import torch

        from asymstore.format.tensors import dtype_from_name

        dtype = dtype_from_name(want.dtype)
        old = {r: layouts[name] for r, layouts in self.layouts.items() if name in layouts}
        out = torch.empty(want.shape, dtype=dtype)
        for read in plan_piece(want, old):
            data = await read_range(self.tiers[read.rank], self.manifests[read.rank], name, read.start, read.stop,
                                    self._packs.setdefault(read.rank, {}))
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            src = flat.as_strided(read.shape, strides(old[read.rank].shape))
            box = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(read.lo, read.hi, want.offsets, strict=True))
            out[box].copy_(src)
        return out


async def restore_resharded(job: Job, tiers: Sequence[Tier], g: GlobalManifest, targets: Targets) -> Checkpoint:
    """This rank's state of global version ``g`` (written by another number of ranks); see the module docstring.

    Raises:
        CorruptVersionError: an old shard is missing, differs from its digest, or fails verification.
        LayoutError: the old pieces do not fit together, or ``targets`` refused them.
    """
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
        tensors: dict[str, torch.Tensor] = {}
        for name in layouts:
            tensors[name] = await (shards.piece(name, wanted[name]) if name in wanted else shards.tensor(source, name))
        manifest = shards.manifests[source]
        meta = dict(manifest.meta)
        new_layouts = {name: wanted.get(name) or lay for name, lay in layouts.items()}
        meta[LAYOUT_KEY] = layout_meta(new_layouts)
        nbytes = sum(m.nbytes for m in shards.manifests.values())
        logger.info("rank %d: global step %d of %d rank(s) resharded for %d rank(s) (%d tensor(s) re-cut, "
                    "%d byte(s) in the old shards)", job.rank, g.step, g.world_size, job.world_size,
                    len(wanted), nbytes)
        return Checkpoint(manifest.step, tensors, meta, f"resharded from {g.world_size} rank(s)", manifest, [])
    finally:
        await shards.close()
