"""GPUTier: snapshot buffers in device memory, for when a device-to-device copy beats going to host.

It is the in-memory bounded tier (:class:`MemoryTier`: bounded, evicting,
with the same back-pressure policies) with its pool on the CUDA device. On a
machine without CUDA it runs on the CPU device, so the same tests cover it.
Device memory does not survive the process: the tier is not persistent.
"""

from __future__ import annotations

import torch

from asymstore.tiers.memory.capacity import BackPressure
from asymstore.tiers.memory.process import MemoryTier


class GPUTier(MemoryTier):
    """Bounded device-memory tier.

    Args:
        capacity_bytes: most bytes held at once.
        device: a CUDA device; default ``"cuda"`` when available, else ``"cpu"``.
        name: the tier's name in reports.
        keep_last: this tier's retention; None uses the store's.
        policy: back-pressure when full: ``"wait"`` or ``"skip"``.
        wait_timeout_s: longest wait under ``"wait"`` (None: no limit).
    """

    def __init__(self, capacity_bytes: int = 1 << 30, *, device: str | torch.device | None = None,
                 name: str | None = None, keep_last: int | None = None, policy: BackPressure = "wait",
                 wait_timeout_s: float | None = None) -> None:
        """Create the tier; device memory is allocated on first use."""
        self._dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        super().__init__(capacity_bytes, name=name or f"gpu:{self._dev}", keep_last=keep_last, policy=policy,
                         wait_timeout_s=wait_timeout_s, pin=False)

    def _device(self) -> str:
        return str(self._dev)

    def __repr__(self) -> str:
        """Return a short description."""
        return f"GPUTier({str(self._dev)!r}, capacity_bytes={self.capacity_bytes})"
