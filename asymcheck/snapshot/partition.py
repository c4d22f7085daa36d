"""The asymmetric partition planner: pure, no torch, no I/O.

The flat state of a step (an :class:`Extent` per tensor, bytes end to end) is copied during the
next iteration, in the idle *windows* between its hook events. :class:`WindowRecorder` turns
events into windows with an injected :class:`Clock`; :class:`Planner` keeps recent windows; and
:func:`plan_partitions` cuts the state into partitions sized ``r_i = R * t_i / T`` (``t_i`` the
window of the event that issues partition ``i``, ``T`` their sum), on element or tensor boundaries,
covering the state exactly once. That is the ``"asymmetric"`` :data:`Partitioning`; ``"uniform"``
and ``"step"`` are the schemes it is measured against (``benches/partitioning.py``).

The protocol the planner serves: docs/concepts/data-path.md.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

from asymcheck.errors import InvalidOptionError

FORWARD = "forward"
BACKWARD = "backward"
DRAIN = "drain"

Partitioning = Literal["asymmetric", "uniform", "step"]
"""How a version's copy is spread over the next iteration.

- ``"asymmetric"``: partitions sized to the measured idle windows, ``r_i = R * t_i / T``.
- ``"uniform"``: equal partitions, as many issued in forward as in backward (symmetric schemes).
- ``"step"``: everything copied at the step boundary, in the optimizer's step pre-hook (CheckFreq).
"""

PARTITIONINGS: tuple[Partitioning, ...] = get_args(Partitioning)
"""Every :data:`Partitioning`, the default first: the values ``Checkpointer(partitioning=...)`` takes."""


def check_partitioning(value: object) -> Partitioning:
    """Return ``value`` as a :data:`Partitioning`.

    Raises:
        InvalidOptionError: it is not one of :data:`PARTITIONINGS`.
    """
    for mode in PARTITIONINGS:
        if value == mode and isinstance(value, str):
            return mode
    raise InvalidOptionError(f"partitioning must be one of {', '.join(map(repr, PARTITIONINGS))}, got {value!r}")


@dataclass(frozen=True)
class Extent:
    """One tensor of the flat state.

    Attributes:
        nbytes: its size in bytes.
        itemsize: bytes per element; boundaries inside it are multiples of this.
        splittable: False for tensors that must be copied whole (not contiguous).
    """

    nbytes: int
    itemsize: int = 1
    splittable: bool = True


@dataclass(frozen=True)
class Span:
    """The bytes ``[start, stop)`` of tensor number ``tensor`` of the flat state."""

    tensor: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Bytes covered."""
        return self.stop - self.start


@dataclass(frozen=True)
class Window:
    """An idle window of one iteration.

    Attributes:
        event: ordinal, within the iteration, of the hook event that opens it.
        phase: ``"forward"`` or ``"backward"``, the kind of that event.
        seconds: its length.
    """

    event: int
    phase: str
    seconds: float


@dataclass(frozen=True)
class Partition:
    """A byte range of the flat state, copied as one unit.

    Attributes:
        index: position in the plan.
        event: ordinal of the hook event that issues it; None: the drain does.
        phase: ``"forward"``, ``"backward"`` or ``"drain"``.
        start: first byte in the flat state.
        stop: one past the last byte.
        spans: the same range, cut at tensor boundaries.
        seconds: the window it was sized for (0 for the drain).
    """

    index: int
    event: int | None
    phase: str
    start: int
    stop: int
    spans: tuple[Span, ...]
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes covered."""
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    """How one version is copied: partitions in issue order, covering the state once.

    Attributes:
        total_bytes: ``R``, the bytes of the flat state.
        partitions: in flat-byte order, which is also issue order.
        windows: the window profile the plan was sized from (empty while warming up).
        warm: False for the warm-up plan (one drain partition, made before any window was measured).
        generation: how many plans the planner made before this one.
        partitioning: the :data:`Partitioning` it was made for.
    """

    total_bytes: int
    partitions: tuple[Partition, ...]
    windows: tuple[Window, ...] = ()
    warm: bool = False
    generation: int = 0
    partitioning: Partitioning = "asymmetric"
    _by_event: dict[int, Partition] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_event = {p.event: p for p in self.partitions if p.event is not None}
        object.__setattr__(self, "_by_event", by_event)

    def for_event(self, ordinal: int) -> Partition | None:
        """Return the partition issued by hook event ``ordinal``, if any."""
        return self._by_event.get(ordinal)

    @property
    def window_seconds(self) -> float:
        """``T``: the sum of the windows the plan was sized from."""
        return sum(w.seconds for w in self.windows)

    def bytes_by_phase(self) -> dict[str, int]:
        """Bytes planned per phase (forward, backward, drain)."""
        out = {FORWARD: 0, BACKWARD: 0, DRAIN: 0}
        for part in self.partitions:
            out[part.phase] += part.nbytes
        return out

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able description."""
        return {
            "total_bytes": self.total_bytes,
            "partitioning": self.partitioning,
            "warm": self.warm,
            "generation": self.generation,
            "window_seconds": self.window_seconds,
            "bytes_by_phase": self.bytes_by_phase(),
            "partitions": [
                {"index": p.index, "event": p.event, "phase": p.phase, "start": p.start,
                 "stop": p.stop, "seconds": p.seconds}
                for p in self.partitions
            ],
        }


