"""Preemption of a multi-rank job: every rank gets SIGTERM mid-training (2 real processes, gloo, CPU).

Per kind, three cases (tests/_mr_cases.py, tests/_preempt_cases.py; one forked child per rank and case):

- ``ref``: 7 iterations without checkpoints (the uninterrupted run);
- ``preempt``: checkpoints every iteration; in iteration K every rank sends itself SIGTERM from
  inside the training step. DDP (a Checkpointer over a RankStore): mid-forward, with the program's
  own handler chained after the flush; DeepSpeed ZeRO-2 (``asymcheck.deepspeed.attach``): inside
  ``engine.step()``, with SIGTERM's default action. Each rank acts at its next hook: it seals the
  newest completed step, commits its shard, the two-phase global commit completes, and the process
  ends killed by SIGTERM. fsck then checks the root;
- ``resume``: a fresh job resumes collectively from the newest global version and trains to the end:
  every rank's final state equals ``ref``'s bit for bit, and every loss either run logged equals
  ``ref``'s for that iteration.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
from _mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow

ITERATIONS = 7
WORLD = 2
AT = {"ddp": 4, "ds": 3}  # iteration whose training step receives SIGTERM on every rank
# steps completed when each rank's next hook acts: DDP's SIGTERM comes mid-forward of iteration K (K steps
# done); DeepSpeed's inside the optimizer step of iteration K (K + 1 steps done once engine.step() returns)
NEWEST = {"ddp": AT["ddp"], "ds": AT["ds"] + 1}
KINDS = ("ddp", "ds")


def cases_for(kind: str, root: Path) -> list[dict[str, Any]]:
    common: dict[str, Any] = {"kind": kind, "iterations": ITERATIONS}
    if kind == "ds":
        common["stage"] = 2
    ck = str(root / f"{kind}-ck")
    return [
        {"name": f"{kind}-ref", "mode": "ref", **common},
        {"name": f"{kind}-preempt", "mode": "attach", "dir": ck, "fsck": True,
         "preempt": {"at": AT[kind], "deadline_s": 25.0}, **common},
        {"name": f"{kind}-resume", "mode": "attach", "dir": ck, **common},
    ]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    root = tmp_path_factory.mktemp("preempt")
    run_cases([c for kind in KINDS for c in cases_for(kind, root / "ckpt")], WORLD, root / "out")
    return root / "out"


def check_losses(ref: Case, *runs: Case, rank: int) -> int:
    want = dict(ref.losses(rank))
    assert sorted(want) == list(range(ITERATIONS))
    seen = 0
    for run in runs:
        for it, loss in run.losses(rank):
            assert loss == want[it], f"{run.dir.name} rank {rank} iteration {it}: {loss} != {want[it]}"
            seen += 1
    return seen


def preemption_lines(case: Case, rank: int, kind: str) -> list[str]:
    """The Checkpointer's preemption log lines of ``kind``'s case (the driver's log holds every case's)."""
    log = (case.dir.parent / f"driver-rank{rank}.log").read_text()
    return [line for line in re.findall(r"preemption \(SIGTERM\): step \d+ [^\n]*", log) if f"/{kind}-ck/" in line]


@pytest.mark.parametrize("kind", KINDS)
def test_sigterm_on_every_rank_commits_the_newest_step_globally_and_resumes_bit_exact(out: Path,
                                                                                       kind: str) -> None:
    ref, pre, resume = (Case(out, f"{kind}-{k}", WORLD) for k in ("ref", "preempt", "resume"))
    newest = NEWEST[kind]
    report = pre.fsck()
    assert report["ok"] and report["layout"] == "multirank", report["problems"]
    assert report["partial_steps"] == {}, report["partial_steps"]
    restorable = report["newest_restorable"]
    assert restorable in (newest, newest - 1), report  # the newest completed step, or the one before
    for r in range(WORLD):
        assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
        assert pre.rc(r) == -signal.SIGTERM, f"rank {r}: rc {pre.rc(r)}\n{pre.log(r)}"
        assert not pre.events(r, "finished")
        logged = [it for it, _ in pre.losses(r)]
        assert logged == list(range(newest))  # SIGTERM came while training; every completed step was logged
        [started] = pre.events(r, "resumed")
        assert started["step"] is None  # a fresh start
        if kind == "ddp":  # the program's own handler ran after the flush and saw its record
            [event] = pre.events(r, "preempted")
            record = event["record"]
            assert record["reason"] == "SIGTERM" and record["step"] == newest
            assert record["deadline_s"] == 25.0 and not record["deadline_hit"] and record["error"] is None
            assert record["durable"] and record["global_step"] == newest == record["persistent_step"]
        else:  # the default action: the record is in the log, written before the signal was handed on
            [line] = preemption_lines(pre, r, kind)
            assert line.startswith(f"preemption (SIGTERM): step {newest} durable"), line
            assert f"persistent {newest}, global {newest};" in line and ", hit" not in line, line
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == restorable == resumed["iteration"]
        assert [it for it, _ in resume.losses(r)] == list(range(restorable, ITERATIONS))
        assert_same_state(ref.final(r), resume.final(r))
        assert check_losses(ref, pre, resume, rank=r) == newest + ITERATIONS - restorable
    assert restorable == newest  # every rank's flush recorded the global version durable: it is the newest
