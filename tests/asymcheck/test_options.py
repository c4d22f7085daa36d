"""The Checkpointer's typed options (asymcheck.options) and its public driver interface (hooks=, state=)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from asymcheck import Checkpointer, InvalidOptionError
from asymcheck.options import (
    FLAT_OPTIONS,
    CommitOptions,
    FailureOptions,
    PacingOptions,
    PartitionOptions,
    PreemptionOptions,
    RetentionOptions,
)
from asymcheck.snapshot.hooks import Driver, HookSet
from asymcheck.state.trainstate import TrainingState
from asymstore import KeepBest
from tests.support.mypy_snippets import assert_mypy_flags_exactly_the_marked_lines

QUIET = PreemptionOptions(preempt_on="none")  # tests build Checkpointers off the main thread too


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _hook_counts(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    forward = sum(len(m._forward_pre_hooks) for m in model.modules())
    return forward, len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)


# -- each group checks its values ---------------------------------------------------

BAD: list[tuple[type[Any], dict[str, Any]]] = [
    (RetentionOptions, {"keep_last": 0}),
    (RetentionOptions, {"keep_every": -2}),
    (RetentionOptions, {"keep_last": True}),
    (RetentionOptions, {"keep_best": "loss"}),
    (PartitionOptions, {"partitioning": "blocks"}),
    (PartitionOptions, {"warmup": 0}),
    (PartitionOptions, {"max_partitions": 0}),
    (PartitionOptions, {"min_partition_bytes": -1}),
    (PartitionOptions, {"replan_tolerance": 0.0}),
    (PartitionOptions, {"replan_tolerance": float("nan")}),
    (PartitionOptions, {"clock": object()}),
    (FailureOptions, {"on_error": "ignore"}),
    (FailureOptions, {"max_steps_without_durable": 0}),
    (FailureOptions, {"max_seconds_without_durable": -1.0}),
    (PreemptionOptions, {"preempt_on": "sigint"}),
    (PreemptionOptions, {"preempt_deadline_s": 0}),
    (PacingOptions, {"max_overhead": 0}),
    (PacingOptions, {"save_on_close": "yes"}),
    (CommitOptions, {"max_inflight": 0}),
    (CommitOptions, {"when_busy": "drop"}),
    (CommitOptions, {"host_slots": 0}),
    (CommitOptions, {"copy": "dma"}),
    (CommitOptions, {"dedup": "all"}),
]


@pytest.mark.parametrize(("cls", "values"), BAD, ids=[f"{c.__name__}-{next(iter(v))}" for c, v in BAD])
def test_each_group_refuses_a_value_out_of_range_naming_it(cls: type[Any], values: dict[str, Any]) -> None:
    (name,) = values
    with pytest.raises(InvalidOptionError, match=rf"{cls.__name__}\.{name}"):
        cls(**values)


def test_groups_are_frozen_and_keyword_only() -> None:
    retention = RetentionOptions(keep_last=5, keep_best=KeepBest("loss", "min", 2))
    with pytest.raises(AttributeError):
        retention.keep_last = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        RetentionOptions(5)  # type: ignore[misc]
    assert set(FLAT_OPTIONS) == {
        "keep_last", "keep_every", "keep_best", "partitioning", "warmup", "max_partitions", "min_partition_bytes",
        "replan_tolerance", "clock", "on_error", "max_steps_without_durable", "max_seconds_without_durable",
        "preempt_on", "preempt_deadline_s", "max_overhead", "save_on_close", "max_inflight", "when_busy",
        "host_slots", "copy"}


# -- the Checkpointer takes them ----------------------------------------------------


def test_the_groups_reach_the_parts_they_configure(tmp_path: Path) -> None:
    model, opt = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the typed form never warns
        ckpt = Checkpointer(model, opt, tmp_path / "ck", retention=RetentionOptions(keep_last=2),
                            partitions=PartitionOptions(partitioning="uniform", warmup=1),
                            failures=FailureOptions(on_error="raise"), preemption=QUIET,
                            pacing=PacingOptions(max_overhead=None, save_on_close=False),
                            commits=CommitOptions(copy="inline"))
    with ckpt:
        _train(model, opt, 5)
    assert ckpt.partitioning == "uniform" and ckpt.on_error == "raise" and not ckpt.save_on_close
    assert ckpt.options.commits.copy == "inline"
    assert ckpt.final_versions is not None
    assert list(ckpt.final_versions.values()) == [[4, 5]]  # keep_last=2 reached the store


def test_flat_keywords_still_work_warn_and_name_the_group(tmp_path: Path) -> None:
    model, opt = _model()
    with pytest.warns(DeprecationWarning) as caught:
        ckpt = Checkpointer(model, opt, tmp_path / "ck", keep_last=2, max_overhead=None, partitioning="uniform",
                            preempt_on="none")
    messages = [str(w.message) for w in caught]
    assert any("retention=RetentionOptions(keep_last=...)" in m for m in messages)
    assert any("partitions=PartitionOptions(partitioning=...)" in m for m in messages)
    assert all(w.filename == __file__ for w in caught)  # pointed at the caller's line
    with ckpt:
        _train(model, opt, 5)
    assert ckpt.options.retention == RetentionOptions(keep_last=2)
    assert ckpt.partitioning == "uniform"
    assert list((ckpt.final_versions or {}).values()) == [[4, 5]]


def test_a_flat_keyword_beside_its_group_or_a_misspelt_one_is_refused_before_anything_is_hooked(
        tmp_path: Path) -> None:
    model, opt = _model()
    before = _hook_counts(model, opt)
    with pytest.raises(InvalidOptionError, match="keep_last= beside retention="):
        Checkpointer(model, opt, tmp_path / "a", retention=RetentionOptions(), keep_last=2,  # type: ignore[call-arg]
                     preemption=QUIET)
    with pytest.raises(TypeError, match="keep_lsat"):
        Checkpointer(model, opt, tmp_path / "b", keep_lsat=2, preemption=QUIET)  # type: ignore[call-arg]
    with pytest.raises(InvalidOptionError, match="RetentionOptions"):
        Checkpointer(model, opt, tmp_path / "c", retention=PacingOptions(), preemption=QUIET)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="every"):
        Checkpointer(model, opt, tmp_path / "d", every=0, preemption=QUIET)
    with pytest.raises(InvalidOptionError, match=r"PartitionOptions\.warmup"), pytest.warns(DeprecationWarning):
        Checkpointer(model, opt, tmp_path / "e", warmup=0, preempt_on="none")
    assert _hook_counts(model, opt) == before
    assert not any((tmp_path / n).exists() for n in "abcde")


# -- mypy catches a misspelt option ---------------------------------------------------

SNIPPET = '''
from typing import Unpack

import torch

from asymcheck import Checkpointer
from asymcheck.deepspeed import attach
from asymcheck.options import CheckpointerOptions, PacingOptions, RetentionOptions


def build(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    Checkpointer(model, opt, "ck", retention=RetentionOptions(keep_last=5), pacing=PacingOptions())
    Checkpointer(model, opt, "ck", keep_last=5, max_overhead=None)
    Checkpointer(model, opt, "ck", retention=RetentionOptions(keep_lsat=5))  # LINE group-field
    Checkpointer(model, opt, "ck", retension=RetentionOptions())  # LINE group-name
    Checkpointer(model, opt, "ck", keep_lsat=5)  # LINE flat-name
    Checkpointer(model, opt, "ck", keep_last="5")  # LINE flat-type
    Checkpointer(model, opt, "ck", retention=PacingOptions())  # LINE group-type
    attach(object(), "ck", keep_lsat=2)  # LINE attach-flat


def integration(model: torch.nn.Module, opt: torch.optim.Optimizer, **options: Unpack[CheckpointerOptions]) -> None:
    Checkpointer(model, opt, "ck", **options)
    attach(object(), "ck", **options)


def caller(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    integration(model, opt, pacing=PacingOptions(max_overhead=None), warmup=2)
    integration(model, opt, pacnig=PacingOptions())  # LINE forwarded-name
    good: CheckpointerOptions = {"retention": RetentionOptions()}
    bad: CheckpointerOptions = {"retention": RetentionOptions(), "warmpu": 3}  # LINE dict-key
    integration(model, opt, **good)
    integration(model, opt, **bad)
'''


def test_mypy_reports_every_misspelt_option_and_accepts_the_right_ones(tmp_path: Path) -> None:
    assert_mypy_flags_exactly_the_marked_lines(SNIPPET, tmp_path)


# -- the driver interface ------------------------------------------------------------


def test_hooks_factory_replaces_the_plain_hooks_and_drives_the_protocol(tmp_path: Path) -> None:
    """An adapter that seals from its own callback: nothing is registered and removed behind its back."""
    model, opt = _model()
    before = _hook_counts(model, opt)
    drivers: list[Driver] = []

    def hooks(driver: Driver) -> HookSet:  # the step pre-hook is the adapter's own (as Lightning's)
        drivers.append(driver)
        return HookSet(model, opt, on_forward=driver.on_forward, on_grad=driver.on_grad,
                       on_step_pre=lambda: None, on_step_post=driver.after_step)

    ckpt = Checkpointer(model, opt, tmp_path / "ck", hooks=hooks, preemption=QUIET,
                        pacing=PacingOptions(max_overhead=None))
    assert drivers == [ckpt.driver]
    forward, pre, post = _hook_counts(model, opt)
    assert (pre, post) == (before[1] + 1, before[2] + 1)  # the factory's set only, no plain set beside it
    assert forward == before[0] + len(list(model.modules()))
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with ckpt:
        for i in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).mean().backward()
            ckpt.driver.before_step()  # the adapter's "before optimizer step"
            opt.step()
            opt.zero_grad(set_to_none=True)
            expected[i + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert _hook_counts(model, opt) == before
    restored, ropt = _model()
    with Checkpointer(restored, ropt, tmp_path / "ck", preemption=QUIET) as again:
        assert again.resume() == 4
        for k, v in restored.state_dict().items():
            assert torch.equal(v, expected[4][k]), k


class _LateHooks(HookSet):
    """Hooks that deliver a step's completion late, at ``settle`` (as the DeepSpeed adapter's, at the next forward)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, driver: Driver) -> None:
        self.pending = False
        self._after = driver.after_step
        self._returned = driver.step_returned
        super().__init__(model, opt, on_forward=driver.on_forward, on_grad=driver.on_grad,
                         on_step_pre=driver.before_step, on_step_post=self._post)

    def _post(self) -> None:
        self.pending = True
        self._returned()

    def settle(self) -> None:
        if self.pending:
            self.pending = False
            self._after()