def offsets_of(extents: Sequence[Extent]) -> list[int]:
    """Return the flat byte offset of every extent, plus the total at the end."""
    out = [0]
    for ext in extents:
        if ext.nbytes < 0 or ext.itemsize < 1 or ext.nbytes % ext.itemsize:
            raise ValueError(f"bad extent {ext}")
        out.append(out[-1] + ext.nbytes)
    return out


def spans_between(extents: Sequence[Extent], offsets: Sequence[int], start: int, stop: int) -> tuple[Span, ...]:
    """Cut the flat range ``[start, stop)`` at tensor boundaries (empty tensors have no span)."""
    spans = []
    for i in range(len(extents)):
        lo, hi = offsets[i], offsets[i + 1]
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            spans.append(Span(i, a - lo, b - lo))
    return tuple(spans)


def _snap(extents: Sequence[Extent], offsets: Sequence[int], target: int) -> int:
    """Move a flat byte offset onto the nearest legal boundary at or near it."""
    total = offsets[-1]
    if target <= 0:
        return 0
    if target >= total:
        return total
    lo_i, hi_i = 0, len(extents) - 1
    while lo_i < hi_i:  # last extent whose offset <= target
        mid = (lo_i + hi_i + 1) // 2
        if offsets[mid] <= target:
            lo_i = mid
        else:
            hi_i = mid - 1
    ext, base = extents[lo_i], offsets[lo_i]
    if not ext.splittable:
        return base if target - base < ext.nbytes / 2 else base + ext.nbytes
    return base + (target - base) // ext.itemsize * ext.itemsize


def group_windows(windows: Sequence[Window], max_groups: int) -> list[Window]:
    """Merge consecutive windows of one phase until each holds about ``T / max_groups``.

    The merged window is issued by its first event and lasts the sum of its
    members. A phase change always starts a new group, so ``max_groups`` is
    a soft limit.
    """
    total = sum(w.seconds for w in windows)
    if not windows or total <= 0:
        return []
    target = total / max(1, max_groups)
    groups: list[Window] = []
    current: Window | None = None
    for w in windows:
        if current is not None and (w.phase != current.phase or current.seconds >= target):
            groups.append(current)
            current = None
        if current is None:
            current = Window(w.event, w.phase, w.seconds)
        else:
            current = Window(current.event, current.phase, current.seconds + w.seconds)
    if current is not None:
        groups.append(current)
    return groups


def drain_plan(extents: Sequence[Extent], generation: int = 0, partitioning: Partitioning = "asymmetric", *,
               windows: Sequence[Window] = ()) -> Plan:
    """Return a plan that copies the whole state at the drain (the step pre-hook).

    Args:
        extents: the flat state, in order.
        generation: the plan's number, for inspection.
        partitioning: the mode it is made for.
        windows: the measured windows, if any: the plan is then warm (the ``"step"`` mode's plan);
            without them it is the warm-up plan of every mode.
    """
    offsets = offsets_of(extents)
    part = Partition(0, None, DRAIN, 0, offsets[-1], spans_between(extents, offsets, 0, offsets[-1]))
    return Plan(offsets[-1], (part,), tuple(windows), bool(windows), generation, partitioning)


