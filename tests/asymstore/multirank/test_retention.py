"""keep_every and keep_best on a multi-rank store: the global versions the rules keep, and only their shards.

Two ranks (threads with their own event loops, a real c10d ``HashStore``) commit 30 steps with
``keep_last=2, keep_every=10`` and the best ``eval_loss`` (reported at every fifth step, step 15
the best), then a new job on the same root commits six more: exactly the expected global
versions survive, every rank keeps exactly their shards, the decision is recorded in each global
manifest, and fsck finds nothing wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asymstore import KeepBest
from asymstore.fsck import check
from asymstore.multirank.globaldir import list_global_steps, read_global
from tests.support.ranks import run_ranks, store

BEST = KeepBest("eval_loss", "min", 1)


def eval_loss(step: int) -> float | None:
    if step % 5:
        return None
    return 0.1 if step == 15 else 1.0 + step / 100


def commit(root: Path, steps: range, **rules: Any) -> dict[int, Any]:
    kv = dist.HashStore()  # a new job: a new coordination store

    async def rank_fn(rank: int) -> list[int]:
        async with store(root, rank, 2, kv, wait_global=True, **rules) as s:
            if s.local.newest_step is not None:
                await s.restore()
            for step in steps:
                await s.put_many(step, {"w": torch.full((4,), float(step + rank))})
                loss = eval_loss(step)
                await s.commit(step, {"metrics": {"eval_loss": loss}} if loss is not None else {})
            await s.flush()
        return sorted({v for vs in s.local.versions().values() for v in vs})

    return run_ranks(2, rank_fn)


def shards(root: Path, rank: int) -> list[int]:
    return sorted(int(p.name[1:]) for p in (root / f"rank-{rank:05d}").glob("v*"))


def test_keep_every_and_keep_best_keep_global_versions_and_exactly_their_shards(tmp_path: Path) -> None:
    out = commit(tmp_path, range(1, 31), keep_last=2, keep_every=10, keep_best=BEST)
    want = [10, 15, 20, 29, 30]
    assert out == {0: want, 1: want}, out
    assert list_global_steps(str(tmp_path / "global")) == want
    assert [shards(tmp_path, r) for r in (0, 1)] == [want, want]
    record = read_global(str(tmp_path / "global"), 20).meta["asymstore"]["retention"]
    assert record["pinned"] == "keep_every" and record["rules"]["keep_every"] == 10
    assert read_global(str(tmp_path / "global"), 15).meta["metrics"] == {"eval_loss": 0.1}
    assert check(str(tmp_path)).ok

    # a restart (a new job, the same rules): the pins and the best stay, keep_last moves on
    out = commit(tmp_path, range(31, 37), keep_last=2, keep_every=10, keep_best=BEST)
    want = [10, 15, 20, 30, 35, 36]
    assert out == {0: want, 1: want}, out
    assert list_global_steps(str(tmp_path / "global")) == want
    assert [shards(tmp_path, r) for r in (0, 1)] == [want, want]
    report = check(str(tmp_path))
    assert report.ok, report.problems


def test_without_the_new_rules_nothing_changes(tmp_path: Path) -> None:
    out = commit(tmp_path, range(1, 8), keep_last=2)
    assert out == {0: [6, 7], 1: [6, 7]}
    assert "asymstore" not in read_global(str(tmp_path / "global"), 7).meta
