"""Unchanged chunks referenced, not rewritten: which chunks of a version one tier can take from its previous one.

A chunk of a tensor whose bytes did not change since the previous version the tier committed (a
frozen base, buffers, embedding rows no gradient touched) need not be written again: the new
manifest (format 4) points at the segment of the version that wrote the bytes, always that one,
never a chain. :func:`find_references` decides it by content, when the plan is made for a tier:
the same tensor name, dtype, shape and byte count, the chunk at the same byte position with the
same length, and the same xxh3-64 checksum of its raw bytes, taken when it was staged. Packed
small tensors are always written. The tier must hold those segments committed
(:class:`~asymstore.tiers.protocol.ReferencingTier`), and keeps them until no version needs them.

The rule, the odds of a checksum deciding identity, and what retention, fsck and restore do with
references: docs/concepts/format.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from asymstore.format.manifest import Chunk, Manifest, SegmentEntry, reference_key, split_key
from asymstore.write.segments import VersionPlan
from asymstore.write.staging import StagedPack

logger = logging.getLogger(__name__)

ReferenceMode = Literal["unchanged", "off"]
"""``"unchanged"``: chunks that did not change since the tier's previous version are referenced from
the version that wrote them (on tiers that can, :class:`~asymstore.tiers.protocol.ReferencingTier`);
``"off"``: every version writes all its bytes (and stays readable by asymstore before format 4)."""
REFERENCE_MODES: tuple[ReferenceMode, ...] = ("unchanged", "off")


@dataclass
class References:
    """The chunks of one plan that one tier takes from earlier versions instead of writing them.

    Attributes:
        chunks: plan chunk index -> the chunk as the new manifest records it (its segment a reference key).
        segments: reference key -> the referenced segment as the new manifest lists it.
    """

    chunks: dict[int, Chunk] = field(default_factory=dict)
    segments: dict[str, SegmentEntry] = field(default_factory=dict)

    @property
    def by_origin(self) -> dict[int, frozenset[str]]:
        """Earlier version -> its segment files referenced (what the tier must keep)."""
        out: dict[int, set[str]] = {}
        for entry in self.segments.values():
            assert entry.origin is not None
            out.setdefault(entry.origin, set()).add(entry.file)
        return {step: frozenset(names) for step, names in out.items()}

    @property
    def nbytes(self) -> int:
        """Raw bytes of the referenced chunks (not written)."""
        return sum(c.raw_length for c in self.chunks.values())


def find_references(plan: VersionPlan, prev: Manifest) -> References:
    """The chunks of ``plan`` equal to the chunk at the same place of the same tensor in ``prev``.

    ``prev`` is the newest version the tier holds committed, older than the
    plan's step. Equal means: same tensor name, dtype, shape and byte count; a
    chunk at the same byte position of the same length; the same raw xxh3-64
    checksum. A chunk of no bytes and packed tensors are never referenced. The
    reference points at the segment that holds the bytes (``prev``'s own, or the
    one ``prev`` itself referenced).
    """
    refs = References()
    if prev.step >= plan.step:
        return refs
    seg_entries = {s.name: s for s in prev.segments}
    index = 0
    for item in plan.order:
        if isinstance(item, StagedPack):
            index += 1
            continue
        dtype, shape, nbytes, count = plan.tensors[item]
        old = prev.tensors.get(item)
        first, index = index, index + count
        if (old is None or old.pack_offset is not None or old.dtype != dtype or old.shape != shape
                or old.nbytes != nbytes):
            continue
        at_old: dict[int, Chunk] = {}
        pos = 0
        for c in old.chunks:
            at_old[pos] = c
            pos += c.raw_length
        pos = 0
        for k in range(first, first + count):
            n = len(plan.views[k])
            hit = at_old.get(pos)
            pos += n
            if not n or hit is None:
                continue
            c = hit
            if c.raw_length != n or (c.raw_checksum or c.checksum) != plan.digests[k]:
                continue
            origin, _ = split_key(c.segment)
            key = c.segment if origin is not None else reference_key(prev.step, c.segment)
            seg = seg_entries.get(c.segment)
            if seg is None:  # a parsed manifest lists every segment its chunks name
                continue
            refs.segments.setdefault(key, SegmentEntry(key, seg.size, seg.checksum,
                                                       prev.step if origin is None else origin, seg.proof))
            refs.chunks[k] = Chunk(key, c.offset, c.length, c.raw_length, c.checksum, c.codec, c.raw_checksum)
    if refs.chunks:
        logger.debug("step %d: %d chunk(s), %d bytes, referenced from step(s) %s", plan.step, len(refs.chunks),
                     refs.nbytes, sorted(refs.by_origin))
    return refs
