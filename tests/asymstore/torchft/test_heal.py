"""torchft's own Manager and lighthouse on CPU: a replica group SIGKILLed mid-training heals from the other's store.

Two replica groups of one rank (two, in an exhaustive case), each rank a real process
(``tests/procs/torchft_group.py``), torchft's ``LighthouseServer`` in this process,
``ProcessGroupGloo`` between the groups. Group 1 is killed after a committed step, restarted,
heals through ``StoreTransport`` from group 0's memory tier, and the job goes on; each group's
versions also reach its disk (the newest one there is its final state). With
``min_replica_size=2`` no step commits while a group is missing, so every committed step's losses
and the final weights equal those of an uninterrupted run (computed here, in one process, as
torchft averages: the sum of the two groups' gradients over 2).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchft")

from torchft._torchft import LighthouseServer

from asymstore import AsymStore, Checkpoint, LocalTier
from asymstore.runtime.sync import run_sync
from asymstore.torchft.state import unflatten
from tests.procs.torchft_group import batch

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn_group(rid: int, lighthouse: str, steps: int, root: Path, logs: list[Path],
                 quorum: str) -> list[subprocess.Popen[str]]:
    """Start every rank of replica group ``rid`` (rank r logs to ``logs[r]``)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    port = _free_port()
    return [subprocess.Popen([sys.executable, "-m", "tests.procs.torchft_group", str(rid), lighthouse, str(steps),
                              str(root), str(out), quorum, str(rank), str(len(logs)), str(port)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank, out in enumerate(logs)]


def _wait_step(proc: subprocess.Popen[str], step: int, deadline: float, seen: list[str]) -> None:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.strip() == f"STEP {step}":
            return
    raise AssertionError(f"the group never reached step {step}:\n{''.join(seen[-40:])}")


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _uninterrupted(steps: int, rank: int, seed: int = 0) -> tuple[dict[int, list[float]], dict[str, torch.Tensor]]:
    """Losses per committed step of ``rank`` of groups 0 and 1, and its final weights, of a run nobody interrupts."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        losses: dict[int, list[float]] = {}
        for n in range(steps):
            grads = []
            losses[n + 1] = []
            for g in (0, 1):
                model.zero_grad(set_to_none=True)
                x, y = batch(g, rank, n)
                loss = F.mse_loss(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                losses[n + 1].append(loss.item())
                grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
            for p, a, b in zip(model.parameters(), *grads, strict=True):
                p.grad = (a + b) / 2
            opt.step()
        return losses, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(before)


def _run_with_kill(tmp_path: Path, steps: int, kill_after: int, quorum: str = "async", world: int = 1) -> None:
    """Run 2 groups of ``world`` ranks; SIGKILL every rank of group 1 after ``kill_after``; restart it; check."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200, heartbeat_timeout_ms=2000)
    lives = ("g0", "g1-first", "g1-second")
    logs = {life: [tmp_path / f"{life}-rank{r}.jsonl" for r in range(world)] for life in lives}
    procs: list[subprocess.Popen[str]] = []
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120 * world
        group0 = _spawn_group(0, lighthouse.address(), steps, tmp_path, logs["g0"], quorum)
        first = _spawn_group(1, lighthouse.address(), steps, tmp_path, logs["g1-first"], quorum)
        procs += group0 + first
        _wait_step(first[0], kill_after, deadline, seen)
        for p in first:
            p.send_signal(signal.SIGKILL)
        for p in first:
            p.wait(10)
        second = _spawn_group(1, lighthouse.address(), steps, tmp_path, logs["g1-second"], quorum)
        procs += second
        for p in group0 + second:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, out[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    for rank in range(world):
        _check_rank(rank, steps, kill_after, *(_records(logs[life][rank]) for life in lives),
                    init_sync=quorum.endswith("+init"))
        for rid in (0, 1):  # persistent versions went on to each group's disk: the last one is the final state
            final = next(r for r in _records(logs["g0" if rid == 0 else "g1-second"][rank]) if "final" in r)
            ck = run_sync(_restore_disk(tmp_path / f"group-{rid}" / f"rank-{rank}"))
            assert ck.step == steps and ck.tier.startswith("local")
            model = unflatten(ck.meta["torchft"]["state"], ck.tensors)["user"]["default"]["model"]
            for name, values in final["final"].items():
                assert torch.equal(model[name], torch.tensor(values, dtype=model[name].dtype)), (rid, name)


async def _restore_disk(root: Path) -> Checkpoint:
    async with AsymStore([LocalTier(root)], read_only=True, calibration_cache=False) as store:
        return await store.restore()


def _check_rank(rank: int, steps: int, kill_after: int, g0: list[dict[str, Any]], first: list[dict[str, Any]],
                second: list[dict[str, Any]], *, init_sync: bool) -> None:
    seed = 0
    if init_sync:  # torchft's step-0 sync: one group healed from the other's version 0 (its own seed's weights)
        at_zero = [r["healed"] for r in g0 + first if "healed" in r]
        assert len(at_zero) == 1 and at_zero[0]["step"] == 0, at_zero
        seed = int(at_zero[0]["group"])
    healed = [r for r in second if "healed" in r]
    assert len(healed) == 1, second
    heal = healed[0]["healed"]
    assert heal["group"] == "0" and heal["tier"] == "memory", heal
    n = heal["step"]
    assert n >= kill_after
    # the healed weights are group 0's committed version of that step (same rank), bit for bit
    saved0 = {r["saved"]: r["digest"] for r in g0 if "saved" in r}
    assert healed[0]["digest"] == saved0[n]
    final0 = next(r for r in g0 if "final" in r)
    assert n in final0["served"]  # group 0 was asked for that step, and served it from its store
    ref_losses, ref_final = _uninterrupted(steps, rank, seed)
    losses0 = {r["step"]: r["loss"] for r in g0 if "step" in r}
    losses1 = {r["step"]: r["loss"] for r in first + second if "step" in r}
    assert sorted(losses0) == list(range(1, steps + 1))
    assert min(r["step"] for r in second if "step" in r) == n + 1
    assert set(losses1) >= set(range(1, kill_after + 1)) | set(range(n + 1, steps + 1))
    for step, loss in losses0.items():
        assert loss == ref_losses[step][0], (rank, step, loss, ref_losses[step])
    for step, loss in losses1.items():
        assert loss == ref_losses[step][1], (rank, step, loss, ref_losses[step])
    final1 = next(r for r in second if "final" in r)
    assert final0["digest"] == final1["digest"]
    for name, ref in ref_final.items():
        assert torch.equal(torch.tensor(final0["final"][name], dtype=ref.dtype), ref), name


def test_killed_group_heals_from_peer_store(tmp_path: Path) -> None:
    """SIGKILL group 1 after step 2 of 5; it restarts, heals from group 0's memory tier, losses as uninterrupted."""
    _run_with_kill(tmp_path, steps=5, kill_after=2)


@pytest.mark.exhaustive
@pytest.mark.parametrize(("steps", "kill_after", "quorum", "world"),
                         [(12, 1, "async", 1), (12, 7, "async", 1), (8, 3, "sync", 1), (6, 2, "async", 2),
                          (6, 2, "sync+init", 1)])
def test_killed_group_heals_longer_runs(tmp_path: Path, steps: int, kill_after: int, quorum: str, world: int) -> None:
    """Other kill points of a longer run, torchft's synchronous quorum, groups of 2 ranks (both killed), and
    torchft's step-0 sync from a group seeded differently (healed from the other's version 0 first)."""
    _run_with_kill(tmp_path, steps=steps, kill_after=kill_after, quorum=quorum, world=world)