def test_settle_delivers_a_step_the_hooks_report_late(tmp_path: Path) -> None:
    """``settle()`` counts a step whose hooks deliver it late, once; each settled step is a version, resumed exactly."""
    model, opt = _model()
    late: list[_LateHooks] = []

    def hooks(driver: Driver) -> _LateHooks:
        late.append(_LateHooks(model, opt, driver))
        return late[0]

    expected: dict[str, torch.Tensor] = {}
    with Checkpointer(model, opt, tmp_path / "ck", hooks=hooks, preemption=QUIET,
                      pacing=PacingOptions(max_overhead=None)) as ckpt:
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert ckpt.step == i and late[0].pending  # the step completed, not delivered yet
            ckpt.settle()
            assert ckpt.step == i + 1 and not late[0].pending
            ckpt.settle()  # nothing pending: a no-op
            assert ckpt.step == i + 1
            expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpt.settle()  # closed: a no-op
    assert ckpt.step == 3
    restored, ropt = _model()
    with Checkpointer(restored, ropt, tmp_path / "ck", preemption=QUIET) as again:
        assert again.resume() == 3
        for k, v in restored.state_dict().items():
            assert torch.equal(v, expected[k]), k


class _CountingState(TrainingState):
    loads = 0

    def load(self, tensors: Any, meta: Any) -> None:
        type(self).loads += 1
        super().load(tensors, meta)


