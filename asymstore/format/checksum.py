"""Chunk and segment checksums: xxHash3 64-bit, hex encoded.

xxh3 runs at memory speed (tens of GB/s), so checksums are computed while the
bytes are in memory on the way out and verified on the way back without
slowing either. It is not cryptographic: it detects corruption, not attacks.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

ALGORITHM = "xxh3_64"


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
