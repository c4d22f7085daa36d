"""The background tiers read an adopted version from the durable tier's own copy, where it lends one.

When a commit's tensors were adopted (the caller's memory, handed back as soon as the durable tier has
the version) and slower tiers still have to be written, those tiers need the bytes after the caller got
its memory back. A durable tier that lends its stored segments without a copy
(:class:`~asymstore.tiers.protocol.ViewTier`: process memory, shared-memory files) holds them already:
the plan's adopted chunks are pointed at views of its segments, open until every background tier is done
with the version (a view keeps its bytes even if the version is deleted or evicted meanwhile). No copy,
and no second buffer of the version's size. Only where every adopted chunk is stored raw and whole there;
otherwise (a chunk compressed on the durable tier, a view refused) the store copies as before
(:mod:`asymstore.write.copybuffers`). What the background tiers write is checked as ever: each chunk's
checksum in their manifests is the one taken when it was staged, so bytes that differed would fail
every restore's verification, never load.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

from asymstore.format.codec import RAW
from asymstore.format.manifest import Manifest
from asymstore.tiers.protocol import ViewTier
from asymstore.write.segments import VersionPlan
from asymstore.write.staging import StagedPack, StagedTensor

logger = logging.getLogger(__name__)


def lend_from(tier: object, manifest: Manifest, plan: VersionPlan,
              staged: Mapping[str, StagedTensor | StagedPack]) -> contextlib.ExitStack | None:
    """Point ``plan``'s adopted chunks at views of ``tier``'s copy of the version ``manifest`` describes.

    Call it on the tier's event loop thread, and close the returned stack there too, once no background
    tier reads the plan any more.

    Returns:
        The open views (close them when done), or None: ``tier`` lends nothing, or not every adopted
        chunk (nothing changed; copy instead).

    Raises:
        AsymstoreError, OSError: a segment could not be lent (nothing changed; copy instead).
    """
    if not isinstance(tier, ViewTier) or getattr(tier, "lends_copies", False):  # device memory: a copy anyway
        return None
    sizes = {s.name: s.size for s in manifest.segments}
    stack = contextlib.ExitStack()
    segments: dict[str, memoryview] = {}

    def chunks_of(name: str) -> list[memoryview] | None:
        entry = manifest.tensors.get(name)
        if entry is None or entry.pack_offset is not None:
            return None
        out = []
        for c in entry.chunks:
            if c.codec != RAW or c.length != c.raw_length or c.segment not in sizes:
                return None
            seg = segments.get(c.segment)
            if seg is None:
                seg = segments[c.segment] = stack.enter_context(
                    tier.view_segment(*manifest.locate(c.segment), sizes[c.segment]))
            out.append(seg[c.offset:c.offset + c.length])
        return out

    try:
        lent = plan.lend(staged, chunks_of)
    except BaseException:
        stack.close()
        raise
    if not lent:
        stack.close()
        return None
    return stack
