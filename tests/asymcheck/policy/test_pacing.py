"""Pacing: the step-time budget decides how often a version is taken, measured against quiet steps."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from asymcheck.options import RetentionOptions
from asymcheck.policy.pacing import Pacer
from tests.support.asymcheck_train import equal_state, make_model, make_opt, open_ckpt, step_once, tensors_of


def simulate(pacer: Pacer, steps: int, cost: float, base: float = 1.0) -> list[bool]:
    """Each version taken makes the next iteration ``cost`` (a fraction of ``base``) slower."""
    taken = []
    for step in range(1, steps + 1):
        took = pacer.take(step)
        taken.append(took)
        pacer.iteration(base * (1.0 + (cost if took else 0.0)))
    return taken


def test_no_budget_takes_every_version() -> None:
    pacer = Pacer(None)
    assert all(simulate(pacer, 300, cost=0.5))
    assert pacer.report().reason == "pacing off"


def test_an_expensive_version_is_taken_every_few_steps_to_meet_the_budget() -> None:
    pacer = Pacer(0.05, first_probe=20, probe_every=40)
    taken = simulate(pacer, 20, cost=0.20)
    assert all(taken)  # every step before the first measurement
    taken = simulate(pacer, 100, cost=0.20)
    report = pacer.report()
    assert report.interval == 4  # 20% per version at every step -> every 4th step costs 5%
    assert report.baseline_s == pytest.approx(1.0)
    assert report.overhead == pytest.approx(0.05, abs=0.01)  # measured at the chosen interval by the 2nd probe
    assert report.paced_steps > 0 and report.probe_steps >= 3
    assert "every 4" in report.reason or "within" in report.reason
    gaps = [i for i, t in enumerate(taken) if t]
    assert max(b - a for a, b in itertools.pairwise(gaps)) <= 4 + 3  # at most a probe beside a gap


def test_the_interval_shrinks_back_when_versions_get_cheap() -> None:
    pacer = Pacer(0.05, first_probe=20, probe_every=40)
    simulate(pacer, 60, cost=0.30)
    assert pacer.interval == 6
    simulate(pacer, 200, cost=0.01)
    assert pacer.interval == 1
    assert "within the budget" in pacer.report().reason


def test_the_longest_interval_is_reported_when_the_budget_cannot_be_met() -> None:
    pacer = Pacer(0.01, first_probe=10, probe_every=20, max_interval=8)
    simulate(pacer, 40, cost=1.0)
    assert pacer.interval == 8
    assert "longest interval" in pacer.report().reason


def test_bad_budgets_are_refused() -> None:
    for bad in (0.0, -0.1):
        with pytest.raises(ValueError):
            Pacer(bad)


def test_a_paced_checkpointer_still_resumes_bit_exact_from_its_newest_version(tmp_path: Path) -> None:
    model = make_model()
    opt, sched = make_opt(model)
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, retention=RetentionOptions(keep_last=2)) as ckpt:
        for it in range(70):
            step_once(model, opt, it, sched)
        pacing = ckpt.stats().pacing
    assert pacing is not None and pacing.budget == 0.05 and pacing.probe_steps >= 3
    assert pacing.baseline_s is not None and pacing.overhead is not None
    state_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert ckpt.stats().host_bytes >= 2 * state_bytes  # two slots, each at least the flat state, reported
    final = tensors_of(model.state_dict())
    assert ckpt.final_versions is not None and max(next(iter(ckpt.final_versions.values()))) == 70  # close saved it
    model2 = make_model(seed=3)
    opt2, sched2 = make_opt(model2)
    with open_ckpt(model2, opt2, tmp_path, stateful={"sched": sched2},
                   retention=RetentionOptions(keep_last=2)) as ckpt2:
        assert ckpt2.resume() == 70
        equal_state(final, model2.state_dict())
