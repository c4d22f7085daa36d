"""One version being captured: its flat state, plan, host slot and issue cursor.

When a version opens, every source's version counter, data address and
storage need are recorded (the copy engine checks them right before and after
each copy), and a sparse byte sample of every contiguous parameter is taken:
``p.data.mul_()`` and other edits through ``.data`` do not move the version
counter PyTorch keeps, but a whole-tensor edit changes the sampled bytes.
On a CUDA device the sample is gathered by one kernel on the compute stream
right after the step (so it holds the step's bytes, whatever is queued after
it) and copied to pinned host memory; :meth:`Snapshot.verify` compares it once
the side stream's copies have landed (it waits for their event).
:meth:`Snapshot.verify` names the tensors that changed before their copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from asymcheck.snapshot.copyengine import CopyEngine, CopyJob
from asymcheck.snapshot.hostpool import HostSlot
from asymcheck.snapshot.partition import BACKWARD, DRAIN, FORWARD, Extent, Partition, Plan
from asymcheck.state.dtensors import address_of
from asymcheck.state.trainstate import Capture

logger = logging.getLogger(__name__)


SAMPLE_BYTES = 16  # bytes sampled per tensor for the fingerprint


def sample_view(flat: torch.Tensor) -> torch.Tensor:
    """Every k-th byte of a flat byte view, about ``SAMPLE_BYTES`` of them."""
    return flat[::max(1, flat.numel() // SAMPLE_BYTES)]


def _sampled(t: torch.Tensor) -> bool:
    return t.device.type in ("cpu", "cuda") and t.is_contiguous() and t.numel() > 0


def gather_samples(sources: list[torch.Tensor], indices: list[int]) -> torch.Tensor | None:
    """The byte samples of ``sources[i]`` for ``i`` in ``indices``, concatenated, on the host."""
    if not indices:
        return None
    sample = torch.cat([sample_view(sources[i].reshape(-1).view(torch.uint8)) for i in indices])
    if sample.device.type == "cpu":
        return sample
    # queued on the compute stream after the step; lands in pinned memory before any later copy's event
    return sample.to("cpu", non_blocking=True)


def storage_need(t: torch.Tensor) -> int:
    """Bytes of its storage a tensor reaches into (offset plus its furthest element)."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():
        return int((t.storage_offset() + t.numel()) * t.element_size())
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return int((t.storage_offset() + last + 1) * t.element_size())


def extents_of(sources: list[torch.Tensor]) -> list[Extent]:
    """Describe live tensors for the planner (non-contiguous ones are never split)."""
    return [Extent(t.numel() * t.element_size(), t.element_size(), t.is_contiguous()) for t in sources]


