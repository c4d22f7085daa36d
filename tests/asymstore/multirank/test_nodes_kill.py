"""A node's leader SIGKILLed in the middle of a commit: 4 DDP ranks as 2 nodes of 2 (``LOCAL_WORLD_SIZE=2``).

Real processes (tests/support/mr_cases.py, gloo, one TCPStore as torchrun starts it): rank 2 leads node 1
(it serves the node store its ranks report through, :mod:`asymstore.dist.fabric`) and dies with half a shard
manifest written in its commit after 4 succeeded. Its node's parts never reach the coordinator, so the
global commit of that step is abandoned (rank 0's commit times out), fsck names the step partial, and the
restarted job (leaders elected anew, the same command) resumes from the previous global version and trains
to the end bit-exact against an uninterrupted run of the same 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow

WORLD = 4
ITERATIONS = 6
COMMITS = 4


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nodes-kill")
    ck = str(root / "ck")
    # dedup off: rank 2's crashing tier is outside the root, so it writes whole copies while the others would
    # slice, and the job's fallback to whole copies (one dropped version, then heard at later commits) would
    # race with the kill at the 5th commit: this test is about the leader, not about replicas
    common = {"kind": "ddp", "iterations": ITERATIONS, "ordered": True, "per_node": 2, "dedup": "off"}
    cases = [
        {"name": "ref", "mode": "ref", **common},
        {"name": "kill", "mode": "attach", "dir": ck, "kill": {"rank": 2, "at": f"commit:{COMMITS}"},
         "timeout_s": 8.0, "fsck": True, **common},
        {"name": "resume", "mode": "attach", "dir": ck, "fsck": True, **common},
    ]
    run_cases(cases, WORLD, root / "out")
    return root / "out"


def test_a_leader_killed_mid_commit_abandons_the_step_and_the_job_resumes_bit_exact(out: Path) -> None:
    ref, kill, resume = Case(out, "ref", WORLD), Case(out, "kill", WORLD), Case(out, "resume", WORLD)
    assert kill.rc(2) == -9, kill.log(2)
    assert kill.rc(0) != 0 and "GlobalCommitTimeoutError" in kill.log(0), kill.log(0)
    assert "rank(s) [2, 3]" in kill.log(0), kill.log(0)  # the whole node is missing: its leader spoke for it
    report = kill.fsck()
    assert report["newest_restorable"] == COMMITS, report
    assert str(COMMITS + 1) in report["partial_steps"], report["partial_steps"]
    after = resume.fsck()
    assert after["ok"] and after["partial_steps"] == {}, after["problems"]
    for r in range(WORLD):
        assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == COMMITS == resumed["iteration"]
        assert_same_state(ref.final(r), resume.final(r))
        want = dict(ref.losses(r))
        for run in (kill, resume):
            for it, loss in run.losses(r):
                assert loss == want[it], (run.dir.name, r, it)
