"""resume(): fresh starts, corrupt newest versions, mismatched models; and the Checkpointer's typed errors."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asymcheck import (
    Checkpointer,
    CheckpointerStateError,
    CommitFailedError,
    NoDurableVersionError,
    StateMismatchError,
    StepConflictError,
    UnsupportedStateError,
)
from asymcheck.options import CommitOptions, FailureOptions, RetentionOptions
from asymstore import AsymStore, AsymstoreError, LocalTier, TierError
from tests.support.asymcheck_train import (
    corrupt_newest_segment,
    data,
    equal_state,
    make_model,
    make_opt,
    open_ckpt,
    read_versions,
    step_once,
    tensors_of,
    train,
)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    return tensors_of({"model": model.state_dict(), "opt": opt.state_dict()})


def test_resume_with_nothing_committed_is_a_fresh_start(tmp_path: Path) -> None:
    model = make_model()
    opt, sched = make_opt(model)
    before = snapshot(model, opt)
    with open_ckpt(model, opt, tmp_path / "empty", stateful={"sched": sched}) as ckpt:
        assert ckpt.resume() is None
        assert ckpt.restored is None and ckpt.step == 0
        equal_state(before, snapshot(model, opt))
        step_once(model, opt, 0, sched)  # training then works and commits
    assert ckpt.final_versions == {f"local:{tmp_path / 'empty'}": [1]}


def test_resume_restores_the_newest_version_and_continues(tmp_path: Path) -> None:
    _, _, states = train(tmp_path, 5, retention=RetentionOptions(keep_last=3))
    model = make_model(seed=7)
    opt, sched = make_opt(model)
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, retention=RetentionOptions(keep_last=3)) as ckpt:
        assert ckpt.resume() == 5
        assert ckpt.restored is not None and not ckpt.restored.fallbacks
        equal_state(states[5], model.state_dict())
        assert sched.last_epoch == 5
        step_once(model, opt, 5, sched)
    assert ckpt.final_versions is not None
    assert list(ckpt.final_versions.values()) == [[4, 5, 6]]


def test_corrupt_newest_version_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    _, _, states = train(tmp_path, 5, retention=RetentionOptions(keep_last=3))
    corrupt_newest_segment(tmp_path, 5)
    model = make_model(seed=7)
    opt, sched = make_opt(model)
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched}, retention=RetentionOptions(keep_last=3)) as ckpt:
        assert ckpt.resume() == 4
        assert ckpt.restored is not None and ckpt.restored.fallbacks
        assert "step 5" in ckpt.restored.fallbacks[0]
        equal_state(states[4], model.state_dict())
        step_once(model, opt, 4, sched)  # version 5 is written again (the corrupt copy is moved aside)
    assert ckpt.final_versions is not None and 5 in next(iter(ckpt.final_versions.values()))


class Renamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()


@pytest.mark.parametrize("kind", ["names", "shapes", "groups", "stateful"])
def test_resume_into_a_different_model_fails_cleanly(tmp_path: Path, kind: str) -> None:
    train(tmp_path, 3)
    model: nn.Module = make_model(seed=5)
    opt, sched = make_opt(model)
    stateful: dict[str, Any] = {"sched": sched}
    if kind == "names":
        model = Renamed()
        opt, sched = make_opt(model)
        stateful = {"sched": sched}
    elif kind == "shapes":
        model = make_model(seed=5, hidden=48)
        opt, sched = make_opt(model)
        stateful = {"sched": sched}
    elif kind == "groups":
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
        stateful = {"sched": torch.optim.lr_scheduler.StepLR(opt, 2)}
    else:
        stateful = {"scheduler": sched}
    before = snapshot(model, opt)
    sched_before = tensors_of(next(iter(stateful.values())).state_dict())
    with open_ckpt(model, opt, tmp_path, stateful=stateful) as ckpt:
        with pytest.raises(StateMismatchError) as info:
            ckpt.resume()
        assert isinstance(info.value, AsymstoreError)
        assert ckpt.step == 0
    equal_state(before, snapshot(model, opt))  # nothing loaded halfway
    equal_state(sched_before, next(iter(stateful.values())).state_dict())
    assert ckpt.final_versions is not None and list(ckpt.final_versions.values()) == [[1, 2, 3]]


def test_training_over_a_store_with_newer_versions_needs_resume(tmp_path: Path) -> None:
    train(tmp_path, 3)
    model = make_model()
    opt, _ = make_opt(model)
    ckpt = open_ckpt(model, opt, tmp_path)
    with pytest.raises(StepConflictError):
        step_once(model, opt, 0)
    ckpt.close()


def test_resume_after_training_started_is_refused(tmp_path: Path) -> None:
    model = make_model()
    opt, _ = make_opt(model)
    with open_ckpt(model, opt, tmp_path) as ckpt:
        step_once(model, opt, 0)
        with pytest.raises(CheckpointerStateError):
            ckpt.resume()
    with pytest.raises(CheckpointerStateError):
        ckpt.resume()


class FailingTier(LocalTier):
    """A LocalTier whose writes fail after ``after`` good versions, ``times`` times (None: forever)."""

    def __init__(self, root: Path, *, after: int, times: int | None) -> None:
        super().__init__(root)
        self.after, self.times, self.begun, self.failed = after, times, 0, 0

    async def begin(self, step: int, nbytes: int) -> Any:
        self.begun += 1
        if self.begun > self.after and (self.times is None or self.failed < self.times):
            self.failed += 1
            raise TierError(f"{self.name}: injected failure")
        return await super().begin(step, nbytes)


def test_failed_commits_raise_at_the_next_step_with_on_error_raise(tmp_path: Path) -> None:
    tier = FailingTier(tmp_path, after=2, times=None)
    model = make_model()
    opt, _ = make_opt(model)
    ckpt = open_ckpt(model, opt, [tier], failures=FailureOptions(on_error="raise"))
    with pytest.raises(CommitFailedError):
        for it in range(20):
            step_once(model, opt, it)
            ckpt.flush() if it < 2 else None
    with pytest.raises(CommitFailedError):
        ckpt.close()
    assert ckpt.stats().commits_failed >= 1


def test_failed_commits_can_be_only_logged(tmp_path: Path) -> None:
    tier = FailingTier(tmp_path, after=1, times=2)
    model = make_model()
    opt, _ = make_opt(model)
    with open_ckpt(model, opt, [tier], failures=FailureOptions(on_error="log")) as ckpt:
        for it in range(6):
            step_once(model, opt, it)
            ckpt.flush()
    stats = ckpt.stats()
    assert stats.commits_failed == 2 and stats.versions_committed == 4
    assert stats.last_error and "injected failure" in stats.last_error


def test_by_default_failed_commits_are_retried_by_later_versions_and_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = FailingTier(tmp_path, after=2, times=5)  # an outage of 5 versions, then the tier is back
    model = make_model()
    opt, _ = make_opt(model)
    with open_ckpt(model, opt, [tier]) as ckpt:  # on_error="budget": 30 minutes by default
        for it in range(12):
            step_once(model, opt, it)
            ckpt.flush()
            if it == 5:
                mid = ckpt.stats()
                assert mid.commits_failed >= 3 and mid.failures_since_durable >= 3 and mid.last_error
    stats = ckpt.stats()
    assert stats.commits_failed == 5 and stats.failures_since_durable == 0
    assert stats.versions_committed == 12 - 5 and stats.last_committed == 12
    assert sum("failed (the next version is the next attempt)" in r.message for r in caplog.records) == 5
    assert read_versions(tmp_path).keys() == {1, 2, 8, 9, 10, 11, 12}


def test_training_stops_once_no_version_was_durable_within_the_step_budget(tmp_path: Path) -> None:
    tier = FailingTier(tmp_path, after=2, times=None)  # the tier never comes back
    model = make_model()
    opt, _ = make_opt(model)
    ckpt = open_ckpt(model, opt, [tier], failures=FailureOptions(max_steps_without_durable=4,
                                                             max_seconds_without_durable=None))
    done = 0
    with pytest.raises(NoDurableVersionError, match="max_steps_without_durable=4"):
        for it in range(20):
            step_once(model, opt, it)
            ckpt.flush()
            done = it + 1
    assert done == 6  # durable at step 2; steps 3-6 failed; the 7th step is refused (7 - 2 > 4)
    with pytest.raises(CommitFailedError):
        ckpt.close()
    assert ckpt.stats().last_committed == 2


def test_training_stops_once_no_version_was_durable_within_the_time_budget(tmp_path: Path) -> None:
    tier = FailingTier(tmp_path, after=1, times=None)
    model = make_model()
    opt, _ = make_opt(model)
    ckpt = open_ckpt(model, opt, [tier], failures=FailureOptions(max_seconds_without_durable=0.3))
    with pytest.raises(NoDurableVersionError, match=r"max_seconds_without_durable=0\.3"):
        for it in range(100):
            step_once(model, opt, it)
            ckpt.flush()
            time.sleep(0.05)
    assert 3 <= ckpt.step <= 40  # stopped after about 0.3 s of failing, not at the first failure
    with pytest.raises(CommitFailedError):
        ckpt.close()


class SlowTier(LocalTier):
    """A LocalTier that takes ``delay`` seconds longer to start each version."""

    def __init__(self, root: Path, delay: float = 0.3) -> None:
        super().__init__(root)
        self.delay = delay

    async def begin(self, step: int, nbytes: int) -> Any:
        await asyncio.sleep(self.delay)
        return await super().begin(step, nbytes)


class GatedTier(LocalTier):
    """A LocalTier that starts no version until ``gate`` is set: busy for as long as the test wants."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    async def begin(self, step: int, nbytes: int) -> Any:
        await asyncio.to_thread(self.gate.wait, 60)
        return await super().begin(step, nbytes)


