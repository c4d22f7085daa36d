"""Hostile and damaged files on disk, as a crash, a disk or a person can leave them.

Each case damages version 20 of a root that also holds version 10. The
forged cases re-seal the manifest (a hostile writer can compute an xxh3 as
well as we can), so only the structural checks can catch them. The cases
run in a child process, tests/procs/hostile_child.py.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asymstore.format.manifest import MANIFEST_NAME, seal_document
from asymstore.format.names import version_dirname

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
