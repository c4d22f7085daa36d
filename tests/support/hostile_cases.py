"""Hostile and damaged files on disk, as a crash, a disk or a person can leave them.

Each case damages version 20 of a root that also holds version 10. The
forged cases re-seal the manifest (a hostile writer can compute an xxh3 as
well as we can), so only the structural checks can catch them. Run as a
script (``python _hostile_cases.py OUT_JSON``), it runs every case in this
one process and records, per case: what restore returned, the typed error of
``restore(step=20)``, the fsck --deep verdict, the seconds taken and the peak
resident memory growth.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asymstore import AsymStore, AsymstoreError, LocalTier
from asymstore.format.manifest import MANIFEST_NAME, seal_document
from asymstore.format.names import version_dirname
from asymstore.fsck import check

STEPS = (10, 20)
CASE_TIMEOUT_S = 20.0


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"i/i64": torch.arange(64) * step, "w": torch.randn(256, generator=g, dtype=torch.float64),
            "b": torch.randn(512, generator=g).to(torch.bfloat16)}


def _vdir(root: Path) -> Path:
    return root / version_dirname(20)


def _doc(root: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((_vdir(root) / MANIFEST_NAME).read_bytes())
    return doc


def _forge(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = _doc(root)
    edit(doc)
    (_vdir(root) / MANIFEST_NAME).write_bytes(seal_document(doc))


def _write_manifest(root: Path, data: bytes) -> None:
    (_vdir(root) / MANIFEST_NAME).write_bytes(data)


def _flip_text(root: Path, old: bytes, new: bytes) -> None:
    """Change one bit of the manifest where ``old`` stands (``new`` differs from it by one bit)."""
    path = _vdir(root) / MANIFEST_NAME
    data = path.read_bytes()
    assert data.count(old) >= 1 and bin(int.from_bytes(old) ^ int.from_bytes(new)).count("1") == 1
    path.write_bytes(data.replace(old, new, 1))


def _segment(root: Path) -> Path:
    return _vdir(root) / _doc(root)["segments"][0]["name"]


def deep_json(root: Path) -> None:
    _write_manifest(root, b"[" * 200_000 + b"]" * 200_000)


def huge_int(root: Path) -> None:
    path = _vdir(root) / MANIFEST_NAME
    text = seal_document(_doc(root)).replace(b'"step":20', b'"step":' + b"7" * 10_000, 1)
    cut = text.rindex(b',"manifest_checksum":')
    path.write_bytes(seal_document_raw(text[:cut]))


def seal_document_raw(body: bytes) -> bytes:
    from asymstore.format.manifest import seal

    return seal(body)


def huge_raw_length(root: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        entry = doc["tensors"]["w"]
        entry["chunks"][0].update(codec="zstd-planes:8", raw_length=2**45)
        entry.update(shape=[2**42], nbytes=2**45)
    _forge(root, edit)


def shape_overflow(root: Path) -> None:
    _forge(root, lambda doc: doc["tensors"]["w"].update(shape=[0, 2**63]))


def shape_mismatch(root: Path) -> None:
    _forge(root, lambda doc: doc["tensors"]["w"].update(shape=[255]))


def qint8_dtype(root: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        entry = doc["tensors"]["i/i64"]
        entry.update(dtype="qint8", shape=[entry["nbytes"]])
    _forge(root, edit)


def fifo_segment(root: Path) -> None:
    seg = _segment(root)
    seg.unlink()
    os.mkfifo(seg)


def manifest_is_directory(root: Path) -> None:
    path = _vdir(root) / MANIFEST_NAME
    path.unlink()
    path.mkdir()


def overlapping_chunks(root: Path) -> None:
    seg = _segment(root)
    with open(seg, "r+b") as f:
        f.truncate(1 << 20)
    from asymstore.format.checksum import checksum

    data = seg.read_bytes()

    def edit(doc: dict[str, Any]) -> None:
        doc["segments"] = [{"name": seg.name, "size": 1 << 20, "checksum": checksum(data)}]
        chunk = {"segment": seg.name, "offset": 0, "length": 1 << 20, "raw_length": 1 << 20, "codec": "raw",
                 "checksum": checksum(data), "raw_checksum": checksum(data)}
        doc["tensors"] = {"big": {"dtype": "uint8", "shape": [256 << 20], "nbytes": 256 << 20,
                                  "chunks": [chunk] * 256}}
    _forge(root, edit)


def symlinked_huge_manifest(root: Path) -> None:
    outside = root.parent / f"{root.name}-outside.json"
    with open(outside, "wb") as f:
        f.truncate(512 << 20)  # sparse: costs no disk, would cost 512 MiB to read
    path = _vdir(root) / MANIFEST_NAME
    path.unlink()
    path.symlink_to(outside)


def symlinked_segment(root: Path) -> None:
    seg = _segment(root)
    outside = root.parent / f"{root.name}-outside.bin"
    shutil.copyfile(seg, outside)
    seg.unlink()
    seg.symlink_to(outside)


def symlinked_version(root: Path) -> None:
    outside = root.parent / f"{root.name}-outside-v"
    shutil.move(_vdir(root), outside)
    _vdir(root).symlink_to(outside, target_is_directory=True)


def segment_is_directory(root: Path) -> None:
    seg = _segment(root)
    seg.unlink()
    seg.mkdir()


def bigger_segment(root: Path) -> None:
    with open(_segment(root), "ab") as f:
        f.truncate(64 << 20)


def empty_manifest(root: Path) -> None:
    _write_manifest(root, b"")


def name_bit_flip(root: Path) -> None:
    _flip_text(root, b'"i/i64"', b'"i/m64"')


def dtype_bit_flip(root: Path) -> None:
    _flip_text(root, b'"float64"', b'"float65"')


def offset_bit_flip(root: Path) -> None:
    _flip_text(root, b'"offset":0', b'"offset":1')


def unknown_codec(root: Path) -> None:
    _forge(root, lambda doc: doc["tensors"]["w"]["chunks"][0].update(codec="lz4"))


def chunk_past_segment(root: Path) -> None:
    _forge(root, lambda doc: doc["tensors"]["w"]["chunks"][0].update(offset=doc["segments"][0]["size"]))


def nan_in_meta(root: Path) -> None:
    path = _vdir(root) / MANIFEST_NAME
    text = seal_document(_doc(root))
    cut = text.rindex(b',"manifest_checksum":')
    path.write_bytes(seal_document_raw(text[:cut].replace(b'"meta":{}', b'"meta":{"x":NaN}', 1)))


def escaping_segment_name(root: Path) -> None:
    _forge(root, lambda doc: doc["tensors"]["w"]["chunks"][0].update(segment="../../etc/passwd"))


def old_format_version(root: Path) -> None:
    _forge(root, lambda doc: doc.update(format_version=99))


CASES: dict[str, Callable[[Path], None]] = {f.__name__: f for f in (
    deep_json, huge_int, huge_raw_length, shape_overflow, shape_mismatch, qint8_dtype, fifo_segment,
    manifest_is_directory, overlapping_chunks, symlinked_huge_manifest, symlinked_segment, symlinked_version,
    segment_is_directory, bigger_segment, empty_manifest, name_bit_flip, dtype_bit_flip, offset_bit_flip,
    unknown_codec, chunk_past_segment, nan_in_meta, escaping_segment_name, old_format_version)}


async def _populate(root: Path) -> None:
    async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20, compression="never") as store:
        for step in STEPS:
            await store.put_many(step, state(step))
            await store.commit(step)


async def _restore(root: Path, step: int | None = None) -> tuple[int, list[str], bool]:
    async with AsymStore([LocalTier(root)], segment_bytes=1 << 20, compression="never") as store:
        ckpt = await store.restore(step)
    same = all(torch.equal(ckpt.tensors[k], v) for k, v in state(ckpt.step).items())
    return ckpt.step, ckpt.fallbacks, same and ckpt.tensors.keys() == state(ckpt.step).keys()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def run_case(name: str, base: Path) -> dict[str, Any]:
    root = base / name
    await _populate(root)
    CASES[name](root)
    peak = _peak_rss()
    started = time.monotonic()
    out: dict[str, Any] = {}
    try:
        step, fallbacks, same = await asyncio.wait_for(_restore(root), CASE_TIMEOUT_S)
        out.update(restored=step, fallbacks=fallbacks, same=same)
    except BaseException as exc:  # recorded: the test says which errors are acceptable
        out["restore_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        await asyncio.wait_for(_restore(root, 20), CASE_TIMEOUT_S)
        out["step20_error"] = None
    except AsymstoreError as exc:
        out["step20_error"] = type(exc).__name__
        out["step20_typed"] = True
    except BaseException as exc:
        out["step20_error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["step20_typed"] = False
    try:
        report = await asyncio.wait_for(asyncio.to_thread(check, str(root), deep=True), CASE_TIMEOUT_S)
        v20 = [e for e in report.entries if e.step == 20 and not e.name.startswith(".")]
        out.update(fsck_ok=report.ok, fsck_newest=report.newest_restorable,
                   fsck_v20=[(e.status, e.problems) for e in v20])
    except BaseException as exc:
        out["fsck_error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["seconds"] = time.monotonic() - started
    out["rss_growth"] = _peak_rss() - peak
    return out


async def main(out_path: str, names: list[str]) -> None:
    base = Path(tempfile.mkdtemp(prefix="hostile-"))
    results = {}
    try:
        for name in names or list(CASES):
            results[name] = await run_case(name, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    Path(out_path).write_text(json.dumps(results))
    os._exit(0)  # a thread blocked on a special file must not keep the process alive


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
