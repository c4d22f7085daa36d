"""The value types every layer passes around: what a store reports and what a restore returns.

:class:`TierCalibration` (a tier's write cost model), :class:`FlushStats` (one version written to
one tier), :class:`TierStatus` (one tier as the store sees it), :class:`CommitResult`,
:class:`Checkpoint` (what a restore returns), ``Into`` (restore destinations) and ``Targets``
(resharding), :class:`KnownChunks` (a tensor staged with its checksums).
Plain data: this module imports only the format, so every layer can use it and
nothing here can form a cycle. The store protocol that returns them is
:mod:`asymstore.protocols`.

Guide: ``docs/guides/store.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from asymstore.format.checksum import host_fill_seconds_per_byte
from asymstore.format.manifest import Manifest
from asymstore.format.pieces import TensorLayout

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch


    Into: TypeAlias = Mapping[str, torch.Tensor] | Callable[[Manifest], Mapping[str, torch.Tensor]]
    """Restore destinations: name -> tensor, or a function of the candidate version's manifest that returns them."""

Targets = Callable[[Mapping[str, TensorLayout]], Mapping[str, TensorLayout]]
"""Resharding: given the old layouts of the sharded tensors, the piece of each this rank holds now (same names)."""


# -- value types ---------------------------------------------------------------


