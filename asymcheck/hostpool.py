"""A fixed pool of host staging slots: one slot holds one version's flat state.

The pool never grows past ``slots`` buffers. A slot is taken when a version
opens and given back once the store has its own copy; when none is free,
``acquire`` waits (back-pressure) instead of allocating more. On CUDA the
buffers are pinned so device-to-host copies run asynchronously.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostSlot:
    """One staging buffer and the layout of the version it currently holds."""

    def __init__(self, index: int, pin: bool) -> None:
        """Create an empty slot; memory is allocated by ``arrange``."""
        self.index = index
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.offsets: list[int] = []
        self.sizes: list[int] = []

    @property
    def capacity(self) -> int:
        """Bytes allocated."""
        return self.buffer.numel()

    def arrange(self, sources: Sequence[torch.Tensor]) -> None:
        """Lay out one region per tensor (64-byte aligned), growing the buffer if needed."""
        offsets, pos = [], 0
        sizes = [t.numel() * t.element_size() for t in sources]
        for size in sizes:
            offsets.append(pos)
            pos = _aligned(pos + size)
        if pos > self.capacity:
            logger.debug("slot %d: growing from %d to %d bytes", self.index, self.capacity, pos)
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.buffer = torch.empty(pos, dtype=torch.uint8, pin_memory=self.pin)
        self.offsets, self.sizes = offsets, sizes

    def region(self, i: int) -> torch.Tensor:
        """Return the bytes of tensor ``i`` as a flat uint8 view."""
        return self.buffer[self.offsets[i]:self.offsets[i] + self.sizes[i]]

    def view(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Return region ``i`` viewed with the dtype and shape of ``like``."""
        if self.sizes[i] == 0:
            return torch.empty(like.shape, dtype=like.dtype)
        return self.region(i).view(like.dtype).view(like.shape)


class HostPool:
    """At most ``slots`` staging slots; ``acquire`` blocks while all are taken.

    Args:
        slots: number of slots (versions staged at once).
        pin: pin the buffers (for CUDA sources).
    """

    def __init__(self, slots: int = 2, *, pin: bool = False) -> None:
        """Create the slots (unallocated)."""
        if slots < 1:
            raise ValueError("the host pool needs at least one slot")
        self._free = [HostSlot(i, pin) for i in range(slots)]
        self._slots = list(self._free)
        self._cond = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by all slots."""
        return sum(s.capacity for s in self._slots)

    @property
    def free_slots(self) -> int:
        """Slots not taken."""
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> HostSlot | None:
        """Take a free slot, waiting for one; None if ``timeout`` passed first."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                return None
            return self._free.pop(0)

    def release(self, slot: HostSlot) -> None:
        """Give a slot back (any thread)."""
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
            self._cond.notify_all()
