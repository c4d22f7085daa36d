"""Batched flushing: per tier, decide which chunks to compress and pack them into segments of size B.

One committed step becomes one :class:`VersionPlan`; for each tier, :meth:`VersionPlan.plan_tier`
makes a :class:`TierPlan` from that tier's :class:`~asymstore.policy.calibration.TierCalibration`:
a chunk is compressed only when compressing it costs less than the write time it saves (ratio and
speed sampled by :func:`asymstore.format.codec.sample`), and the segment size is
:func:`~asymstore.policy.costmodel.optimal_segment_bytes`, capped by half the flush memory budget
(``AsymStore(segment_bytes=...)`` overrides it). A :class:`SegmentBuilder` then fills one segment
while the previous one is written: raw chunks are views of the staged tensors, so host memory
beyond them stays around two segments; compressed chunks are shared between tiers within a budget.

The cost model and the compression rule: docs/concepts/batching.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Container, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from asymstore.format.checksum import StreamingChecksum
from asymstore.format.codec import (
    RAW,
    Encoded,
    PlaneCodec,
    Sample,
    codec_name,
    encode,
    fixed_overhead_seconds,
    plane_width,
    sample,
)
from asymstore.format.manifest import Chunk, Manifest, SegmentEntry, TensorEntry
from asymstore.format.names import segment_filename
from asymstore.format.proof import SegmentProof, chunks_digest
from asymstore.format.tensors import as_bytes, dtype_name
from asymstore.policy.compression import Compression, pays, worth_sampling
from asymstore.policy.costmodel import optimal_segment_bytes, predicted_seconds
from asymstore.runtime.gcpause import gc_paused
from asymstore.tiers.protocol import Buffer
from asymstore.values import FlushStats, TierCalibration
from asymstore.write.copybuffers import CopyBuffers
from asymstore.write.samples import SampleMemory
from asymstore.write.staging import StagedPack, StagedTensor

logger = logging.getLogger(__name__)

SMALL_CHUNK_BYTES = 64 << 10
"""Raw chunks smaller than this are copied together into one buffer per run (bounded by the segment size),
so 10,000 small tensors are a few large writes, not 10,000 tiny buffers to gather and checksum."""

SEGMENT_ALIGN = 4096
"""Larger raw chunks start at a multiple of this in their segment (zero padding before them), so a chunk
that sits in page-aligned memory can be written with O_DIRECT straight from that memory, and read back
straight into an aligned destination."""
_ZEROS = memoryview(bytes(SEGMENT_ALIGN))



@dataclass
class Segment:
    """One segment to write: its name, the buffers that form it, and its checksum (empty until hashed)."""

    name: str
    parts: list[Buffer]
    size: int
    checksum: str


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One staged chunk of one tensor, in version order."""

    index: int
    tensor: str
    view: memoryview
    raw_checksum: str
    width: int




@dataclass
class TierPlan:
    """How one version goes to one tier: per-chunk codec choice and the segment size."""

    tier: str
    calibration: TierCalibration
    masks: list[tuple[bool, ...] | None]  # per chunk: planes to compress, or None for raw
    segment_bytes: int
    segment_bytes_source: str
    est_stored_bytes: int
    est_compress_seconds: float
    sample_seconds: float
    reserve_bytes: int
    predicted_seconds: float

    @property
    def compressed_chunks(self) -> int:
        """Chunks planned to be compressed."""
        return sum(m is not None for m in self.masks)


@dataclass
class _Stored:
    parts: list[Buffer]
    nbytes: int
    codec: str
    checksum: str


