"""``AccelerateCheckpointer.step`` under the DeepSpeed plugin, read right after the optimizer step (real DeepSpeed).

The DeepSpeed adapter's hooks deliver a completed ``engine.step()`` at the next forward; the child
(tests/procs/ds_settle.py, one process, ZeRO-2 on DeepSpeed's CPU accelerator, gloo) reads ``ckpt.step`` in between.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ds_child import run_ds_settle

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install -e '.[accelerate]')")


@pytest.mark.exhaustive  # ~40 s (DeepSpeed starting); the settle it relies on: tests/asymcheck/deepspeed/test_settle.py
def test_accelerate_step_counts_the_engine_step_right_after_it(tmp_path: Path) -> None:
    """Accelerate's DeepSpeed plugin (``accelerator.backward`` runs ``engine.step()``): ``ckpt.step`` right after.

    Before, it was one behind until the next forward (0, 1, 2 after steps 1, 2, 3; a plain Accelerate job
    reads 1, 2, 3): a loop that stops at ``ckpt.step >= max_steps`` trained one step more under DeepSpeed.
    """
    result = run_ds_settle(tmp_path, "accelerate")
    assert result["seen"] == [1, 2, 3]
    assert result["step"] == 3
