"""The deferred checkpointer a framework callback drives.

A callback builds its :class:`asymcheck.Checkpointer` when training starts (when the framework has
made the optimizer) and takes each version's small state (RNG, schedulers, the framework's loop
state) not when the step returns but at the first event after the step's loop body, through
:meth:`asymcheck.Checkpointer.mark`, once per step. After a resume it puts the version's RNG
states back at the framework's own point (the framework's new loader iterator drew from them
first). :class:`DeferredCheckpointer` keeps that bookkeeping once for every callback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from typing import Generic, TypeVar

from asymcheck.checkpointer import Checkpointer
from asymcheck.integrations.rng import HeldRng

__all__ = ["DeferredCheckpointer"]

C = TypeVar("C", bound=Checkpointer)


class DeferredCheckpointer(Generic[C]):
    """A callback's Checkpointer, made when training starts, with its once-per-step mark and held RNG states.

    Attributes:
        checkpointer: the Checkpointer of the running (or last) training, None before.
        rng: the version's RNG states held after a resume, to put back at the framework's point.
    """

    def __init__(self) -> None:
        """No Checkpointer yet."""
        self.checkpointer: C | None = None
        self.rng = HeldRng()
        self._marked: Hashable = None

    def start(self, checkpointer: C, marked: Hashable = None) -> C:
        """Use ``checkpointer`` for this training; ``marked`` is the step whose small state is taken already."""
        self.checkpointer = checkpointer
        self.rng.drop()
        self._marked = marked
        return checkpointer

    def set_marked(self, marked: Hashable) -> None:
        """The small state of ``marked`` is taken already (after a resume: the version's step)."""
        self._marked = marked

    def due(self, step: Hashable) -> bool:
        """Whether ``step``'s small state is still to take (then it counts as taken): once per step."""
        if self.checkpointer is None or self._marked == step:
            return False
        self._marked = step
        return True

    def mark(self, step: Hashable) -> bool:
        """Take the open version's small state now, once per ``step``; whether it was taken now."""
        if not self.due(step):
            return False
        assert self.checkpointer is not None
        self.checkpointer.mark()
        return True

    def stop_stale(self) -> None:
        """A previous training raised: commit what it sealed, seal nothing more, forget it."""
        stale, self.checkpointer = self.checkpointer, None
        if stale is not None:
            stale.save_on_close = False
            with contextlib.suppress(Exception):
                stale.close()
