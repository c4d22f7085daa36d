"""A multi-rank job opening a single-process root (asymstore/multirank/takeover.py, rootlayout.py), in one process.

Ranks are threads over a c10d HashStore (tests/support/ranks.py); the single-process root is written by a
real AsymStore over a LocalTier, every version with its layout (so a multi-rank job can reshard it).

- What is current is decided once, from what the root holds (``RootSurvey.current``): a ``global/`` that a
  multi-rank job created at open, or a record it wrote just before a first global version it never
  published, leaves the single-process versions current, for fsck, export and the DCP reader alike.
- A multi-rank job that neither resumed them nor was told ``across_layouts="start_fresh"`` is refused at
  its first commit on every rank, before anything is committed.
- A single-process writer still running on the root makes the takeover a typed error on every rank, and
  none can open the root while the takeover is in progress.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asymcheck import Checkpointer
from asymcheck.errors import CommitFailedError
from asymcheck.options import PacingOptions, PreemptionOptions
from asymstore import AsymStore, LocalTier, open_store
from asymstore.dcp.spec import own_store
from asymstore.errors import LayoutTakeoverError, RootLockedError, WorldSizeMismatchError
from asymstore.export import export
from asymstore.format.pieces import LAYOUT_KEY, TensorLayout, layout_meta
from asymstore.fsck import check, repair
from asymstore.io.rootlock import DirLock
from asymstore.multirank import RankStore
from asymstore.multirank.rootlayout import LAYOUT_FILE, read_record, record_multirank, record_single, survey
from tests.support.ranks import run_ranks, store

SHAPE = (12,)


def tensors(step: int) -> dict[str, torch.Tensor]:
    return {"model/w": torch.arange(12, dtype=torch.float32) + step}


def meta() -> dict[str, Any]:
    return {LAYOUT_KEY: layout_meta({"model/w": TensorLayout.whole(SHAPE, "float32")})}


async def put_commit(s: AsymStore | RankStore, step: int) -> None:
    await s.put_many(step, tensors(step))
    await s.commit(step, meta())


def single_root(root: Path, steps: tuple[int, ...] = (4, 5, 6)) -> None:
    """What a one-process Checkpointer leaves: ``ROOT/v…``, ``ROOT/LATEST`` and the record."""
    async def go() -> None:
        async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20, compression="never") as s:
            for step in steps:
                await put_commit(s, step)

    asyncio.run(go())
    record_single(str(root))


def whole(old: Any) -> dict[str, TensorLayout]:
    return {n: TensorLayout.whole(lay.global_shape, lay.dtype) for n, lay in old.items()}


def single_versions_intact(root: Path, newest: int = 6) -> None:
    """fsck finds the root a clean single-process root whose LATEST says ``newest``; repair touches nothing."""
    report = check(str(root))
    assert report.ok, report.problems
    assert report.layout == "single"
    assert [(e.step, e.status) for e in report.entries if e.name.startswith("v0")] == [
        (s, "committed") for s in range(4, newest + 1)]
    assert report.latest == newest and report.newest_restorable == newest
    assert repair(report) == []
    assert (root / "LATEST").read_text().strip() == str(newest)


def exported_step(root: Path, tmp_path: Path) -> int:
    out = tmp_path / f"out-{len(os.listdir(tmp_path))}.safetensors"
    summary = asyncio.run(export(str(root), "safetensors", str(out)))
    return int(summary["step"])


def test_a_job_that_stopped_at_restore_leaves_the_single_process_versions_current(tmp_path: Path) -> None:
    """3 ranks open the root (creating global/) and raise WorldSizeMismatchError: fsck, export, DCP read v4..6."""
    root = tmp_path / "ck"
    single_root(root)
    kv = torch.distributed.HashStore()

    async def go(rank: int) -> None:
        async with store(root, rank, 3, kv) as s:  # no reshard set
            await s.restore()

    got = run_ranks(3, go)
    assert all(isinstance(e, WorldSizeMismatchError) for e in got.values()), got
    assert (root / "global").is_dir() and survey(str(root)).layout == "single"
    single_versions_intact(root)  # was: not OK ("two layouts"), LATEST stale and --repair deleted it
    assert exported_step(root, tmp_path) == 6  # was: NoCheckpointError (no global version)
    reader = own_store(str(root), None, {}, read_only=True)  # was: the root as a multi-rank root (nothing in it)
    assert isinstance(reader, AsymStore)
    assert isinstance(open_store(str(root), keep_last=3), AsymStore)


def test_a_job_that_died_before_its_first_global_version_leaves_them_current(tmp_path: Path) -> None:
    """The crash window: the record says multi-rank (written just before the first publish), nothing published."""
    root = tmp_path / "ck"
    single_root(root)
    (root / "global").mkdir()
    (root / "rank-00000").mkdir()
    assert record_multirank(str(root), 3, resumed_single=6)  # what the coordinator wrote, then it died
    assert survey(str(root)).current == "single"
    single_versions_intact(root)  # was: v4..6 "superseded", nothing restorable, LATEST stale
    assert exported_step(root, tmp_path) == 6  # was: NoCheckpointError
    assert isinstance(own_store(str(root), None, {}, read_only=True), AsymStore)
    # one process goes on with them, and its first commit records the root as single-process again
    asyncio.run(_commit_one(root, 7))
    record_single(str(root))
    record = read_record(str(root))
    assert record is not None and (record.layout, record.world_size, record.previous) == ("single", 1, ())
    single_versions_intact(root, 7)


async def _commit_one(root: Path, step: int) -> None:
    async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20, compression="never") as s:
        await s.restore()
        await put_commit(s, step)


def test_a_multirank_job_that_did_not_resume_is_refused_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    single_root(root)
    before = (root / LAYOUT_FILE).read_bytes()
    kv = torch.distributed.HashStore()

    async def go(rank: int) -> tuple[list[str], dict[str, list[int]]]:
        errors = []
        async with store(root, rank, 2, kv) as s:  # no restore()
            for step in (1, 2):  # the next step is refused the same way
                try:
                    await put_commit(s, step)
                except LayoutTakeoverError as exc:
                    errors.append(str(exc))
            return errors, s.versions()

    got = run_ranks(2, go)
    for rank, (errors, versions) in got.items():
        assert len(errors) == 2, (rank, got)
        assert "3 single-process version(s), newest step 6" in errors[0] and "start_fresh" in errors[0]
        assert versions == {f"local:{root / f'rank-{rank:05d}'}": []}, versions  # nothing committed
    assert (root / LAYOUT_FILE).read_bytes() == before  # was: rewritten, "resumed": false, LATEST dropped
    assert survey(str(root)).global_steps == ()
    single_versions_intact(root)


@pytest.mark.parametrize("how", ["start_fresh", "resume"])
def test_a_takeover_asked_for_goes_on_and_is_recorded(tmp_path: Path, how: str) -> None:
    root = tmp_path / "ck"
    single_root(root)
    kv = torch.distributed.HashStore()

    async def go(rank: int) -> int | None:
        async with store(root, rank, 2, kv, across_layouts=how, wait_global=True) as s:
            s.reshard = whole
            try:
                step = (await s.restore()).step
            except Exception as exc:  # start_fresh: nothing to restore
                assert how == "start_fresh" and type(exc).__name__ == "NoCheckpointError", exc
                step = None
            await put_commit(s, 7)
            return step

    got = run_ranks(2, go)
    assert got == {0: None, 1: None} if how == "start_fresh" else got == {0: 6, 1: 6}, got
    record = json.loads((root / LAYOUT_FILE).read_text())
    assert record["layout"] == "multirank" and record["previous"] == [
        {"layout": "single", "world_size": 1, "newest_step": 6, "resumed": how == "resume"}]
    report = check(str(root))
    assert report.ok, report.problems
    assert [e.status for e in report.entries if e.name.startswith("v0")] == ["superseded"] * 3


def test_a_single_process_writer_still_running_blocks_the_takeover_on_every_rank(tmp_path: Path) -> None:
    """The old job still drains (its store open): every rank gets RootLockedError; its versions are untouched."""
    root = tmp_path / "ck"
    single_root(root)
    kv = torch.distributed.HashStore()

    async def rank_fn(rank: int) -> int:
        async with store(root, rank, 2, kv) as s:
            s.reshard = whole
            return (await s.restore()).step

    async def old_job() -> dict[int, Any]:
        async with AsymStore([LocalTier(root)], keep_last=2, segment_bytes=1 << 20, compression="never") as old:
            got = await asyncio.to_thread(run_ranks, 2, rank_fn)
            await put_commit(old, 7)  # it goes on committing (and retention deletes v4, v5)
        return got

    got = asyncio.run(old_job())
    assert all(isinstance(e, RootLockedError) for e in got.values()), got  # was: resumed 6 beside a live writer
    assert "one writer per root" in str(got[0]) and "one writer per root" in str(got[1])
    assert read_record(str(root)).layout == "single"  # type: ignore[union-attr]
    assert survey(str(root)).single_steps == (6, 7)
    assert (root / "LATEST").read_text().strip() == "7"

    # once it is gone, the takeover goes on; the lock is held until the first global version is published
    kv = torch.distributed.HashStore()
    seen: dict[int, Any] = {}

    async def takeover(rank: int) -> int:
        async with store(root, rank, 2, kv, wait_global=True) as s:
            s.reshard = whole
            step = (await s.restore()).step
            if rank == 0:
                seen["during"] = DirLock(str(root)).holder()
                try:
                    await AsymStore([LocalTier(root)], keep_last=None).open()
                except RootLockedError as exc:
                    seen["second writer"] = exc
            await put_commit(s, step + 1)
            if rank == 0:
                seen["after"] = DirLock(str(root)).holder()
            return step

    assert run_ranks(2, takeover) == {0: 7, 1: 7}
    assert seen["during"] is not None and isinstance(seen["second writer"], RootLockedError), seen
    assert seen["after"] is None, seen
    assert survey(str(root)).global_steps == (8,)


def test_a_checkpointer_that_skips_resume_stops_at_the_next_step(tmp_path: Path) -> None:
    """A Checkpointer over a multi-rank store that never called resume(): refused, and training stops at once."""
    root = tmp_path / "ck"
    single_root(root)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank_store = RankStore(root, rank=0, world_size=1, segment_bytes=1 << 20, compression="never")
    ckpt = Checkpointer(model, opt, rank_store, preemption=PreemptionOptions(preempt_on="none"),
                        pacing=PacingOptions(max_overhead=None))
    steps = 0
    with pytest.raises(CommitFailedError, match="LayoutTakeoverError") as info:
        for _ in range(10):  # was: each failure logged and counted; training went on for the budget (30 min)
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            ckpt.flush()
    assert isinstance(info.value.__cause__, LayoutTakeoverError)
    assert steps <= 2, steps  # the first version's commit is refused; the next step stops
    with pytest.raises(CommitFailedError):
        ckpt.close()
    assert survey(str(root)).global_steps == () and (root / "LATEST").read_text().strip() == "6"
    single_versions_intact(root)


def test_only_a_refusal_every_rank_met_stops_training_under_the_budget() -> None:
    """The coordinator's own last check at publish reaches the other ranks as a failed commit: it must not stop
    rank 0 alone (the others would wait in their next collective); every rank's check does stop every rank."""
    from asymcheck.policy.failures import FailureBudget
    from asymcheck.stats import StatsRecorder
    from asymstore.multirank.rootlayout import takeover_refusal

    budget = FailureBudget(StatsRecorder(), "budget", 100, None)
    alone = takeover_refusal("the root holds single-process versions 4..6", 6)
    budget.check(3, alone)  # counted against the budget like any failed commit
    everywhere = takeover_refusal("the root holds single-process versions 4..6", 6)
    everywhere.every_rank = True
    with pytest.raises(CommitFailedError, match="LayoutTakeoverError"):
        budget.check(3, everywhere)


