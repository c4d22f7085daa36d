"""Replicated state written once per job: what a shard claims about the slices it holds (pure data, no I/O).

Under data parallelism (DDP) every rank holds the same parameters and optimizer state. A writer that
stores only its balanced slice of them (each slice a ``"S(0)"`` piece recorded in ``meta["layout"]``,
:mod:`asymstore.format.pieces`) puts a *claim* into the shard's meta under :data:`REPLICAS_KEY`::

    {"format": 1, "mode": "slices", "world": 2, "digest": "<hex>", "full": true}

``digest`` is the writer's digest of the replicated state it sliced (names, shapes, dtypes and bytes:
every byte when ``full``, a sample otherwise), taken before slicing, so it is the same on every rank
exactly when the replicas are. The claim is copied into the rank's entry of the global manifest
(``summary``), and the coordinator publishes a global version only when :func:`refusal` finds
nothing wrong: either no rank sliced, or every rank sliced the same state (equal digests, the same
world). A version whose replicas differ is never published: its restore would mix ranks' states.
Format and guide: docs/concepts/format.md, docs/guides/multirank.md ("Replicated state").
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REPLICAS_KEY = "replicas"
"""The key of a shard's meta (and of its entry's ``summary`` in the global manifest) holding the claim."""
FORMAT = 1
SLICES = "slices"
_HEX = re.compile(r"^[0-9a-f]{1,64}$")


@dataclass(frozen=True)
class ReplicaClaim:
    """One shard's claim: it holds its slice of a replicated state of digest ``digest``.

    Attributes:
        world: the number of ranks the replicated state was sliced over.
        digest: the digest of the whole replicated state on the writing rank, before slicing.
        full: whether the digest covers every byte (else a sample of them).
    """

    world: int
    digest: str
    full: bool

    def to_json(self) -> dict[str, Any]:
        """The claim's JSON object."""
        return {"format": FORMAT, "mode": SLICES, "world": self.world, "digest": self.digest, "full": self.full}

    @classmethod
    def from_json(cls, doc: object) -> ReplicaClaim:
        """Parse a claim (untrusted).

        Raises:
            ValueError: it is malformed.
        """
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("mode") != SLICES:
            raise ValueError(f"not a replica claim of format {FORMAT}: {str(doc)[:120]}")
        world, digest, full = doc.get("world"), doc.get("digest"), doc.get("full")
        if type(world) is not int or world < 2 or not isinstance(digest, str) or not _HEX.match(digest) \
                or not isinstance(full, bool):
            raise ValueError(f"malformed replica claim: {str(doc)[:120]}")
        return cls(world, digest, full)


def claim_of(meta: Mapping[str, Any] | None) -> ReplicaClaim | None:
    """The claim in a shard's meta (or a global manifest entry's summary), None when there is none.

    Raises:
        ValueError: the claim is malformed.
    """
    if not meta or REPLICAS_KEY not in meta:
        return None
    return ReplicaClaim.from_json(meta[REPLICAS_KEY])


def is_sliced(summaries: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a global version's shards (their summaries) hold slices of a replicated state.

    A malformed claim counts as sliced: such a version is read through the layouts, which are checked.
    """
    for summary in summaries:
        try:
            if claim_of(summary) is not None:
                return True
        except ValueError:
            return True
    return False


def refusal(summaries: Sequence[Mapping[str, Any]], world: int, *, whole_only: bool = False) -> str | None:
    """Why a global version of shards with ``summaries`` must not be published (None: it may be).

    Args:
        summaries: each rank's summary, in rank order.
        world: the job's number of ranks.
        whole_only: the job fell back to whole copies: a sliced version is refused.
    """
    claims: list[ReplicaClaim | None] = []
    for rank, summary in enumerate(summaries):
        try:
            claims.append(claim_of(summary))
        except ValueError as exc:
            return f"rank {rank}: {exc}"
    sliced = [r for r, c in enumerate(claims) if c is not None]
    if not sliced:
        return None
    if whole_only:
        return f"rank(s) {sliced} wrote slices after the job fell back to whole copies of the replicated state"
    if len(sliced) != len(claims):
        whole = [r for r, c in enumerate(claims) if c is None]
        return f"rank(s) {sliced} wrote slices of the replicated state, rank(s) {whole} whole copies"
    digests = {c.digest for c in claims if c is not None}
    worlds = {c.world for c in claims if c is not None}
    if worlds != {world}:
        return f"slices cut for {sorted(worlds)} rank(s) in a job of {world}"
    if len(digests) != 1:
        by = {r: c.digest for r, c in enumerate(claims) if c is not None}
        return f"the replicas differ across ranks (digests {by})"
    return None
