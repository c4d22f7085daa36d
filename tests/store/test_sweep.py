"""Sweeping with judgment: a version directory without a manifest is removed at open only when an interrupted
retention delete can have left it (older than the oldest committed version); any other one — a committed version
whose manifest a person, a disk or a tool lost — is moved to ``.quarantine/`` with a WARNING, and fsck says so.
Real directories with fsync, a real pyarrow file:// filesystem and the loopback moto S3 server.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

from asymstore import AsymStore, LocalTier
from asymstore.fsck import check, repair
from asymstore.tiers.remote.tier import RemoteTier

STEPS = [1, 2, 3, 4, 5]


def tensor(step: int) -> torch.Tensor:
    return torch.arange(1024, dtype=torch.float32) + step


async def commit_all(tier: Any) -> None:
    async with AsymStore([tier], keep_last=None, segment_bytes=1 << 20, compression="never") as s:
        for step in STEPS:
            await s.put(step, "w", tensor(step))
            await s.commit(step)


async def reopen(tier: Any) -> tuple[list[int], int]:
    async with AsymStore([tier], keep_last=None, segment_bytes=1 << 20, compression="never") as s:
        ckpt = await s.restore()
        assert torch.equal(ckpt.tensors["w"], tensor(ckpt.step))
        return await tier.list_versions(), ckpt.step


def test_a_committed_version_that_lost_its_manifest_is_quarantined_not_deleted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "t"
    asyncio.run(commit_all(LocalTier(root)))
    segments = sorted(p.name for p in (root / "v000000000003").iterdir() if p.name != "MANIFEST.json")
    (root / "v000000000003" / "MANIFEST.json").unlink()
    with caplog.at_level(logging.WARNING):
        listed, newest = asyncio.run(reopen(LocalTier(root)))
    assert listed == [1, 2, 4, 5] and newest == 5
    [moved] = list((root / ".quarantine").iterdir())
    assert moved.name.startswith("v000000000003-") and sorted(p.name for p in moved.iterdir()) == segments
    assert any("v000000000003" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    report = check(str(root))
    assert [e.status for e in report.entries if e.name.startswith(".quarantine/")] == ["quarantined"]


def test_an_interrupted_retention_delete_is_still_swept_silently(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "t"
    asyncio.run(commit_all(LocalTier(root)))
    (root / "v000000000001" / "MANIFEST.json").unlink()  # retention removes the oldest's manifest first
    with caplog.at_level(logging.WARNING):
        listed, _ = asyncio.run(reopen(LocalTier(root)))
    assert listed == [2, 3, 4, 5]
    assert not (root / "v000000000001").exists() and not (root / ".quarantine").exists()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "v000000000001" in r.getMessage()]


def test_fsck_calls_a_lost_manifest_corrupt_and_repair_moves_it_aside(tmp_path: Path) -> None:
    root = tmp_path / "t"
    asyncio.run(commit_all(LocalTier(root)))
    (root / "v000000000004" / "MANIFEST.json").unlink()
    (root / "v000000000001" / "MANIFEST.json").unlink()
    report = check(str(root))
    status = {e.name: e.status for e in report.entries}
    assert status["v000000000004"] == "corrupt" and status["v000000000001"] == "orphaned"
    repair(report)
    assert not (root / "v000000000001").exists() and not (root / "v000000000004").exists()
    [moved] = list((root / ".quarantine").iterdir())
    assert moved.name.startswith("v000000000004") and any(moved.iterdir())
    assert check(str(root)).ok


def _remote_files(tier: RemoteTier, prefix: str) -> list[str]:
    sel = pafs.FileSelector(f"{tier.root}/{prefix}", allow_not_found=True, recursive=True)
    return sorted(i.path[len(tier.root) + len(prefix) + 2:] for i in tier.fs.get_file_info(sel)
                  if i.type == pafs.FileType.File)


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_remote_prefixes_get_the_same_judgment(tmp_path: Path, kind: str, s3_uri: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    uri = (tmp_path / "remote").as_uri() if kind == "file" else s3_uri
    if kind == "file":
        (tmp_path / "remote").mkdir()
    asyncio.run(commit_all(RemoteTier(uri)))
    tier = RemoteTier(uri)
    tier.fs.delete_file(f"{tier.root}/v000000000003/MANIFEST.json")  # a committed version loses its manifest
    tier.fs.delete_file(f"{tier.root}/v000000000001/MANIFEST.json")  # an interrupted retention delete
    segments = [f for f in _remote_files(tier, "v000000000003")]
    assert segments
    with caplog.at_level(logging.WARNING):
        listed, newest = asyncio.run(reopen(RemoteTier(uri)))
    assert listed == [2, 4, 5] and newest == 5
    assert _remote_files(tier, "v000000000001") == [] and _remote_files(tier, "v000000000003") == []
    moved = _remote_files(tier, ".quarantine")
    assert [m.split("/", 1)[1] for m in moved] == segments and moved[0].startswith("v000000000003-")
    assert any("v000000000003" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
