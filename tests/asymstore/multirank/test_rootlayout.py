"""A root's layout is recorded, never guessed (asymstore/multirank/rootlayout.py), in one process.

The record (``LAYOUT.json``) is written by the first commit of a layout and read as untrusted input: a
damaged one is a typed error wherever a root is opened. A root that holds versions of both layouts and no
record saying which is current (what a job of 3 ranks left beside a single-process job's versions before
records existed) is refused, typed, and fsck flags it, as it flags a single-process ``LATEST`` left in a
multi-rank root. The FSDP2 resumes across the boundary run in real processes:
tests/asymcheck/fsdp2/test_layout_boundary.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from asymcheck import Checkpointer
from asymcheck.options import PacingOptions, PreemptionOptions
from asymstore import AsymStore, LocalTier, open_store
from asymstore.errors import RootLayoutConflictError, RootLayoutError, RootUnreadableError
from asymstore.format.manifest import MANIFEST_NAME
from asymstore.fsck import check, repair
from asymstore.multirank import RankStore
from asymstore.multirank.rootlayout import (
    LAYOUT_FILE,
    MAX_RECORD_BYTES,
    RootLayout,
    read_record,
    single_version,
    survey,
    write_record,
)
from tests.support.ranks import run_ranks, store


def tensors(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32) + step}


def commit_single(root: Path, steps: list[int]) -> None:
    async def go() -> None:
        async with AsymStore([LocalTier(root)], keep_last=None, segment_bytes=1 << 20, compression="never") as s:
            for step in steps:
                await s.put_many(step, tensors(step))
                await s.commit(step)

    asyncio.run(go())


def commit_multirank(root: Path, steps: list[int], **kw: Any) -> None:
    async def go(rank: int) -> None:
        async with store(root, rank, 1, torch.distributed.HashStore(), **kw) as s:
            for step in steps:
                await s.put_many(step, tensors(step))
                await s.commit(step)

    [result] = run_ranks(1, go).values()
    assert result is None, result


def train_one_step(root: Path) -> list[int]:
    """A Checkpointer of one process over ``root``: one step, closed; the steps its root then holds."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(model, opt, str(root), preemption=PreemptionOptions(preempt_on="none"),
                      pacing=PacingOptions(max_overhead=None)) as ckpt:
        start = ckpt.resume() or 0
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    return [start]


def test_the_first_commit_of_a_single_process_checkpointer_records_the_layout(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    train_one_step(root)
    record = read_record(str(root))
    assert record is not None and (record.layout, record.world_size, record.previous) == ("single", 1, ())
    assert check(str(root)).ok and check(str(root)).layout_record == {"format": 1, "layout": "single",
                                                                      "world_size": 1, "previous": []}


def test_the_first_global_commit_records_a_multirank_root(tmp_path: Path) -> None:
    root = tmp_path / "mr"
    commit_multirank(root, [1, 2])
    record = read_record(str(root))
    assert record is not None and (record.layout, record.world_size) == ("multirank", 1)
    report = check(str(root))
    assert report.ok, report.problems
    assert report.layout == "multirank" and report.to_json()["layout_record"]["world_size"] == 1


@pytest.mark.parametrize("bad", ["not json", "[]", '{"format": 2, "layout": "single", "world_size": 1}',
                                 '{"format": 1, "layout": "sliced", "world_size": 1}',
                                 '{"format": 1, "layout": "single", "world_size": 4}',
                                 '{"format": 1, "layout": "multirank", "world_size": 0}',
                                 '{"format": 1, "layout": "multirank", "world_size": 2, "extra": 1}',
                                 '{"format": 1, "layout": "multirank", "world_size": 2, "previous": [{}]}',
                                 '{"format": 1, "layout": "single", "world_size": NaN}',
                                 "symlink", "fifo", "huge"])
def test_a_damaged_record_is_a_typed_error_wherever_the_root_is_opened(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "ck"
    commit_single(root, [1, 2])
    path = root / LAYOUT_FILE
    if bad == "symlink":
        (tmp_path / "elsewhere.json").write_text('{"format": 1, "layout": "single", "world_size": 1}')
        path.symlink_to(tmp_path / "elsewhere.json")
    elif bad == "fifo":
        os.mkfifo(path)
    elif bad == "huge":
        path.write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    else:
        path.write_text(bad)
    with pytest.raises(RootLayoutError):
        survey(str(root))
    with pytest.raises(RootLayoutError):
        open_store(str(root), keep_last=3)
    model = nn.Linear(3, 2)
    with pytest.raises(RootLayoutError):
        Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), str(root),
                     preemption=PreemptionOptions(preempt_on="none"))
    assert not model.weight._backward_hooks and not model._forward_pre_hooks  # nothing was hooked
    report = check(str(root))  # fsck names it and still lists the versions
    assert not report.ok and any(LAYOUT_FILE in p for p in report.layout_problems), report.problems
    assert sorted(e.step for e in report.entries if e.status == "committed") == [1, 2]
    assert sorted(os.listdir(root / "v000000000002")) == sorted(os.listdir(root / "v000000000001"))  # untouched