def spread_events(windows: Sequence[Window], count: int) -> list[Window]:
    """Choose ``count`` issuing events the symmetric way, whatever the windows' lengths.

    As many events in the forward pass as in the backward pass (forward takes
    the odd one; a pass with too few events leaves its share to the other),
    spread evenly by ordinal within each pass, the first event of each pass
    included. Each returned window is issued by its event and lasts until the
    next chosen event (the last one until the end of the iteration).
    """
    fwd = [w for w in windows if w.phase == FORWARD]
    bwd = [w for w in windows if w.phase == BACKWARD]
    want_f = (count + 1) // 2 if fwd and bwd else count
    n_b = min(len(bwd), count - min(len(fwd), want_f))
    n_f = min(len(fwd), count - n_b)
    chosen = sorted([ws[j * len(ws) // n].event for ws, n in ((fwd, n_f), (bwd, n_b)) if n for j in range(n)])
    out = []
    for i, event in enumerate(chosen):
        until = chosen[i + 1] if i + 1 < len(chosen) else None
        members = [w for w in windows if w.event >= event and (until is None or w.event < until)]
        out.append(Window(event, members[0].phase, sum(w.seconds for w in members)))  # members[0]: its own
    return out


def _cut(extents: Sequence[Extent], offsets: Sequence[int], groups: Sequence[Window], weights: Sequence[float],
         min_bytes: int) -> tuple[Partition, ...]:
    """Cut the flat state into one partition per group, sized by ``weights``, merging those under ``min_bytes``.

    Partitions still smaller than ``min_bytes`` after the cut are merged into
    the one before them (issued earlier), the first into the one after it.
    """
    total = offsets[-1]
    whole = sum(weights)
    cuts: list[tuple[Window, int, int]] = []
    elapsed = 0.0
    prev = 0
    for i, (g, weight) in enumerate(zip(groups, weights, strict=True)):
        elapsed += weight
        stop = total if i == len(groups) - 1 else max(prev, _snap(extents, offsets, round(total * elapsed / whole)))
        cuts.append((g, prev, stop))
        prev = stop
    merged: list[tuple[Window, int, int]] = []
    for g, start, stop in cuts:
        if merged and stop - start < min_bytes:
            mg, mstart, _ = merged[-1]
            merged[-1] = (Window(mg.event, mg.phase, mg.seconds + g.seconds), mstart, stop)
        else:
            merged.append((g, start, stop))
    if len(merged) > 1 and merged[0][2] - merged[0][1] < min_bytes:
        (g0, s0, _), (g1, _, e1) = merged[0], merged[1]
        merged[0:2] = [(Window(g0.event, g0.phase, g0.seconds + g1.seconds), s0, e1)]
    return tuple(
        Partition(i, g.event, g.phase, start, stop, spans_between(extents, offsets, start, stop), g.seconds)
        for i, (g, start, stop) in enumerate(merged)
    )


def plan_partitions(extents: Sequence[Extent], windows: Sequence[Window], *,
                    partitioning: Partitioning = "asymmetric", max_partitions: int = 16, min_bytes: int = 1 << 20,
                    generation: int = 0) -> Plan:
    """Cut the flat state into partitions issued by the hook events of one iteration.

    A pure function of the layout, the measured windows and the mode. At most
    ``n = min(max_partitions, R // min_bytes)`` partitions (at least one):

    - ``"asymmetric"``: windows are first grouped (consecutive, same phase)
      into about ``n`` groups; partition ``i`` then gets ``R * t_i / T``
      bytes, issued by the first event of group ``i``.
    - ``"uniform"``: ``n`` events chosen by :func:`spread_events` (as many in
      forward as in backward, evenly spread by ordinal) each issue ``R / n``
      bytes, whatever the windows' lengths.
    - ``"step"``: one partition, the whole state, copied by the drain (the
      step pre-hook); windows are kept for inspection only.

    Boundaries are rounded to legal ones (element boundaries, whole
    unsplittable tensors), so sizes are equal only up to that granularity;
    partitions still smaller than ``min_bytes`` are merged into the one
    before them (issued earlier), the first into the one after it.

    Args:
        extents: the flat state, in order.
        windows: one iteration's windows in event order.
        partitioning: the mode.
        max_partitions: soft limit on the number of partitions.
        min_bytes: the smallest partition worth a separate copy.
        generation: the plan's number, for inspection.

    Returns:
        A plan whose partitions cover every byte exactly once; the warm-up
        (drain-only) plan when there are no windows (for ``"asymmetric"``:
        no window longer than zero).

    Raises:
        InvalidOptionError: ``partitioning`` is not a :data:`Partitioning`.
    """
    mode = check_partitioning(partitioning)
    offsets = offsets_of(extents)
    total = offsets[-1]
    count = max(1, min(max_partitions, total // max(1, min_bytes)))
    if mode == "step" or not windows:
        return drain_plan(extents, generation, mode, windows=windows if mode == "step" else ())
    if mode == "uniform":
        groups = spread_events(windows, count)
        weights = [1.0] * len(groups)
    else:  # fewer, larger groups when the state is small, so partitions come out near min_bytes or above
        groups = group_windows(windows, count)
        weights = [g.seconds for g in groups]
    if not groups or sum(weights) <= 0:
        return drain_plan(extents, generation, mode)
    return Plan(total, _cut(extents, offsets, groups, weights, min_bytes), tuple(windows), True, generation, mode)


class Clock(Protocol):
    """A timing source: marks now, and the seconds between two marks once known."""

    def mark(self) -> Any:
        """Return a mark of the current moment (of the stream that does the work)."""
        ...

    def seconds(self, start: Any, end: Any) -> float | None:
        """Return the seconds from ``start`` to ``end``, or None if not known yet."""
        ...


class PerfCounterClock:
    """Wall time of the calling thread: right for CPU training."""

    def mark(self) -> float:
        """Return ``time.perf_counter()``."""
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        """Return ``end - start``."""
        return max(0.0, end - start)


class WindowRecorder:
    """Records hook events of each iteration and turns them into windows.

    Call order per iteration: ``enter(phase)`` / ``leave()`` around each hook
    event, then ``finish()`` at the optimizer's step pre-hook, then
    ``start()`` after the step. The window of event ``i`` runs from leaving it
    to entering event ``i + 1`` (or the step pre-hook), so time spent inside
    the hooks themselves is not counted as idle.
    """

    def __init__(self, clock: Clock, max_pending: int = 4) -> None:
        """Record with ``clock``; keep at most ``max_pending`` unresolved iterations."""
        self.clock = clock
        self._events: list[tuple[str, Any, Any]] = []  # (phase, enter mark, leave mark)
        self._pending: deque[tuple[list[tuple[str, Any, Any]], Any]] = deque(maxlen=max_pending)

    @property
    def ordinal(self) -> int:
        """Number of events seen in the current iteration."""
        return len(self._events)

    def start(self) -> None:
        """Begin a new iteration (after the optimizer step)."""
        self._events = []

    def enter(self, phase: str) -> int:
        """Record entering a hook event; return its ordinal in the iteration."""
        self._events.append((phase, self.clock.mark(), None))
        return len(self._events) - 1

    def leave(self) -> None:
        """Record leaving the current hook event."""
        phase, entered, _ = self._events[-1]
        self._events[-1] = (phase, entered, self.clock.mark())

    def finish(self) -> list[list[Window]]:
        """End the iteration; return the windows of every iteration whose timing is now known."""
        if self._events:
            self._pending.append((self._events, self.clock.mark()))
        self._events = []
        done: list[list[Window]] = []
        while self._pending:
            windows = self._resolve(*self._pending[0])
            if windows is None:
                break
            done.append(windows)
            self._pending.popleft()
        return done

    def _resolve(self, events: list[tuple[str, Any, Any]], end: Any) -> list[Window] | None:
        windows = []
        for i, (phase, entered, left) in enumerate(events):
            nxt = events[i + 1][1] if i + 1 < len(events) else end
            seconds = self.clock.seconds(left if left is not None else entered, nxt)
            if seconds is None:
                return None
            windows.append(Window(i, phase, seconds))
        return windows


def _signature(windows: Sequence[Window]) -> tuple[str, ...]:
    return tuple(w.phase for w in windows)


class Planner:
    """Keeps recent window profiles and the current plan; re-plans on drift.

    Until ``warmup`` iterations were observed the plan is the drain-only one.
    The profile is the per-event median over the recent iterations that
    share the most common event sequence (an iteration stretched by a skipped
    optimizer step has a different sequence and is ignored). The plan is
    recomputed when the layout changes, or when the profile drifts: its
    events differ, or the windows moved by more than ``tolerance`` of ``T``
    (sum of absolute differences).

    Only ``"asymmetric"`` plans depend on the windows' lengths: a
    ``"uniform"`` plan is re-made when the event sequence changes, a
    ``"step"`` plan only when the layout does.

    Args:
        warmup: iterations measured before the first sized plan.
        tolerance: relative drift that triggers a re-plan.
        history: iterations kept for the profile.
        max_partitions: soft limit on partitions per plan.
        min_bytes: the smallest partition worth a separate copy.
        partitioning: the :data:`Partitioning` of its plans.

    Raises:
        InvalidOptionError: ``partitioning`` is not a :data:`Partitioning`.
    """

    def __init__(self, *, warmup: int = 3, tolerance: float = 0.25, history: int = 5,
                 max_partitions: int = 16, min_bytes: int = 1 << 20,
                 partitioning: Partitioning = "asymmetric") -> None:
        """Configure; no plan exists before the first ``plan`` call."""
        if warmup < 1 or history < 1 or tolerance <= 0:
            raise ValueError("warmup and history must be >= 1 and tolerance > 0")
        self.partitioning = check_partitioning(partitioning)
        self.warmup = warmup
        self.tolerance = tolerance
        self.max_partitions = max_partitions
        self.min_bytes = min_bytes
        self._recent: deque[list[Window]] = deque(maxlen=history)
        self._observed = 0
        self._plan: Plan | None = None
        self._extents: tuple[Extent, ...] | None = None
        self.replans = 0

    @property
    def current(self) -> Plan | None:
        """The plan made by the last ``plan`` call."""
        return self._plan

    @property
    def observed(self) -> int:
        """Iterations observed so far."""
        return self._observed

    def observe(self, windows: Sequence[Window]) -> None:
        """Add one iteration's windows."""
        if windows:
            self._recent.append(list(windows))
            self._observed += 1

    def profile(self) -> list[Window]:
        """Return the per-event median windows of the most common recent event sequence."""
        if not self._recent:
            return []
        common, _ = Counter(_signature(w) for w in self._recent).most_common(1)[0]
        same = [w for w in self._recent if _signature(w) == common]
        return [Window(i, phase, statistics.median(ws[i].seconds for ws in same))
                for i, phase in enumerate(common)]

    def drifted(self, profile: Sequence[Window]) -> bool:
        """Whether ``profile`` differs from the current plan's by more than the tolerance."""
        plan = self._plan
        if plan is None or not plan.warm:
            return True
        if self.partitioning == "step":  # the whole state at the boundary, whatever the windows
            return False
        if _signature(profile) != _signature(plan.windows):
            return True
        if self.partitioning == "uniform":  # equal partitions: only the event sequence matters
            return False
        base = plan.window_seconds
        if base <= 0:
            return True
        moved = sum(abs(a.seconds - b.seconds) for a, b in zip(profile, plan.windows, strict=True))
        return moved / base > self.tolerance

    def plan(self, extents: Sequence[Extent]) -> Plan:
        """Return the plan for a version with this flat state, re-planning if needed."""
        layout = tuple(extents)
        warm = self._observed >= self.warmup
        profile = self.profile() if warm else []
        stale = self._plan is None or layout != self._extents
        if stale or (warm and self.drifted(profile)):
            generation = self.replans
            self.replans += 1
            self._extents = layout
            if warm and profile:
                self._plan = plan_partitions(layout, profile, partitioning=self.partitioning,
                                             max_partitions=self.max_partitions, min_bytes=self.min_bytes,
                                             generation=generation)
            else:
                self._plan = drain_plan(layout, generation, self.partitioning)
        assert self._plan is not None
        return self._plan
