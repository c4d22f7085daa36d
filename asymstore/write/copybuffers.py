"""Host buffers reused for the private copies the background tiers read.

When adopted tensors must be copied for tiers written after the durable one, fresh memory would
cost a page fault per 4 KiB page on first touch (several times the copy itself), so the buffer of
a version the background tiers are done with is kept and handed to the next version of the same
size. At most ``keep`` idle buffers are kept (oldest dropped first); a buffer in use comes back
through :meth:`CopyBuffers.give_back`, and one that never does (a plan dropped on a failure) is
ordinary garbage.

Where these copies fit in the ownership rules: docs/concepts/data-path.md.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)


class CopyBuffers:
    """Idle flat byte buffers by exact size, reused from version to version.

    Args:
        keep: idle buffers kept at most (0 keeps none: every copy is fresh memory).
    """

    def __init__(self, keep: int = 2) -> None:
        """Start with no buffer."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes of the idle buffers kept."""
        with self._lock:
            return sum(b.numel() for b in self._idle)

    def take(self, nbytes: int) -> torch.Tensor:
        """Return a ``torch.uint8`` buffer of exactly ``nbytes`` (an idle one of that size, or fresh memory)."""
        with self._lock:
            for i, buf in enumerate(self._idle):
                if buf.numel() == nbytes:
                    self.reuses += 1
                    return self._idle.pop(i)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self.allocations += 1
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` for a later :meth:`take` (nothing may read or write it any more)."""
        if not self.keep:
            return
        with self._lock:
            self._idle.append(buf)
            del self._idle[:-self.keep]
