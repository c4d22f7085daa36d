"""Ray's preemption notice drives the agreed flush: no completed step is lost, and the resumed run is bit-exact.

tests/procs/ray_preempt.py builds a Ray cluster on this machine (a head without CPUs and two one-CPU nodes,
one worker on each), and once rank 0 has completed step 4 asks Ray's GCS to drain rank 1's node for
preemption with a 4 s deadline, as a spot reclaim does; at the deadline the node is removed and a fresh
one added. Ray Train's watcher marks the workers; at their next ``check_preemption()`` both ranks flush the
newest completed step and wait; Ray restarts the group at the deadline. The resumed attempt must start at
the last step the first attempt completed (nothing lost), every loss and the final parameters must equal
the uninterrupted run's, bit for bit, and no Ray process may outlive the program. 58-87 s on the busy
2-core VM (three Ray nodes): ``exhaustive``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch import proc_argv, proc_env
from tests.support.raytrain import ray_workdir, uninterrupted

pytest.importorskip("ray.train")

from tests.procs import ray_preempt

pytestmark = [pytest.mark.slow, pytest.mark.exhaustive]

STEPS = 40
NOTICE_AT = 4


def test_drain_notice_flushes_the_newest_step_and_the_restart_resumes_it() -> None:
    with ray_workdir("rp-") as work:
        child = subprocess.Popen(proc_argv("ray_preempt", work, str(STEPS), str(NOTICE_AT)), env=proc_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = child.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            output, _ = child.communicate()
            pytest.fail(f"the Ray program took over 300 s:\n{output[-4000:]}")
        assert child.returncode == 0, output[-4000:]
        drained = json.loads(Path(work, "drained").read_text())
        assert drained["accepted"], drained
        lines: list[dict[str, Any]] = [json.loads(line) for line in Path(work, "out.jsonl").read_text().splitlines()]

    starts = [line["start"] for line in lines if "step" not in line and "final" not in line]
    assert len(starts) == 2 and starts[0] == 0, starts
    first = [line["step"] for line in lines if "step" in line and line["start"] == 0]
    assert first == list(range(1, first[-1] + 1)) and first[-1] >= NOTICE_AT
    assert starts[1] == first[-1], f"the first attempt completed step {first[-1]}, the restart resumed {starts[1]}"
    assert starts[1] < STEPS  # the notice came before the end

    losses, params = uninterrupted(ray_preempt.make_model, ray_preempt.batch, STEPS)
    steps = [line for line in lines if "step" in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))  # every step once: none lost, none repeated
    for line in steps:
        assert line["loss"] == losses[line["step"] - 1], line
    final = next(line for line in lines if "final" in line)
    assert final["final"] == STEPS and final["params"] == params
