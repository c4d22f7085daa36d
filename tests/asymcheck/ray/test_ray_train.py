"""Ray Train: a worker of a TorchTrainer dies mid-training, Ray restarts the group, the run resumes bit-exact.

The program is examples/ray_train/ray_train.py (the guide's snippet), run as it is in a child process:
a local Ray of 2 CPUs, a TorchTrainer of 2 CPU workers (DDP, gloo over the process group Ray sets up),
an ``asymcheck.ray.RayCheckpointer`` on a shared root, rank 1's process ending by ``os._exit`` after its
3rd optimizer step of the first attempt (no cleanup, as a SIGKILL), ``FailureConfig(max_failures=1)``.
The resumed attempt's losses and final parameters must equal those of the same training run
uninterrupted, bit for bit: here computed in this process without Ray (2 ranks simulated as DDP
averages them: each rank's gradient halved, the two summed), checked against the first attempt's own
losses too. Ray's final checkpoint must be the pointer to the final version, and no Ray process may
outlive the program.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from asymstore.multirank.globaldir import list_global_steps
from tests.support.launch import ROOT, proc_env
from tests.support.raytrain import ray_workdir, uninterrupted

pytest.importorskip("ray.train")

pytestmark = pytest.mark.slow

PROGRAM = ROOT / "examples" / "ray_train" / "ray_train.py"
STEPS = 6
KILL_AT = 3


def _program() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ray_train_example", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def work() -> Iterator[str]:
    """A short directory for Ray; no process may be left naming it (see :func:`ray_workdir`)."""
    with ray_workdir("rt-") as path:
        yield path


def _run(work: str, out: Path, root: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    child = subprocess.Popen([sys.executable, str(PROGRAM), "--root", str(root), "--out", str(out),
                              "--steps", str(STEPS), "--kill-at", str(KILL_AT), "--work", work],
                             env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        pytest.fail(f"the Ray program took over {timeout_s:.0f} s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(child.args, child.returncode, output, "")


def test_worker_killed_resumes_bit_exact(work: str, tmp_path: Path) -> None:
    out, root = tmp_path / "out.jsonl", tmp_path / "shared" / "ckpt"
    done = _run(work, out, root, timeout_s=240.0)
    assert done.returncode == 0, done.stdout[-4000:]
    lines: list[dict[str, Any]] = [json.loads(line) for line in out.read_text().splitlines()]
    steps = [line for line in lines if "step" in line]
    starts = sorted({line["start"] for line in steps})
    assert starts[0] == 0 and len(starts) == 2, f"expected a first attempt and one resumed attempt: {starts}"
    resumed = starts[1]
    assert 1 <= resumed <= KILL_AT, f"resumed from step {resumed}, killed after {KILL_AT}"
    assert (root / "..").resolve().joinpath("killed-once").exists()

    program = _program()
    expected_losses, expected_params = uninterrupted(program.make_model, program.batch, STEPS)
    for line in steps:  # both attempts: every loss is the uninterrupted run's, bit for bit
        assert line["loss"] == expected_losses[line["step"] - 1], line
    after = [line["step"] for line in steps if line["start"] == resumed]
    assert after == list(range(resumed + 1, STEPS + 1))
    final = next(line for line in lines if "final" in line)
    assert final["final"] == STEPS
    assert final["params"] == expected_params  # exact floats (JSON keeps every bit of a float32 value)

    pointer = next(line["pointer"] for line in lines if "pointer" in line)
    assert pointer == {"root": str(root), "step": STEPS, "world_size": 2}
    assert list_global_steps(str(root / "global"))[-1] == STEPS  # what Ray names is the newest published version
