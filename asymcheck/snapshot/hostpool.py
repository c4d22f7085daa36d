"""A fixed pool of host staging slots: one slot holds one version's flat state.

The pool never grows past ``slots`` buffers: a slot is taken when a version opens and given back
once the store has its own copy; when none is free, ``acquire`` waits (back-pressure). A slot's
buffer is allocated once and reused (it only grows), pinned on CUDA. Unpinned buffers of at least
:data:`HUGE_MIN_BYTES` are 2 MiB-aligned anonymous mappings advised ``MADV_HUGEPAGE`` when
transparent huge pages are enabled.

The slots in the data path, and what huge pages cost and save: docs/concepts/data-path.md.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

ALIGN = 64
PAGE = 4096
PAGE_ALIGNED_BYTES = 64 << 10  # regions at least this large start on a page (the store writes them with O_DIRECT)
HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 8 << 20
"""Unpinned slots at least this large are mapped with huge pages advised (where the kernel allows)."""
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``; ``never`` if unknown)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


def huge_pages_available() -> bool:
    """Whether ``MADV_HUGEPAGE`` can back slots here (Linux, THP not ``never``)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def _allocate(nbytes: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Allocate a slot buffer of ``nbytes``: (the allocation, its aligned part, huge pages advised)."""
    if not pin and nbytes >= HUGE_MIN_BYTES and huge_pages_available():
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            huge = True
        except OSError as exc:  # a kernel without THP for anonymous memory: plain pages
            logger.debug("MADV_HUGEPAGE refused (%s): slot uses base pages", exc)
            huge = False
        raw = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping; unmapped when the tensor is freed
        align = HUGE_PAGE
    else:
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
        huge, align = False, PAGE
    skip = -raw.data_ptr() % align
    return raw, raw[skip:skip + nbytes], huge


def _aligned(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class HostSlot:
    """One staging buffer and the layout of the version it currently holds."""

    def __init__(self, index: int, pin: bool) -> None:
        """Create an empty slot; memory is allocated by ``arrange``."""
        self.index = index
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._raw = self.buffer  # the allocation; ``buffer`` is its page-aligned part
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.huge = False
        """Whether the buffer's memory is advised ``MADV_HUGEPAGE``."""
        self.allocations = 0
        """How many times a buffer was allocated (once, unless a version outgrew it)."""
        # the regions and typed views of the current layout, made once and handed out again for every
        # version laid out the same (a view per tensor per version was most of a seal's own time); dropped
        # whenever the layout or the buffer changes
        self._regions: list[torch.Tensor | None] = []
        self._views: list[torch.Tensor | None] = []

    @property
    def allocated(self) -> int:
        """Bytes allocated (the capacity plus up to a page, or a huge page, to align it)."""
        return self._raw.numel()

    @property
    def capacity(self) -> int:
        """Bytes allocated."""
        return self.buffer.numel()

    def arrange(self, sources: Sequence[torch.Tensor]) -> None:
        """Lay out one region per tensor, growing the buffer if needed.

        Regions of 64 KiB and more start on a 4 KiB page, smaller ones on 64
        bytes; the buffer itself starts on a page (on a huge page when huge
        pages are advised). A buffer large enough is kept. The store adopts the
        regions as they are and writes the large ones with O_DIRECT straight
        from here (segments place such chunks at page offsets too).
        """
        offsets, pos = [], 0
        sizes = [t.numel() * t.element_size() for t in sources]
        for size in sizes:
            if size >= PAGE_ALIGNED_BYTES:
                pos = _aligned(pos, PAGE)
            offsets.append(pos)
            pos = _aligned(pos + size)
        grown = pos > self.capacity
        if grown:
            logger.debug("slot %d: growing from %d to %d bytes", self.index, self.capacity, pos)
            self._regions = self._views = []  # nothing may keep the old buffer alive
            self._raw = self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._raw, self.buffer, self.huge = _allocate(pos, self.pin)
            self.allocations += 1
        if grown or offsets != self.offsets or sizes != self.sizes:
            self._regions = [None] * len(sizes)
            self._views = [None] * len(sizes)
        self.offsets, self.sizes = offsets, sizes

    def region(self, i: int) -> torch.Tensor:
        """Return the bytes of tensor ``i`` as a flat uint8 view (the same one while the layout stays)."""
        region = self._regions[i]
        if region is None:
            region = self._regions[i] = self.buffer[self.offsets[i]:self.offsets[i] + self.sizes[i]]
        return region

    def view(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Return region ``i`` viewed with the dtype and shape of ``like``.

        The same view is returned for every version laid out the same (same regions, ``like`` of the
        same dtype and shape); a new one when any of these changes.
        """
        cached = self._views[i]
        if cached is not None and cached.dtype == like.dtype and cached.shape == like.shape:
            return cached
        if self.sizes[i] == 0:
            return torch.empty(like.shape, dtype=like.dtype)
        view = self._views[i] = self.region(i).view(like.dtype).view(like.shape)
        return view


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
        return sum(s.allocated for s in self._slots)

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
