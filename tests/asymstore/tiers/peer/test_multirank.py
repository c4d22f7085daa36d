"""Losing a node: 4 DDP ranks as 2 simulated nodes of 2, tiers [shared memory, peer, local disk].

Each node has its own shared-memory directory (its ranks' memory tiers, and the replicas it holds for
the other node's ranks) and each rank its own disk directory. Real processes, gloo, a TCPStore, and the
replication group the peer tiers build. Every run is compared with an uninterrupted reference run of
the same 4 ranks: losses of the resumed iterations and the final state, bit for bit (gradients are
averaged in rank order, ``ordered`` in tests/support/mr_cases.py: gloo's ring allreduce over 4 ranks is not
bit-reproducible across a restart, since DDP rebuilds its buckets after each process's first iteration).

DDP through the plain Checkpointer, and DeepSpeed ZeRO-2 through ``asymcheck.deepspeed.attach()``: (a) the job
is SIGKILLed mid-training and node 1 is lost with its memory and its disks: the restarted
job resumes from the replicas node 0 holds, losing at most the steps in flight; (b) a rank dies in the
middle of sending a version to its peer: the peer never lists a half replica, every replica it lists
verifies, and the job resumes bit-exact; (c) a replica is corrupt: its rank falls back to its disk; (d) every
rank is sent SIGTERM mid-training: each flushes the newest completed step to its disk before it dies, and
the job resumes from the disks alone, bit-exact.

Exit (tests/procs/peer_exit_script.py: each rank a user's script in a process of its own, as torchrun starts it):
(e) a node is SIGKILLed mid-training: each survivor's training fails, and its process ends within seconds of
its program, with the program's own status, never SIGABRT, and no thread's traceback; (f) a rank whose program
ends without closing the Checkpointer (its replica service blocked in a gloo receive from a live peer) exits
as cleanly when that peer is killed while the rank's interpreter finalizes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asymstore import host_tier
from asymstore.format.names import rank_dirname
from asymstore.read.load import load_version
from tests.support.mr_harness import Case, Script, assert_same_state, run_cases
from tests.support.shm import shm_dir

pytestmark = pytest.mark.slow

WORLD, PER_NODE, N = 4, 2, 8


@pytest.fixture(scope="module")
def shm() -> Iterator[Path]:
    """The simulated nodes' shared memory (/dev/shm where it is a tmpfs, else a temporary directory)."""
    with shm_dir("asymstore-peer-") as path:
        yield path


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("peer") / "out"
    run_cases([{"kind": "ddp", "mode": "ref", "name": "ref", "iterations": N, "ordered": True}], WORLD, root)
    return root


def attach(out: Path, shm: Path, name: str, **peer: Any) -> dict[str, Any]:
    return {"kind": "ddp", "mode": "attach", "dir": str(out.parent / f"ck-{name}"), "ordered": True, "step_s": 0.2,
            "peer": {"shm": str(shm / name), "per_node": PER_NODE, **peer}}


def lose(case: dict[str, Any], node: int, *, disks: bool) -> None:
    """Node ``node`` is gone: its shared memory, and with ``disks`` its ranks' disk directories."""
    shutil.rmtree(Path(case["peer"]["shm"]) / f"node-{node}")
    if disks:
        for r in range(node * PER_NODE, (node + 1) * PER_NODE):
            shutil.rmtree(Path(case["dir"]) / rank_dirname(r))


def replicas(case: dict[str, Any], holder_node: int, of_rank: int) -> Path:
    return Path(case["peer"]["shm"]) / f"node-{holder_node}" / "replicas" / f"of-rank-{of_rank:05d}"


def listed(path: Path) -> list[int]:
    async def go() -> list[int]:
        tier = host_tier(64 << 20, path=path)
        await tier.open()
        try:
            steps = await tier.list_versions()
            for s in steps:  # every replica listed is whole: it loads and verifies
                await load_version(tier, s)
            return steps
        finally:
            await tier.close()

    return asyncio.run(go())


def assert_resumed_like_ref(out: Path, name: str, tiers: dict[int, str], ref_name: str = "ref") -> int:
    """Every rank resumed (from a tier whose name starts with ``tiers[rank]``) and ended exactly as ``ref``."""
    case, ref = Case(out, name, WORLD), Case(out, ref_name, WORLD)
    steps = set()
    for r in range(WORLD):
        assert case.rc(r) == 0, case.log(r)
        [resumed] = case.events(r, "resumed")
        assert resumed["tier"].startswith(tiers[r]), (r, resumed)
        steps.add(resumed["step"])
        want = dict(ref.losses(r))
        got = case.losses(r)
        assert got and [it for it, _ in got] == list(range(resumed["step"], N))
        assert all(loss == want[it] for it, loss in got), r
        assert_same_state(ref.final(r), case.final(r))
    assert len(steps) == 1
    return steps.pop()


