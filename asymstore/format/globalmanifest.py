"""The global manifest: which rank shards make up one multi-rank version (pure data, no I/O).

A global manifest (format version 2) lists, per rank, the step, the :func:`shard_digest` of its
shard manifest, its size and tensor count; it names the placement record the version was
committed under (:mod:`asymstore.format.placement`) and ends with its own checksum (a flipped bit
is a :class:`GlobalManifestError`). A shard's digest covers its tensors' raw checksums and its
meta, not its segment layout or compression, so it is the same on every tier that holds the shard
and restore can check a copy read from any tier. Version 1 (no checksum, no placement) is still read.

The schema and what the digest covers: docs/concepts/format.md; the commit: docs/guides/multirank.md.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from asymstore.errors import GlobalManifestError
from asymstore.format.checksum import checksum
from asymstore.format.manifest import CHECKSUM_SUFFIX, Manifest, TensorEntry, seal_document

FORMAT = "asymstore.global"
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)


def shard_digest(manifest: Manifest) -> str:
    """Return the tier-independent content digest of one rank's shard manifest."""
    doc = {
        "step": manifest.step,
        "meta": manifest.meta,
        "tensors": {name: [t.dtype, list(t.shape), t.nbytes, _content(t)]
                    for name, t in sorted(manifest.tensors.items())},
    }
    return checksum(json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())


def manifest_digest(g: GlobalManifest) -> str:
    """The identity of a global manifest: the checksum of its sealed JSON (:meth:`GlobalManifest.to_json`).

    Two manifests have the same digest exactly when they serialize alike, so a rank given only its node's
    entries and this digest can check a whole manifest it reads later against the one the coordinator chose.
    """
    return checksum(g.to_json())


def _content(t: TensorEntry) -> list[str]:
    """The raw checksums of a tensor's chunks; a packed tensor: its pack's raw checksum at its offset."""
    if t.pack_offset is not None:
        c = t.chunks[0]
        return [f"{c.raw_checksum or c.checksum}@{t.pack_offset}"]
    return [c.raw_checksum or c.checksum for c in t.chunks]


@dataclass(frozen=True)
class ShardInfo:
    """One rank's committed shard of a global version.

    Attributes:
        rank: the rank.
        step: the shard's step in the rank's own store.
        digest: :func:`shard_digest` of its manifest.
        nbytes: raw bytes of its tensors.
        tensors: number of tensors.
        summary: small JSON the rank attached (e.g. the files it holds).
    """

    rank: int
    step: int
    digest: str
    nbytes: int = 0
    tensors: int = 0
    summary: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object for this shard."""
        return {"rank": self.rank, "step": self.step, "digest": self.digest, "nbytes": self.nbytes,
                "tensors": self.tensors, "summary": self.summary}

    @classmethod
    def from_json(cls, doc: Any) -> ShardInfo:
        """Parse one shard entry.

        Raises:
            GlobalManifestError: it is malformed.
        """
        try:
            info = cls(int(doc["rank"]), int(doc["step"]), str(doc["digest"]), int(doc.get("nbytes", 0)),
                       int(doc.get("tensors", 0)), dict(doc.get("summary", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise GlobalManifestError(f"malformed shard entry {doc!r}: {exc}") from exc
        if info.rank < 0 or info.step < 0:
            raise GlobalManifestError(f"negative rank or step in {doc!r}")
        return info


@dataclass(frozen=True)
class GlobalManifest:
    """A committed multi-rank version: one shard per rank.

    Attributes:
        placement: the digest of the placement record the shards were committed under (None: a
            version 1 manifest, shards in ``ROOT/rank-NNNNN/``).
    """

    step: int
    world_size: int
    shards: tuple[ShardInfo, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    placement: str | None = None

    def shard(self, rank: int) -> ShardInfo:
        """Return the shard of ``rank``."""
        return self.shards[rank]

    @property
    def nbytes(self) -> int:
        """Raw bytes over all shards."""
        return sum(s.nbytes for s in self.shards)

    def to_json(self) -> bytes:
        """Serialize to sealed UTF-8 JSON bytes (format version 2)."""
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": self.step,
               "world_size": self.world_size, "created": self.created,
               "ranks": [s.to_json() for s in self.shards], "meta": self.meta, "placement": self.placement}
        return seal_document(doc)

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview) -> GlobalManifest:
        """Parse and validate global manifest bytes.

        Raises:
            GlobalManifestError: not a valid global manifest of a known version.
        """
        raw = bytes(data)
        match = CHECKSUM_SUFFIX.search(raw, max(0, len(raw) - 64))
        if match is not None and checksum(raw[:match.start()]) != match.group(1).decode():
            raise GlobalManifestError("global manifest checksum mismatch: it is damaged")
        try:
            doc = json.loads(raw, parse_constant=_refuse_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise GlobalManifestError(f"global manifest is not strict JSON: {str(exc)[:200]}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise GlobalManifestError("not an asymstore global manifest")
        version = doc.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise GlobalManifestError(f"unsupported global manifest format_version {version!r}")
        if version >= 2 and match is None:
            raise GlobalManifestError("global manifest lost its checksum: it is damaged")
        placement = doc.get("placement")
        if placement is not None and (not isinstance(placement, str) or not _HEX.fullmatch(placement)):
            raise GlobalManifestError(f"bad placement reference {str(placement)[:80]!r}")
        try:
            step, world = int(doc["step"]), int(doc["world_size"])
            shards = tuple(ShardInfo.from_json(s) for s in doc["ranks"])
            meta = doc.get("meta", {})
            created = float(doc.get("created", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise GlobalManifestError(f"malformed global manifest: {exc!r}") from exc
        if step < 0 or world < 1 or not isinstance(meta, dict) or not math.isfinite(created):
            raise GlobalManifestError("bad step, world_size, meta or created")
        if [s.rank for s in shards] != list(range(world)):
            raise GlobalManifestError(f"shards must list ranks 0..{world - 1} in order")
        return cls(step, world, shards, meta, created, placement)


_HEX = re.compile(r"[0-9a-f]{16}")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not strict JSON")
