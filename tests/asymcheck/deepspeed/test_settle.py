"""Reading the Checkpointer between ``engine.step()`` and the next forward, which delivers the step (real DeepSpeed).

The DeepSpeed adapter's hooks deliver a completed engine step late: at the next forward of the engine's
root module (or ``settle()``, ``mark()``, ``close()``). Each test runs a real one-process job (ZeRO-2 on
DeepSpeed's CPU accelerator, gloo; tests/procs/ds_settle.py) whose loop reads the Checkpointer in between.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ds_child import run_ds_settle

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")


def test_metrics_logged_right_after_the_engine_step_go_with_its_version(tmp_path: Path) -> None:
    """``log_metrics`` right after ``engine.step()``: each version carries its own step's metric; ``keep_best`` keeps 1.

    ``keep_last=1`` and the best by ``m`` (min; step 1's is the best). Before the step was delivered the
    metrics went to the step before, whose version was sealed already: every version's were lost, and
    retention deleted version 1, the best.
    """
    result = run_ds_settle(tmp_path, "metrics")
    assert result["versions"] == [1, 3]
    assert result["metrics"] == {"1": {"m": 1.0}, "3": {"m": 3.0}}


@pytest.mark.parametrize("mode", ["submodule", "functional"])
def test_forwards_that_bypass_the_root_module_still_deliver_each_step(tmp_path: Path, mode: str) -> None:
    """Forwards that never run the root module's (``submodule``: its children called directly; ``functional``: no
    module's forward at all, ``torch.nn.functional`` on the parameters): one version per step, resumed exactly.

    Before, no step after the first was delivered until ``close()``: the only version was numbered 1 and held
    the engine after 3 steps, so a loop resumed from it (``range(ckpt.resume(), total)``) trained 2 steps more.
    ``submodule`` is delivered at the next module's forward, ``functional`` at the next engine step's pre-hook.
    """
    result = run_ds_settle(tmp_path, mode)
    assert result["engine_steps"] == 3
    assert result["step"] == 3
    assert result["versions"] == [1, 2, 3]
    assert result["resumed"] == 3 and result["resumed_engine_steps"] == 3



def test_preempt_right_after_the_engine_step_agrees_on_that_step(tmp_path: Path) -> None:
    """2 ranks call ``preempt()`` after step 3: rank 0 right after ``engine.step()``, rank 1 after a validation forward.

    Both flush step 3 durably, and the ranks agree on step 3. Before, rank 0 proposed the step it had
    counted (2: the engine's step not delivered yet), and one rank logged that the ranks had agreed on
    another step than its own.
    """
    result = run_ds_settle(tmp_path, "preempt", world=2)
    for rank in ("rank0", "rank1"):
        assert result[rank]["step"] == 3 and result[rank]["durable"], result
        assert result[rank]["global_step"] == 3, result
        assert result[rank]["errors"] == [], result


def test_resume_after_an_engine_step_is_refused(tmp_path: Path) -> None:
    """``resume()`` after this run's first ``engine.step()`` (no forward since), the store holding versions 1, 2.

    Refused with the error the plain adapter raises at such a step (``StepConflictError``: the store is ahead
    of the run); nothing is loaded (the engine goes on from its own step: 2 steps in all) and nothing written.
    Before, the step was not delivered yet, so ``resume()`` took the run for a fresh one and loaded version 2
    over the stepped engine; the pending step was then counted on top: version 3 held the engine of version
    2 and version 4 that of engine step 3.
    """
    result = run_ds_settle(tmp_path, "late-resume")
    assert result["outcome"] == "StepConflictError", result
    assert result["engine_steps"] == 2, result
    assert result["versions"] == [1, 2], result
