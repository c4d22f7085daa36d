"""What a failed background commit does to training: the failure budget.

A failed commit is logged, counted in ``stats()`` and its version abandoned; every later step's
version is the next attempt, so a storage outage heals by itself. Training stops
(:class:`asymcheck.errors.NoDurableVersionError` at the next optimizer step) only when commits failed
and the newest durable version is older than the budget (``max_steps_without_durable`` or
``max_seconds_without_durable``); ``on_error="raise"`` stops at the first failure, ``"log"`` never.
A commit every rank refused for the root's layout
(:class:`~asymstore.errors.LayoutTakeoverError` with ``every_rank``) stops training at once on every
rank; other layout errors count against the budget.

Guide: ``docs/guides/checkpointer.md`` (When commits fail).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from asymcheck.errors import CommitFailedError, NoDurableVersionError
from asymcheck.stats import StatsRecorder
from asymstore.errors import LayoutTakeoverError

logger = logging.getLogger(__name__)

OnError = Literal["budget", "raise", "log"]
ON_ERROR: tuple[OnError, ...] = ("budget", "raise", "log")


class FailureBudget:
    """Decides, at each step, whether commit failures must stop training.

    Args:
        stats: where commits and failures are counted.
        on_error: ``"budget"`` (default), ``"raise"`` or ``"log"``.
        max_steps: optimizer steps without a durable version tolerated after a failure (None: no limit).
        max_seconds: seconds without a durable version tolerated after a failure (None: no limit).
    """

    def __init__(self, stats: StatsRecorder, on_error: OnError, max_steps: int | None,
                 max_seconds: float | None) -> None:
        """Start the clock: the run's start counts as durable."""
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if max_steps is not None and max_steps < 1:
            raise ValueError("max_steps_without_durable must be >= 1 or None")
        if max_seconds is not None and max_seconds <= 0:
            raise ValueError("max_seconds_without_durable must be > 0 or None")
        self.stats = stats
        self.on_error = on_error
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.start_step = 0
        self.start_time = time.monotonic()

    def restart(self, step: int) -> None:
        """The run (re)starts at ``step``: it counts as durable."""
        self.start_step = step
        self.start_time = time.monotonic()

    def check(self, step: int, error: BaseException | None) -> None:
        """Raise if training must stop now; ``error`` is the newest failure not reported yet (or None).

        Raises:
            CommitFailedError: ``on_error="raise"`` and a commit failed, or ``"budget"`` and every rank's
                check refused it for the root's layout (``LayoutTakeoverError``: every later one would be too).
            NoDurableVersionError: ``on_error="budget"``, commits failed, and no
                version became durable within the budget.
        """
        if error is not None and (self.on_error == "raise" or (  # a refusal that never heals, met on every rank
                self.on_error == "budget" and isinstance(error, LayoutTakeoverError) and error.every_rank)):
            raise CommitFailedError(f"a background commit failed: {type(error).__name__}: {error}") from error
        if self.on_error != "budget":
            return
        with self.stats.lock:
            failing = self.stats.failures_since_durable
            durable_step = self.stats.last_committed
            durable_at = self.stats.last_committed_at
        if not failing:
            return
        base_step = max(self.start_step, durable_step if durable_step is not None else self.start_step)
        base_time = max(self.start_time, durable_at if durable_at is not None else self.start_time)
        steps, seconds = step - base_step, time.monotonic() - base_time
        over = []
        if self.max_steps is not None and steps > self.max_steps:
            over.append(f"{steps} steps > max_steps_without_durable={self.max_steps}")
        if self.max_seconds is not None and seconds > self.max_seconds:
            over.append(f"{seconds:.0f} s > max_seconds_without_durable={self.max_seconds:g}")
        if over:
            raise NoDurableVersionError(
                f"{failing} commit(s) failed and no version became durable for {' and '.join(over)}; "
                f"newest durable version: {durable_step}; last error: {self.stats.last_error}") from error

    def check_final(self) -> None:
        """At close: raise if the newest versions (the final one included) all failed (unless ``"log"``).

        Raises:
            CommitFailedError: the final version was not committed.
        """
        with self.stats.lock:
            failing = self.stats.failures_since_durable
        if failing and self.on_error != "log":
            raise CommitFailedError(f"the final version was not committed ({failing} failed commit(s) since the "
                                    f"newest durable version {self.stats.last_committed}): {self.stats.last_error}")
