"""The partition planner (asymmetric, uniform, step): pure, so tested with fake clocks and made-up windows."""

from __future__ import annotations

import random

import pytest

from asymcheck import InvalidOptionError
from asymcheck.snapshot.partition import (
    BACKWARD,
    DRAIN,
    FORWARD,
    PARTITIONINGS,
    Extent,
    Plan,
    Planner,
    Window,
    WindowRecorder,
    check_partitioning,
    drain_plan,
    group_windows,
    offsets_of,
    plan_partitions,
)
from asymstore import AsymstoreError


def covered_once(extents: list[Extent], plan: Plan) -> None:
    """Every byte of every tensor appears in exactly one span, and partitions tile [0, R)."""
    offsets = offsets_of(extents)
    assert plan.total_bytes == offsets[-1]
    pos = 0
    for part in plan.partitions:
        assert part.start == pos
        assert part.stop >= part.start
        assert sum(s.nbytes for s in part.spans) == part.nbytes
        pos = part.stop
    assert pos == plan.total_bytes
    per_tensor: list[list[tuple[int, int]]] = [[] for _ in extents]
    for part in plan.partitions:
        for span in part.spans:
            assert span.stop > span.start  # no empty spans
            per_tensor[span.tensor].append((span.start, span.stop))
    for ext, spans in zip(extents, per_tensor, strict=True):  # the spans of a tensor tile [0, nbytes)
        pos = 0
        for start, stop in sorted(spans):
            assert start == pos, "gap or overlap"
            pos = stop
        assert pos == ext.nbytes


def windows(*spec: tuple[str, float]) -> list[Window]:
    return [Window(i, phase, sec) for i, (phase, sec) in enumerate(spec)]


def test_sizes_are_proportional_to_windows_over_one_total() -> None:
    extents = [Extent(1000, 1), Extent(2000, 1), Extent(1000, 1)]  # R = 4000
    ws = windows((FORWARD, 1.0), (FORWARD, 1.0), (BACKWARD, 2.0), (BACKWARD, 4.0))  # T = 8
    plan = plan_partitions(extents, ws, max_partitions=64, min_bytes=1)
    covered_once(extents, plan)
    assert [p.nbytes for p in plan.partitions] == [500, 500, 1000, 2000]
    assert [p.event for p in plan.partitions] == [0, 1, 2, 3]
    by_phase = plan.bytes_by_phase()
    assert by_phase[FORWARD] + by_phase[BACKWARD] == 4000  # one shared R, not R per phase
    assert by_phase[BACKWARD] == 3 * by_phase[FORWARD]
    assert by_phase[DRAIN] == 0
    assert plan.window_seconds == pytest.approx(8.0)


def test_backward_partitions_come_out_larger() -> None:
    extents = [Extent(4 * 10_000, 4) for _ in range(8)]
    ws = windows(*[(FORWARD, 0.010)] * 6, *[(BACKWARD, 0.020)] * 6)
    plan = plan_partitions(extents, ws, max_partitions=64, min_bytes=1)
    covered_once(extents, plan)
    fwd = [p.nbytes for p in plan.partitions if p.phase == FORWARD]
    bwd = [p.nbytes for p in plan.partitions if p.phase == BACKWARD]
    assert min(bwd) > max(fwd)
    assert sum(bwd) == pytest.approx(2 * sum(fwd), rel=0.01)


def test_boundaries_fall_on_elements_and_unsplittable_tensors_stay_whole() -> None:
    extents = [Extent(4 * 999, 4), Extent(8 * 333, 8, splittable=False), Extent(2 * 1001, 2), Extent(0, 4)]
    offsets = offsets_of(extents)
    rng = random.Random(0)
    for _ in range(50):
        ws = windows(*[(rng.choice([FORWARD, BACKWARD]), rng.uniform(0.001, 1)) for _ in range(rng.randint(1, 30))])
        plan = plan_partitions(extents, ws, max_partitions=rng.randint(1, 20), min_bytes=rng.choice([1, 64, 4096]))
        covered_once(extents, plan)
        for part in plan.partitions:
            for span in part.spans:
                ext = extents[span.tensor]
                assert span.start % ext.itemsize == 0 and span.stop % ext.itemsize == 0
                if not ext.splittable:
                    assert (span.start, span.stop) == (0, ext.nbytes)
        assert plan.partitions[-1].stop == offsets[-1]


