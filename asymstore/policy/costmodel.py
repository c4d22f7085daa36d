"""The write cost model of a tier (pure): segment size and predicted time from its calibration.

Writing one segment of ``n`` bytes costs ``t_write(n) = a + b·n``; writing ``N`` bytes in segments
of ``B`` costs ``T(B) = a·N/B + b·N + c·B``, where ``c = b + f`` is the part no pipelining hides
(``f`` the host's cost per byte of filling a segment). ``T`` is smallest at ``B* = sqrt(a·N/c)``
(:func:`optimal_segment_bytes`). The constants of a tier are a
:class:`~asymstore.values.TierCalibration`, measured by :mod:`asymstore.policy.calibration`.

The model and its terms: docs/concepts/batching.md.
"""

from __future__ import annotations

import math

from asymstore.format.checksum import host_fill_seconds_per_byte
from asymstore.values import TierCalibration

ALIGN = 4096
MIN_SEGMENT_BYTES = 1 << 20

# when nothing can be measured: a plausible local SSD (1 ms per write, 1 GB/s)
ASSUMED_LATENCY_S = 1e-3
ASSUMED_SECONDS_PER_BYTE = 1e-9


def assumed_calibration() -> TierCalibration:
    """The fallback for tiers that cannot be probed: 1 ms per write, 1 GB/s."""
    b = ASSUMED_SECONDS_PER_BYTE
    return TierCalibration(ASSUMED_LATENCY_S, b, b + host_fill_seconds_per_byte(), source="assumed")


def fit(small: int, large: int, t_small: float, t_large: float) -> tuple[float, float]:
    """Return ``(a, b)`` of the line through two timed writes (never negative)."""
    b = max((t_large - t_small) / (large - small), 1e-13)
    a = max(t_small - b * small, 1e-7)
    return a, b


def optimal_segment_bytes(latency_s: float, exposed_seconds_per_byte: float, nbytes: int,
                          max_bytes: int) -> int:
    """Return ``B* = sqrt(a·N/c)``, rounded up to 4 KiB and kept within ``[1 MiB, max_bytes]``.

    ``B`` never exceeds what the version needs (``N`` rounded up to 4 KiB):
    a version smaller than ``B*`` is one segment.
    """
    c = max(exposed_seconds_per_byte, 1e-15)
    best = math.sqrt(latency_s * max(nbytes, 1) / c)
    upper = max(min(max_bytes, _align(nbytes)), ALIGN)
    lower = min(MIN_SEGMENT_BYTES, upper)
    return int(min(max(_align(int(best)), lower), upper))


def predicted_seconds(latency_s: float, seconds_per_byte: float, exposed_seconds_per_byte: float,
                      nbytes: int, segment_bytes: int) -> float:
    """``T(B) = a·⌈N/B⌉ + b·N + c·B`` for ``N = nbytes`` and ``B = segment_bytes``."""
    writes = max(1, math.ceil(nbytes / max(segment_bytes, 1)))
    return latency_s * writes + seconds_per_byte * nbytes + exposed_seconds_per_byte * min(segment_bytes, nbytes)


def _align(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN
