"""A :class:`asymcheck.snapshot.partition.Clock` made of CUDA events: windows in GPU time."""

from __future__ import annotations

import torch


class CudaEventClock:
    """Marks are timing events recorded on the current stream; read once they completed."""

    def mark(self) -> torch.cuda.Event:
        """Record an event on the current stream."""
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float | None:
        """Return GPU seconds between the events, or None while ``end`` has not run yet."""
        if not end.query():  # type: ignore[no-untyped-call]
            return None
        return max(0.0, float(start.elapsed_time(end)) / 1000.0)