def test_a_lost_node_resumes_from_its_peers_memory(out: Path, shm: Path) -> None:
    case = attach(out, shm, "a")
    run_cases([{**case, "name": "a1", "iterations": N, "kill": {"rank": None, "at": "forward:5"}}], WORLD, out)
    assert listed(replicas(case, 0, 2)) and listed(replicas(case, 0, 3))
    lose(case, 1, disks=True)
    run_cases([{**case, "name": "a2", "iterations": N}], WORLD, out)
    step = assert_resumed_like_ref(out, "a2", {0: "host:", 1: "host:", 2: "peer:", 3: "peer:"})
    assert step >= 3  # killed in the forward of iteration 5: at most the steps in flight are lost
    for r in range(WORLD):  # replication went on after the restart, up to the version committed on close
        assert listed(replicas(case, 1 - r // PER_NODE, r))[-1] == N, r


def test_a_rank_killed_mid_replication_leaves_no_half_replica(out: Path, shm: Path) -> None:
    case = attach(out, shm, "b", crash={"rank": 3, "step": 4})
    run_cases([{**case, "name": "b1", "iterations": N}], WORLD, out)
    assert Case(out, "b1", WORLD).rc(3) != 0
    held = listed(replicas(case, 0, 3))  # rank 3's replicas live on rank 1 (node 0)
    assert all(s < 4 for s in held), held  # it died sending its first version >= 4: never published
    own = listed(Path(case["peer"]["shm"]) / "node-1" / "own" / rank_dirname(3))
    assert max(own) >= 4  # there was a newer version to replicate
    lose(case, 1, disks=False)  # node 1's memory is gone; its disks are not
    run_cases([{**case, "name": "b2", "iterations": N, "peer": {k: v for k, v in case["peer"].items()
                                                                 if k != "crash"}}], WORLD, out)
    assert_resumed_like_ref(out, "b2", {0: "host:", 1: "host:", 2: "", 3: ""})


def test_a_corrupt_replica_falls_back_to_disk(out: Path, shm: Path) -> None:
    case = attach(out, shm, "c")
    run_cases([{**case, "name": "c1", "iterations": 5}], WORLD, out)  # ends cleanly: every tier has step 5
    assert listed(replicas(case, 0, 2))[-1] == 5
    lose(case, 1, disks=False)
    segments = sorted((replicas(case, 0, 2) / "v000000000005").glob("*.bin"))
    assert segments
    with open(segments[0], "r+b") as f:  # one bit flipped in rank 2's newest replica
        f.seek(os.path.getsize(segments[0]) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    run_cases([{**case, "name": "c2", "iterations": N}], WORLD, out)
    step = assert_resumed_like_ref(out, "c2", {0: "host:", 1: "host:", 2: "local:", 3: "peer:"})
    assert step == 5
    [resumed] = Case(out, "c2", WORLD).events(2, "resumed")
    assert any("peer:" in f for f in resumed["fallbacks"]), resumed


@pytest.mark.exhaustive  # ~45 s; DeepSpeed's peer restore is the same path as the plain loop's (the test above)
def test_deepspeed_zero2_lost_node_resumes_from_its_peers_memory(out: Path, shm: Path) -> None:
    pytest.importorskip("deepspeed")
    run_cases([{"kind": "ds", "stage": 2, "mode": "ref", "name": "ds_ref", "iterations": N}], WORLD, out)
    case = {**attach(out, shm, "ds"), "kind": "ds", "stage": 2}
    run_cases([{**case, "name": "ds1", "iterations": N, "kill": {"rank": None, "at": "forward:5"}}], WORLD, out)
    lose(case, 1, disks=True)
    run_cases([{**case, "name": "ds2", "iterations": N}], WORLD, out)
    step = assert_resumed_like_ref(out, "ds2", {0: "host:", 1: "host:", 2: "peer:", 3: "peer:"}, "ds_ref")
    assert step >= 3


@pytest.mark.exhaustive  # ~19 s; SIGTERM on every rank: tests/asymcheck/policy/test_preempt_multirank.py
def test_sigterm_on_every_rank_leaves_the_newest_step_on_the_disks(out: Path, shm: Path) -> None:
    case = attach(out, shm, "d")
    run_cases([{**case, "name": "d1", "iterations": N, "preempt": {"at": 5}}], WORLD, out)
    steps = set()
    for r in range(WORLD):
        [event] = Case(out, "d1", WORLD).events(r, "preempted")
        record = event["record"]
        assert record["durable"] and record["persistent_step"] == record["step"] == record["global_step"], record
        steps.add(record["step"])
    # SIGTERMed in the forward of iteration 5 (5 steps completed): the ranks agree to finish step 6, the one
    # in flight, and all flush it at the same boundary (asymcheck.policy.agreement); it is on every disk
    assert steps == {6}
    lose(case, 0, disks=False)  # both nodes' memories gone (a reboot): only the disks are left
    lose(case, 1, disks=False)
    run_cases([{**case, "name": "d2", "iterations": N}], WORLD, out)
    assert assert_resumed_like_ref(out, "d2", dict.fromkeys(range(WORLD), "local:")) == 6


EXIT_S = 20.0
"""A survivor's process must end within this long of its training program (measured: about 1-2 s)."""


def assert_exited_cleanly(job: Script, rank: int, status: int) -> float:
    """The rank's program ended, and its process ended within EXIT_S of it, with ``status``: no abort, no thread's
    traceback. Returns the seconds from the program's end to the process's."""
    ended, log = job.ended(rank), job.log(rank)
    assert ended is not None, log[-3000:]
    assert rank in job.exited, f"rank {rank} still running {time.time() - ended['t']:.0f} s after its program ended"
    took = job.exited[rank] - ended["t"]
    assert job.procs[rank].returncode != -signal.SIGABRT, log[-3000:]
    assert job.procs[rank].returncode == status, (job.procs[rank].returncode, log[-3000:])
    assert "terminate called" not in log and "Exception in thread" not in log, log[-3000:]
    assert took <= EXIT_S, (rank, took)
    return took


@pytest.mark.parametrize("exit", ["propagate", pytest.param("catch", marks=pytest.mark.exhaustive)])
def test_survivors_of_a_lost_node_exit_when_their_program_ends(tmp_path: Path, shm: Path, exit: str) -> None:
    case = {"world": WORLD, "per_node": PER_NODE, "timeout_s": 60, "iterations": 200, "step_s": 0.2,
            "shm": str(shm / f"e-{exit}"), "dir": str(tmp_path / "ck"), "exit": exit}
    job = Script(case, tmp_path / "out")
    try:
        job.wait_for_iterations(4, timeout=300)  # versions replicated both ways
        for r in (2, 3):  # node 1 is lost
            job.procs[r].send_signal(signal.SIGKILL)
        job.wait([0, 1], timeout=120 + EXIT_S)
    finally:
        job.kill_all()
    took = [assert_exited_cleanly(job, r, 1 if exit == "propagate" else 0) for r in (0, 1)]
    for r in (0, 1):
        error = job.ended(r)["error"]  # type: ignore[index]
        assert (error is not None) == (exit == "propagate"), error  # the DDP collective failed; caught or not
        if exit == "catch":  # the replica service of the lost rank's versions stopped: status() says why
            status = json.loads((job.out / f"status-rank{r}.json").read_text())
            assert f"replicas of rank {r + PER_NODE} held here" in status["peer_error"], status
    print(f"{exit}: survivors exited {took[0]:.2f} s and {took[1]:.2f} s after their programs ended")


def test_a_rank_whose_peer_dies_as_it_exits_exits_cleanly(tmp_path: Path, shm: Path) -> None:
    """2 ranks as 2 nodes of 1; both programs end without closing the Checkpointer, so each rank's replica
    service is still waiting in gloo for its peer's next frame. Node 1 is killed just as rank 0's interpreter
    starts finalizing (which takes 2 s more, as a large program's does): the wait fails then, unless ended before."""
    case = {"world": 2, "per_node": 1, "timeout_s": 60, "iterations": 6, "step_s": 0.1, "teardown_s": 2.0,
            "shm": str(shm / "f"), "dir": str(tmp_path / "ck"), "exit": "forget"}
    job = Script(case, tmp_path / "out")
    try:
        deadline = time.monotonic() + 300
        while not (job.out / "finalizing-rank0").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        job.procs[1].send_signal(signal.SIGKILL)
        job.wait([0], timeout=60)
    finally:
        job.kill_all()
    took = assert_exited_cleanly(job, 0, 0)
    print(f"peer killed at exit: rank 0 exited {took:.2f} s after its program ended")
