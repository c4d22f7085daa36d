"""Slices of a replicated state on tiers only their own ranks read: what the ranks exchange at a restore.

Under DDP each rank writes only its slice of the replicated state (:mod:`asymstore.format.replicas`).
When every rank reads the others' shards where they are written (the default tiers under a shared
root) a restore reads the slices it needs there (:mod:`.reshard`). When each rank's tiers are its own
(node-local disks, shared memory, peer replicas) a restore loads only this rank's own shard
(:func:`asymstore.multirank.reshard.restore_resharded`: from its own tiers, or after a node loss from
the peer replica of it), verified against the global manifest, and the ranks then exchange their
slices over the training process group (the adapter does the sending: :mod:`asymcheck.restore.exchange`).
This module is what travels and how it is checked; it does no communication itself:

- each rank sends its shard manifest (:meth:`~asymstore.format.manifest.Manifest.to_json`, sealed);
  a receiver parses it as untrusted input and refuses it unless its :func:`shard_digest` is the one
  the global manifest records for the sender (:func:`check_manifest`);
- each rank then sends the raw bytes of every chunk of its manifest that holds bytes of a sliced
  tensor (:func:`wire_chunks`, in ``(segment, offset)`` order; a pack whole, its gaps zero, as it
  was written), rebuilt from its restored tensors (:func:`payload`);
- a receiver checks each chunk's raw checksum against the sender's (verified) manifest before a
  byte lands, and the pieces must cover every sliced tensor exactly once (:class:`Assembler`).

Anything that does not verify is a :class:`~asymstore.errors.SliceExchangeError`; nothing of it is
returned. Guide: ``docs/guides/multirank.md`` (Replicated state written once per job).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from asymstore.errors import AsymstoreError, SliceExchangeError, describe
from asymstore.format.checksum import checksum
from asymstore.format.globalmanifest import GlobalManifest, shard_digest
from asymstore.format.manifest import MAX_MANIFEST_BYTES, Chunk, Manifest
from asymstore.format.parse import parse_manifest
from asymstore.format.pieces import LAYOUT_KEY, TensorLayout, layout_meta, read_layouts
from asymstore.format.replicas import REPLICAS_KEY
from asymstore.values import Checkpoint

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

EXCHANGED = "slices exchanged"
"""Part of ``Checkpoint.tier`` of a version whose slices were exchanged between the ranks."""


def _layouts(manifest: Manifest, who: str) -> dict[str, TensorLayout]:
    try:
        return read_layouts(manifest)
    except AsymstoreError as exc:
        raise SliceExchangeError(f"{who}: the tensor layouts do not parse: {describe(exc)}") from exc


def sliced_names(manifest: Manifest) -> list[str]:
    """The tensors of a shard held as slices (a layout on a mesh; a rank's slice may be all rows, or none), sorted.

    Raises:
        SliceExchangeError: the layouts are malformed.
    """
    return sorted(name for name, lay in _layouts(manifest, f"shard {manifest.step}").items() if lay.mesh is not None)


def needs_exchange(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` holds only this rank's slices of a replicated state: the ranks must exchange the rest.

    A version read through the shared root (:mod:`.reshard`) holds whole tensors already; one loaded
    from a rank's own tiers alone holds its claim (:data:`~asymstore.format.replicas.REPLICAS_KEY`)
    and slices.
    """
    if REPLICAS_KEY not in ckpt.manifest.meta or REPLICAS_KEY not in ckpt.meta:
        return False
    try:
        return any(lay.mesh is not None for lay in read_layouts(ckpt.manifest).values()) and \
            LAYOUT_KEY in ckpt.meta and ckpt.meta[LAYOUT_KEY] == ckpt.manifest.meta.get(LAYOUT_KEY)
    except AsymstoreError:
        return True  # malformed: the exchange refuses it, typed


def wire_chunks(manifest: Manifest) -> list[Chunk]:
    """The chunks a rank sends: each chunk holding bytes of a sliced tensor, once, in ``(segment, offset)`` order.

    Raises:
        SliceExchangeError: the layouts are malformed.
    """
    seen: dict[Chunk, None] = {}
    for name in sliced_names(manifest):
        for chunk, _, _ in manifest.tensors[name].pieces():
            seen.setdefault(chunk)
    return sorted(seen, key=lambda c: (c.segment, c.offset, c.length, c.raw_length, c.checksum))


def payload_bytes(manifest: Manifest) -> int:
    """How many bytes a rank with this shard manifest sends (:func:`payload`)."""
    return sum(c.raw_length for c in wire_chunks(manifest))


def _flat_bytes(t: torch.Tensor) -> memoryview:
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).cpu().numpy()).cast("B")  # type: ignore[arg-type]


