"""Restore from a shared-memory host_tier: buffered reads straight into tensors, fresh tensors built in bulk.

Each round trip runs with ``compression="auto"`` (a memory tier: the cost model never compresses, every chunk
is raw) and ``compression="always"`` (compressed chunks on shm, as the manifests' codecs show).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pytest
import torch
import xxhash

from asymstore import AsymStore, CorruptVersionError, host_tier
from asymstore.io.files import read_ranges
from asymstore.read.load import load_version
from tests.support.store import same_state

CHUNK = 4096


def state(step: int) -> dict[str, torch.Tensor]:
    """Tensors spanning many chunks and segments, odd sizes and dtypes, and enough small ones to be packed."""
    g = torch.Generator().manual_seed(step)
    out = {
        "big": torch.randn(300, 77, generator=g),  # 92,400 bytes: 23 chunks
        "half": torch.randn(5000, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**40), 2**40, (1031,), generator=g),
        "empty": torch.empty(0, 3),
        "step": torch.tensor(step),
    }
    out.update({f"small{i}": torch.randn(i + 1, generator=g) for i in range(40)})
    return out


COMPRESSIONS = ["auto", "always"]


async def save(path: str, steps: list[int], compression: Any = "auto") -> host_tier:
    host = host_tier(1 << 30, path=path)
    async with AsymStore([host], keep_last=None, segment_bytes=64 << 10, chunk_bytes=CHUNK,
                         compression=compression) as store:
        for step in steps:
            await store.put_many(step, state(step))
            await store.commit(step)
    return host


def segments(path: str, step: int) -> list[str]:
    return sorted(glob.glob(os.path.join(path, f"v{step:012d}", "seg-*.bin")))


def codecs(path: str, step: int) -> set[str]:
    """The codecs the manifest of ``step`` names (every chunk's and pack's)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("codec"), str):
                found.add(node["codec"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    with open(os.path.join(path, f"v{step:012d}", "MANIFEST.json")) as f:
        walk(json.load(f))
    return found


def check_codecs(path: str, step: int, compression: str) -> None:
    """``always`` really compressed on shm (zstd chunks beside raw ones); ``auto`` left every chunk raw."""
    found = codecs(path, step)
    if compression == "always":
        assert any(c.startswith("zstd") for c in found), found
    else:
        assert found == {"raw"}, found


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("how", ["fresh", "into", "some"])
async def test_restore_bit_exact(shm_dir: str, how: str, compression: str) -> None:
    await save(shm_dir, [10], compression)
    check_codecs(shm_dir, 10, compression)
    assert len(segments(shm_dir, 10)) > 1
    want = state(10)
    into = {} if how == "fresh" else {k: torch.zeros_like(v) for k, v in want.items()
                                      if how == "into" or k in ("big", "small3")}
    async with AsymStore([host_tier(1 << 30, path=shm_dir)]) as store:
        ckpt = await store.restore(into=into or None)
    assert ckpt.step == 10 and not ckpt.fell_back
    assert same_state(ckpt.tensors, want)
    for name, dest in into.items():
        assert ckpt.tensors[name] is dest
    before = ckpt.tensors["big"].clone()
    for seg in segments(shm_dir, 10):  # the restored tensors are copies, never views of the shared files
        with open(seg, "r+b") as f:
            f.write(b"\xff" * 64)
    assert torch.equal(ckpt.tensors["big"], before)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("how", ["fresh", "into"])
async def test_flipped_byte_falls_back(shm_dir: str, how: str, compression: str) -> None:
    await save(shm_dir, [10, 20], compression)
    check_codecs(shm_dir, 20, compression)
    seg = segments(shm_dir, 20)[1]
    with open(seg, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x10]))
    into = {k: torch.zeros_like(v) for k, v in state(10).items()} if how == "into" else None
    async with AsymStore([host_tier(1 << 30, path=shm_dir)]) as store:
        ckpt = await store.restore(into=into)
    assert ckpt.step == 10 and ckpt.fell_back
    assert same_state(ckpt.tensors, state(10))


@pytest.mark.parametrize("compression", COMPRESSIONS)
async def test_truncated_file_is_typed_error(shm_dir: str, compression: str) -> None:
    host = await save(shm_dir, [10, 20], compression)
    check_codecs(shm_dir, 20, compression)
    seg = segments(shm_dir, 20)[0]
    os.truncate(seg, os.path.getsize(seg) - 1)
    await host.open()
    with pytest.raises(CorruptVersionError):
        await load_version(host, 20)
    with pytest.raises(CorruptVersionError):
        await load_version(host, 20, into={"big": torch.empty(300, 77)})
    async with AsymStore([host_tier(1 << 30, path=shm_dir)]) as store:
        ckpt = await store.restore()
    assert ckpt.step == 10 and ckpt.fell_back
    assert same_state(ckpt.tensors, state(10))


@pytest.mark.parametrize("direct", [True, False])
def test_read_ranges_buffered(tmp_path: str, direct: bool) -> None:
    data = os.urandom((9 << 20) + 123)  # large enough for the O_DIRECT path where it is taken
    path = os.path.join(tmp_path, "seg")
    with open(path, "wb") as f:
        f.write(data)
    spans = [(0, 10), (5, 3 << 20), ((3 << 20) + 7, 6 << 20), (len(data) - 1, 1)]
    bufs = [bytearray(n) for _, n in spans]
    digests = read_ranges(path, len(data), [(off, memoryview(b)) for (off, _), b in zip(spans, bufs, strict=True)],
                          hashes=True, direct=direct)
    assert [bytes(b) for b in bufs] == [data[off:off + n] for off, n in spans]
    assert digests == [xxhash.xxh3_64(data[off:off + n]).hexdigest() for off, n in spans]
    with pytest.raises(CorruptVersionError):
        read_ranges(path, len(data), [(len(data) - 4, memoryview(bytearray(5)))], direct=direct)
    with pytest.raises(CorruptVersionError):
        read_ranges(path, len(data) + 1, [(0, memoryview(bytearray(5)))], direct=direct)
