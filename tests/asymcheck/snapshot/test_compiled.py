"""The snapshot hooks under ``torch.compile``: every version is still exactly one step's state.

``HookSet`` (the default hooks) wraps its forward pre-hooks and grad hooks in ``torch.compiler.disable``:
a compiled graph breaks at a hooked submodule and the hook runs eagerly, each call. Without it Dynamo
inlines the Checkpointer's protocol into the traced frame and breaks wherever inside it something
cannot be traced (``time.perf_counter``, ...). ``StepHooks`` (only the optimizer's step hooks, the copy
at the step) is what a model compiled with ``fullgraph=True`` can be checkpointed with: nothing breaks
its graph. The ``aot_eager`` backend (Dynamo and AOTAutograd, no code generation) keeps these fast.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from asymcheck.snapshot.hooks import Driver, StepHooks
from tests.support.asymcheck_train import (
    Recorder,
    check_version,
    data,
    fast_partitions,
    finish_iteration,
    make_model,
    make_opt,
    open_ckpt,
    read_versions,
)

STEPS = 8


def train_compiled(root: Path, *, fullgraph: bool = False, hooks: Callable[[Driver], Any] | None = None,
                   **kwargs: Any) -> tuple[Recorder, int]:
    """Train a compiled model STEPS steps under a Checkpointer; return the recorder and the steps copied in forwards."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    opt, sched = make_opt(model)
    stateful: dict[str, Any] = {"sched": sched}
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    rec = Recorder()
    with open_ckpt(model, opt, root, stateful=stateful, hooks=hooks(opt) if hooks else None, **kwargs) as ckpt:
        rec.hook(model, opt, lambda: ckpt.step)
        for it in range(STEPS):
            x, y = data(it)
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            finish_iteration(opt, sched, None, rec, lambda: ckpt.step, stateful)
        forwards = sum(r.forward_bytes > 0 for r in ckpt.stats().steps)
    return rec, forwards


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = make_model(seed=99)
    opt, sched = make_opt(model)
    return model, opt, {"sched": sched}


def test_hooks_run_eagerly_inside_a_compiled_model(tmp_path: Path) -> None:
    rec, forwards = train_compiled(tmp_path)
    breaks = dict(counters["graph_break"])
    # the only graph breaks are the hooks themselves: Dynamo never traced into the snapshot protocol
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), list(breaks)
    assert forwards > 0  # partitions were copied by forward hooks inside the compiled forward
    versions = read_versions(tmp_path)
    assert sorted(versions) == list(range(1, STEPS + 1))
    for version in versions.values():
        check_version(version, rec, *fresh())


def test_fullgraph_needs_the_step_hooks(tmp_path: Path) -> None:
    """fullgraph=True forbids the forward hooks' graph breaks; StepHooks copy at the step, still exact."""
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch\.compiler\.disable"):
        train_compiled(tmp_path / "hookset", fullgraph=True)
    rec, forwards = train_compiled(tmp_path / "steps", fullgraph=True,
                                    hooks=lambda opt: (lambda driver: StepHooks(opt, driver)),
                                    partitions=fast_partitions(partitioning="step"))
    assert forwards == 0 and not counters["graph_break"]
    versions = read_versions(tmp_path / "steps")
    assert sorted(versions) == list(range(1, STEPS + 1))
    for version in versions.values():
        check_version(version, rec, *fresh())
