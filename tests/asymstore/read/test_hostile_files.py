"""Hostile and damaged files: each ends in a typed error or a fallback to the previous version, fast, in bounded memory.

The cases live in tests/support/hostile_cases.py and run in one child process
(tests/procs/hostile_child.py: a thread stuck on a special file could not hang
the test run); this module checks what each case got. Plus an exhaustive single-bit-flip test of the
manifest parser: every flipped bit is a ManifestError, never a manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from asymstore.errors import ManifestError
from asymstore.format.manifest import Chunk, Manifest, SegmentEntry, TensorEntry
from asymstore.format.parse import parse_manifest
from tests.support.hostile_cases import CASE_TIMEOUT_S, CASES
from tests.support.launch import ROOT, proc_argv, proc_env

RSS_BUDGET = 96 << 20  # the versions are a few KiB: anything near a claimed size is a failure
# cases where version 20 is not even listed (its manifest is not a regular file in a real directory)
UNLISTED = {"manifest_is_directory", "symlinked_huge_manifest", "symlinked_version"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("hostile") / "results.json"
    proc = subprocess.run(proc_argv("hostile_child", str(out)), capture_output=True, text=True,
                          timeout=60 + CASE_TIMEOUT_S * 3 * len(CASES), cwd=ROOT, env=proc_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    data: dict[str, dict[str, Any]] = json.loads(out.read_text())
    return data


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_gets_typed_error_and_fallback(results: dict[str, dict[str, Any]], case: str) -> None:
    r = results[case]
    # restore: the previous version, bit-exact, with the damaged one named as a fallback
    assert "restore_error" not in r, r
    assert r["restored"] == 10 and r["same"] is True, r
    if case not in UNLISTED:
        assert r["fallbacks"] and "step 20" in r["fallbacks"][0], r
        assert r["step20_typed"] is True and r["step20_error"] in (
            "CorruptVersionError", "ManifestError", "CodecError", "TierError"), r
    else:
        assert r["fallbacks"] == [] and r["step20_error"] == "VersionNotFoundError", r
    # fsck --deep: no crash, version 20 not committed, 10 the newest restorable
    assert "fsck_error" not in r, r
    assert r["fsck_ok"] is False and r["fsck_newest"] == 10, r
    assert r["fsck_v20"] and all(status in ("corrupt", "orphaned") for status, _ in r["fsck_v20"]), r
    # bounded time and memory
    assert r["seconds"] < CASE_TIMEOUT_S, r
    assert r["rss_growth"] < RSS_BUDGET, r


def _small_manifest() -> bytes:
    chunks = (Chunk("seg-000000.bin", 0, 32, 32, "0123456789abcdef"),)
    return Manifest(
        step=7,
        tensors={"i/i64": TensorEntry("int64", (4,), 32, chunks),
                 "w": TensorEntry("float64", (2, 2), 32, (Chunk("seg-000000.bin", 32, 32, 32, "fedcba9876543210"),))},
        segments=(SegmentEntry("seg-000000.bin", 64, "00112233aabbccdd"),),
        meta={"lr": 0.001}, created=1.5).to_json()


def test_every_single_bit_flip_in_a_manifest_is_detected() -> None:
    data = bytearray(_small_manifest())
    good = parse_manifest(bytes(data))
    assert good.step == 7 and set(good.tensors) == {"i/i64", "w"}
    missed = []
    for i in range(len(data)):
        for bit in range(8):
            data[i] ^= 1 << bit
            try:
                parse_manifest(bytes(data))
                missed.append((i, bit))
            except ManifestError:
                pass
            finally:
                data[i] ^= 1 << bit
    # trailing whitespace after the closing brace is the only place a flip may not matter; there is none
    assert missed == [], missed


def test_version_1_manifests_are_still_read_with_every_check() -> None:
    doc = json.loads(_small_manifest())
    del doc["manifest_checksum"]
    doc["format_version"] = 1
    assert parse_manifest(json.dumps(doc).encode()).step == 7
    doc["tensors"]["w"]["dtype"] = "float65"
    with pytest.raises(ManifestError, match="storable"):
        parse_manifest(json.dumps(doc).encode())
    doc["format_version"] = 2  # a format-2 manifest that lost its checksum is damaged, not old
    with pytest.raises(ManifestError, match="self-checksum"):
        parse_manifest(json.dumps(doc).encode())


def test_storable_dtypes_table_matches_torch() -> None:
    from asymstore.format.manifest import DTYPE_SIZES
    from asymstore.format.tensors import dtype_from_name

    for name, size in DTYPE_SIZES.items():
        dtype = getattr(torch, name, None)
        if dtype is None:  # a newer dtype this torch lacks
            continue
        assert dtype_from_name(name) is dtype and dtype.itemsize == size
    for name in ("qint8", "quint8", "bits8", "float65", "Tensor", "__class__"):
        with pytest.raises(ManifestError):
            dtype_from_name(name)


def test_hostile_global_manifests_and_latest_are_refused_in_bounded_time(tmp_path: Path) -> None:
    """A FIFO, a symlink or a huge file in a multi-rank root's global/ is refused, never read or waited on."""
    from asymstore.errors import GlobalManifestError
    from asymstore.multirank import globaldir

    gdir = tmp_path / "global"
    gdir.mkdir()
    os.mkfifo(gdir / globaldir.global_filename(1))
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", gdir / globaldir.global_filename(2))
    with open(gdir / globaldir.global_filename(3), "wb") as f:
        f.truncate(globaldir.MAX_GLOBAL_BYTES + 1)  # sparse: no disk used
    for step in (1, 2, 3):
        with pytest.raises(GlobalManifestError):
            globaldir.read_global(str(gdir), step)
    os.mkfifo(gdir / "LATEST")
    assert globaldir.read_global_latest(str(gdir)) is None