def test_random_layouts_are_covered_exactly_once() -> None:
    rng = random.Random(1)
    for _ in range(100):
        extents = []
        for _ in range(rng.randint(1, 12)):
            itemsize = rng.choice([1, 2, 4, 8])
            extents.append(Extent(itemsize * rng.randint(0, 300), itemsize, rng.random() > 0.2))
        ws = windows(*[(rng.choice([FORWARD, BACKWARD]), rng.uniform(0, 1)) for _ in range(rng.randint(0, 25))])
        plan = plan_partitions(extents, ws, max_partitions=rng.randint(1, 20), min_bytes=rng.randint(1, 500))
        covered_once(extents, plan)


def test_no_windows_gives_the_drain_plan() -> None:
    extents = [Extent(100, 4), Extent(40, 8)]
    for plan in (plan_partitions(extents, []), plan_partitions(extents, windows((FORWARD, 0.0))),
                 drain_plan(extents)):
        covered_once(extents, plan)
        assert len(plan.partitions) == 1 and plan.partitions[0].phase == DRAIN
        assert plan.partitions[0].event is None and not plan.warm
        assert plan.for_event(0) is None


def test_small_partitions_merge_into_the_earlier_one() -> None:
    extents = [Extent(10_000, 1)]
    ws = windows((FORWARD, 1.0), (FORWARD, 0.01), (BACKWARD, 1.0))
    plan = plan_partitions(extents, ws, max_partitions=64, min_bytes=1000)
    covered_once(extents, plan)
    assert [p.event for p in plan.partitions] == [0, 2]  # the 50-byte partition of event 1 joined event 0's
    assert plan.partitions[0].nbytes == pytest.approx(5025, abs=2)


def test_window_grouping_respects_phase_and_limit() -> None:
    ws = windows(*[(FORWARD, 1.0)] * 10, *[(BACKWARD, 1.0)] * 10)
    groups = group_windows(ws, 4)
    assert [g.phase for g in groups] == [FORWARD, FORWARD, BACKWARD, BACKWARD]
    assert sum(g.seconds for g in groups) == pytest.approx(20.0)
    assert [g.event for g in groups] == [0, 5, 10, 15]