def test_a_job_on_an_empty_root_holds_it_until_its_first_global_version(tmp_path: Path) -> None:
    """A single-process writer that opened an empty root while a multi-rank job starts would commit beside it."""
    root = tmp_path / "ck"
    kv = torch.distributed.HashStore()
    seen: dict[str, Any] = {}

    async def rank_fn(rank: int) -> None:
        async with store(root, rank, 2, kv, wait_global=True) as s:
            if rank == 0:
                try:
                    await AsymStore([LocalTier(root)], keep_last=None).open()
                except RootLockedError as exc:
                    seen["before"] = exc
            await put_commit(s, 1)
            if rank == 0:
                seen["after"] = DirLock(str(root)).holder()

    out = run_ranks(2, rank_fn)
    assert out == {0: None, 1: None}, out
    assert isinstance(seen.get("before"), RootLockedError) and seen["after"] is None, seen
    assert survey(str(root)).global_steps == (1,) and survey(str(root)).single_steps == ()


def test_a_failed_open_gives_the_root_lock_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asymstore.multirank import takeover

    root = tmp_path / "ck"
    single_root(root)

    async def broken_share(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the coordination store went away")

    monkeypatch.setattr(takeover, "share", broken_share)
    with pytest.raises(ConnectionError):
        asyncio.run(RankStore(root, rank=0, world_size=1, segment_bytes=1 << 20).open())
    assert DirLock(str(root)).holder() is None and DirLock(str(root / "global")).holder() is None
