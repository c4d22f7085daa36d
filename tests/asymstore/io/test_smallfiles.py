"""Small metadata files (manifests, LATEST) read through aiofiles keep every check on untrusted files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asymstore.errors import CorruptVersionError
from asymstore.format.names import LATEST
from asymstore.io.smallfiles import read_small
from asymstore.tiers.local import LocalTier


async def test_reads_a_small_regular_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert await read_small(str(tmp_path / "f"), 100) == b"x" * 100
    with pytest.raises(CorruptVersionError, match="more than the 99"):
        await read_small(str(tmp_path / "f"), 99)
    with pytest.raises(FileNotFoundError):
        await read_small(str(tmp_path / "missing"), 100)


async def test_refuses_symlinks_fifos_and_symlinked_directories(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"7\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(CorruptVersionError, match="symlink"):
        await read_small(str(tmp_path / "link"), 100)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CorruptVersionError, match="not a regular file"):
        await read_small(str(tmp_path / "fifo"), 100)  # never hangs waiting for a writer
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f").write_bytes(b"ok")
    (tmp_path / "dirlink").symlink_to(tmp_path / "dir")
    assert await read_small(str(tmp_path / "dir" / "f"), 10, directory=str(tmp_path / "dir")) == b"ok"
    with pytest.raises(CorruptVersionError, match="not a directory"):
        await read_small(str(tmp_path / "dirlink" / "f"), 10, directory=str(tmp_path / "dirlink"))


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge", "garbage"])
async def test_a_hostile_latest_is_no_hint(tmp_path: Path, kind: str) -> None:
    tier = LocalTier(tmp_path)
    await tier.open()
    await tier.write_latest(12)
    assert await tier.read_latest() == 12
    latest = tmp_path / LATEST
    latest.unlink()
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text("5\n")
        latest.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(latest)
    elif kind == "huge":
        latest.write_text("1" * 100)
    else:
        latest.write_bytes(b"\xff\n")
    assert await tier.read_latest() is None