class FakeClock:
    """A clock the test advances by hand; marks resolve only once ``ready`` is set (like CUDA events)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.ready = True

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float | None:
        return end - start if self.ready else None


def test_recorder_measures_windows_without_the_hooks_own_time() -> None:
    clock = FakeClock()
    rec = WindowRecorder(clock)
    rec.start()
    clock.now = 1.0
    for phase, gap, inside in [(FORWARD, 0.5, 0.1), (FORWARD, 1.0, 0.2), (BACKWARD, 2.0, 0.0)]:
        assert rec.enter(phase) == rec.ordinal - 1
        clock.now += inside  # time spent inside the hook (copying) is not idle
        rec.leave()
        clock.now += gap
    [ws] = rec.finish()
    assert [(w.event, w.phase) for w in ws] == [(0, FORWARD), (1, FORWARD), (2, BACKWARD)]
    assert [w.seconds for w in ws] == pytest.approx([0.5, 1.0, 2.0])


def test_recorder_waits_for_deferred_timings() -> None:
    clock = FakeClock()
    clock.ready = False
    rec = WindowRecorder(clock)
    for _ in range(2):
        rec.start()
        rec.enter(FORWARD)
        rec.leave()
        clock.now += 1.0
        assert rec.finish() == []  # GPU timings not done yet
    clock.ready = True
    rec.start()
    rec.enter(BACKWARD)
    rec.leave()
    clock.now += 2.0
    done = rec.finish()
    assert len(done) == 3
    assert [w.seconds for ws in done for w in ws] == pytest.approx([1.0, 1.0, 2.0])


def test_planner_warms_up_then_sizes_then_replans_on_drift() -> None:
    extents = [Extent(4 << 20, 4), Extent(4 << 20, 4)]
    planner = Planner(warmup=3, tolerance=0.25, history=3, min_bytes=1)
    assert not planner.plan(extents).warm
    base = windows((FORWARD, 0.1), (FORWARD, 0.1), (BACKWARD, 0.2), (BACKWARD, 0.2))
    for _ in range(2):
        planner.observe(base)
        assert not planner.plan(extents).warm  # still warming up
    planner.observe(base)
    warm = planner.plan(extents)
    assert warm.warm and len(warm.partitions) == 4
    covered_once(extents, warm)
    # a little noise: same plan object
    planner.observe(windows((FORWARD, 0.105), (FORWARD, 0.1), (BACKWARD, 0.19), (BACKWARD, 0.2)))
    assert planner.plan(extents) is warm
    # a stretched iteration (skipped optimizer step: twice the events) does not count
    planner.observe(base + [Window(i + 4, w.phase, w.seconds) for i, w in enumerate(base)])
    assert planner.plan(extents) is warm
    # the forward pass becomes much slower: re-plan
    slow = windows((FORWARD, 0.4), (FORWARD, 0.4), (BACKWARD, 0.2), (BACKWARD, 0.2))
    for _ in range(3):
        planner.observe(slow)
    replanned = planner.plan(extents)
    assert replanned is not warm and replanned.generation > warm.generation
    assert replanned.bytes_by_phase()[FORWARD] > replanned.bytes_by_phase()[BACKWARD]
    covered_once(extents, replanned)
    # a parameter added: the layout changed, so a new plan over the new total
    bigger = [*extents, Extent(4 << 20, 4)]
    grown = planner.plan(bigger)
    assert grown.total_bytes == 12 << 20
    covered_once(bigger, grown)


def test_plan_to_dict_is_json() -> None:
    import json

    plan = plan_partitions([Extent(4096, 4)], windows((FORWARD, 1.0), (BACKWARD, 3.0)), min_bytes=1)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["total_bytes"] == 4096 and data["bytes_by_phase"] == {FORWARD: 1024, BACKWARD: 3072, DRAIN: 0}


# -- the partitioning modes: asymmetric (above), uniform, step -----------------------------------


def cuts_near_ideal(extents: list[Extent], plan: Plan) -> None:
    """Every boundary is the ideal ``R * i / n``, moved down by less than the itemsize of the tensor it cuts."""
    offsets = offsets_of(extents)
    n = len(plan.partitions)
    for i, part in enumerate(plan.partitions[:-1], start=1):
        ideal = round(plan.total_bytes * i / n)
        tensor = max(j for j in range(len(extents)) if offsets[j] <= ideal)
        assert ideal - extents[tensor].itemsize < part.stop <= ideal, (i, part.stop, ideal)


def test_uniform_cuts_equal_partitions_as_many_in_forward_as_in_backward() -> None:
    extents = [Extent(4 * 1000, 4), Extent(4 * 3000, 4), Extent(2 * 500, 2)]  # R = 17,000
    ws = windows(*[(FORWARD, 0.01)] * 6, *[(BACKWARD, 0.05)] * 10)  # backward windows 5x longer
    plan = plan_partitions(extents, ws, partitioning="uniform", max_partitions=8, min_bytes=1)
    covered_once(extents, plan)
    cuts_near_ideal(extents, plan)
    assert plan.partitioning == "uniform" and plan.warm
    sizes = [p.nbytes for p in plan.partitions]
    assert len(sizes) == 8 and max(sizes) - min(sizes) <= 2 * 4  # 17,000 / 8 = 2,125, within the fp32 granularity
    assert [p.phase for p in plan.partitions] == [FORWARD] * 4 + [BACKWARD] * 4
    assert [p.event for p in plan.partitions] == [0, 1, 3, 4, 6, 8, 11, 13]  # spread evenly by ordinal per pass
    assert plan.partitions[0].seconds == pytest.approx(0.01)  # event 0's own window, until event 1
    assert plan.partitions[-1].seconds == pytest.approx(0.05 * 3)  # events 13..15, to the end
    by_phase = plan.bytes_by_phase()
    assert abs(by_phase[FORWARD] - by_phase[BACKWARD]) <= 2 * 4 and by_phase[DRAIN] == 0
    # the windows' lengths do not matter, only their sequence
    flipped = windows(*[(FORWARD, 0.3)] * 6, *[(BACKWARD, 0.001)] * 10)
    again = plan_partitions(extents, flipped, partitioning="uniform", max_partitions=8, min_bytes=1)
    assert [(p.event, p.start, p.stop) for p in again.partitions] == [
        (p.event, p.start, p.stop) for p in plan.partitions]
    # while the asymmetric plan of the same windows puts most of the state in backward
    asym = plan_partitions(extents, ws, max_partitions=8, min_bytes=1).bytes_by_phase()
    assert asym[BACKWARD] > 3 * asym[FORWARD]


def test_uniform_gives_a_short_pass_all_it_has_and_the_rest_to_the_other() -> None:
    extents = [Extent(4 * 4000, 4)]
    one_forward = windows((FORWARD, 1.0), *[(BACKWARD, 1.0)] * 10)
    plan = plan_partitions(extents, one_forward, partitioning="uniform", max_partitions=8, min_bytes=1)
    covered_once(extents, plan)
    assert [p.phase for p in plan.partitions] == [FORWARD] + [BACKWARD] * 7
    assert {p.nbytes for p in plan.partitions} == {2000}
    only_backward = windows(*[(BACKWARD, 1.0)] * 5)  # a forward that is not a module call
    plan = plan_partitions(extents, only_backward, partitioning="uniform", max_partitions=8, min_bytes=1)
    covered_once(extents, plan)
    assert [p.event for p in plan.partitions] == [0, 1, 2, 3, 4]  # every event it has, never one twice
    assert {p.nbytes for p in plan.partitions} == {3200}
    # few bytes: n = R // min_bytes partitions, equal
    plan = plan_partitions(extents, one_forward, partitioning="uniform", max_partitions=16, min_bytes=8000)
    assert [(p.phase, p.nbytes) for p in plan.partitions] == [(FORWARD, 8000), (BACKWARD, 8000)]


def test_step_copies_the_whole_state_at_the_boundary() -> None:
    extents = [Extent(4 << 20, 4), Extent(2 << 20, 2)]
    ws = windows(*[(FORWARD, 0.1)] * 4, *[(BACKWARD, 0.2)] * 4)
    plan = plan_partitions(extents, ws, partitioning="step", min_bytes=1)
    covered_once(extents, plan)
    [part] = plan.partitions
    assert (part.phase, part.event, part.nbytes) == (DRAIN, None, 6 << 20)
    assert plan.warm and plan.partitioning == "step" and plan.windows == tuple(ws)
    assert all(plan.for_event(i) is None for i in range(len(ws)))  # no hook issues anything
    assert plan.bytes_by_phase() == {FORWARD: 0, BACKWARD: 0, DRAIN: 6 << 20}
    assert plan.to_dict()["partitioning"] == "step"


def test_every_mode_covers_random_layouts_exactly_once() -> None:
    rng = random.Random(2)
    for _ in range(100):
        extents = []
        for _ in range(rng.randint(1, 12)):
            itemsize = rng.choice([1, 2, 4, 8])
            extents.append(Extent(itemsize * rng.randint(0, 300), itemsize, rng.random() > 0.2))
        ws = windows(*[(rng.choice([FORWARD, BACKWARD]), rng.uniform(0, 1)) for _ in range(rng.randint(0, 25))])
        for mode in PARTITIONINGS:
            plan = plan_partitions(extents, ws, partitioning=mode, max_partitions=rng.randint(1, 20),
                                   min_bytes=rng.randint(1, 500))
            covered_once(extents, plan)
            assert plan.partitioning == mode
            events = [p.event for p in plan.partitions if p.event is not None]
            assert len(events) == len(set(events))  # one partition per issuing event


def test_unknown_partitioning_is_a_typed_error() -> None:
    for bad in ("blocks", "Uniform", None, 3):
        with pytest.raises(InvalidOptionError, match="partitioning must be one of 'asymmetric', 'uniform', 'step'"):
            plan_partitions([Extent(8, 4)], windows((FORWARD, 1.0)), partitioning=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError):
            Planner(partitioning=bad)  # type: ignore[arg-type]
    assert issubclass(InvalidOptionError, ValueError) and issubclass(InvalidOptionError, AsymstoreError)
    assert check_partitioning("uniform") == "uniform"


def test_uniform_and_step_planners_replan_only_when_what_they_depend_on_changes() -> None:
    extents = [Extent(4 << 20, 4), Extent(4 << 20, 4)]
    base = windows((FORWARD, 0.1), (FORWARD, 0.1), (BACKWARD, 0.2), (BACKWARD, 0.2))
    slow = windows((FORWARD, 0.4), (FORWARD, 0.4), (BACKWARD, 0.2), (BACKWARD, 0.2))
    longer = windows((FORWARD, 0.1), (FORWARD, 0.1), (BACKWARD, 0.2), (BACKWARD, 0.2), (BACKWARD, 0.2))
    for mode in ("uniform", "step"):
        planner = Planner(warmup=2, history=3, min_bytes=1, partitioning=mode)
        assert planner.partitioning == mode
        first = planner.plan(extents)
        assert not first.warm and first.partitioning == mode and len(first.partitions) == 1
        for _ in range(2):
            planner.observe(base)
        warm = planner.plan(extents)
        assert warm.warm and warm.partitioning == mode
        covered_once(extents, warm)
        assert len(warm.partitions) == (4 if mode == "uniform" else 1)
        for _ in range(3):  # the windows' lengths move far past the tolerance
            planner.observe(slow)
        assert planner.plan(extents) is warm
        for _ in range(3):  # an event more per iteration
            planner.observe(longer)
        if mode == "uniform":
            replanned = planner.plan(extents)
            assert replanned is not warm and len(replanned.windows) == 5
        else:
            assert planner.plan(extents) is warm
        bigger = [*extents, Extent(4 << 20, 4)]  # every mode follows the layout
        assert planner.plan(bigger).total_bytes == 12 << 20
