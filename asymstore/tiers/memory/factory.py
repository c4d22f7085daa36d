"""``host_tier(...)``: the factory of the bounded host-memory tier, in process memory or in shared-memory files.

It is a function, named as one: it returns one of two classes. ``host_tier(capacity_bytes)`` keeps
versions in process memory
(:class:`~asymstore.tiers.memory.process.MemoryTier`); they die with the process.
``host_tier(capacity_bytes, path=...)`` (for example ``/dev/shm/asym-job42``)
keeps them as files on a tmpfs in the same layout as a ``LocalTier``
(:class:`~asymstore.tiers.memory.shm.ShmTier`), so a training process that was
killed can be restarted on the same node and restore without touching disk.
Both are :class:`~asymstore.tiers.memory.capacity.BoundedTier` instances: the
bytes held never exceed ``capacity_bytes``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from asymstore.tiers.memory.capacity import BackPressure, BoundedTier
from asymstore.tiers.memory.process import MemoryTier
from asymstore.tiers.memory.shm import ShmTier


def host_tier(capacity_bytes: int = 2 << 30, *, path: str | os.PathLike[str] | None = None,
              name: str | None = None, keep_last: int | None = None, policy: BackPressure = "wait",
              wait_timeout_s: float | None = None, pin: bool | None = None) -> BoundedTier:
    """Return a bounded host-memory tier: shared-memory files under ``path``, else process memory.

    Args:
        capacity_bytes: most bytes held at once (committed plus in flight).
        path: a tmpfs directory for shared-memory files; None keeps versions
            in process memory.
        name: the tier's name in reports.
        keep_last: this tier's retention; None uses the store's.
        policy: back-pressure when full: ``"wait"`` for room, or ``"skip"`` the
            new version (:class:`~asymstore.errors.SnapshotSkippedError`).
        wait_timeout_s: longest wait under ``"wait"`` (None: no limit), then CapacityError.
        pin: page-lock the memory pool's buffers; None pins when CUDA is
            available (process memory only: shared-memory files are not pooled).

    Raises:
        ValueError: ``capacity_bytes`` is not positive, or ``policy`` is not a back-pressure mode.
    """
    if path is None:
        return MemoryTier(capacity_bytes, name=name, keep_last=keep_last, policy=policy,
                          wait_timeout_s=wait_timeout_s, pin=pin)
    return ShmTier(capacity_bytes, path=path, name=name, keep_last=keep_last, policy=policy,
                   wait_timeout_s=wait_timeout_s)


def HostTier(*args: Any, **kwargs: Any) -> BoundedTier:
    """Deprecated alias of :func:`host_tier` (it was never a class); goes in the next release."""
    warnings.warn("asymstore.HostTier is deprecated and goes in the next release: use asymstore.host_tier "
                  "(a factory returning a MemoryTier or a ShmTier)", DeprecationWarning, stacklevel=2)
    return host_tier(*args, **kwargs)