def _u8(raw: bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``raw`` (no copy; only read from)."""
    import warnings

    import torch

    if not len(raw):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read from here
        return torch.frombuffer(raw, dtype=torch.uint8)


def payload(ckpt: Checkpoint) -> bytearray:
    """The raw bytes of this rank's :func:`wire_chunks`, rebuilt from its restored (verified) tensors.

    A pack's gaps are zero, as the writer left them (:mod:`asymstore.write.staging`), so each chunk's
    bytes hash to its raw checksum.
    """
    manifest = ckpt.manifest
    chunks = wire_chunks(manifest)
    at: dict[Chunk, int] = {}
    total = 0
    for chunk in chunks:
        at[chunk] = total
        total += chunk.raw_length
    out = bytearray(total)
    for name, entry in manifest.tensors.items():
        pos = 0
        src: memoryview | None = None
        for chunk, lo, hi in entry.pieces():
            base = at.get(chunk)
            if base is not None and hi > lo:
                if src is None:
                    src = _flat_bytes(ckpt.tensors[name])
                out[base + lo:base + hi] = src[pos:pos + hi - lo]
            pos += hi - lo
    return out


def check_manifest(g: GlobalManifest, rank: int, data: bytes | bytearray | memoryview) -> Manifest:
    """Rank ``rank``'s shard manifest as it sent it, parsed and checked against the global manifest ``g``.

    Raises:
        SliceExchangeError: too large, malformed, or its digest is not the one ``g`` records for ``rank``.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise SliceExchangeError(f"rank {rank} sent a shard manifest of {len(data)} bytes (at most "
                                 f"{MAX_MANIFEST_BYTES})")
    try:
        manifest = parse_manifest(bytes(data))
    except (AsymstoreError, ValueError) as exc:
        raise SliceExchangeError(f"rank {rank} sent a shard manifest that does not parse: {describe(exc)}") from exc
    shard = g.shard(rank)
    if manifest.step != shard.step or shard_digest(manifest) != shard.digest:
        raise SliceExchangeError(f"rank {rank} sent a shard manifest of step {manifest.step} whose digest is not "
                                 f"the one global step {g.step} records for its shard {shard.step}")
    return manifest


class Assembler:
    """Whole replicated tensors from every rank's verified slices (see the module docstring).

    Args:
        g: the global version restored.
        own: this rank's own shard of it (loaded and verified against ``g``).
        rank: this rank.
    """

    def __init__(self, g: GlobalManifest, own: Checkpoint, rank: int) -> None:
        """Allocate the whole tensors and land this rank's own slices."""
        import torch

        from asymstore.format.tensors import dtype_from_name

        self.g = g
        self.own = own
        self.layouts = _layouts(own.manifest, f"rank {rank}")
        self.names = sorted(n for n, lay in self.layouts.items() if lay.mesh is not None)
        self.tensors: dict[str, torch.Tensor] = {}
        self._rows: dict[str, list[tuple[int, int, int]]] = {n: [] for n in self.names}  # (first, stop, rank)
        for name in self.names:
            lay = self.layouts[name]
            self.tensors[name] = torch.empty(lay.global_shape, dtype=dtype_from_name(lay.dtype))
        for name in self.names:
            self._land(rank, name, self.layouts[name], own.tensors[name])

    def _rows_of(self, sender: int, name: str, lay: TensorLayout) -> tuple[int, int]:
        """The rows ``[first, stop)`` of the global tensor a piece holds (slices are row ranges: ``"S(0)"``)."""
        mine = self.layouts[name]
        if lay.global_shape != mine.global_shape or lay.dtype != mine.dtype:
            raise SliceExchangeError(f"rank {sender}'s {name!r} is a piece of a {lay.dtype} tensor of shape "
                                     f"{list(lay.global_shape)}; this rank's of {mine.dtype} {list(mine.global_shape)}")
        if not lay.global_shape or any(lay.offsets[1:]) or lay.shape[1:] != lay.global_shape[1:] \
                or not 0 <= lay.offsets[0] <= lay.offsets[0] + lay.shape[0] <= lay.global_shape[0]:
            raise SliceExchangeError(f"rank {sender}'s {name!r} is not a range of rows of its tensor")
        return lay.offsets[0], lay.offsets[0] + lay.shape[0]

    def _land(self, sender: int, name: str, lay: TensorLayout, piece: torch.Tensor) -> None:
        first, stop = self._rows_of(sender, name, lay)
        if stop > first:
            self.tensors[name][first:stop].copy_(piece.reshape(lay.shape))
        self._rows[name].append((first, stop, sender))

    def take(self, sender: int, manifest: Manifest, data: memoryview) -> None:
        """Verify rank ``sender``'s chunks ``data`` (:func:`payload`) against its checked ``manifest``, then land them.

        Raises:
            SliceExchangeError: its slices are not this version's, a chunk's checksum differs, or the size is wrong.
        """
        from asymstore.format.tensors import dtype_from_name

        layouts = _layouts(manifest, f"rank {sender}")
        names = sorted(n for n, lay in layouts.items() if lay.mesh is not None)
        if names != self.names:
            raise SliceExchangeError(f"rank {sender} holds slices of {len(names)} tensor(s), this rank of "
                                     f"{len(self.names)}: {sorted(set(names) ^ set(self.names))[:5]}")
        chunks = wire_chunks(manifest)
        want = sum(c.raw_length for c in chunks)
        if len(data) != want:
            raise SliceExchangeError(f"rank {sender} sent {len(data)} bytes of slices; its manifest says {want}")
        at: dict[Chunk, int] = {}
        pos = 0
        for chunk in chunks:
            raw = data[pos:pos + chunk.raw_length]
            if checksum(raw) != (chunk.raw_checksum or chunk.checksum):
                raise SliceExchangeError(f"rank {sender}'s chunk in {chunk.segment} at {chunk.offset}: the bytes "
                                         "received differ from the checksum in its shard manifest")
            at[chunk] = pos
            pos += chunk.raw_length
        for name in names:
            entry, lay = manifest.tensors[name], layouts[name]
            pieces = entry.pieces()
            dtype = dtype_from_name(lay.dtype)
            if len(pieces) == 1 and (at[pieces[0][0]] + pieces[0][1]) % dtype.itemsize == 0:
                chunk, lo, hi = pieces[0]  # one chunk, or one range of a pack, aligned: read where it was received
                src: bytearray | memoryview = data[at[chunk] + lo:at[chunk] + hi]
            else:
                src = bytearray(entry.nbytes)
                off = 0
                for chunk, lo, hi in pieces:
                    src[off:off + hi - lo] = data[at[chunk] + lo:at[chunk] + hi]
                    off += hi - lo
            self._land(sender, name, lay, _u8(src).view(dtype))

    def result(self, tier: str) -> Checkpoint:
        """This rank's checkpoint with whole tensors, once every rank's slices were taken.

        Raises:
            SliceExchangeError: the pieces of a tensor do not cover its rows exactly once.
        """
        for name, rows in self._rows.items():
            senders = sorted(r for _, _, r in rows)
            if senders != list(range(self.g.world_size)):
                raise SliceExchangeError(f"{name!r}: pieces from rank(s) {senders} of {self.g.world_size}")
            end = 0
            for first, stop, sender in sorted(rows):
                if stop == first:
                    continue
                if first != end:
                    raise SliceExchangeError(f"{name!r}: rank {sender}'s rows start at {first}, the pieces before "
                                             f"end at {end}")
                end = stop
            if end != self.layouts[name].global_shape[0]:
                raise SliceExchangeError(f"{name!r}: the pieces cover {end} of "
                                         f"{self.layouts[name].global_shape[0]} rows")
        meta = dict(self.own.meta)
        whole = {n: TensorLayout.whole(self.layouts[n].global_shape, self.layouts[n].dtype) for n in self.names}
        meta[LAYOUT_KEY] = layout_meta({n: whole.get(n) or lay for n, lay in self.layouts.items()})
        return Checkpoint(self.own.step, {**self.own.tensors, **self.tensors}, meta, tier, self.own.manifest,
                          list(self.own.fallbacks))
