"""keep_last + keep_every + keep_best in a real store: exactly the expected set, across a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.errors import InvalidMetaError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import version_dirname
from asymstore.fsck import check
from asymstore.policy.retention import KeepBest, Note, Retention


def loss_at(step: int) -> float:
    return 10.0 / step + (0.5 if step % 7 == 0 else 0.0) if step != 23 else 0.01  # step 23 is the best


async def run(root: Path, steps: range, **rules: object) -> list[int]:
    async with AsymStore([host_tier(64 << 20), LocalTier(root)], keep_last=2, **rules) as store:  # type: ignore[arg-type]
        for step in steps:
            await store.put(step, "w", torch.full((256,), float(step)))
            meta = {"metrics": {"eval_loss": loss_at(step)}} if step % 3 == 2 else {}  # evaluated now and then
            await store.commit(step, meta)
        await store.flushed()
        return store.versions()[f"local:{root}"]


async def test_fifty_steps_keep_last_every_and_best_then_a_restart_keeps_the_same_set(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    best = KeepBest("eval_loss", "min", k=1)
    kept = await run(root, range(1, 51), keep_every=10, keep_best=best)
    assert kept == [10, 20, 23, 30, 40, 49, 50]  # every 10th, the best (step 23), the newest two
    # a restart with keep_every dropped from the settings: the recorded pins still hold
    kept = await run(root, range(51, 56), keep_best=best)
    assert kept == [10, 20, 23, 30, 40, 50, 54, 55]
    doc = json.loads((root / version_dirname(20) / MANIFEST_NAME).read_bytes())
    assert doc["meta"]["asymstore"]["retention"]["pinned"] == "keep_every"
    report = check(str(root))
    assert report.ok, report.problems
    kept_by = {e.step: e.kept_by for e in report.entries if e.status == "committed"}
    assert kept_by[10] == ["keep_every"] and kept_by[23] == ["keep_best"] and kept_by[55] == ["keep_last"]


async def test_the_memory_tier_keeps_only_the_newest_and_the_stores_key_is_reserved(tmp_path: Path) -> None:
    async with AsymStore([host_tier(64 << 20), LocalTier(tmp_path / "c")], keep_last=2, keep_every=2) as store:
        for step in range(1, 7):
            await store.put(step, "w", torch.zeros(4))
            await store.commit(step)
        await store.flushed()
        assert store.versions() == {"host:memory": [5, 6], f"local:{tmp_path / 'c'}": [2, 4, 5, 6]}
        await store.put(7, "w", torch.zeros(4))
        with pytest.raises(InvalidMetaError, match="asymstore"):
            await store.commit(7, {"asymstore": {"retention": {"pinned": "keep_every"}}})


def test_rules_are_checked_and_unreadable_notes_keep_nothing_extra() -> None:
    for bad in ({"keep_every": 0}, {"keep_last": -1}):
        with pytest.raises(ValueError):
            Retention(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        KeepBest("loss", "median")  # type: ignore[arg-type]
    rules = Retention(keep_last=1, keep_best=KeepBest("acc", "max", k=2))
    notes = {1: Note(metric=0.5), 2: Note(metric=0.9), 3: Note(), 4: Note(metric=0.7), 5: Note()}
    assert rules.kept(notes) == {5: ["keep_last"], 2: ["keep_best"], 4: ["keep_best"]}
    assert rules.to_delete(notes) == [1, 3]
    assert rules.to_delete(notes, persistent=False) == [1, 2, 3, 4]
    assert rules.note_of({"asymstore": "garbage", "metrics": {"acc": float("nan")}}) == Note()
