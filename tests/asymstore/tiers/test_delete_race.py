"""Deleting a version is idempotent: a deleter that races another (a sweep, a second retention) never fails.

Seen under load in the peer layout: the multi-rank retention deleted a shard
(manifest first) while the sweep after a publish removed the same directory,
now without a manifest; the retention's fsync of the directory then raised
FileNotFoundError and failed the next commit.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch

import asymstore.tiers.local as local_module
from asymstore import AsymStore, LocalTier
from asymstore.format.names import version_dirname


async def _committed(root: Path, steps: list[int]) -> LocalTier:
    tier = LocalTier(root)
    async with AsymStore([tier], keep_last=None) as store:
        for step in steps:
            await store.put(step, "w", torch.arange(1024, dtype=torch.float32) + step)
            await store.commit(step)
    return LocalTier(root)


async def test_a_version_swept_between_its_manifest_and_its_directory_is_deleted_without_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = await _committed(tmp_path / "t", [1, 2])
    await tier.open()
    real_fsync_dir = local_module.fsync_dir
    vdir = os.path.join(tier.root, version_dirname(1))

    def sweep_first(path: str) -> None:
        if path == vdir:  # the sweep removes the manifest-less directory just before this deleter's fsync
            shutil.rmtree(vdir)
        real_fsync_dir(path)

    monkeypatch.setattr(local_module, "fsync_dir", sweep_first)
    await tier.delete_version(1)
    monkeypatch.setattr(local_module, "fsync_dir", real_fsync_dir)
    assert await tier.list_versions() == [2] and not os.path.exists(vdir)
    await tier.delete_version(1)  # already gone: still no error
    await tier.close()


async def test_two_deleters_of_one_version_both_succeed(tmp_path: Path) -> None:
    tier = await _committed(tmp_path / "t", list(range(1, 9)))
    await tier.open()
    for step in range(1, 8):
        await asyncio.gather(tier.delete_version(step), tier.delete_version(step), tier.delete_version(step))
    assert await tier.list_versions() == [8]
    await tier.close()
