"""A rank's shard directory without a manifest: removed when the job's retention was deleting it, else quarantined.

Each rank's own store keeps every shard itself (the job's retention deletes them, through the global
versions), so its sweep learns from the RankStore which shard is the oldest a kept global version
still needs: a manifest-less shard below it is what a delete interrupted by a crash leaves (the
manifest goes first) and is removed; one at or above it, or any under no retention rule, may be a
committed shard that lost its manifest and is moved to ``.quarantine/``. Two ranks as threads over a
real c10d HashStore, real directories.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asymstore.format.manifest import MANIFEST_NAME
from asymstore.format.names import QUARANTINE, version_dirname
from tests.support.ranks import run_ranks, store


def commit(root: Path, steps: range, **rules: Any) -> dict[int, Any]:
    kv = dist.HashStore()

    async def rank_fn(rank: int) -> list[int]:
        async with store(root, rank, 2, kv, wait_global=True, **rules) as s:
            if s.local.newest_step is not None:
                await s.restore()
            for step in steps:
                await s.put_many(step, {"w": torch.full((4,), float(step + rank))})
                await s.commit(step)
            await s.flush()
        return sorted({v for vs in s.local.versions().values() for v in vs})

    return run_ranks(2, rank_fn)


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank:05d}"


def without_manifest(root: Path, rank: int, step: int, *, like: int) -> Path:
    """A shard directory of ``step`` holding ``like``'s segments and no manifest (a delete cut short)."""
    dest = rank_dir(root, rank) / version_dirname(step)
    shutil.copytree(rank_dir(root, rank) / version_dirname(like), dest)
    (dest / MANIFEST_NAME).unlink()
    return dest


def quarantined(root: Path, rank: int) -> list[str]:
    q = rank_dir(root, rank) / QUARANTINE
    return sorted(p.name[:13] for p in q.iterdir()) if q.exists() else []


def test_a_shard_delete_cut_short_is_removed_under_the_jobs_retention(tmp_path: Path) -> None:
    assert commit(tmp_path, range(1, 6), keep_last=2) == {0: [4, 5], 1: [4, 5]}
    cut = without_manifest(tmp_path, 0, 2, like=4)  # below the oldest kept shard (4): retention's delete
    lost = without_manifest(tmp_path, 1, 6, like=5)  # above it: maybe a committed shard whose manifest was lost
    out = commit(tmp_path, range(6, 8), keep_last=2)
    assert out == {0: [6, 7], 1: [6, 7]}, out
    assert not cut.exists() and quarantined(tmp_path, 0) == []
    assert (lost / MANIFEST_NAME).exists()  # moved aside, then step 6 committed anew in its place
    assert quarantined(tmp_path, 1) == [version_dirname(6)]


def test_without_a_retention_rule_every_manifest_less_shard_is_quarantined(tmp_path: Path) -> None:
    commit(tmp_path, range(1, 4), keep_last=None)
    (rank_dir(tmp_path, 0) / version_dirname(1) / MANIFEST_NAME).unlink()  # the oldest shard loses its manifest
    commit(tmp_path, range(4, 5), keep_last=None)
    assert quarantined(tmp_path, 0) == [version_dirname(1)]