def test_state_factory_builds_the_adapters_state_with_the_opened_store(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(model, opt, tmp_path / "ck", preemption=QUIET) as first:
        _train(model, opt, 3)
    assert first.final_versions is not None
    seen: list[Any] = []

    def state(store: Any, run: Any) -> TrainingState:
        seen.append((store, run))
        return _CountingState(model, opt)

    with Checkpointer(model, opt, tmp_path / "ck", state=state, preemption=QUIET) as ckpt:
        assert isinstance(ckpt.state, _CountingState) and seen[0][0] is ckpt.store and callable(seen[0][1])
        assert ckpt.resume() == 3 and _CountingState.loads == 1  # the adapter's state loaded the version


def test_state_factory_of_another_model_or_beside_stateful_is_refused(tmp_path: Path) -> None:
    model, opt = _model()
    other, other_opt = _model()
    before = _hook_counts(model, opt)
    with pytest.raises(InvalidOptionError, match="model and optimizer"):
        Checkpointer(model, opt, tmp_path / "a", state=lambda s, r: TrainingState(other, other_opt),
                     preemption=QUIET)
    with pytest.raises(InvalidOptionError, match="stateful"):
        Checkpointer(model, opt, tmp_path / "b", state=lambda s, r: TrainingState(model, opt),
                     stateful={"sched": torch.optim.lr_scheduler.StepLR(opt, 1)}, preemption=QUIET)
    assert _hook_counts(model, opt) == before


def test_setting_state_is_deprecated_but_still_works(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(model, opt, tmp_path / "ck", preemption=QUIET) as ckpt:
        replacement = _CountingState(model, opt)
        with pytest.warns(DeprecationWarning, match="state="):
            ckpt.state = replacement
        assert ckpt.state is replacement


def test_the_private_rehook_path_adapters_used_still_works(tmp_path: Path) -> None:
    """LightningCheckpointer's path until it moves to hooks=: remove the hooks, re-hook, seal by hand."""
    model, opt = _model()
    before = _hook_counts(model, opt)
    ckpt = Checkpointer(model, opt, tmp_path / "ck", preemption=QUIET, pacing=PacingOptions(max_overhead=None))
    ckpt._hooks.remove()
    ckpt._hooks = HookSet(model, opt, on_forward=ckpt._on_forward, on_grad=ckpt._on_grad,
                          on_step_pre=lambda: None, on_step_post=ckpt._on_step_post)
    with ckpt:
        for i in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).sum().backward()
            ckpt._on_step_pre()
            opt.step()
            opt.zero_grad(set_to_none=True)
        ckpt.mark()  # settles through the replaced hooks
    assert list((ckpt.final_versions or {}).values()) == [[1, 2, 3]]
    assert _hook_counts(model, opt) == before