def legacy_root_of_two_layouts(root: Path) -> None:
    """What the defect left: single-process versions 4..6 and LATEST, then a multi-rank job's 7..9 beside them."""
    commit_single(root, [4, 5, 6])
    latest = (root / "LATEST").read_text()
    commit_multirank(root, [7, 8, 9], across_layouts="start_fresh")  # (the defect started beside them unasked)
    (root / LAYOUT_FILE).unlink()  # written before records existed
    (root / "LATEST").write_text(latest)


def test_a_root_of_two_layouts_without_a_record_is_refused_typed_and_flagged(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    legacy_root_of_two_layouts(root)
    with pytest.raises(RootLayoutConflictError, match=r"newest step 6.*newest step 9"):
        _ = survey(str(root)).layout
    with pytest.raises(RootLayoutConflictError):
        train_one_step(root)  # one process: refused at construction, nothing trained or written

    async def resume(rank: int) -> None:
        s = RankStore(root, rank=0, world_size=1, kv=torch.distributed.HashStore(), segment_bytes=1 << 20)
        async with s:
            await s.restore()

    [got] = run_ranks(1, resume).values()
    assert isinstance(got, RootLayoutConflictError), got  # a RankStore's restore refuses it too
    report = check(str(root))
    assert not report.ok
    assert [e.step for e in report.entries if e.name.startswith("v0")] == [4, 5, 6]  # every version of both layouts
    assert sorted(e.step for e in report.entries if e.name.startswith("global/")) == [7, 8, 9]
    assert any("two layouts" in p for p in report.layout_problems)
    assert any(p.startswith("LATEST") and "stale" in p for p in report.layout_problems)
    assert repair(report) == ["removed the stale single-process LATEST (the root is multi-rank)"]
    report = check(str(root))
    assert not report.ok and [p for p in report.layout_problems if "two layouts" in p]  # not repaired by guessing
    assert not (root / "LATEST").exists() and (root / "v000000000006").is_dir()


def test_a_recorded_takeover_lists_the_single_process_versions_as_superseded(tmp_path: Path) -> None:
    """A multi-rank job that took over a single-process root records it; only a stale LATEST is then flagged."""
    root = tmp_path / "ck"
    commit_single(root, [4, 5, 6])
    latest = (root / "LATEST").read_text()
    commit_multirank(root, [7], across_layouts="start_fresh")  # its first global commit records the takeover
    # and drops LATEST
    record = json.loads((root / LAYOUT_FILE).read_text())
    assert record == {"format": 1, "layout": "multirank", "world_size": 1,
                      "previous": [{"layout": "single", "world_size": 1, "newest_step": 6, "resumed": False}]}
    assert not (root / "LATEST").exists()
    report = check(str(root))
    assert report.ok, report.problems
    assert [(e.step, e.status) for e in report.entries if e.name.startswith("v0")] == [
        (4, "superseded"), (5, "superseded"), (6, "superseded")]
    (root / "LATEST").write_text(latest)  # e.g. a crash between the publish and the removal
    report = check(str(root))
    assert not report.ok and len(report.layout_problems) == 1 and "stale" in report.layout_problems[0]
    repair(report)
    assert check(str(root)).ok
    assert survey(str(root)).layout == "multirank" and isinstance(open_store(str(root), keep_last=3), RankStore)


def swap_after_open(monkeypatch: pytest.MonkeyPatch, path: Path, target: Path) -> list[str]:
    """Fault injection: the first time ``path`` is opened, it is replaced by a symlink to ``target`` (a race)."""
    real_open = os.open
    swapped: list[str] = []

    def opening(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(file, flags, *args, **kwargs)
        if os.fspath(file) == str(path) and not swapped:
            link = path.with_name(".swap")
            link.symlink_to(target)
            os.replace(link, path)
            swapped.append(str(path))
        return fd

    monkeypatch.setattr(os, "open", opening)
    return swapped


def test_the_record_is_read_from_the_descriptor_it_was_checked_on(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    commit_single(root, [1])
    write_record(str(root), RootLayout("single", 1))
    other = tmp_path / "other.json"
    other.write_bytes(RootLayout("multirank", 7).to_json())
    swapped = swap_after_open(monkeypatch, root / LAYOUT_FILE, other)
    record = read_record(str(root))
    assert swapped and record is not None and (record.layout, record.world_size) == ("single", 1)


def test_a_single_process_manifest_is_read_from_the_descriptor_it_was_checked_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    commit_single(root, [5, 6])
    manifest = root / "v000000000006" / MANIFEST_NAME
    assert manifest.is_file()
    swapped = swap_after_open(monkeypatch, manifest, root / "v000000000005" / MANIFEST_NAME)
    assert single_version(str(root), 6).step == 6 and swapped


def test_a_root_that_cannot_be_listed_is_a_typed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    commit_single(root, [1])
    real_scandir = os.scandir

    def denied(path: Any = ".") -> Any:
        if os.fspath(path) == str(root):
            raise PermissionError(13, "Permission denied", str(root))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", denied)  # fault injection (the tests run as root: chmod would not do)
    with pytest.raises(RootUnreadableError, match=r"cannot be listed.*Permission denied"):
        survey(str(root))
    with pytest.raises(RootUnreadableError):
        check(str(root))
    with pytest.raises(RootUnreadableError):
        open_store(str(root), keep_last=3)
