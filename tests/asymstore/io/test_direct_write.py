"""write_parts: O_DIRECT straight from page-aligned caller memory, a bounce buffer for the rest, same bytes always."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest
import torch

from asymstore.io import files as fileio
from asymstore.io.files import address_of, write_parts


def aligned(nbytes: int, seed: int) -> memoryview:
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buf)[:nbytes]
    view[:] = random.Random(seed).randbytes(nbytes)
    return view


def random_parts(rng: random.Random, case: int, *, pages: int, count: tuple[int, int], loose: int) -> list[memoryview]:
    """A random mix of page-aligned buffers (with and without a tail), unaligned ones, read-only bytes and padding."""
    parts: list[memoryview] = []
    for k in range(rng.randint(*count)):
        kind = rng.choice(["aligned", "aligned-tail", "offset", "bytes", "pad"])
        if kind == "aligned":
            parts.append(aligned(4096 * rng.randint(1, pages), case * 100 + k))
        elif kind == "aligned-tail":
            parts.append(aligned(4096 * rng.randint(1, pages) + rng.randint(1, 4095), case * 100 + k))
        elif kind == "offset":  # writable but not on a page boundary
            parts.append(aligned(4096 * rng.randint(2, pages // 6 + 2), case * 100 + k)[rng.randint(1, 4095):])
        elif kind == "bytes":
            parts.append(memoryview(random.Random(k).randbytes(rng.randint(1, loose))))
        else:
            parts.append(memoryview(bytes(rng.randint(1, 4095))))
    return parts


def test_address_of_reports_writable_buffers_only() -> None:
    view = aligned(8192, 0)
    addr = address_of(view)
    assert addr is not None and addr % 4096 == 0
    assert address_of(memoryview(b"read only")) is None


@pytest.mark.parametrize("case", range(12))
def test_any_mix_of_aligned_unaligned_and_read_only_parts_lands_byte_exact(tmp_path: Path, case: int) -> None:
    parts = random_parts(random.Random(case), case, pages=3000, count=(1, 7), loose=3 << 20)
    total = sum(len(p) for p in parts)
    if total < (8 << 20):  # below the O_DIRECT threshold nothing under test runs
        parts.append(aligned(8 << 20, case))
    expect = b"".join(bytes(p) for p in parts)
    path = tmp_path / "seg.bin"
    assert write_parts(str(path), parts) == len(expect)
    assert path.read_bytes() == expect


def test_aligned_tensor_memory_is_written_without_the_bounce_buffer(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    gathered: list[int] = []
    src = aligned(32 << 20, 7)
    tensor = torch.frombuffer(src, dtype=torch.uint8)
    view = memoryview(tensor.numpy())
    orig_write = os.write

    def spy(fd: int, data: object) -> int:
        gathered.append(address_of(data) if isinstance(data, memoryview) else -1)  # type: ignore[arg-type]
        return orig_write(fd, data)  # type: ignore[arg-type]

    monkeypatch.setattr(fileio.os, "write", spy)
    path = tmp_path / "seg.bin"
    write_parts(str(path), [view])
    assert path.read_bytes() == bytes(src)
    base = address_of(view)
    assert base is not None
    assert gathered and all(a is not None and base <= a < base + len(view) for a in gathered), \
        "every write came straight from the tensor's own pages"


@pytest.mark.parametrize("case", range(6))
def test_the_nvme_posix_engine_writes_any_mix_byte_exact(tmp_path: Path, case: int) -> None:
    from asymstore.tiers.engines import PosixEngine

    rng = random.Random(100 + case)
    parts = random_parts(rng, case, pages=700, count=(2, 8), loose=1 << 20)
    expect = b"".join(bytes(p) for p in parts)
    engine = PosixEngine(num_threads=3, task_size=rng.choice([64 << 10, 1 << 20, 4 << 20]))
    path = tmp_path / "seg.bin"
    assert engine.write(str(path), parts, fsync=True) == len(expect)
    assert path.read_bytes() == expect
    assert bytes(engine.read(str(path))) == expect


@pytest.mark.parametrize("case", range(6))
def test_sparse_ranges_of_a_large_file_read_back_exact_with_their_hashes(tmp_path: Path, case: int) -> None:
    import xxhash

    from asymstore.io.files import read_ranges

    rng = random.Random(500 + case)
    data = random.Random(case).randbytes(40 << 20)
    path = tmp_path / "seg.bin"
    path.write_bytes(data)
    starts = sorted(rng.sample(range(0, len(data) - (1 << 20)), rng.randint(1, 40)))
    ranges, at = [], -1
    for off in starts:
        if off < at:
            continue
        n = rng.choice([1, 100, 4096, 70_000, 1 << 20])
        ranges.append((off, memoryview(bytearray(n))))
        at = off + n
    rng.shuffle(ranges)
    digests = read_ranges(str(path), len(data), ranges, hashes=True)
    assert digests is not None
    for (off, view), digest in zip(ranges, digests, strict=True):
        assert bytes(view) == data[off:off + len(view)]
        assert digest == xxhash.xxh3_64_hexdigest(data[off:off + len(view)])
