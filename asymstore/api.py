"""CheckpointStore: the store protocol the adapters (``asymcheck``) program against.

Both :class:`~asymstore.AsymStore` (one process's tiers) and
:class:`~asymstore.multirank.RankStore` (one rank's shard store of a
multi-rank checkpoint, which holds an ``AsymStore`` and adds the global
commit) satisfy it. It names only what the adapters use:

* ``open`` / ``close``: the adapter's store loop opens and closes it;
* ``adopt_many`` / ``abandon`` / ``commit``: a sealed version is staged from
  the adapter's host slots without a copy, committed, or dropped;
* ``restore``: resume (``into`` fills live tensors in place where the store
  supports it);
* ``versions`` / ``newest_step``: what the store holds.

Anything else (``reshard``, ``restored_global``, ``read_shard`` ...) belongs to
a concrete store, and an adapter that needs it checks for that class.
The protocol is ``runtime_checkable``: ``isinstance(x, CheckpointStore)``
tells a store from the other things an adapter accepts (tiers, a directory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

if TYPE_CHECKING:
    from asymstore.read.load import Into
    from asymstore.read.restore import Checkpoint
    from asymstore.store import CommitResult
    from asymstore.write.segments import TierStatus


@runtime_checkable
class CheckpointStore(Protocol):
    """A versioned checkpoint store, as the adapters use it (see the module docstring)."""

    async def open(self) -> Self:
        """Open the store (before any other call); return it."""
        ...

    async def close(self) -> None:
        """Wait for what the store still writes, then close it."""
        ...

    def versions(self) -> dict[str, list[int]]:
        """Committed steps per tier name, ascending."""
        ...

    @property
    def newest_step(self) -> int | None:
        """The newest committed step, or None."""
        ...

    @property
    def newest_persistent_step(self) -> int | None:
        """The newest step some persistent tier holds, or None."""
        ...

    async def flush(self, timeout_s: float | None = None) -> int | None:
        """Wait (at most ``timeout_s``) until a persistent tier holds the newest step; return the newest it holds."""
        ...

    def status(self) -> dict[str, TierStatus]:
        """Per tier: versions, lag, errors (see :meth:`asymstore.AsymStore.status`)."""
        ...

    async def adopt_many(self, step: int, tensors: Mapping[str, object], *,
                         release: Callable[[], None] | None = None) -> None:
        """Stage ``tensors`` for ``step`` without copying; ``release`` runs once the store is done with them."""
        ...

    def abandon(self, step: int) -> None:
        """Drop everything staged for an uncommitted ``step`` (adopted tensors are released)."""
        ...

    async def commit(self, step: int, meta: Mapping[str, Any] | None = None) -> CommitResult:
        """Commit ``step`` with its JSON ``meta``; return once it is durable."""
        ...

    async def restore(self, step: int | None = None, *, into: Into | None = None) -> Checkpoint:
        """Return the newest version that verifies (or ``step``), optionally read into ``into``."""
        ...


@runtime_checkable
class DropReportingStore(Protocol):
    """A store whose commit of a step involves others, who must hear when this process will not commit it.

    :class:`~asymstore.multirank.RankStore` is one: a rank that drops a version
    (an edit between steps, a version skipped under back-pressure) reports it,
    so the coordinator abandons that step's global commit at once instead of
    waiting for the rank until its timeout. The adapters check for it with
    ``isinstance``.
    """

    async def report_dropped(self, step: int, reason: str) -> None:
        """Say that ``step`` will not be committed by this process, and why."""
        ...
