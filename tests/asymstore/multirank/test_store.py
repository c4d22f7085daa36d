"""RankStore and multi-rank fsck, in one process: each rank is a thread with its own event loop.

The ranks coordinate through a real c10d store (``torch.distributed.HashStore``),
the same calls the TCPStore of a job gets; tests/asymstore/multirank/test_ddp.py runs the
protocol across real processes with gloo and SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asymstore import CorruptVersionError, NoCheckpointError
from asymstore.errors import TierError
from asymstore.fsck import check, repair
from asymstore.fsck.__main__ import main as fsck_main
from asymstore.multirank import GlobalCommitError, RankStore, WorldSizeMismatchError
from asymstore.multirank.globaldir import list_global_steps, read_global
from asymstore.testing import FailingLocalTier
from tests.support.ranks import run_ranks, store


def value(step: int, rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) + 100 * step + rank


def commit_steps(root: Path, kv: Any, steps: dict[int, list[int]], world: int = 2,
                 **kw: Any) -> dict[int, Any]:
    """Rank r commits steps[r] in order; returns per rank the exceptions raised, by step."""
    async def rank_fn(rank: int) -> dict[int, str]:
        errors: dict[int, str] = {}
        async with store(root, rank, world, kv, **kw) as s:
            for step in steps[rank]:
                await s.put_many(step, {"w": value(step, rank), "b": torch.tensor([rank])})
                try:
                    await s.commit(step, {"rank": rank, "step": step})
                except Exception as exc:
                    errors[step] = type(exc).__name__
        return errors

    return run_ranks(world, rank_fn)


def restore_all(root: Path, kv: Any, world: int = 2, **kw: Any) -> dict[int, Any]:
    async def rank_fn(rank: int) -> Any:
        async with store(root, rank, world, kv, **kw) as s:
            ckpt = await s.restore()
            assert s.restored_global is not None and s.restored_global.step == ckpt.step
            return ckpt

    return run_ranks(world, rank_fn)


def test_two_ranks_publish_a_global_manifest_per_step_and_restore_their_own_shards(tmp_path: Path) -> None:
    kv = dist.HashStore()
    errors = commit_steps(tmp_path, kv, {0: [1, 2, 3], 1: [1, 2, 3]})
    assert errors == {0: {}, 1: {}}
    gdir = str(tmp_path / "global")
    assert list_global_steps(gdir) == [1, 2, 3]
    g = read_global(gdir, 3)
    assert g.world_size == 2 and [s.rank for s in g.shards] == [0, 1] and [s.step for s in g.shards] == [3, 3]
    assert g.shards[0].digest != g.shards[1].digest
    assert (tmp_path / "global" / "LATEST").read_text().strip() == "3"
    restored = restore_all(tmp_path, kv)
    for rank in (0, 1):
        ckpt = restored[rank]
        assert ckpt.step == 3 and ckpt.meta == {"rank": rank, "step": 3}
        assert torch.equal(ckpt.tensors["w"], value(3, rank))
    assert check(str(tmp_path)).ok


def test_a_rank_that_never_reports_leaves_the_previous_version_and_fsck_names_the_partial_one(
        tmp_path: Path) -> None:
    kv = dist.HashStore()
    started = time.monotonic()
    errors = commit_steps(tmp_path, kv, {0: [1, 2, 3], 1: [1, 2]}, timeout_s=1.0)
    assert errors[0] == {3: "GlobalCommitTimeoutError"} and errors[1] == {}
    assert time.monotonic() - started < 20
    assert list_global_steps(str(tmp_path / "global")) == [1, 2]

    report = check(str(tmp_path))
    assert not report.ok and report.newest_restorable == 2
    partial = [e for e in report.entries if e.status == "partial"]
    assert [(e.name, e.step) for e in partial] == [("global/v000000000003.json", 3)]
    assert "rank(s) [0] committed" in partial[0].problems[0] and "[1] have no shard" in partial[0].problems[0]
    assert report.to_json()["partial_steps"] == {"3": [0]}

    restored = restore_all(tmp_path, kv)
    assert [restored[r].step for r in (0, 1)] == [2, 2]
    assert torch.equal(restored[1].tensors["w"], value(2, 1))

    # after the restore, step 3 commits again on every rank: rank 0's orphan shard is rolled back
    async def again(rank: int) -> list[int]:
        async with store(tmp_path, rank, 2, kv) as s:
            await s.restore()
            await s.put_many(3, {"w": value(30, rank)})
            await s.commit(3)
            return s.versions()[s.tiers[0].name]

    assert run_ranks(2, again) == {0: [1, 2, 3], 1: [1, 2, 3]}
    assert check(str(tmp_path)).ok
    assert torch.equal(restore_all(tmp_path, kv)[0].tensors["w"], value(30, 0))


def test_a_rank_whose_shard_fails_makes_the_coordinator_fail_fast(tmp_path: Path) -> None:
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> Any:
        tiers = ([FailingLocalTier(tmp_path / "rank-00001", fail_at="manifest_half", after=1)] if rank == 1
                 else None)
        async with store(tmp_path, rank, 2, kv, tiers=tiers, timeout_s=30.0) as s:
            out = []
            for step in (1, 2):
                await s.put_many(step, {"w": value(step, rank)})
                try:
                    await s.commit(step)
                    out.append("ok")
                except (GlobalCommitError, TierError) as exc:
                    out.append(type(exc).__name__)
            return out

    started = time.monotonic()
    results = run_ranks(2, rank_fn)
    assert results == {0: ["ok", "GlobalCommitError"], 1: ["ok", "TierError"]}
    assert time.monotonic() - started < 15  # not the 30 s timeout
    assert list_global_steps(str(tmp_path / "global")) == [1]
    assert check(str(tmp_path)).partial_steps == {2: [0]}  # type: ignore[attr-defined]


def test_a_corrupt_shard_on_one_rank_makes_every_rank_fall_back(tmp_path: Path) -> None:
    kv = dist.HashStore()
    commit_steps(tmp_path, kv, {0: [1, 2], 1: [1, 2]})
    seg = next((tmp_path / "rank-00001" / "v000000000002").glob("seg-*"))
    data = bytearray(seg.read_bytes())
    data[3] ^= 0xFF
    seg.write_bytes(bytes(data))
    restored = restore_all(tmp_path, kv)
    assert [restored[r].step for r in (0, 1)] == [1, 1]
    assert any("global step 2" in f for f in restored[0].fallbacks)
    assert torch.equal(restored[0].tensors["w"], value(1, 0))
    report = check(str(tmp_path), deep=True)
    assert {e.name: e.status for e in report.entries}["global/v000000000002.json"] == "corrupt"
    assert report.newest_restorable == 1


def test_restore_needs_the_same_world_size_and_says_so(tmp_path: Path) -> None:
    commit_steps(tmp_path, dist.HashStore(), {0: [1], 1: [1]})
    out = restore_all(tmp_path, dist.HashStore(), world=1)
    assert isinstance(out[0], WorldSizeMismatchError)
    assert "2 rank(s); this job has 1" in str(out[0])


def test_every_rank_gets_no_checkpoint_from_an_empty_root(tmp_path: Path) -> None:
    out = restore_all(tmp_path, dist.HashStore())
    assert all(isinstance(out[r], NoCheckpointError) for r in (0, 1))


def test_retention_keeps_the_last_global_versions_and_the_shards_they_need(tmp_path: Path) -> None:
    kv = dist.HashStore()
    commit_steps(tmp_path, kv, {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5]}, keep_last=2)
    assert list_global_steps(str(tmp_path / "global")) == [4, 5]
    for rank in ("rank-00000", "rank-00001"):
        # shard versions (a directory kept only for segments later shards reference has no manifest)
        kept = sorted(p.parent.name for p in (tmp_path / rank).glob("v*/MANIFEST.json"))
        assert "v000000000004" in kept and "v000000000005" in kept and "v000000000001" not in kept
    assert check(str(tmp_path)).ok


def test_fsck_repair_removes_the_partial_step_and_the_cli_exit_status_follows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commit_steps(tmp_path, dist.HashStore(), {0: [1, 2], 1: [1]}, timeout_s=0.5)
    assert fsck_main([str(tmp_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == "multirank" and doc["partial_steps"] == {"2": [0]} and doc["newest_restorable"] == 1
    actions = repair(check(str(tmp_path)))
    assert "removed partial shard rank-00000/v000000000002" in actions
    assert not (tmp_path / "rank-00000" / "v000000000002").exists()
    assert fsck_main([str(tmp_path)]) == 0
    assert "verdict: OK" in capsys.readouterr().out


def test_a_corrupt_global_manifest_is_reported_and_skipped(tmp_path: Path) -> None:
    kv = dist.HashStore()
    commit_steps(tmp_path, kv, {0: [1, 2], 1: [1, 2]})
    (tmp_path / "global" / "v000000000002.json").write_text("{not json")
    report = check(str(tmp_path))
    assert {e.name: e.status for e in report.entries}["global/v000000000002.json"] == "corrupt"
    restored = restore_all(tmp_path, kv)
    assert restored[1].step == 1
    with pytest.raises(CorruptVersionError):
        read_global(str(tmp_path / "global"), 2)


def test_a_second_job_on_the_same_root_is_refused_and_dead_coordinators_leftovers_swept(tmp_path: Path) -> None:
    from asymstore import RootLockedError

    async def one_rank() -> None:
        first = store(tmp_path, 0, 1, dist.HashStore())
        await first.open()
        try:
            with pytest.raises(RootLockedError, match="global"):  # the coordinator's global/ is taken
                await store(tmp_path, 0, 1, dist.HashStore()).open()
            await first.put(1, "w", value(1, 0))
            await first.commit(1)
        finally:
            await first.close()
        (tmp_path / "global" / ".tmp-v000000000002.json-0badc0de").write_bytes(b"{half a global manifest")
        again = store(tmp_path, 0, 1, dist.HashStore())
        await again.open()  # a dead coordinator's temp file is swept at open
        try:
            assert not [p for p in (tmp_path / "global").iterdir() if p.name.startswith(".tmp-")]
            assert (await again.restore()).step == 1
        finally:
            await again.close()

    asyncio.run(one_rank())
    assert check(str(tmp_path), deep=True).ok


def test_after_falling_back_the_job_commits_the_abandoned_steps_again(tmp_path: Path) -> None:
    """Global versions newer than the one restored belong to an abandoned history: the next commit replaces them."""
    kv = dist.HashStore()
    commit_steps(tmp_path, kv, {0: [1, 2, 3], 1: [1, 2, 3]})
    seg = next((tmp_path / "rank-00001" / "v000000000003").glob("seg-*"))
    data = bytearray(seg.read_bytes())
    data[3] ^= 0xFF
    seg.write_bytes(bytes(data))

    async def go_on(rank: int) -> list[int]:
        async with store(tmp_path, rank, 2, kv) as s:
            ckpt = await s.restore()
            assert ckpt.step == 2
            for step in (3, 4):
                await s.put_many(step, {"w": value(step, rank) + 0.5, "b": torch.tensor([rank])})
                await s.commit(step, {"rank": rank, "step": step})
            return s.global_steps() if rank == 0 else []

    done = run_ranks(2, go_on)
    assert done[0] == [2, 3, 4], done
    restored = restore_all(tmp_path, kv)
    for r in range(2):
        assert restored[r].step == 4 and torch.equal(restored[r].tensors["w"], value(4, r) + 0.5)
    restored = run_ranks(2, lambda rank: _restore_step(tmp_path, kv, rank, 3))
    for r in range(2):
        assert torch.equal(restored[r].tensors["w"], value(3, r) + 0.5)  # the new step 3, not the abandoned one
    assert check(str(tmp_path), deep=True).ok


async def _restore_step(root: Path, kv: Any, rank: int, step: int) -> Any:
    async with store(root, rank, 2, kv) as s:
        return await s.restore(step)


@pytest.mark.parametrize("dropper", [1, 0])
def test_a_dropped_version_abandons_its_step_at_once_and_the_next_step_commits(tmp_path: Path, dropper: int) -> None:
    """A rank that drops step 2 says so: the global commit gives up at once (not after timeout_s), step 3 commits."""
    kv = dist.HashStore()
    timings: dict[int, float] = {}

    async def rank_fn(rank: int) -> dict[int, str]:
        errors: dict[int, str] = {}
        async with store(tmp_path, rank, 2, kv, timeout_s=30.0, wait_global=True) as s:
            for step in (1, 2, 3):
                started = time.monotonic()
                if step == 2 and rank == dropper:
                    await s.report_dropped(step, "a tensor changed before its copy")
                else:
                    await s.put_many(step, {"w": value(step, rank)})
                    try:
                        await s.commit(step)
                    except GlobalCommitError as exc:
                        errors[step] = type(exc).__name__
                timings[rank * 10 + step] = time.monotonic() - started
        return errors

    out = run_ranks(2, rank_fn)
    other = 1 - dropper
    assert out[dropper] == {} and out[other] == {2: "GlobalVersionDroppedError"}, out
    assert timings[other * 10 + 2] < 10.0  # told at once, not after the 30 s timeout
    assert list_global_steps(str(tmp_path / "global")) == [1, 3]
    report = check(str(tmp_path))
    assert report.ok, report.problems  # the dropped step's shard was rolled back or retired, nothing partial


def test_a_rank_dropping_a_version_does_not_stall_the_other_ranks_checkpointer(tmp_path: Path) -> None:
    """Checkpointers over RankStores: rank 1's version 3 is dropped (an EMA swap between steps, unguarded);
    rank 0's commit of step 3 gives up at once, so its next version does not wait for timeout_s."""
    import warnings

    from asymcheck import Checkpointer
    from asymcheck.options import PacingOptions, PartitionOptions, PreemptionOptions
    from tests.support.asymcheck_train import data, make_model, make_opt

    kv = dist.HashStore()
    step_s: dict[int, list[float]] = {0: [], 1: []}
    dropped: dict[int, int] = {}

    async def rank_fn(rank: int) -> None:
        model = make_model()
        opt, _ = make_opt(model)
        s = RankStore(tmp_path, rank=rank, world_size=2, kv=kv, timeout_s=60.0, segment_bytes=1 << 20,
                      compression="never")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Checkpointer(model, opt, s, pacing=PacingOptions(max_overhead=None),
                              preemption=PreemptionOptions(preempt_on="none"),
                              partitions=PartitionOptions(warmup=1)) as ckpt:
                for it in range(8):
                    started = time.monotonic()
                    x, y = data(it)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if rank == 1 and it == 3:  # an EMA swap between steps, not declared: version 3 is dropped
                        with torch.no_grad():
                            for p in model.parameters():
                                p.add_(1.0)
                                p.sub_(1.0)
                    step_s[rank].append(time.monotonic() - started)
                dropped[rank] = ckpt.versions_dropped

    started = time.monotonic()
    out = run_ranks(2, rank_fn)
    assert all(v is None for v in out.values()), out
    assert dropped == {0: 0, 1: 1}
    assert time.monotonic() - started < 40.0 and max(step_s[0]) < 20.0, step_s  # never the 60 s timeout
    steps = list_global_steps(str(tmp_path / "global"))
    assert 4 not in steps and steps[-1] == 8, steps  # version 4 (after step 4) dropped; the rest on time