@pytest.mark.parametrize("slots", [2, 1])
def test_busy_store_skips_versions_by_policy(tmp_path: Path, slots: int) -> None:
    """With one host slot the skipped version never waits for it either: the loop runs on while the store is busy."""
    model = make_model()
    opt, _ = make_opt(model)
    tier = GatedTier(tmp_path)  # busy until the loop ends, however fast or slow the steps run
    with open_ckpt(model, opt, [tier], commits=CommitOptions(when_busy="skip", host_slots=slots)) as ckpt:
        started = time.monotonic()
        for it in range(8):
            step_once(model, opt, it)
        assert time.monotonic() - started < 30  # not one gate wait (60 s) in the loop
        tier.gate.set()
    stats = ckpt.stats()
    assert stats.versions_skipped > 0
    assert stats.versions_committed + stats.versions_skipped == stats.versions_sealed == 8
    assert any(r.skipped for r in stats.steps)
    assert ckpt.final_versions is not None and max(next(iter(ckpt.final_versions.values()))) == 8  # close() waits


@pytest.mark.parametrize("slots", [2, 1])
def test_busy_store_applies_back_pressure_by_default(tmp_path: Path, slots: int) -> None:
    """Back-pressure is reported whether it is met submitting (two slots) or waiting for the slot (one)."""
    model = make_model()
    opt, _ = make_opt(model)
    with open_ckpt(model, opt, [SlowTier(tmp_path, delay=0.5)], commits=CommitOptions(host_slots=slots)) as ckpt:
        for it in range(6):
            step_once(model, opt, it)
    stats = ckpt.stats()
    assert stats.versions_skipped == 0 and stats.versions_committed == 6
    waits = [r.backpressure_s for r in stats.steps]
    assert sum(waits) > 0.5 and all(r.stall_s >= r.backpressure_s for r in stats.steps)


