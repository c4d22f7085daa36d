"""One version being captured: its flat state, plan, host slot and issue cursor."""

from __future__ import annotations

import logging

import torch

from asymcheck.copyengine import CopyEngine, CopyJob
from asymcheck.hostpool import HostSlot
from asymcheck.partition import Extent, Partition, Plan
from asymcheck.state import Capture

logger = logging.getLogger(__name__)


def extents_of(sources: list[torch.Tensor]) -> list[Extent]:
    """Describe live tensors for the planner (non-contiguous ones are never split)."""
    return [Extent(t.numel() * t.element_size(), t.element_size(), t.is_contiguous()) for t in sources]


class Snapshot:
    """Copies one version's flat state into a host slot, partition by partition.

    Args:
        step: the version (optimizer steps completed).
        capture: the state captured right after the step.
        plan: the partitions to issue.
        slot: the host slot the flat state is copied into (already arranged).
    """

    def __init__(self, step: int, capture: Capture, plan: Plan, slot: HostSlot) -> None:
        """Prepare; nothing is copied yet."""
        self.step = step
        self.capture = capture
        self.plan = plan
        self.slot = slot
        self.next_pending = True  # param groups and stateful objects not captured yet
        self._issued = [False] * len(plan.partitions)
        self.issued_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the flat state."""
        return self.plan.total_bytes

    @property
    def complete(self) -> bool:
        """Whether every partition was issued."""
        return all(self._issued)

    def issue(self, part: Partition, engine: CopyEngine) -> int:
        """Issue one partition (once); return its bytes."""
        if self._issued[part.index]:
            return 0
        self._issued[part.index] = True
        jobs = [CopyJob(self.capture.sources[s.tensor], self.slot.region(s.tensor), s.start, s.stop)
                for s in part.spans]
        engine.submit(jobs)
        self.issued_bytes += part.nbytes
        return part.nbytes

    def issue_event(self, ordinal: int, engine: CopyEngine) -> int:
        """Issue the partition planned for hook event ``ordinal``, if any."""
        part = self.plan.for_event(ordinal)
        return self.issue(part, engine) if part is not None else 0

    def issue_rest(self, engine: CopyEngine) -> int:
        """Issue every partition not issued yet (the drain); return their bytes."""
        total = 0
        pending = [p for p in self.plan.partitions if not self._issued[p.index]]
        if pending:  # one batch, so the copy thread sees one job list
            jobs = [CopyJob(self.capture.sources[s.tensor], self.slot.region(s.tensor), s.start, s.stop)
                    for p in pending for s in p.spans]
            for p in pending:
                self._issued[p.index] = True
                total += p.nbytes
            engine.submit(jobs)
        self.issued_bytes += total
        return total

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version: eager copies plus typed views into the slot."""
        if not self.complete:
            raise RuntimeError(f"version {self.step} sealed with partitions not issued")
        out = dict(self.capture.eager)
        for i, (name, src) in enumerate(zip(self.capture.names, self.capture.sources, strict=True)):
            out[name] = self.slot.view(i, src)
        return out