class Snapshot:
    """Copies one version's flat state into a host slot, partition by partition.

    The host slot may come later than the version opens (every slot still held by an earlier version
    being committed): a hook that finds none free skips its partition, and the first hook that finds
    one issues every partition skipped so far with its own; the drain (:meth:`issue_rest`) waits for
    one. So one slot costs back-pressure only when an earlier version's commit outlasts the next
    forward and backward, not at every step boundary.

    Args:
        step: the version (optimizer steps completed).
        capture: the state captured right after the step.
        plan: the partitions to issue.
        slot: the host slot the flat state is copied into (already arranged), or None: none free yet.
        acquire: takes a free slot (``acquire(wait)``: waiting for one, or None at once when none is
            free); needed when ``slot`` is None.
    """

    def __init__(self, step: int, capture: Capture, plan: Plan, slot: HostSlot | None,
                 acquire: Callable[[bool], HostSlot | None] | None = None) -> None:
        """Prepare; nothing is copied yet."""
        if slot is None and acquire is None:
            raise ValueError("a snapshot without a slot needs a way to acquire one")
        self.step = step
        self.capture = capture
        self.plan = plan
        self.slot = slot
        self._acquire = acquire
        self.slot_wait_s = 0.0
        """Seconds the drain waited for a slot (back-pressure: an earlier commit still held them all)."""
        self.next_pending = True  # param groups and stateful objects not captured yet
        self._issued = [False] * len(plan.partitions)
        self.issued_bytes = 0
        self.issued_by_phase = {FORWARD: 0, BACKWARD: 0, DRAIN: 0}
        """Bytes issued by forward hooks, backward hooks, and at the step boundary (the drain, ``editing()``)."""
        self.verified = False  # every copy done and checked (by editing() or the seal)
        self.dirty: list[str] = []  # tensors found changed before their copy
        self.ready: object = None  # the CUDA event of the copies when they finished early
        srcs = capture.sources
        self.versions = [t._version for t in capture.versioned]  # a DTensor's, not its local tensor's
        self.ptrs = [t.data_ptr() for t in srcs]
        self._owner_ptrs = [address_of(o) if o is not None else 0 for o in capture.owners]  # a slice starts inside
        self.needs = [storage_need(t) for t in srcs]
        sampled = [i for i, (t, owner) in enumerate(zip(srcs, capture.owners, strict=False))
                   if owner is not None and _sampled(t)]  # parameters: what ``p.data`` edits reach
        self._sampled: list[list[int]] = []  # per device: indices of the tensors sampled there
        self._samples: list[torch.Tensor] = []  # their samples (host), in the same order
        self._device_samples = False  # some sample comes from a CUDA device (its copy is asynchronous)
        for device in dict.fromkeys(srcs[i].device for i in sampled):
            indices = [i for i in sampled if srcs[i].device == device]
            sample = gather_samples(srcs, indices)
            if sample is not None:
                self._sampled.append(indices)
                self._samples.append(sample)
                self._device_samples |= device.type != "cpu"

    def _job(self, i: int, start: int, stop: int) -> CopyJob:
        assert self.slot is not None
        return CopyJob(self.capture.sources[i], self.slot.region(i), start, stop, self.versions[i], self.ptrs[i],
                       self.needs[i], i, self.capture.versioned[i])

    def take_slot(self, wait: bool) -> bool:
        """Make sure the version has its host slot (arranged for its sources); False: none free (``wait`` off)."""
        if self.slot is None:
            assert self._acquire is not None
            started = time.perf_counter()
            slot = self._acquire(wait)
            if wait:
                self.slot_wait_s += time.perf_counter() - started
            if slot is None:
                return False
            slot.arrange(self.capture.sources)
            self.slot = slot
        return True

    @property
    def nbytes(self) -> int:
        """Bytes of the flat state."""
        return self.plan.total_bytes

    @property
    def complete(self) -> bool:
        """Whether every partition was issued."""
        return all(self._issued)

    def issue(self, part: Partition, engine: CopyEngine, phase: str | None = None) -> int:
        """Issue one partition (once), counted under ``phase`` (default: its planned one); return its bytes.

        Returns 0 when no slot is free yet: it is issued later.
        """
        if self._issued[part.index] or not self.take_slot(False):
            return 0
        self._issued[part.index] = True
        jobs = [self._job(s.tensor, s.start, s.stop) for s in part.spans]
        engine.submit(jobs)
        self.issued_bytes += part.nbytes
        self.issued_by_phase[phase or part.phase] += part.nbytes
        return part.nbytes

    def issue_event(self, ordinal: int, engine: CopyEngine, phase: str | None = None) -> int:
        """Issue the partition planned for hook event ``ordinal`` (of ``phase``), and any skipped before it.

        Partitions skipped for want of a slot are counted under the phase of the hook that issued them.
        """
        if self.slot is None:
            if not self.take_slot(False):
                return 0
            late = [p for p in self.plan.partitions  # this event's, and those skipped before it
                    if p.event is not None and p.event <= ordinal and not self._issued[p.index]]
            return sum(self.issue(p, engine, phase) for p in late)
        part = self.plan.for_event(ordinal)
        return self.issue(part, engine) if part is not None else 0

    def issue_rest(self, engine: CopyEngine) -> int:
        """Issue every partition not issued yet (the drain), waiting for a slot if none came yet; return their bytes."""
        self.take_slot(True)
        total = 0
        pending = [p for p in self.plan.partitions if not self._issued[p.index]]
        if pending:  # one batch, so the copy thread sees one job list
            jobs = [self._job(s.tensor, s.start, s.stop) for p in pending for s in p.spans]
            for p in pending:
                self._issued[p.index] = True
                total += p.nbytes
            engine.submit(jobs)
        self.issued_bytes += total
        self.issued_by_phase[DRAIN] += total
        return total

    def verify(self, bad: set[int]) -> list[str]:
        """After every copy finished: name the tensors that changed before (or while) they were copied.

        Args:
            bad: indices the copy engine reported (counter, address or size changed).

        Returns:
            The names found changed (also kept in ``dirty``); empty for a clean version.
        """
        idx = set(bad)
        slot = self.slot
        assert slot is not None, "verified before every partition was issued"
        if self._device_samples:  # the host slot and the samples are filled by queued device copies
            if self.ready is not None:
                self.ready.synchronize()  # type: ignore[attr-defined]
            else:
                torch.cuda.synchronize()
        for indices, sample in zip(self._sampled, self._samples, strict=True):
            copied = torch.cat([sample_view(slot.region(i)) for i in indices])
            if not torch.equal(copied, sample):  # find which (rare)
                at = 0
                for i in indices:
                    n = sample_view(slot.region(i)).numel()
                    if not torch.equal(sample_view(slot.region(i)), sample[at:at + n]):
                        idx.add(i)
                    at += n
        for i, owner in enumerate(self.capture.owners):
            if owner is not None and address_of(owner) != self._owner_ptrs[i]:  # ``p.data = other`` since the step
                idx.add(i)
        self.verified = True
        self.dirty = [self.capture.names[i] for i in sorted(idx)]
        return self.dirty

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version: eager copies plus typed views into the slot."""
        if not self.complete or self.slot is None:
            raise RuntimeError(f"version {self.step} sealed with partitions not issued")
        out = dict(self.capture.eager)
        for i, (name, src) in enumerate(zip(self.capture.names, self.capture.sources, strict=True)):
            out[name] = self.slot.view(i, src)
        return out
