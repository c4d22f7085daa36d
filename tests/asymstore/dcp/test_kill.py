"""Training a GPT-2 with a ``dcp.async_save`` into asymstore every step, SIGKILLed at a random step, resumed with
``dcp.load``: the losses and the final state (model, AdamW state) are bit-identical to an uninterrupted run.

Two processes of tests/procs/dcp_child.py (``train``): the first is killed once a random step's save is done (the
kill lands in the next step's training or its save, which runs on DCP's thread); the second resumes from the
newest version, trains to the end, then runs the uninterrupted reference in the same process. fsck finds the
root clean. ``DCP_KILL_SEED`` replays the kill point (the test prints it). Three times: one writer for every save,
DCP's own recipe (a new ``StorageWriter`` per save, ``checkpoint_id=f"checkpoint_step{step}"``, never closed), and one
writer with every save staged by ``asymcheck.dcp.Stager`` (its copy running through the next step).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from asymstore.dcp import StorageReader
from tests.support import dcp_train as t
from tests.support.launch import proc_argv, proc_env

pytestmark = pytest.mark.slow

STEPS = 12
SEED = int(os.environ.get("DCP_KILL_SEED", random.randrange(1 << 30)))


def progress(out: Path) -> list[dict[str, object]]:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("writers", ["one-writer", "writer-per-save", "stager"])
def test_sigkill_and_resume_bit_exact(tmp_path: Path, writers: str) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = proc_env(OMP_NUM_THREADS="1")
    flags = {"one-writer": [], "writer-per-save": ["--idiom"], "stager": ["--stager"]}[writers]
    kill_after = random.Random(f"{SEED}-sigkill-{writers}").randint(1, STEPS - 4)
    print(f"SIGKILL once step {kill_after} is saved (DCP_KILL_SEED={SEED})")
    first = subprocess.Popen(proc_argv("dcp_child", "train", str(root), str(out), str(STEPS), *flags), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not any(p.get("saved", -1) >= kill_after for p in progress(out)):  # type: ignore[operator]
            assert first.poll() is None, first.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the first run made no progress"
            time.sleep(0.01)
        first.kill()
    finally:
        log = first.communicate()[0]
    assert first.returncode == -9, log[-3000:]
    saved = max(p["saved"] for p in progress(out) if "saved" in p)  # type: ignore[type-var]
    assert saved < STEPS - 1, "the run ended before it was killed"

    second = subprocess.run(proc_argv("dcp_child", "train", str(root), str(out), str(STEPS), "--reference", *flags),
                            env=env, capture_output=True, text=True, timeout=300, check=False)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    resumed = [p for p in progress(out) if "resumed" in p]
    assert len(resumed) == 1 and resumed[0]["resumed"] >= saved and resumed[0]["fallbacks"] == []

    losses: dict[int, str] = {}
    for line in (out / "losses.jsonl").read_text().splitlines():  # a step the kill interrupted is run again
        doc = json.loads(line)
        losses[doc["step"]] = doc["loss"]
    ref = t.read_json(out / "ref.json")
    assert [losses[s] for s in range(STEPS)] == ref["losses"]
    assert t.read_json(out / "final.json") == ref["final"]

    if writers == "writer-per-save":  # every save was the step its checkpoint_id named; keep_last=2 kept two
        with StorageReader(root) as reader:
            assert reader.steps() == [STEPS - 1, STEPS - 2]
    done = t.fsck(root, "--deep")
    assert done.returncode == 0 and "verdict: OK" in done.stdout, done.stdout + done.stderr
