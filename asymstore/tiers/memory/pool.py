"""A bounded pool of reusable byte buffers: pinned host memory, device memory, or plain memory.

Buffers are ``torch.uint8`` tensors. Freed buffers are kept (by size class)
and handed out again, so a steady stream of same-sized segments allocates
page-locked memory once — pinning is expensive — and the pool never holds
more than ``capacity_bytes``, cached buffers included.
"""

from __future__ import annotations

import threading

import torch

from asymstore.errors import CapacityError

_MiB = 1 << 20


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to 4 KiB below 1 MiB, and to 1 MiB above."""
    unit = 4096 if nbytes < _MiB else _MiB
    return max(unit, -(-nbytes // unit) * unit)


class BufferPool:
    """Fixed-capacity buffer pool.

    Args:
        capacity_bytes: most bytes allocated at once (in use plus cached).
        device: ``"cpu"`` (default) or a CUDA device for device-memory buffers.
        pin: page-lock host buffers; None pins when CUDA is available.
    """

    def __init__(self, capacity_bytes: int, *, device: str | torch.device = "cpu", pin: bool | None = None) -> None:
        """Create an empty pool; memory is allocated on first use."""
        self.capacity_bytes = capacity_bytes
        self.device = torch.device(device)
        on_host = self.device.type == "cpu"
        self.pinned = on_host and (torch.cuda.is_available() if pin is None else pin)
        self._free: dict[int, list[torch.Tensor]] = {}
        self._allocated = 0
        self._in_use = 0
        self.high_water_bytes = 0
        self._lock = threading.Lock()

    @property
    def in_use_bytes(self) -> int:
        """Bytes handed out and not yet given back."""
        return self._in_use

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated, in use or cached."""
        return self._allocated

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Return a buffer of exactly ``nbytes`` (a view of a pooled allocation).

        Raises:
            CapacityError: it cannot fit even after dropping every cached buffer.
        """
        cls = size_class(nbytes)
        with self._lock:
            cached = self._free.get(cls)
            if cached:
                buf = cached.pop()
            else:
                self._trim(cls)
                if self._allocated + cls > self.capacity_bytes:
                    raise CapacityError(f"buffer pool: {nbytes} bytes do not fit "
                                        f"({self._in_use} of {self.capacity_bytes} in use)")
                buf = torch.empty(cls, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)
                self._allocated += cls
            self._in_use += cls
            self.high_water_bytes = max(self.high_water_bytes, self._in_use)
        return buf[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer from :meth:`acquire` back to the pool."""
        base = buf._base if buf._base is not None else buf
        cls = base.numel()
        with self._lock:
            self._in_use -= cls
            self._free.setdefault(cls, []).append(base)

    def _trim(self, need: int) -> None:
        """Drop cached buffers until ``need`` more bytes fit (caller holds the lock)."""
        for cls in sorted(self._free, reverse=True):
            while self._free[cls] and self._allocated + need > self.capacity_bytes:
                self._free[cls].pop()
                self._allocated -= cls
