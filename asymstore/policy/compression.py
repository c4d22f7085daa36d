"""Selective compression (pure): whether a chunk is worth compressing for the tier it is headed to.

The rule (docs/concepts/batching.md): compress a chunk of ``n`` bytes only when
``t_compress(n) + t_write(n / ratio) < t_write(n)`` on the tier it goes to.
The per-write latency cancels out of that comparison, so only the tier's
cost per byte ``b`` matters: a slow remote tier compresses, a fast NVMe may
not. The ratio and the compression time come from a sample of the chunk
(:class:`asymstore.format.codec.Sample`); sampling costs a fixed overhead, so
a chunk whose whole write costs less than that is not even sampled.
"""

from __future__ import annotations

from typing import Literal

Compression = Literal["auto", "never", "always"]
"""Per store: ``"auto"`` (the cost model decides per chunk and tier), ``"never"``, or ``"always"``."""
COMPRESSION_POLICIES: tuple[Compression, ...] = ("auto", "never", "always")


def worth_sampling(nbytes: int, seconds_per_byte: float, overhead_s: float) -> bool:
    """Whether compressing ``nbytes`` could pay at all: its write costs more than compression's fixed overhead."""
    return overhead_s < seconds_per_byte * nbytes


def pays(nbytes: int, seconds_per_byte: float, compress_s: float, ratio: float) -> bool:
    """Whether compressing ``nbytes`` (``compress_s`` seconds, to ``nbytes / ratio``) beats writing them raw."""
    return compress_s + seconds_per_byte * nbytes / ratio < seconds_per_byte * nbytes
