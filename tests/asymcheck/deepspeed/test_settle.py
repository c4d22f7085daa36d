"""Reading the Checkpointer between ``engine.step()`` and the next forward, which delivers the step (real DeepSpeed).

The DeepSpeed adapter's hooks deliver a completed engine step late: at the next forward of the engine's
root module (or ``settle()``, ``mark()``, ``close()``). Each test runs a real one-process job (ZeRO-2 on
DeepSpeed's CPU accelerator, gloo; tests/procs/ds_settle.py) whose loop reads the Checkpointer in between.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch import proc_argv, proc_env

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, mode: str) -> dict[str, Any]:
    out = tmp_path / f"{mode}.json"
    env = proc_env(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    done = subprocess.run(proc_argv("ds_settle", "--mode", mode, "--dir", str(tmp_path / "ckpt"), "--out", str(out)),
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_metrics_logged_right_after_the_engine_step_go_with_its_version(tmp_path: Path) -> None:
    """``log_metrics`` right after ``engine.step()``: each version carries its own step's metric; ``keep_best`` keeps 1.

    ``keep_last=1`` and the best by ``m`` (min; step 1's is the best). Before the step was delivered the
    metrics went to the step before, whose version was sealed already: every version's were lost, and
    retention deleted version 1, the best.
    """
    result = _run(tmp_path, "metrics")
    assert result["versions"] == [1, 3]
    assert result["metrics"] == {"1": {"m": 1.0}, "3": {"m": 3.0}}


def test_forwards_that_bypass_the_root_module_still_deliver_each_step(tmp_path: Path) -> None:
    """A loop calling the root module's children directly (its forward pre-hook never runs): one version per step.

    Before, no step after the first was delivered until ``close()``: the only version was numbered 1 and held
    the engine after 3 steps, so a loop resumed from it (``range(ckpt.resume(), total)``) trained 2 steps more.
    """
    result = _run(tmp_path, "submodule")
    assert result["engine_steps"] == 3
    assert result["step"] == 3
    assert result["versions"] == [1, 2, 3]
    assert result["resumed"] == 3 and result["resumed_engine_steps"] == 3
