"""Compression samples remembered across versions: a chunk's ratio is measured once every few versions.

The cost model (:mod:`asymstore.policy.compression`) needs, for every chunk worth sampling, the
ratio and speed of compressing it; :func:`asymstore.format.codec.sample` measures them on the
chunk's first 64 KiB. A training state changes a little at each step, so the ratio of one tensor's
chunk changes slowly, but measuring it again at every version costs a fixed price per chunk (a
split into planes and a zstd call each): on a small model checkpointed every step, a few
milliseconds of CPU per version, more than its write. :class:`SampleMemory` keeps each chunk's
last sample (its ratio, speed and which planes compress, never its compressed bytes: those were
of an older version's data) for :data:`REUSE_VERSIONS` versions, after which the chunk is sampled
again. What is stored is the same either way: a chunk planned compressed is compressed from the
current version's bytes, and one that does not shrink is stored raw; only the estimate is older.
"""

from __future__ import annotations

import dataclasses
import threading

from asymstore.format.codec import Sample

REUSE_VERSIONS = 32
"""Versions a chunk's sample is used for before the chunk is sampled again."""

Key = tuple[str, int, int, int]
"""A chunk: its tensor's (or pack's) name, its index in the version, its bytes and its plane width."""


class SampleMemory:
    """The newest sample of each chunk, by tensor name and place, for :data:`REUSE_VERSIONS` versions.

    One per store; every :class:`~asymstore.write.segments.VersionPlan` of the store calls
    :meth:`next_version` once, then :meth:`recall` and :meth:`remember` from its worker threads.

    Args:
        reuse_versions: versions a sample is used for (1: sampled at every version, as without memory).

    Raises:
        ValueError: ``reuse_versions`` is not positive.
    """

    def __init__(self, reuse_versions: int = REUSE_VERSIONS) -> None:
        """Start with nothing remembered."""
        if reuse_versions < 1:
            raise ValueError("reuse_versions must be >= 1")
        self.reuse_versions = reuse_versions
        self._lock = threading.Lock()
        self._version = 0
        self._samples: dict[Key, tuple[int, Sample]] = {}

    def next_version(self) -> int:
        """Count one more version (a plan); forget samples too old to be used again; return its number."""
        with self._lock:
            self._version += 1
            if self._version % self.reuse_versions == 0:
                self._samples = {k: v for k, v in self._samples.items()
                                 if self._version - v[0] < self.reuse_versions}
            return self._version

    def recall(self, key: Key, version: int) -> Sample | None:
        """The sample of ``key`` taken fewer than ``reuse_versions`` versions before ``version``, or None."""
        with self._lock:
            hit = self._samples.get(key)
        if hit is None or version - hit[0] >= self.reuse_versions:
            return None
        return hit[1]

    def remember(self, key: Key, version: int, sample: Sample) -> None:
        """Keep ``sample`` (taken at ``version``) without its encoded bytes: they belong to that version only."""
        kept = dataclasses.replace(sample, encoded=None)
        with self._lock:
            self._samples[key] = (version, kept)

    def __len__(self) -> int:
        """Chunks remembered."""
        with self._lock:
            return len(self._samples)
