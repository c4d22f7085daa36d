"""DDP on 2 real processes (gloo) through the plain adapter: a Checkpointer over a RankStore per rank.

Cases (tests/support/mr_cases.py, one forked child per rank and case): ``ref`` trains 7 iterations without
checkpoints; ``kill`` checkpoints every iteration and every rank SIGKILLs itself inside the forward pass
of iteration 4; ``resume`` restores the newest global version (collectively) and trains to the end: its
final parameters, optimizer state, scheduler, data position and RNG states equal ``ref``'s bit for bit.
``mc_kill`` SIGKILLs rank 1 in the middle of committing its last shard: rank 0's commit of that step
times out, fsck names it partial, and ``mc_resume`` starts from the previous global version.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow

ITERATIONS = 7
KILL_AT = 4


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    ck, mc = str(root / "ck"), str(root / "mc")
    cases = [
        {"name": "ref", "kind": "ddp", "mode": "ref", "iterations": ITERATIONS},
        {"name": "kill", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck,
         "kill": {"rank": None, "at": f"forward:{KILL_AT}"}, "fsck": True},
        {"name": "resume", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck},
        {"name": "mc_kill", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": mc,
         "kill": {"rank": 1, "at": "commit:6"}, "timeout_s": 4.0, "fsck": True},
        {"name": "mc_resume", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": mc, "fsck": True},
    ]
    run_cases(cases, 2, root / "out")
    return root / "out"


def same_losses(ref: Case, *runs: Case, rank: int) -> None:
    want = dict(ref.losses(rank))
    assert sorted(want) == list(range(ITERATIONS))
    for run in runs:
        for it, loss in run.losses(rank):
            assert loss == want[it], f"{run.dir.name} rank {rank} iteration {it}"


def test_ddp_sigkill_resume_is_bit_identical(out: Path) -> None:
    ref, kill, resume = Case(out, "ref", 2), Case(out, "kill", 2), Case(out, "resume", 2)
    report = kill.fsck()
    for r in range(2):
        assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
        assert kill.rc(r) == -9, kill.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == report["newest_restorable"] == resumed["iteration"]
        assert 1 <= resumed["step"] < KILL_AT
        assert_same_state(ref.final(r), resume.final(r))
        same_losses(ref, kill, resume, rank=r)
        assert [it for it, _ in resume.losses(r)] == list(range(resumed["step"], ITERATIONS))


def test_ddp_rank_killed_mid_commit_leaves_the_previous_global_version(out: Path) -> None:
    ref, kill, resume = Case(out, "ref", 2), Case(out, "mc_kill", 2), Case(out, "mc_resume", 2)
    assert kill.rc(1) == -9, kill.log(1)
    assert kill.rc(0) == 1 and "GlobalCommitTimeoutError" in kill.log(0)
    report = kill.fsck()
    assert report["newest_restorable"] == 6 and report["partial_steps"] == {"7": [0]}
    status = {v["name"]: v["status"] for v in report["versions"]}
    assert status["global/v000000000007.json"] == "partial"
    assert any(n.startswith("rank-00001/.tmp-v000000000007") and s == "partial" for n, s in status.items())
    after = resume.fsck()  # the resumed job's commits rolled back the dead commit's shards; its open swept the rest
    assert after["ok"] and after["partial_steps"] == {} and after["stale_steps"] == {}, after["problems"]
    for r in range(2):
        assert resume.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == 6
        assert_same_state(ref.final(r), resume.final(r))
        same_losses(ref, kill, resume, rank=r)
