"""Where a multi-rank job's shards live: each rank's tier locations, as the job opened them (pure data, no I/O).

A multi-rank root holds the commit points (``global/``), but the shards may live elsewhere: shared
memory and a node-local disk, a peer's memory, a remote store. So that fsck can verify a global
version where its shards are, the coordinator records the job's placement in ``global/`` as
``placement-<digest>.json`` (strict JSON, sealed with a self-checksum), and every global manifest
names the placement it was committed under. Per rank it lists the host and each tier's name, kind,
``location`` (an absolute directory on that host, a URI, or null for process or GPU memory) and
``holds`` (the rank whose shards the tier holds: itself, or the source rank of a replica tier).

The schema: docs/concepts/format.md; how fsck uses it: docs/guides/fsck.md.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any, Literal, cast

from asymstore.errors import GlobalManifestError, ManifestError
from asymstore.format.checksum import checksum
from asymstore.format.manifest import CHECKSUM_SUFFIX, seal_document

FORMAT = "asymstore.placement"
FORMAT_VERSION = 1
MAX_PLACEMENT_BYTES = 64 << 20
"""The largest placement record read (a few hundred bytes a rank)."""

TierKind = Literal["local", "host", "memory", "remote", "replicas", "other"]
TIER_KINDS: tuple[TierKind, ...] = ("local", "host", "memory", "remote", "replicas", "other")


@dataclass(frozen=True)
class TierPlace:
    """One tier of a rank, as fsck needs to find it.

    Attributes:
        name: the tier's name in the rank's store.
        kind: ``local`` (a directory: LocalTier, NVMeTier), ``host`` (a shared-memory directory),
            ``memory`` (process or GPU memory: no location), ``remote`` (a URI), ``replicas`` (a peer's
            versions held in this rank's memory), ``other``.
        location: an absolute directory on the rank's host, a URI, or None.
        holds: the rank whose shards this tier holds.
    """

    name: str
    kind: TierKind
    location: str | None
    holds: int

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object of this tier."""
        return {"name": self.name, "kind": self.kind, "location": self.location, "holds": self.holds}

    @classmethod
    def from_json(cls, doc: Any) -> TierPlace:
        """Parse one tier entry.

        Raises:
            GlobalManifestError: it is malformed.
        """
        if not isinstance(doc, dict):
            raise GlobalManifestError(f"malformed tier entry {str(doc)[:200]}")
        name, kind, location, holds = doc.get("name"), doc.get("kind"), doc.get("location"), doc.get("holds")
        if not isinstance(name, str) or kind not in TIER_KINDS or not isinstance(holds, int) or holds < 0:
            raise GlobalManifestError(f"malformed tier entry {str(doc)[:200]}")
        if location is not None and (not isinstance(location, str) or "\0" in location or not location
                                     or len(location) > 4096):
            raise GlobalManifestError(f"bad tier location in {str(doc)[:200]}")
        return cls(name, cast(TierKind, kind), location, holds)


@dataclass(frozen=True)
class RankPlacement:
    """One rank's tiers and the host it ran on."""

    rank: int
    host: str
    tiers: tuple[TierPlace, ...]

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object of this rank."""
        return {"rank": self.rank, "host": self.host, "tiers": [t.to_json() for t in self.tiers]}

    @classmethod
    def from_json(cls, doc: Any) -> RankPlacement:
        """Parse one rank entry.

        Raises:
            GlobalManifestError: it is malformed.
        """
        if not isinstance(doc, dict) or not isinstance(doc.get("tiers"), list):
            raise GlobalManifestError(f"malformed rank placement {str(doc)[:200]}")
        rank, host = doc.get("rank"), doc.get("host")
        if not isinstance(rank, int) or rank < 0 or not isinstance(host, str) or len(host) > 255:
            raise GlobalManifestError(f"malformed rank placement {str(doc)[:200]}")
        return cls(rank, host, tuple(TierPlace.from_json(t) for t in doc["tiers"]))


@dataclass(frozen=True)
class Placement:
    """Every rank's tiers, as a job opened them."""

    world_size: int
    ranks: tuple[RankPlacement, ...]

    def holders(self, rank: int) -> list[tuple[RankPlacement, TierPlace]]:
        """Every tier holding ``rank``'s shards (its own and its replicas), with the rank that has the tier."""
        return [(r, t) for r in self.ranks for t in r.tiers if t.holds == rank]

    def to_json(self) -> bytes:
        """Serialize to sealed strict JSON."""
        return seal_document({"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": self.world_size,
                              "ranks": [r.to_json() for r in self.ranks]})

    @property
    def digest(self) -> str:
        """A content digest (names the record's file)."""
        return checksum(self.to_json())

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> Placement:
        """Parse and verify a placement record.

        Raises:
            GlobalManifestError: too large, damaged (self-checksum), not strict JSON or malformed.
        """
        raw = bytes(data)
        if len(raw) > MAX_PLACEMENT_BYTES:
            raise GlobalManifestError(f"placement record of {len(raw)} bytes exceeds {MAX_PLACEMENT_BYTES}")
        match = CHECKSUM_SUFFIX.search(raw, max(0, len(raw) - 64))
        if match is None:
            raise GlobalManifestError("placement record has no checksum")
        if checksum(raw[:match.start()]) != match.group(1).decode():
            raise GlobalManifestError("placement record checksum mismatch: it is damaged")
        try:
            doc = json.loads(raw, parse_constant=_refuse)
        except (UnicodeDecodeError, ValueError, RecursionError, ManifestError) as exc:
            raise GlobalManifestError(f"placement record is not strict JSON: {str(exc)[:200]}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            raise GlobalManifestError("not an asymstore placement record of a known version")
        world, ranks = doc.get("world_size"), doc.get("ranks")
        if not isinstance(world, int) or world < 1 or not isinstance(ranks, list):
            raise GlobalManifestError("malformed placement record")
        parsed = tuple(RankPlacement.from_json(r) for r in ranks)
        if [r.rank for r in parsed] != list(range(world)):
            raise GlobalManifestError(f"placement must list ranks 0..{world - 1} in order")
        return cls(world, parsed)


def _refuse(name: str) -> None:
    raise ValueError(f"{name} is not strict JSON")


def this_host() -> str:
    """The name of the machine this process runs on, as placements record it."""
    return socket.gethostname()


def placement_filename(digest: str) -> str:
    """The file name of the placement record with ``digest`` in ``global/``."""
    return f"placement-{digest}.json"
