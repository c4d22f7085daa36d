"""Pacing: keep what checkpointing costs the training step within a budget (``max_overhead``).

On a busy host the copies and writes compete with training for cores and memory bandwidth, which
shows only in the step time. So the :class:`Pacer` measures it: after ``first_probe`` checkpointed
steps, and every ``probe_every`` after, it takes no version for ``probe_steps`` steps (the quiet
baseline); the overhead is the mean iteration since the previous probe over the median quiet one,
minus one; the next interval is the smallest ``k`` with ``k0 · overhead(k0) / k`` within the budget
(at most ``max_interval``). Paced steps take no version, so a crash loses at most ``interval`` steps.

Guide: ``docs/guides/checkpointer.md`` (Pacing).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_SETTLE_STEPS = 5  # the first iterations (allocations, planning) say nothing about the steady cost


@dataclass(frozen=True)
class PaceReport:
    """What pacing measured and decided.

    Attributes:
        budget: the ``max_overhead`` (None: pacing off).
        interval: a version is taken every ``interval`` steps now.
        overhead: the overhead measured at the last probe (None before the first).
        baseline_s: the median quiet iteration time (None before the first probe).
        paced_steps: steps that took no version because of the interval.
        probe_steps: steps that took no version to measure the baseline.
        reason: why the interval is what it is.
    """

    budget: float | None
    interval: int
    overhead: float | None
    baseline_s: float | None
    paced_steps: int
    probe_steps: int
    reason: str


class Pacer:
    """Decides, step by step, whether the Checkpointer takes a version (see the module docstring).

    Args:
        max_overhead: the budget, as a fraction of the quiet step time (0.05
            is 5%); None takes a version at every step, unmeasured.
        first_probe: checkpointed steps before the first measurement.
        probe_every: steps between measurements.
        probe_steps: steps without a version per measurement (at least 2).
        max_interval: the longest interval pacing may choose.
    """

    def __init__(self, max_overhead: float | None, *, first_probe: int = 50, probe_every: int = 200,
                 probe_steps: int = 3, max_interval: int = 64) -> None:
        """Configure; nothing is measured yet."""
        if max_overhead is not None and not max_overhead > 0:
            raise ValueError("max_overhead must be > 0 (or None to turn pacing off)")
        if probe_steps < 2 or first_probe < 1 or probe_every < probe_steps or max_interval < 1:
            raise ValueError("pacing needs probe_steps >= 2, first_probe >= 1, probe_every >= probe_steps "
                             "and max_interval >= 1")
        self.budget = max_overhead
        self.first_probe = first_probe
        self.probe_every = probe_every
        self.probe_steps = probe_steps
        self.max_interval = max_interval
        self.interval = 1
        self.overhead: float | None = None
        self.reason = "pacing off" if max_overhead is None else "not measured yet"
        self._quiet: deque[float] = deque(maxlen=3 * probe_steps)
        self._loaded: list[float] = []
        self._next_probe = first_probe
        self._probing = 0  # steps of the current probe taken so far
        self._since_version = 0  # steps since the last version was taken
        self._taken_last = False  # whether the iteration now running has a version open
        self._open_before = False  # whether the iteration before it had one
        self._paced = 0
        self._probed = 0
        self._steps = 0

    @property
    def baseline_s(self) -> float | None:
        """The median quiet iteration time measured so far."""
        return statistics.median(self._quiet) if self._quiet else None

    def iteration(self, seconds: float) -> None:
        """Record the iteration that just ended (called once per optimizer step, before ``take``)."""
        if self.budget is None or seconds <= 0:
            return
        if self._probing >= 2 and not self._taken_last and not self._open_before:
            self._quiet.append(seconds)  # no version open in it or the one before: training alone
        elif not self._probing and self._steps > _SETTLE_STEPS:
            self._loaded.append(seconds)

    def take(self, step: int) -> bool:
        """Whether to take a version at ``step`` (the Checkpointer's ``every`` already agreed)."""
        self._open_before, self._taken_last = self._taken_last, False
        if self.budget is None:
            self._taken_last = True
            return True
        self._steps += 1
        if self._probing or self._steps > self._next_probe:
            self._probing += 1
            self._probed += 1
            if self._probing > self.probe_steps:
                self._probing = 0
                self._decide()
                self._next_probe = self._steps + self.probe_every
            else:
                return False
        self._since_version += 1
        if self._since_version < self.interval:
            self._paced += 1
            return False
        self._since_version = 0
        self._taken_last = True
        return True

    def _decide(self) -> None:
        base = self.baseline_s
        if base is None or not self._loaded:
            self.reason = "no quiet iteration measured; interval kept"
            return
        loaded = statistics.fmean(self._loaded[-self.probe_every:])
        self._loaded.clear()
        self.overhead = max(0.0, loaded / base - 1.0)
        assert self.budget is not None
        per_version = self.overhead * self.interval  # the overhead one version per step would cost
        wanted = min(self.max_interval, max(1, math.ceil(per_version / self.budget - 1e-9)))
        if wanted != self.interval:
            logger.info("pacing: step overhead %.1f%% at one version every %d step(s) (budget %.1f%%): "
                        "now every %d", 100 * self.overhead, self.interval, 100 * self.budget, wanted)
        if wanted == self.max_interval and per_version / wanted > self.budget:
            self.reason = (f"overhead {per_version:.1%} per version-per-step exceeds the budget even at the "
                           f"longest interval ({self.max_interval})")
        elif wanted > 1:
            self.reason = (f"overhead {self.overhead:.1%} at every {self.interval} step(s) over a budget of "
                           f"{self.budget:.1%}: one version every {wanted} steps")
        else:
            self.reason = f"overhead {self.overhead:.1%} within the budget of {self.budget:.1%}"
        self.interval = wanted
        self._since_version = self.interval  # take the next version right after the probe

    def report(self) -> PaceReport:
        """What was measured and decided so far."""
        return PaceReport(self.budget, self.interval, self.overhead, self.baseline_s, self._paced,
                          self._probed, self.reason)