class Opaque:
    def state_dict(self) -> dict[str, Any]:
        return {"handle": object()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_state_that_needs_pickle_is_refused(tmp_path: Path) -> None:
    model = make_model()
    opt, _ = make_opt(model)
    ckpt = open_ckpt(model, opt, tmp_path, stateful={"opaque": Opaque()})
    with pytest.raises(UnsupportedStateError, match="without pickle"):
        for it in range(2):
            step_once(model, opt, it)
    with pytest.raises(UnsupportedStateError):  # the last step cannot be saved either
        ckpt.close()
    with pytest.raises(CheckpointerStateError):  # but the Checkpointer is closed
        ckpt.resume()


def test_an_exception_in_the_loop_still_commits_the_consistent_state(tmp_path: Path) -> None:
    model = make_model()
    opt, sched = make_opt(model)
    with pytest.raises(RuntimeError, match="boom"), open_ckpt(model, opt, tmp_path, stateful={"sched": sched}):
        for it in range(3):
            step_once(model, opt, it, sched)
        after_step_3 = tensors_of(model.state_dict())
        model(data(3)[0])  # the next forward changes the BatchNorm buffers: not part of step 3's state
        raise RuntimeError("boom")
    model2 = make_model(seed=3)
    opt2, sched2 = make_opt(model2)
    with Checkpointer(model2, opt2, str(tmp_path), stateful={"sched": sched2}) as ckpt:
        assert ckpt.resume() == 3
    equal_state(after_step_3, model2.state_dict())


def test_store_argument_forms(tmp_path: Path) -> None:
    model = make_model()
    opt, _ = make_opt(model)
    store = AsymStore([LocalTier(tmp_path / "a")], keep_last=2)
    with Checkpointer(model, opt, store) as ckpt:
        assert ckpt.store is store
        for it in range(3):
            step_once(model, opt, it)
    assert ckpt.final_versions == {f"local:{tmp_path / 'a'}": [2, 3]}
    with Checkpointer(model, opt, [LocalTier(tmp_path / "b")], retention=RetentionOptions(keep_last=1)) as ckpt:
        assert ckpt.resume() is None
    with pytest.raises(ValueError):
        Checkpointer(model, opt, str(tmp_path / "c"), every=0)


class Refusing:
    """A stateful object that refuses any state it is given: at check time (``checks=True``) or while loading."""

    def __init__(self, checks: bool) -> None:
        self.checks = checks
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise StateMismatchError("this state belongs to another run")

    def check_state_dict(self, state: dict[str, int]) -> None:
        if self.checks:
            raise StateMismatchError("this state belongs to another run")


class RefusingLate:
    """The same refusal, only inside ``load_state_dict`` (no check capability)."""

    def state_dict(self) -> dict[str, int]:
        return {"n": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise StateMismatchError("this state belongs to another run")


def test_a_state_refused_by_its_check_leaves_every_live_object_untouched(tmp_path: Path) -> None:
    """A CheckedStateful is asked before anything loads: the refusal leaves model and optimizer as they were."""
    model = make_model()
    opt, sched = make_opt(model)
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched, "other": Refusing(checks=False)}):
        for it in range(3):
            step_once(model, opt, it, sched)
    fresh = make_model(seed=7)
    fresh_opt, fresh_sched = make_opt(fresh)
    before = snapshot(fresh, fresh_opt)
    with open_ckpt(fresh, fresh_opt, tmp_path, stateful={"sched": fresh_sched, "other": Refusing(checks=True)}) as ck:
        with pytest.raises(StateMismatchError, match="another run"):
            ck.resume()
        equal_state(before, snapshot(fresh, fresh_opt))  # refused before the model or optimizer were loaded
        ck.save_on_close = False


def test_a_state_refused_while_loading_stops_training(tmp_path: Path) -> None:
    """Refused inside load_state_dict, after the model was loaded: the next step is a typed error, never training.

    (Whether the store read into the live model in place or not: training on a partly loaded version is refused.)
    """
    model = make_model()
    opt, sched = make_opt(model)
    with open_ckpt(model, opt, tmp_path, stateful={"sched": sched, "other": RefusingLate()}):
        for it in range(3):
            step_once(model, opt, it, sched)
    fresh = make_model(seed=7)
    fresh_opt, fresh_sched = make_opt(fresh)
    with open_ckpt(fresh, fresh_opt, tmp_path, stateful={"sched": fresh_sched, "other": RefusingLate()}) as ck:
        with pytest.raises(StateMismatchError, match="another run"):
            ck.resume()
        with pytest.raises(CheckpointerStateError, match=r"resume\(\) failed"):
            step_once(fresh, fresh_opt, 3, fresh_sched)
        ck.save_on_close = False
