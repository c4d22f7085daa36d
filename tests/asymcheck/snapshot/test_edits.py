"""In-place edits between steps and loop shapes, in process: every committed version must equal what the loop
saw when that step returned (parameters, optimizer state) and after its own bookkeeping (param groups,
scheduler, stateful objects) — or be dropped and reported. Never a wrong version.

The kill tests (tests/asymcheck/test_kill.py) run the same shapes across a SIGKILL and a resume.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asymcheck import Checkpointer, DroppedVersionWarning
from asymcheck.state.trainstate import TrainingState
from tests.support.asymcheck_train import (
    Recorder,
    check_version,
    data,
    equal_state,
    make_model,
    make_opt,
    open_ckpt,
    read_versions,
)

Edit = Callable[[nn.Module, Checkpointer, int], None]


def ema_swap(model: nn.Module, ckpt: Checkpointer | None, it: int, *, guarded: bool) -> None:
    """The torch_ema / timm pattern: EMA weights into the model, a no_grad eval forward, originals back."""
    params = list(model.parameters())
    shadow = [p.detach() * 0.5 for p in params]  # stands for the EMA weights
    guard = ckpt.editing() if guarded and ckpt is not None else contextlib.nullcontext()
    with guard, torch.no_grad():
        backup = [p.detach().clone() for p in params]
        for p, s in zip(params, shadow, strict=True):
            p.copy_(s)
        model.eval()
        model(data(it)[0])
        model.train()
        for p, b in zip(params, backup, strict=True):
            p.copy_(b)


def load_sd(model: nn.Module, ckpt: Checkpointer | None, it: int) -> None:
    if it % 3 == 1:  # weight surgery at the head of the iteration
        model.load_state_dict({k: v * 0.95 if v.is_floating_point() else v for k, v in model.state_dict().items()})


def data_mul(model: nn.Module, ckpt: Checkpointer | None, it: int) -> None:
    model[0].weight.data.mul_(0.99)  # invisible to the version counter: caught by the byte sample


class EmbedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16, max_norm=0.5)  # renormalises the rows it looks up, in the forward
        self.body = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 7).long().clamp(max=31)
        out: torch.Tensor = self.body(self.emb(ids).mean(1))
        return out


def run(tmp_path: Path, model: nn.Module, *, head: Edit | None = None, tail: Edit | None = None,
        steps: int = 8) -> tuple[Checkpointer, Recorder, dict[int, Any]]:
    opt, sched = make_opt(model)
    rec = Recorder()
    with open_ckpt(model, opt, tmp_path / "ckpt", stateful={"sched": sched}) as ckpt:
        rec.hook(model, opt, lambda: ckpt.step)
        for it in range(steps):
            if head is not None:
                head(model, ckpt, it)
            x, y = data(it)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if tail is not None:
                tail(model, ckpt, it)
            sched.step()
            opt.zero_grad(set_to_none=True)
            rec.end_of_body(ckpt.step, opt, {"sched": sched})
    return ckpt, rec, read_versions(tmp_path / "ckpt")


def check_all(versions: dict[int, Any], rec: Recorder, make: Callable[[], nn.Module]) -> None:
    for ckpt in versions.values():
        model = make()
        opt, sched = make_opt(model)
        check_version(ckpt, rec, model, opt, {"sched": sched})


def test_ema_swap_inside_editing_keeps_every_version(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DroppedVersionWarning)
        ckpt, rec, versions = run(tmp_path, make_model(),
                                  tail=lambda m, c, it: ema_swap(m, c, it, guarded=True))
    assert ckpt.stats().versions_dropped == 0 and ckpt.stats().eager_tensors == ()
    assert sorted(versions) == list(range(1, 9))
    check_all(versions, rec, make_model)


def test_ema_swap_without_editing_drops_and_reports_never_commits_a_mix(tmp_path: Path) -> None:
    with pytest.warns(DroppedVersionWarning, match="editing"):
        ckpt, rec, versions = run(tmp_path, make_model(),
                                  head=lambda m, c, it: ema_swap(m, c, it, guarded=False))
    stats = ckpt.stats()
    assert stats.versions_dropped >= 1 and stats.summary()["versions_dropped"] == stats.versions_dropped
    assert any(s.dropped for s in stats.steps)
    assert len(versions) == 8 - stats.versions_dropped and 8 in versions
    assert any(name.startswith("model/") for name in stats.eager_tensors)  # learned: copied eagerly since
    check_all(versions, rec, make_model)


@pytest.mark.parametrize("edit", [load_sd, data_mul], ids=["load_state_dict", "p.data.mul_"])
def test_in_place_edits_drop_the_version_then_copy_those_tensors_eagerly(tmp_path: Path, edit: Edit) -> None:
    with pytest.warns(DroppedVersionWarning):
        ckpt, rec, versions = run(tmp_path, make_model(), head=edit)
    stats = ckpt.stats()
    assert stats.versions_dropped == 1  # the first edit; the tensors are copied eagerly after it
    assert "model/0.weight" in stats.eager_tensors
    assert len(versions) == 7
    check_all(versions, rec, make_model)


def test_embedding_max_norm_renormalisation_is_never_committed_as_clean(tmp_path: Path) -> None:
    with pytest.warns(DroppedVersionWarning):
        ckpt, rec, versions = run(tmp_path, EmbedModel())
    stats = ckpt.stats()
    assert stats.versions_dropped >= 1 and stats.eager_tensors == ("model/emb.weight",)
    assert len(versions) == 8 - stats.versions_dropped and 8 in versions
    check_all(versions, rec, EmbedModel)


def test_validation_forward_between_step_and_scheduler_is_not_the_next_iteration(tmp_path: Path) -> None:
    ckpt, rec, versions = run(tmp_path, make_model(), tail=lambda m, c, it: _val(m, it))
    assert ckpt.stats().versions_dropped == 0 and sorted(versions) == list(range(1, 9))
    check_all(versions, rec, make_model)  # param groups and scheduler as after sched.step()


def _val(model: nn.Module, it: int) -> None:
    model.eval()
    model(data(it + 100)[0])  # eval() with grad enabled
    model.train()
    with torch.no_grad():
        model(data(it + 200)[0])  # no_grad in training mode (BatchNorm stats move: a buffer, taken at the step)


@pytest.mark.parametrize("mark", [True, False], ids=["mark", "no-mark"])
def test_mark_takes_late_state_for_loops_hooks_cannot_read(tmp_path: Path, mark: bool) -> None:
    """A training-mode forward with grad enabled between step and scheduler needs ``mark()``."""
    model = make_model()
    opt, sched = make_opt(model)
    rec = Recorder()
    at_step: dict[int, dict[str, Any]] = {}  # the model as the step left it, before the extra forward
    with open_ckpt(model, opt, tmp_path / "ckpt", stateful={"sched": sched}) as ckpt:
        rec.hook(model, opt, lambda: ckpt.step)
        for it in range(6):
            x, y = data(it)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            model(data(it + 50)[0]).sum()  # looks like the next iteration's forward to any hook
            sched.step()
            rec.end_of_body(ckpt.step, opt, {"sched": sched})
            at_step[ckpt.step] = dict(rec.after_step[ckpt.step]["model"])
            buffers = {k: v.clone() for k, v in model.named_buffers()}  # the extra forward moved BatchNorm's
            rec.after_step[ckpt.step]["model"].update(buffers)
            if mark:
                ckpt.mark()
    versions = read_versions(tmp_path / "ckpt")
    assert sorted(versions) == list(range(1, 7))
    if mark:
        check_all(versions, rec, make_model)
        return
    # without it, that forward looks like iteration t+1: what it moved (BatchNorm's buffers) and the scheduler
    # are taken before it, as the step left them; the optimizer's state is the step's own
    moved = sorted(k for k in at_step[1] if not torch.equal(at_step[1][k], rec.after_step[1]["model"][k]))
    assert moved == sorted(dict(model.named_buffers())), moved  # BatchNorm's buffers, nothing else
    for step, ckpt_ in versions.items():
        model = make_model()
        opt, sched = make_opt(model)
        with pytest.raises(AssertionError, match=r"^model/\d+\.running_"):  # the one way it may fail
            check_version(ckpt_, rec, model, opt, {"sched": sched})
        model = make_model()
        opt, sched = make_opt(model)
        TrainingState(model, opt, {"sched": sched}).load(ckpt_.tensors, ckpt_.meta)
        equal_state(at_step[step], model.state_dict(), "model")
        equal_state(rec.after_step[step]["optim"], opt.state_dict()["state"], "optim")
        assert sched.state_dict()["last_epoch"] == step - 1, step  # the scheduler before its step
