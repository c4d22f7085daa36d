"""Preemption of a multi-rank job: every rank gets SIGTERM mid-training (2 and 4 real processes, gloo, CPU).

Per kind, three cases (tests/support/mr_cases.py, tests/support/preempt_cases.py; one forked child per rank and case):

- ``ref``: 7 iterations without checkpoints (the uninterrupted run);
- ``preempt``: checkpoints every iteration; in iteration K every rank sends itself SIGTERM from
  inside the training step. DDP (a Checkpointer over a RankStore): mid-forward, with the program's
  own handler chained after the flush; DeepSpeed ZeRO-2 (``asymcheck.deepspeed.attach``): inside
  ``engine.step()``, with SIGTERM's default action. The ranks agree through the key-value store on
  the step to flush (asymcheck/policy/agreement.py: the one after the step in flight), train to it, seal it
  at the same iteration boundary, commit their shards, the two-phase global commit completes, and the
  process ends killed by SIGTERM. fsck then checks the root;
- ``resume``: a fresh job resumes collectively from the newest global version and trains to the end:
  every rank's final state equals ``ref``'s bit for bit, and every loss either run logged equals
  ``ref``'s for that iteration.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow

ITERATIONS = 7
WORLD = 2
AT = {"ddp": 4, "ds": 3}  # iteration whose training step receives SIGTERM on every rank
# the step every rank agrees to flush: DDP's SIGTERM comes mid-forward of iteration K (K steps done, the
# notice is published from a forward hook): K + 1; DeepSpeed's inside the optimizer step of iteration K,
# published at the first hook after it (K + 1 steps done, a boundary): K + 2
NEWEST = {"ddp": AT["ddp"] + 1, "ds": AT["ds"] + 2}
KINDS = ("ddp", "ds")
PEERLOST_DEADLINE_S = 3.0


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
        *([{"name": "ddp-peerlost", "mode": "attach", "dir": str(root / "ddp-peerlost-ck"), "fsck": True,
            "preempt": {"at": AT["ddp"], "deadline_s": PEERLOST_DEADLINE_S},
            "kill": {"rank": 1, "at": f"commit:{NEWEST['ddp'] - 1}"}, **common}] if kind == "ddp" else []),
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
    assert restorable == newest, report  # the newest completed step (every rank flushed it)
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
        # the default action (DeepSpeed) as well: the record as logged, written before the signal was handed on
        [logged_record] = pre.events(r, "record")
        record = logged_record["record"]
        assert record["reason"] == "SIGTERM" and record["step"] == newest, record
        assert not record["deadline_hit"] and not record["peer_lost"] and record["error"] is None, record
        assert record["durable"] and record["global_step"] == newest == record["persistent_step"], record
        [line] = preemption_lines(pre, r, kind)
        assert line.startswith(f"preemption (SIGTERM): step {newest} durable"), line
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == restorable == resumed["iteration"]
        assert [it for it, _ in resume.losses(r)] == list(range(restorable, ITERATIONS))
        assert_same_state(ref.final(r), resume.final(r))
        assert check_losses(ref, pre, resume, rank=r) == newest + ITERATIONS - restorable
    assert restorable == newest  # every rank's flush recorded the global version durable: it is the newest


def test_a_peer_dying_in_the_flush_leaves_a_record_that_says_so(out: Path) -> None:
    """Rank 1 dies (SIGKILL) inside its commit of the agreed step: rank 0 records the step not durable,
    ``peer_lost`` and ``deadline_hit``, then still ends by the signal; the previous global version stays."""
    case = Case(out, "ddp-peerlost", WORLD)
    newest = NEWEST["ddp"]
    assert case.rc(1) == -signal.SIGKILL, case.log(1)
    assert case.rc(0) == -signal.SIGTERM, case.log(0)
    [record] = [e["record"] for e in case.events(0, "record")]
    assert record["step"] == newest and record["reason"] == "SIGTERM", record
    assert record["peer_lost"] and record["deadline_hit"] and not record["durable"], record
    assert record["persistent_step"] == newest and record["global_step"] == newest - 1, record
    assert record["seconds"] < PEERLOST_DEADLINE_S + 10.0, record  # within the deadline (and the loop's grace)
    [event] = case.events(0, "preempted")
    assert event["record"] == record
    report = case.fsck()
    assert report["newest_restorable"] == newest - 1, report


# -- 4 ranks, the signal reaching each rank at its own random moment ----------------------------------------

WORLD4 = 4
AT4 = 3
ITERATIONS4 = 40  # far more than the few steps the spread and the agreement take
SPREAD_MS = 20.0
SEEDS = {"ddp": (1, 2), "ds": (1, 2)}
RESUMED = {"ddp": 1}  # the (kind, seed) whose root a fresh job resumes from, compared with a reference run
ONLY = 2  # the one rank SIGTERMed in the ddp4-only case


def cases4(root: Path) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for kind, seeds in SEEDS.items():
        common: dict[str, Any] = {"kind": kind, "iterations": ITERATIONS4,
                                  "per_node": 2}  # 2 nodes of 2 (LOCAL_WORLD_SIZE=2): the notice through leaders
        if kind == "ds":
            common["stage"] = 2
        else:
            common["ordered"] = True  # DDP on more than 2 ranks resumes bit-exact only with ordered sums
        if kind in RESUMED:
            cases.append({"name": f"{kind}4-ref", "mode": "ref", **common})
        for seed in seeds:
            ck = str(root / f"{kind}4-{seed}-ck")
            cases.append({"name": f"{kind}4-preempt-{seed}", "mode": "attach", "dir": ck, "fsck": True,
                          "preempt": {"at": AT4, "deadline_s": 25.0, "spread_ms": SPREAD_MS, "seed": seed},
                          **common})
            if RESUMED.get(kind) == seed:
                cases.append({"name": f"{kind}4-resume-{seed}", "mode": "attach", "dir": ck, **common})
        if kind == "ddp":  # only one rank is signalled: the others act on the notice alone
            cases.append({"name": "ddp4-only", "mode": "attach", "dir": str(root / "ddp4-only-ck"), "fsck": True,
                          "preempt": {"at": AT4, "deadline_s": 25.0, "spread_ms": SPREAD_MS, "seed": 1,
                                      "ranks": [ONLY]}, **common})
    return cases


@pytest.fixture(scope="module")
def out4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    root = tmp_path_factory.mktemp("preempt4")
    run_cases(cases4(root / "ckpt"), WORLD4, root / "out")
    return root / "out"


@pytest.mark.parametrize(("kind", "seed"), [(k, s) for k, seeds in SEEDS.items() for s in seeds])
def test_sigterm_spread_over_four_ranks_every_rank_flushes_the_same_newest_step(out4: Path, kind: str,
                                                                                seed: int) -> None:
    """SIGTERM reaches 4 ranks 0-20 ms apart: every rank flushes the same step, the newest completed, and
    ends by the signal (the old code let early ranks exit while the others were in the step's allreduce)."""
    pre = Case(out4, f"{kind}4-preempt-{seed}", WORLD4)
    logs = "\n".join(f"--- rank {r} rc {pre.rc(r)}\n{pre.log(r)}" for r in range(WORLD4))
    for r in range(WORLD4):
        assert pre.rc(r) == -signal.SIGTERM, f"rank {r} did not end by the signal\n{logs}"
        assert not pre.events(r, "finished")
        assert len(pre.events(r, "timer")) == 1
    records = [pre.events(r, "record") for r in range(WORLD4)]
    assert all(len(rs) == 1 for rs in records), f"{records}\n{logs}"
    records_ = [rs[0]["record"] for rs in records]
    steps = {rec["step"] for rec in records_}
    assert len(steps) == 1, f"the ranks flushed different steps: {records_}"
    [newest] = steps
    assert newest > AT4  # the signals came in iteration AT4 or later: every rank trained on to the agreed step
    for r, rec in enumerate(records_):
        assert rec["reason"] in ("SIGTERM", "peer"), rec
        assert rec["durable"] and rec["global_step"] == newest == rec["persistent_step"], (r, rec)
        assert not rec["deadline_hit"] and not rec["peer_lost"] and rec["error"] is None, (r, rec)
        # the newest completed step on every rank is the flushed one: no rank trained past it, none stopped short
        assert [it for it, _ in pre.losses(r)] == list(range(newest)), r
    if kind == "ddp":  # the program's own handler ran after the flush (more than once if its SIGTERM came late)
        for r in range(WORLD4):
            assert pre.events(r, "preempted") and all(e["record"]["step"] == newest
                                                      for e in pre.events(r, "preempted")), r
    report = pre.fsck()
    assert report["ok"] and report["layout"] == "multirank", report["problems"]
    assert report["partial_steps"] == {}, report["partial_steps"]
    assert report["newest_restorable"] == newest, report  # exactly the newest completed step, not the one before
    if RESUMED.get(kind) == seed:
        ref, resume = Case(out4, f"{kind}4-ref", WORLD4), Case(out4, f"{kind}4-resume-{seed}", WORLD4)
        for r in range(WORLD4):
            assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
            [resumed] = resume.events(r, "resumed")
            assert resumed["step"] == newest == resumed["iteration"]
            assert_same_state(ref.final(r), resume.final(r))
            want = dict(ref.losses(r))
            for run in (pre, resume):
                for it, loss in run.losses(r):
                    assert loss == want[it], (run.dir.name, r, it)
    else:  # nothing resumed from this root: fsck's command line on it as well
        cli = subprocess.run([sys.executable, "-m", "asymstore.fsck", str(report_root(out4, kind, seed))],
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 0, cli.stdout + cli.stderr


def report_root(out: Path, kind: str, seed: int) -> Path:
    return out.parent / "ckpt" / f"{kind}4-{seed}-ck"


def test_ranks_that_only_read_the_notice_flush_the_same_step_and_exit_as_if_signalled(out4: Path) -> None:
    """Only rank 2 gets SIGTERM: every other rank flushes the same step for its notice (reason ``peer``)
    and hands SIGTERM on to the program's own handler, which ends it by the signal."""
    pre = Case(out4, "ddp4-only", WORLD4)
    records = [[e["record"] for e in pre.events(r, "record")] for r in range(WORLD4)]
    assert all(len(rs) == 1 for rs in records), records
    [newest] = {rs[0]["step"] for rs in records}
    for r, [rec] in enumerate(records):
        assert pre.rc(r) == -signal.SIGTERM, f"rank {r}: rc {pre.rc(r)}\n{pre.log(r)}"
        assert rec["reason"] == ("SIGTERM" if r == ONLY else "peer"), (r, rec)
        assert rec["durable"] and rec["global_step"] == newest and not rec["peer_lost"], (r, rec)
        assert [it for it, _ in pre.losses(r)] == list(range(newest)), r
        [handled] = pre.events(r, "preempted")  # the program's own handler, called once
        assert handled["record"] == rec
    assert newest > AT4
    assert pre.fsck()["newest_restorable"] == newest