def test_a_job_killed_before_its_first_global_version_restarts_and_commits(tmp_path: Path) -> None:
    """Shards left by a job killed before any global version belong to none: the restarted job replaces them.

    Seen as a hang: every commit of the restarted job failed with "step 1 is already committed" on the
    ranks holding such shards, and the coordinator waited for them until its timeout.
    """

    async def leftovers(rank: int) -> tuple[list[list[int]], list[int]]:  # shards committed; no global version
        async with store(tmp_path, rank, 2, dist.HashStore()) as s:
            for step in range(1, 3 + rank):
                await s.local.put(step, "w", value(step, rank))
                await s.local.commit(step)
            return list(s.versions().values()), s.global_steps()

    setup = run_ranks(2, leftovers)  # a failed setup would leave nothing for the restart to meet
    assert setup == {0: ([[1, 2]], []), 1: ([[1, 2, 3]], [])}, setup
    kv = dist.HashStore()

    async def restart(rank: int) -> tuple[bool, list[int]]:
        async with store(tmp_path, rank, 2, kv) as s:
            fresh = False
            try:
                await s.restore()
            except NoCheckpointError:
                fresh = True
            for step in (1, 2):
                await s.put(step, "w", value(step, rank) + 0.5)
                await s.commit(step)
            ckpt = await s.restore()
            assert torch.equal(ckpt.tensors["w"], value(2, rank) + 0.5)
            return fresh, s.global_steps()

    out = run_ranks(2, restart)
    assert out == {0: (True, [1, 2]), 1: (True, [1, 2])}, out