@dataclass(frozen=True)
class KnownChunks:
    """A tensor whose chunk checksums the caller already knows (:class:`~asymstore.protocols.KnownBytesStore`).

    The caller vouches that ``checksums`` are the xxh3-64 checksums of ``tensor``'s raw bytes cut
    into chunks of ``chunk_bytes`` (rounded down to whole elements), as the store itself would cut
    and hash them, and that nobody writes the tensor until the store is done with it. A wrong
    checksum is caught when the bytes are read back (verification), never returned as data; but
    a chunk the store references by its checksum is not read, so the caller must hold a private,
    immutable copy whose checksums it computed itself.

    Attributes:
        tensor: a contiguous CPU tensor (taken without a copy).
        chunk_bytes: the chunk size the checksums were taken with (must be the store's).
        checksums: one per chunk, in byte order.
    """

    tensor: torch.Tensor
    chunk_bytes: int
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class TierCalibration:
    """The write cost model of one tier: ``t_write(n) = a + b·n``, exposed cost ``c·B``.

    Attributes:
        latency_s: ``a``, seconds of fixed cost per write (open, fsync, request).
        seconds_per_byte: ``b``, seconds per byte written.
        exposed_seconds_per_byte: ``c``, seconds per byte of one segment that
            do not overlap (``b`` plus the host's cost to fill a segment).
        source: ``"measured"``, ``"cached"``, ``"given"`` or ``"assumed"``.
        key: the cache key it was measured for, if any.
        measured_at: UNIX time of the measurement.
    """

    latency_s: float
    seconds_per_byte: float
    exposed_seconds_per_byte: float
    source: str = "given"
    key: str | None = None
    measured_at: float = 0.0

    def __post_init__(self) -> None:
        """Check that every cost is a finite non-negative number."""
        for name in ("latency_s", "seconds_per_byte", "exposed_seconds_per_byte"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_throughput(cls, bytes_per_second: float, latency_s: float, *, source: str = "given") -> TierCalibration:
        """Build a calibration from a bandwidth and a per-write latency (e.g. 100 MB/s, 20 ms)."""
        if bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be positive")
        b = 1.0 / bytes_per_second
        return cls(latency_s, b, b + host_fill_seconds_per_byte(), source=source)

    @property
    def bytes_per_second(self) -> float:
        """The bandwidth ``1/b`` (inf for a free tier)."""
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf

    def write_seconds(self, nbytes: int) -> float:
        """``t_write(n) = a + b·n``: the time one write of ``nbytes`` takes."""
        return self.latency_s + self.seconds_per_byte * nbytes

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> TierCalibration:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: the document is not a calibration.
        """
        if not isinstance(doc, dict):
            raise ValueError("calibration must be a JSON object")
        try:
            return cls(
                latency_s=float(doc["latency_s"]),
                seconds_per_byte=float(doc["seconds_per_byte"]),
                exposed_seconds_per_byte=float(doc["exposed_seconds_per_byte"]),
                source=str(doc.get("source", "cached")),
                key=doc.get("key"),
                measured_at=float(doc.get("measured_at", 0.0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed calibration: {exc!r}") from exc


@dataclass
class FlushStats:
    """What writing one version to one tier did.

    Attributes:
        tier: the tier's name.
        step: the version.
        segment_bytes: the segment size ``B`` used.
        segment_bytes_source: ``"override"`` (``AsymStore(segment_bytes=...)``) or ``"cost-model"``.
        segments: segment files written.
        chunks_compressed: chunks stored with the byte-plane codec.
        chunks_raw: chunks stored raw.
        raw_bytes: the version's tensor bytes.
        stored_bytes: bytes of the segment files.
        sample_seconds: time spent sampling chunks to decide (this tier's share).
        compress_seconds: time spent compressing for this tier (chunks shared with
            an earlier tier cost nothing here).
        write_seconds: time the tier spent in ``write_segment`` calls (summed over the pipeline's threads).
        predicted_seconds: the model's ``T(B)`` plus the estimated compression time.
        calibration: the tier calibration the decisions used.
        pipeline_threads: threads that hashed and wrote the segments
            (``AsymStore(pipeline_threads=...)``; :mod:`asymstore.write.pool`).
        inflight_peak_bytes: most segment bytes in flight at once (filled and
            not yet written, and with more than one pipeline thread the raw
            bytes of chunks compressed ahead); at most ``flush_memory_bytes``
            unless one segment alone is larger.
    """

    tier: str
    step: int
    segment_bytes: int
    segment_bytes_source: str
    calibration: TierCalibration
    segments: int = 0
    chunks_compressed: int = 0
    chunks_raw: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    sample_seconds: float = 0.0
    compress_seconds: float = 0.0
    write_seconds: float = 0.0
    predicted_seconds: float = 0.0
    pipeline_threads: int = 1
    inflight_peak_bytes: int = 0

    @property
    def ratio(self) -> float:
        """Raw bytes per stored byte."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {
            "tier": self.tier, "step": self.step, "segment_bytes": self.segment_bytes,
            "segment_bytes_source": self.segment_bytes_source, "segments": self.segments,
            "chunks_compressed": self.chunks_compressed, "chunks_raw": self.chunks_raw,
            "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes, "ratio": self.ratio,
            "sample_seconds": self.sample_seconds, "compress_seconds": self.compress_seconds,
            "write_seconds": self.write_seconds, "predicted_seconds": self.predicted_seconds,
            "calibration": self.calibration.to_json(),
        }


@dataclass
class TierStatus:
    """One tier as the store sees it (see ``AsymStore.status``).

    Attributes:
        name: the tier's name.
        versions: committed steps, ascending.
        calibration: the write cost model in use (None before ``open``).
        last_flush: what the latest write of a version to this tier did.
        last_error: the latest failure on this tier, if any.
        pending_steps: committed steps still being written to it in the background.
        newest: newest committed step on the tier.
        lag_versions: versions committed through this store that the tier does not have yet.
        lag_bytes: raw bytes waiting for (or being written to) the tier.
        bytes_per_second: raw bytes per second of the tier's background writes.
        queue_depth: versions waiting for or being written to the tier.
        retries: background write attempts that failed and were retried.
        skipped: versions the tier skipped (superseded while behind, or no room).
        quarantined: where this store's sweeps moved version directories found without a manifest that
            retention cannot have been deleting (under the tier's ``.quarantine/``; each also logged as a
            WARNING saying why, and listed by fsck).
    """

    name: str
    versions: list[int]
    calibration: TierCalibration | None
    last_flush: FlushStats | None
    last_error: str | None
    pending_steps: list[int] = field(default_factory=list)
    newest: int | None = None
    lag_versions: int = 0
    lag_bytes: int = 0
    bytes_per_second: float = 0.0
    queue_depth: int = 0
    retries: int = 0
    skipped: int = 0
    quarantined: list[str] = field(default_factory=list)


@dataclass
class CommitResult:
    """What ``commit`` did: the manifest, and the tiers that hold the version so far."""

    step: int
    manifest: Manifest
    tiers: list[str]
    seconds: float
    flush: dict[str, FlushStats] = field(default_factory=dict)
    """Per tier written so far: the segment size chosen, compression decisions, bytes raw vs stored."""

    @property
    def nbytes(self) -> int:
        """Raw bytes of the version."""
        return self.manifest.nbytes


@dataclass
class Checkpoint:
    """A restored version.

    Attributes:
        step: the version's step.
        tensors: name -> tensor, bit-exact with dtype and shape as put.
        meta: the user's JSON metadata.
        tier: name of the tier it was read from.
        manifest: the version's parsed manifest.
        fallbacks: one line per newer version or faster tier that was tried
            and failed verification before this one; empty when none failed.
    """

    step: int
    tensors: dict[str, torch.Tensor] = field(repr=False)
    meta: dict[str, Any] = field(repr=False)
    tier: str
    manifest: Manifest = field(repr=False)
    fallbacks: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        """A short description: printing every tensor of a large version takes seconds.

        (``asyncio.run`` on Python 3.11 builds the repr of the value a coroutine returns, so a
        full repr would cost every ``asyncio.run(store.restore())`` that much.)
        """
        return (f"Checkpoint(step={self.step}, tier={self.tier!r}, tensors={len(self.tensors)}, "
                f"nbytes={self.manifest.nbytes}, fallbacks={len(self.fallbacks)})")

    @property
    def fell_back(self) -> bool:
        """True when a newer or faster copy failed and this one was used instead."""
        return bool(self.fallbacks)


