"""Chunk and segment checksums: xxHash3 64-bit, hex encoded.

xxh3 runs at memory speed (tens of GB/s), so checksums are computed while the
bytes are in memory on the way out and verified on the way back without
slowing either. It is not cryptographic: it detects corruption, not attacks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import xxhash

ALGORITHM = "xxh3_64"

Buffer = memoryview | bytes | bytearray
"""Bytes as the format hashes, stores and reads them (a tier's segments are lists of these)."""


def checksum(data: memoryview | bytes | bytearray) -> str:
    """Return the hex xxh3-64 digest of ``data``."""
    return xxhash.xxh3_64_hexdigest(data)


class StreamingChecksum:
    """Incremental xxh3-64 over several buffers (a segment written piecewise)."""

    def __init__(self, parts: Iterable[memoryview | bytes | bytearray] = ()) -> None:
        """Start a digest, optionally fed with ``parts``."""
        self._state = xxhash.xxh3_64()
        for part in parts:
            self.update(part)

    def update(self, data: memoryview | bytes | bytearray) -> None:
        """Feed ``data`` to the digest."""
        self._state.update(data)

    def hexdigest(self) -> str:
        """Return the hex digest of everything fed so far."""
        return self._state.hexdigest()


_fill: float | None = None


def host_fill_seconds_per_byte() -> float:
    """Seconds per byte to fill a segment on this host (one checksum pass), measured once per process."""
    global _fill
    if _fill is None:
        data = memoryview(bytearray(os.urandom(1 << 16)) * 64)  # 4 MiB
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            checksum(data)
            times.append(time.perf_counter() - t0)
        _fill = min(times) / len(data)
    return _fill
