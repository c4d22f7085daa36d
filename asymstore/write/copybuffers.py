"""Host buffers reused for the private copies the background tiers read.

When a commit's tensors were adopted (the caller's memory, handed back as
soon as the durable tier has the version) and slower tiers still have to be
written, the store copies the adopted bytes once into private memory. Fresh
memory costs a page fault per 4 KiB page on its first touch: for a version
of a few hundred MiB that is several times the copy itself (0.22 CPU-s for
335 MiB fresh against 0.03 s into memory already touched, measured on the
development VM). Consecutive versions of a training run have the same size,
so the buffer of a version the background tiers are done with is kept and
handed to the next version of that size.

At most ``keep`` idle buffers are kept (the oldest is dropped first);
buffers in use are owned by their version's plan and come back through
:meth:`CopyBuffers.give_back` once every background tier is done with it.
A buffer that never comes back (a plan dropped on a failure) is ordinary
garbage: nothing is accounted for it.
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
