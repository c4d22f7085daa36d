"""Where a DCP load reads from: the versions of one store, or the global versions of a multi-rank root.

A :class:`Source` lists candidate steps (newest first) and opens one as a
:class:`Version`: for every rank that saved a shard, the tiers that may hold
it (fastest first) and, for a multi-rank version, the shard digest the global
manifest recorded. A :class:`Version` reads one stored tensor of one rank's
shard at a time, verified chunk by chunk (:mod:`asymstore.read.verify`); a
copy that fails (manifest, digest, size, checksum, decoding, I/O) is skipped
for the next tier's copy of the same shard; when none is left the read raises
:class:`~asymstore.errors.CorruptVersionError` naming every copy tried.
Nothing unverified is ever returned.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from asymstore.errors import AsymstoreError, CorruptVersionError, TierError, VersionNotFoundError, describe
from asymstore.format.codec import RAW
from asymstore.format.globalmanifest import GlobalManifest, shard_digest
from asymstore.format.manifest import Chunk, Manifest
from asymstore.read.verify import decode_one, read_manifest, verify_segment
from asymstore.tiers.protocol import ReadIntoTier, Tier

if TYPE_CHECKING:
    import torch

    from asymstore.store import AsymStore

logger = logging.getLogger(__name__)

_READ_ERRORS = (AsymstoreError, OSError)


@dataclass
class ShardCopies:
    """One rank's shard of a version and the tiers that may hold a copy of it.

    Attributes:
        rank: the rank that wrote it.
        step: the shard's step on those tiers.
        tiers: candidate tiers, fastest first (opened).
        digest: the shard digest a global manifest recorded (None: a single store's version).
    """

    rank: int
    step: int
    tiers: Sequence[Tier]
    digest: str | None = None
    manifests: dict[int, Manifest] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)


class Version:
    """One version being loaded: per rank, its shard's copies (see the module docstring).

    Args:
        step: the version's step (a global step for a multi-rank version).
        shards: rank -> copies.
        close: called by :meth:`close` (closes tiers the source opened for this version).
    """

    def __init__(self, step: int, shards: dict[int, ShardCopies],
                 close: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        """Nothing is read before the first call."""
        self.step = step
        self.shards = shards
        self.fallbacks: list[str] = []
        """One line per copy that failed and was skipped."""
        self._close = close
        self._segment: tuple[int, int, str, memoryview] | None = None  # (rank, tier index, segment, bytes)
        self._pack: tuple[tuple[int, int, Chunk], memoryview] | None = None  # ((rank, tier, pack), raw)

    @property
    def world_size(self) -> int:
        """The number of ranks whose shards make the version."""
        return len(self.shards)

    async def close(self) -> None:
        """Release what the source opened for this version."""
        self._segment = None
        close, self._close = self._close, None
        if close is not None:
            await close()

    async def _manifest(self, copies: ShardCopies, i: int) -> Manifest:
        manifest = copies.manifests.get(i)
        if manifest is None:
            tier = copies.tiers[i]
            manifest = await read_manifest(tier, copies.step)
            if copies.digest is not None and shard_digest(manifest) != copies.digest:
                raise CorruptVersionError(f"rank {copies.rank}'s shard {copies.step} on {tier.name} differs from "
                                          "the digest its global manifest recorded")
            copies.manifests[i] = manifest
        return manifest

    def _fail(self, copies: ShardCopies, i: int, exc: BaseException) -> None:
        line = f"rank {copies.rank}'s shard {copies.step} on {copies.tiers[i].name}: {describe(exc)}"
        copies.failed[i] = line
        self.fallbacks.append(line)
        logger.warning("DCP load of step %d: %s", self.step, line)

    async def manifest(self, rank: int) -> Manifest:
        """The manifest of ``rank``'s shard from its first copy that verifies.

        Raises:
            CorruptVersionError: no copy's manifest verifies (VersionNotFoundError is one when no tier holds it).
        """
        copies = self._copies(rank)
        for i in range(len(copies.tiers)):
            if i in copies.failed:
                continue
            try:
                return await self._manifest(copies, i)
            except _READ_ERRORS as exc:
                self._fail(copies, i, exc)
        raise self._none_left(copies, "manifest")

    def _copies(self, rank: int) -> ShardCopies:
        copies = self.shards.get(rank)
        if copies is None:
            raise CorruptVersionError(f"step {self.step} has no shard of rank {rank}")
        return copies

    def _none_left(self, copies: ShardCopies, what: str) -> AsymstoreError:
        reasons = "; ".join(copies.failed.values()) or "no tier holds it"
        if not copies.tiers:
            return VersionNotFoundError(f"rank {copies.rank}'s shard {copies.step}: no tier holds it")
        return CorruptVersionError(f"step {self.step}: no copy of rank {copies.rank}'s {what} verifies: {reasons}")

    async def read(self, rank: int, name: str) -> torch.Tensor:
        """Stored tensor ``name`` of ``rank``'s shard, verified, from the first copy that verifies.

        Raises:
            CorruptVersionError: no copy verifies; or the shard does not store ``name`` (a DCPMetadataError).
        """
        from asymstore.errors import DCPMetadataError

        copies = self._copies(rank)
        for i in range(len(copies.tiers)):
            if i in copies.failed:
                continue
            try:
                manifest = await self._manifest(copies, i)
            except _READ_ERRORS as exc:
                self._fail(copies, i, exc)
                continue
            if name not in manifest.tensors:
                raise DCPMetadataError(f"step {self.step}: rank {rank}'s shard stores no tensor {name!r}")
            try:
                return await self._read_tensor(copies, i, manifest, name)
            except (CorruptVersionError, TierError, OSError) as exc:
                self._fail(copies, i, exc)
        raise self._none_left(copies, f"tensor {name!r}")

    async def _read_tensor(self, copies: ShardCopies, i: int, manifest: Manifest, name: str) -> torch.Tensor:
        import torch

        from asymstore.format.tensors import as_bytes, dtype_from_name

        entry = manifest.tensors[name]
        out = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
        view = as_bytes(out.reshape(-1)) if entry.nbytes else memoryview(bytearray())
        if entry.pack_offset is not None:  # a small tensor: its verified pack (kept for the tensors after it)
            data = await self._pack_bytes(copies, i, manifest, entry.chunks[0])
            view[:] = data[entry.pack_offset:entry.pack_offset + entry.nbytes]
            return out
        by_segment: dict[str, list[tuple[Chunk, memoryview]]] = {}
        pos = 0
        for chunk in entry.chunks:
            by_segment.setdefault(chunk.segment, []).append((chunk, view[pos:pos + chunk.raw_length]))
            pos += chunk.raw_length
        if pos != entry.nbytes:
            raise CorruptVersionError(f"{name!r}: chunks hold {pos} bytes, the tensor {entry.nbytes}")
        tier = copies.tiers[i]
        sizes = {s.name: s.size for s in manifest.segments}
        for segment, chunks in by_segment.items():
            if isinstance(tier, ReadIntoTier):
                stored = [dest if c.codec == RAW else memoryview(bytearray(c.length)) for c, dest in chunks]
                await tier.read_segment_into(*manifest.locate(segment), sizes[segment],
                                             [(c.offset, buf) for (c, _), buf in zip(chunks, stored, strict=True)])
                pairs = [(c, buf, None if c.codec == RAW else dest)
                         for (c, dest), buf in zip(chunks, stored, strict=True)]
            else:
                data = await self._segment_bytes(copies, i, manifest, segment, sizes[segment])
                pairs = [(c, data[c.offset:c.offset + c.length], dest) for c, dest in chunks]
            await asyncio.to_thread(_decode, name, pairs)
        return out

    async def _pack_bytes(self, copies: ShardCopies, i: int, manifest: Manifest, pack: Chunk) -> memoryview:
        """The verified raw bytes of a pack (the last one is kept: packed tensors are read in stored order)."""
        key = (copies.rank, i, pack)  # the pack itself: an empty one shares its place with the next
        cached = self._pack
        if cached is not None and cached[0] == key:
            return cached[1]
        self._pack = None
        tier = copies.tiers[i]
        size = next(s.size for s in manifest.segments if s.name == pack.segment)
        if isinstance(tier, ReadIntoTier):
            stored = memoryview(bytearray(pack.length))
            await tier.read_segment_into(*manifest.locate(pack.segment), size, [(pack.offset, stored)])
        else:
            stored = (await self._segment_bytes(copies, i, manifest, pack.segment, size))[
                pack.offset:pack.offset + pack.length]
        raw = await asyncio.to_thread(decode_one, f"pack at {pack.segment}:{pack.offset}", pack, stored, None)
        self._pack = (key, raw)
        return raw

    async def _segment_bytes(self, copies: ShardCopies, i: int, manifest: Manifest, segment: str,
                             size: int) -> memoryview:
        """A whole segment of a tier that cannot read ranges (one kept: tensors are read in stored order)."""
        cached = self._segment
        if cached is not None and cached[:3] == (copies.rank, i, segment):
            return cached[3]
        self._segment = None
        raw = await copies.tiers[i].read_segment(*manifest.locate(segment), size)
        verify_segment(manifest, segment, raw, deep=False)
        data = memoryview(raw).cast("B") if len(raw) else memoryview(bytearray())
        self._segment = (copies.rank, i, segment, data)
        return data


def _decode(name: str, pairs: list[tuple[Chunk, memoryview, memoryview | None]]) -> None:
    """Verify (and decode into place) each chunk; a raw chunk read into its destination is verified there."""
    for chunk, stored, dest in pairs:
        decode_one(name, chunk, stored, dest)


class Source(Protocol):
    """Versions a DCP load can read (see the module docstring)."""

    description: str

    async def steps(self) -> list[int]:
        """Candidate steps, newest first."""
        ...

    async def version(self, step: int) -> Version:
        """Open ``step`` (raises a read error when it cannot be opened at all)."""
        ...


class StoreSource:
    """The versions of one open :class:`~asymstore.AsymStore` (its tiers, fastest first)."""

    def __init__(self, store: AsymStore) -> None:
        """Read through ``store`` (open, on the loop this source is used from)."""
        self.store = store
        self.description = ", ".join(t.name for t in store.tiers)

    async def steps(self) -> list[int]:
        """Every step a tier of the store lists, newest first."""
        await self.store.refresh()
        return sorted({s for steps in self.store.versions().values() for s in steps}, reverse=True)

    async def version(self, step: int) -> Version:
        """The copies of ``step`` on the store's tiers, fastest first."""
        held = self.store.versions()
        tiers = [t for t in self.store.tiers if step in held.get(t.name, ())]
        return Version(step, {0: ShardCopies(0, step, tiers)})


class RootSource:
    """The global versions of a multi-rank checkpoint.

    Args:
        description: what to call it in messages.
        list_steps: published global steps (ascending).
        read_global: the global manifest of a step.
        tiers_for: rank -> (its tiers, fastest first; True when this source must open and close them).
    """

    def __init__(self, description: str, list_steps: Callable[[], list[int]],
                 read_global: Callable[[int], GlobalManifest],
                 tiers_for: Callable[[int], tuple[Sequence[Tier], bool]]) -> None:
        """Nothing is read before the first call."""
        self.description = description
        self._list = list_steps
        self._read = read_global
        self._tiers_for = tiers_for
        self.globals: dict[int, GlobalManifest] = {}

    @classmethod
    def of_root(cls, root: str) -> RootSource:
        """A multi-rank root on this machine: ``root/global`` and each rank's ``LocalTier(root/rank-NNNNN)``."""
        from asymstore.multirank import globaldir
        from asymstore.tiers.location import rank_tier

        gdir = os.path.join(root, globaldir.GLOBAL_DIR)
        return cls(root, lambda: globaldir.list_global_steps(gdir), lambda s: globaldir.read_global(gdir, s),
                   lambda r: ([rank_tier(root, r)], True))

    async def steps(self) -> list[int]:
        """Published global steps, newest first."""
        return sorted(await asyncio.to_thread(self._list), reverse=True)

    async def version(self, step: int) -> Version:
        """The shards of global version ``step`` (the tiers of other ranks are opened here)."""
        g = await asyncio.to_thread(self._read, step)
        self.globals[step] = g
        opened: list[Tier] = []
        shards = {}
        try:
            for rank in range(g.world_size):
                tiers, own = self._tiers_for(rank)
                if own:
                    for tier in tiers:
                        await tier.open()
                        opened.append(tier)
                shards[rank] = ShardCopies(rank, g.shard(rank).step, list(tiers), g.shard(rank).digest)
        except BaseException:
            await _close_all(opened)
            raise
        return Version(step, shards, lambda: _close_all(opened))


async def _close_all(tiers: Sequence[Tier]) -> None:
    for tier in tiers:
        try:
            await tier.close()
        except _READ_ERRORS as exc:  # pragma: no cover - closing a tier only read
            logger.debug("closing %s: %s", tier.name, exc)