class VersionPlan:
    """One step's staged chunks in version order, with the samples and encodings shared between tiers.

    Args:
        step: the version.
        staged: name -> staged tensor (or the pack that holds it), in manifest order.
        meta: the user's JSON metadata.
        created: UNIX time of the commit.
        codec: the codec's settings.
        share_bytes: most bytes of compressed chunks kept for the next tier.
        tiers: how many tiers the version will be written to (the last one
            keeps nothing for later).
        samples: the store's compression samples of earlier versions
            (:class:`~asymstore.write.samples.SampleMemory`): a chunk sampled recently is not sampled again.
    """

    def __init__(self, step: int, staged: Mapping[str, StagedTensor | StagedPack], meta: dict[str, Any],
                 created: float, *, codec: PlaneCodec, share_bytes: int = 64 << 20, tiers: int = 1,
                 samples: SampleMemory | None = None) -> None:
        """Index the chunks of ``staged``; nothing is sampled or compressed yet."""
        self.step = step
        self.meta = dict(meta)
        self.created = created
        self.codec = codec
        self.share_bytes = share_bytes
        # name -> (dtype name, shape, raw bytes, number of chunks) of each tensor with chunks of its own;
        # ``order``: those names and the packs (one chunk for all their tensors) in version order; the
        # chunks in parallel lists, in version order (no object per chunk: tens of thousands of them
        # would wake the GC)
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        self.order: list[str | StagedPack] = []
        self.views: list[memoryview] = []
        self.digests: list[str] = []
        self.widths: list[int] = []
        self.owners: list[str] = []
        kinds: dict[torch.dtype, tuple[str, int]] = {}
        with gc_paused():
            self._index(staged, kinds)
        self.raw_bytes = sum(t[2] for t in self.tensors.values()) + sum(
            p.nbytes for p in self.order if isinstance(p, StagedPack))
        self.chunks_nbytes = sum(map(len, self.views))  # the raw bytes of every chunk: packs' padding included
        self._lock = threading.Lock()
        self._samples: dict[int, Sample] = {}
        self._shared: dict[int, tuple[tuple[bool, ...], Encoded]] = {}
        self._shared_bytes = 0
        self._tiers_left = tiers
        self._memory = samples
        self._version = samples.next_version() if samples is not None else 0

    def _index(self, staged: Mapping[str, StagedTensor | StagedPack],
               kinds: dict[torch.dtype, tuple[str, int]]) -> None:
        last: StagedPack | None = None
        seen: set[int] = set()
        for name, st in staged.items():
            if isinstance(st, StagedPack):
                if st is not last and id(st) not in seen:  # a pack's members follow one another
                    last = st
                    seen.add(id(st))
                    self.order.append(st)
                    self.views.append(st.view)
                    self.digests.append(st.checksum)
                    self.widths.append(st.width)
                    self.owners.append(name)
                continue
            self.order.append(name)
            t = st.tensor
            kind = kinds.get(t.dtype)
            if kind is None:
                kind = kinds[t.dtype] = (dtype_name(t.dtype), plane_width(t.dtype))
            nbytes = 0
            for view, digest in st.chunks:
                self.views.append(view)
                self.digests.append(digest)
                nbytes += len(view)
            count = len(st.chunks)
            self.widths.extend([kind[1]] * count)
            self.owners.extend([name] * count)
            self.tensors[name] = (kind[0], tuple(t.shape), nbytes, count)

    def _adopted(self, staged: Mapping[str, StagedTensor | StagedPack]) -> list[tuple[int, str, StagedTensor, int]]:
        """The adopted tensors of ``staged`` (the mapping the plan was made from), in version order.

        Each as (index of its first chunk, name, staged tensor, chunk count); packs are private copies already.
        """
        out: list[tuple[int, str, StagedTensor, int]] = []
        pos = 0
        for item in self.order:
            if isinstance(item, StagedPack):
                pos += 1
                continue
            st = staged[item]
            assert isinstance(st, StagedTensor)
            count = self.tensors[item][3]
            if st.adopted:
                out.append((pos, item, st, count))
            pos += count
        return out

    def detach(self, staged: Mapping[str, StagedTensor | StagedPack],
               buffers: CopyBuffers | None = None) -> torch.Tensor | None:
        """Point the chunks of adopted tensors at one private copy (the owner gets its memory back).

        ``staged`` is the mapping the plan was made from. Call it before any
        background tier reads the plan. The copy is one flat buffer taken from
        ``buffers`` (memory reused from an earlier version: no page faults) or
        fresh memory.

        Returns:
            The buffer that now holds the adopted bytes (give it back to
            ``buffers`` once no tier reads this plan any more), or None when
            nothing was adopted.
        """
        spans = [(first, st.tensor, count) for first, _, st, count in self._adopted(staged)]
        total = sum(len(self.views[k]) for first, _, count in spans for k in range(first, first + count))
        if not spans:
            return None
        buf = buffers.take(total) if buffers is not None else torch.empty(total, dtype=torch.uint8)
        data = as_bytes(buf) if total else memoryview(bytearray())
        at = 0
        for first, tensor, count in spans:
            n = sum(len(self.views[k]) for k in range(first, first + count))
            if n:  # one memmove, GIL released: no OpenMP team competing with the training threads
                ctypes.memmove(buf.data_ptr() + at, tensor.data_ptr(), n)
            for k in range(first, first + count):
                size = len(self.views[k])
                self.views[k] = data[at:at + size]
                at += size
        return buf

    def lend(self, staged: Mapping[str, StagedTensor | StagedPack],
             chunks_of: Callable[[str], list[memoryview] | None]) -> bool:
        """Point the chunks of adopted tensors at views of the same bytes held elsewhere (the durable tier's).

        ``chunks_of(name)`` gives an adopted tensor's chunks, in order, or None where it cannot. All or
        nothing: when any adopted tensor has no views, or views of other sizes, nothing changes and the
        caller copies instead (:meth:`detach`). Call it before any background tier reads the plan.

        Returns:
            Whether every adopted chunk now reads from its view (True also when nothing was adopted).
        """
        spans: list[tuple[int, list[memoryview]]] = []
        for first, name, _, count in self._adopted(staged):
            views = chunks_of(name)
            if views is None or len(views) != count or any(
                    len(v) != len(self.views[k]) for k, v in zip(range(first, first + count), views, strict=True)):
                return False
            spans.append((first, views))
        for first, views in spans:
            for k, view in enumerate(views):
                self.views[first + k] = view
        return True

    def chunk(self, index: int) -> ChunkRef:
        """Return chunk ``index`` (in version order)."""
        return ChunkRef(index, self.owners[index], self.views[index], self.digests[index], self.widths[index])

    # -- decisions ---------------------------------------------------------

    def _sample(self, ref: ChunkRef) -> tuple[Sample, float]:
        with self._lock:
            hit = self._samples.get(ref.index)
        if hit is not None:
            return hit, 0.0
        key = (ref.tensor, ref.index, len(ref.view), ref.width)
        if self._memory is not None and (old := self._memory.recall(key, self._version)) is not None:
            with self._lock:  # an estimate only: no encoded bytes of an older version come with it
                self._samples.setdefault(ref.index, old)
            return old, 0.0
        t0 = time.perf_counter()
        result = sample(ref.view, ref.width, self.codec)
        spent = time.perf_counter() - t0
        if self._memory is not None:
            self._memory.remember(key, self._version, result)
        with self._lock:
            if result.encoded is not None:
                if self._tiers_left > 0 and self._shared_bytes + result.encoded.nbytes <= self.share_bytes:
                    self._shared_bytes += result.encoded.nbytes
                else:
                    result = Sample(result.width, result.nbytes, result.stored, result.seconds, result.mask)
            self._samples[ref.index] = result
        return result, spent

    def plan_tier(self, tier: str, cal: TierCalibration, *, policy: Compression = "auto",
                  segment_bytes: int | None = None, memory_bytes: int = 256 << 20,
                  skip: Container[int] = ()) -> TierPlan:
        """Decide every chunk's codec and the segment size for one tier (runs in a worker thread).

        Args:
            tier: the tier's name (for reports).
            cal: the tier's calibration.
            policy: ``"auto"`` (the cost model), ``"never"`` or ``"always"``.
            segment_bytes: a fixed ``B`` (the user's override), or None for ``B*``.
            memory_bytes: the flush memory budget; ``B`` is at most half of it.
            skip: chunks not written to this tier (referenced from an earlier version): neither sampled nor counted.
        """
        max_b = max(memory_bytes // 2, 4096)
        per_byte = cal.seconds_per_byte  # t_write(s) - t_write(s/r) = b·(s - s/r): the per-write ``a`` cancels
        overhead = fixed_overhead_seconds() if policy == "auto" else 0.0
        masks: list[tuple[bool, ...] | None] = []
        stored = 0.0
        compress_s = 0.0
        sample_s = 0.0
        for index, view in enumerate(self.views):
            n = len(view)
            mask: tuple[bool, ...] | None = None
            if index in skip:
                masks.append(None)
                continue
            if n == 0 or policy == "never":
                pass
            elif policy == "always":
                mask = (True,) * self.widths[index]
                stored += n
            elif worth_sampling(n, per_byte, overhead):  # compression could pay at all: measure the ratio
                smp, spent = self._sample(self.chunk(index))
                sample_s += spent
                if any(smp.mask):
                    t_c = smp.compress_seconds(n)
                    n_stored = n / smp.ratio
                    if pays(n, per_byte, t_c, smp.ratio):
                        mask = smp.mask
                        stored += n_stored
                        compress_s += t_c
            masks.append(mask)
            if mask is None:
                stored += n
        n_stored = max(int(stored), 0)
        exposed = cal.exposed_seconds_per_byte + (compress_s / n_stored if n_stored else 0.0)
        if segment_bytes:
            seg, source = segment_bytes, "override"
        else:
            seg, source = optimal_segment_bytes(cal.latency_s, exposed, n_stored, max_b), "cost-model"
        predicted = predicted_seconds(cal.latency_s, cal.seconds_per_byte, exposed, n_stored, seg) + compress_s
        plan = TierPlan(tier, cal, masks, seg, source, n_stored, compress_s, sample_s,
                        self.chunks_nbytes + self.padding_bound + self.manifest_bound(seg), predicted)
        logger.debug("step %d on %s: B=%d (%s), %d/%d chunks compressed, ~%d of %d bytes stored",
                     self.step, tier, seg, source, plan.compressed_chunks, len(masks), n_stored, self.raw_bytes)
        return plan

    @functools.cached_property
    def padding_bound(self) -> int:
        """Most zero bytes the segments can hold.

        A raw chunk of at least ``SMALL_CHUNK_BYTES`` starts on a ``SEGMENT_ALIGN``
        boundary (a chunk planned compressed that does not shrink is stored raw, so all count).
        """
        return sum(SEGMENT_ALIGN - 1 for view in self.views if len(view) >= SMALL_CHUNK_BYTES)

    def manifest_bound(self, segment_bytes: int) -> int:
        """An upper bound on the manifest's size in bytes for segments of ``segment_bytes``."""
        segments = min(len(self.views), 2 * math.ceil(self.raw_bytes / max(segment_bytes, 1)) + 1) + 1
        tensors = sum(len(json.dumps(name)) + 128 + 21 * len(t[1]) for name, t in self.tensors.items())
        for p in self.order:  # packed: name, dtype index, shape, pack index, offset; the dtype table
            if isinstance(p, StagedPack):
                tensors += len(json.dumps(p.names)) + sum(64 + 21 * len(shape) for shape in p.shapes)
        return 512 + len(json.dumps(self.meta)) + tensors + 240 * len(self.views) + 160 * segments

    # -- encoding ----------------------------------------------------------

    def encoded(self, ref: ChunkRef, mask: tuple[bool, ...], codec: PlaneCodec | None = None) -> tuple[Encoded, bool]:
        """Return the chunk's stored form for ``mask`` and whether it was computed now (not shared).

        ``codec``: other settings that give the same bytes as the plan's (another zstd thread count >= 1).
        """
        with self._lock:
            shared = self._shared.get(ref.index)
            smp = self._samples.get(ref.index)
        if shared is not None and shared[0] == mask:
            return shared[1], False
        if smp is not None and smp.encoded is not None and smp.mask == mask:
            return smp.encoded, False
        enc = encode(ref.view, ref.width, codec or self.codec, mask)
        with self._lock:
            if self._tiers_left > 1 and self._shared_bytes + enc.nbytes <= self.share_bytes:
                self._shared[ref.index] = (mask, enc)
                self._shared_bytes += enc.nbytes
        return enc, True

    def tier_done(self) -> None:
        """Record that one tier finished with this version; the last one drops everything shared."""
        with self._lock:
            self._tiers_left -= 1
            if self._tiers_left <= 0:
                self._shared.clear()
                self._samples.clear()
                self._shared_bytes = 0


class SegmentBuilder:
    """Produces one tier's segments in order, then its manifest.

    Call :meth:`next_segment` until it returns None (each call may run in a
    worker thread, one at a time), then :meth:`manifest`.
    """

    def __init__(self, plan: VersionPlan, tier_plan: TierPlan, *, references: Mapping[int, Chunk] | None = None,
                 referenced: Mapping[str, SegmentEntry] | None = None, proof: SegmentProof = "chunks") -> None:
        """Start before the first chunk.

        ``references``: plan chunk index -> the chunk of an earlier version's
        segment that holds its bytes (not written; recorded as is), and
        ``referenced`` those segments, listed in the manifest
        (:mod:`asymstore.write.references`). ``proof``: how each segment's
        checksum is taken (:mod:`asymstore.format.proof`): ``"chunks"`` from the
        chunks' own checksums when the segment is laid out (no pass over its
        bytes), ``"bytes"`` by one more xxh3 pass over them (for a tier whose
        receiver checks segments before it has the manifest: a peer).
        """
        self.plan = plan
        self.tier_plan = tier_plan
        self.proof: SegmentProof = proof
        self._refs = references or {}
        self._referenced = referenced or {}
        self._pos = 0
        self._carry: _Stored | None = None  # a chunk that did not fit in the previous segment
        self._segments: list[SegmentEntry] = []
        self._chunks: list[Chunk] = []  # version order
        self._done = False
        self._ahead: dict[int, tuple[Future[tuple[Encoded, bool]], int]] = {}  # chunk -> its encoding, raw bytes
        self._ahead_pos = 0
        self._ahead_bytes = 0
        self.stats = FlushStats(tier_plan.tier, plan.step, tier_plan.segment_bytes, tier_plan.segment_bytes_source,
                                tier_plan.calibration, raw_bytes=plan.raw_bytes,
                                sample_seconds=tier_plan.sample_seconds,
                                predicted_seconds=tier_plan.predicted_seconds)

    def encode_ahead(self, submit: Callable[[Callable[[], tuple[Encoded, bool]]], Future[tuple[Encoded, bool]]],
                     budget: int) -> int:
        """Start encoding the next chunks planned compressed, ahead of the layout, with ``submit``.

        Chunks are taken in order from the layout's position while the raw
        bytes of those started and not yet laid out stay within ``budget``
        (one chunk at least when none is ahead). The layout then takes each
        result instead of encoding the chunk itself (same bytes either way).

        Returns:
            The raw bytes of the chunks encoded ahead and not yet laid out (:attr:`ahead_bytes`).
        """
        masks, views = self.tier_plan.masks, self.plan.views
        # several chunks are encoded at once: one zstd worker each, not one per CPU each (zstd's output is the
        # same for any number of workers >= 1; 0, compressing on the calling thread, is another format)
        codec = self.plan.codec
        if codec.threads != 0:
            codec = dataclasses.replace(codec, threads=1)
        at = max(self._ahead_pos, self._pos)
        while at < len(views):
            mask = masks[at]
            n = len(views[at])
            if mask is not None and n:
                if self._ahead and self._ahead_bytes + n > budget:
                    break
                ref = self.plan.chunk(at)
                self._ahead[at] = (submit(functools.partial(self.plan.encoded, ref, mask, codec)), n)
                self._ahead_bytes += n
            at += 1
        self._ahead_pos = at
        return self._ahead_bytes

    @property
    def ahead_bytes(self) -> int:
        """Raw bytes of the chunks encoded ahead (:meth:`encode_ahead`) and not yet laid out."""
        return self._ahead_bytes

    def drop_ahead(self) -> list[Future[tuple[Encoded, bool]]]:
        """Cancel the encodings ahead that have not started; return those still running (a failed version)."""
        running = [fut for fut, _ in self._ahead.values() if not fut.cancel()]
        self._ahead.clear()
        self._ahead_bytes = 0
        return running

    def _compressed(self, index: int, mask: tuple[bool, ...]) -> _Stored | None:
        ref = self.plan.chunk(index)
        ahead = self._ahead.pop(index, None)
        if ahead is not None:  # encoded by another thread (encode_ahead)
            self._ahead_bytes -= ahead[1]
            enc, fresh = ahead[0].result()
        else:
            enc, fresh = self.plan.encoded(ref, mask)
        if fresh:
            self.stats.compress_seconds += enc.seconds
        if enc.nbytes >= len(ref.view):
            return None
        return _Stored(enc.parts, enc.nbytes, codec_name(ref.width), enc.checksum)

    def next_segment(self) -> Segment | None:
        """Fill and return the next segment (about ``B`` bytes, at least one chunk), or None at the end."""
        laid = self.next_layout()
        if laid is None:
            return None
        seg, index = laid
        if not seg.checksum:
            seg.checksum = StreamingChecksum(seg.parts).hexdigest()
            self.settle(index, seg.checksum)
        return seg

    def settle(self, index: int, digest: str) -> None:
        """Record the checksum of segment ``index`` (from :meth:`next_layout`); any thread may call it."""
        entry = self._segments[index]
        self._segments[index] = SegmentEntry(entry.name, entry.size, digest, proof=entry.proof)

    def next_layout(self) -> tuple[Segment, int] | None:
        """Fill the next segment without hashing it: the segment and its index, or None.

        Layouts come one at a time, in order. With the ``"chunks"`` proof the
        segment comes with its checksum (from its chunks' checksums); with
        ``"bytes"`` it has none yet, and :meth:`settle` records it (one xxh3
        pass over its parts in order), from any thread.
        """
        if self._done:
            return None
        plan = self.plan
        views, digests, masks, total = plan.views, plan.digests, self.tier_plan.masks, len(plan.views)
        limit = self.tier_plan.segment_bytes
        name = segment_filename(len(self._segments))
        parts: list[Buffer] = []
        small: list[memoryview] = []  # consecutive small raw chunks, joined into one buffer
        size = 0
        count = 0
        raw_count = 0

        def flush_small() -> None:
            if small:
                blob = b"".join(small)
                parts.append(blob)
                small.clear()

        def pad_to_alignment(at: int) -> int:
            pad = -at % SEGMENT_ALIGN
            if pad:
                parts.append(_ZEROS[:pad])
            return at + pad

        out = self._chunks
        first = len(out)
        while self._carry is not None or self._pos < total:
            st = self._carry
            if st is None and self._pos in self._refs:  # the bytes are in an earlier version's segment
                out.append(self._refs[self._pos])
                self._pos += 1
                continue
            if st is None:
                index = self._pos
                view = views[index]
                mask = masks[index]
                n = len(view)
                if mask is not None and n:
                    st = self._compressed(index, mask)
                if st is None:  # raw: the staged bytes themselves, no copy (the common case: kept lean)
                    if size and size + n > limit:
                        self._carry = _Stored([view], n, RAW, digests[index])
                        self.stats.chunks_raw += 1
                        break
                    self._pos += 1
                    if n < SMALL_CHUNK_BYTES:
                        small.append(view)
                    else:
                        flush_small()
                        size = pad_to_alignment(size)
                        parts.append(view)
                    out.append(Chunk(name, size, n, n, digests[index], RAW, digests[index]))
                    size += n
                    count += 1
                    raw_count += 1
                    continue
                self.stats.chunks_compressed += 1
            if size and size + st.nbytes > limit:
                self._carry = st
                break
            self._carry = None
            index = self._pos
            self._pos += 1
            if st.codec == RAW and st.nbytes < SMALL_CHUNK_BYTES:
                small.append(views[index])
            else:
                flush_small()
                if st.codec == RAW:
                    size = pad_to_alignment(size)
            out.append(Chunk(name, size, st.nbytes, len(views[index]), st.checksum, st.codec, digests[index]))
            if st.codec != RAW or st.nbytes >= SMALL_CHUNK_BYTES:
                for part in st.parts:
                    if len(part):
                        parts.append(part)
            size += st.nbytes
            count += 1
        self.stats.chunks_raw += raw_count
        flush_small()
        if self._carry is None and self._pos >= total:
            self._done = True
        if not count:
            return None
        digest = ""
        if self.proof == "chunks":  # the chunks' checksums prove the segment: no pass over its bytes
            digest = chunks_digest(((c.offset, c.length, c.checksum) for c in out[first:] if c.segment == name),
                                   size)
        seg = Segment(name, parts, size, digest)
        self._segments.append(SegmentEntry(name, size, digest, proof=self.proof))
        self.stats.segments += 1
        self.stats.stored_bytes += size
        return seg, len(self._segments) - 1

    def manifest(self) -> Manifest:
        """Return the version's manifest for this tier (after the last segment)."""
        if not self._done or not all(entry.checksum for entry in self._segments):
            raise RuntimeError("manifest() before the last segment was built and hashed")
        entries = {}
        pos = 0
        chunks, tensors = self._chunks, self.plan.tensors
        with gc_paused():
            for item in self.plan.order:
                if isinstance(item, StagedPack):
                    pack = (chunks[pos],)
                    pos += 1
                    for name, dtype, shape, nbytes, offset in zip(item.names, item.dtypes, item.shapes, item.sizes,
                                                                  item.offsets, strict=True):
                        entries[name] = TensorEntry(dtype, shape, nbytes, pack, offset)
                    continue
                dtype, shape, nbytes, count = tensors[item]
                entries[item] = TensorEntry(dtype, shape, nbytes, tuple(chunks[pos:pos + count]))
                pos += count
        referenced = tuple(self._referenced[k] for k in sorted(self._referenced))
        return Manifest(step=self.plan.step, tensors=entries, segments=tuple(self._segments) + referenced,
                        meta=dict(self.plan.meta), created=self.plan.created)


