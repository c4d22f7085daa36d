"""FSDP2 across the single-process / multi-rank boundary (gloo, CPU, real processes): 1 rank -> 3 -> 1.

The defect of issue 29 as reported: a 1-rank FSDP2 job (``Checkpointer(model, opt, ROOT)``, an ordinary
store: ``ROOT/v…``, ``ROOT/LATEST``) commits steps 4-6; the same script on 3 ranks opens ROOT. Its
``resume()`` must return 6 on every rank (it returned None and trained from step 0 beside the old
versions), each rank holding its piece of the single-process version bit for bit, and training must go
on exactly as a 3-rank run that loaded that state through torch's own API. fsck then finds the root clean:
the record says multi-rank (3 ranks) after a resumed single-process layout, v4..6 are listed as
superseded, no ``LATEST`` is left in the root itself. The root then resumes on 1 rank again (3 -> 1, a
``RankStore`` of one rank: a root stays multi-rank), bit-exact the same way, fsck clean.

On another copy of the single-process root, ``across_layouts="start_fresh"`` starts from nothing beside
the old versions (explicitly, recorded as not resumed), and a root whose layout record is damaged makes
``resume()`` raise the same typed error on every rank. 2 -> 1 -> 2 is
tests/asymcheck/fsdp2/test_reshard.py (fsck after each). DDP of one rank resumes on two, each rank
taking the whole version.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.asymcheck.fsdp2.test_reshard import assert_resharded, ref
from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP in this torch")
    root = tmp_path_factory.mktemp("fsdp2-boundary")
    ck = str(root / "ck")
    base = {"kind": "fsdp2", "mode": "attach", "dir": ck, "dump_resumed": True}
    run_cases([{**base, "name": "solo", "iterations": 6}], 1, root / "out")
    shutil.copytree(ck, root / "fresh")
    shutil.copytree(ck, root / "bad")
    (root / "bad" / "LAYOUT.json").write_text('{"format": 1, "layout": "single", "world_size": 3}')
    run_cases([{**base, "name": "three", "iterations": 8, "fsck": True}, ref("three", "solo", 1, 8),
               {**base, "dir": str(root / "fresh"), "name": "fresh", "iterations": 2, "across": "start_fresh",
                "fsck": True},
               {**base, "dir": str(root / "bad"), "name": "bad", "iterations": 2, "expect_error": True}],
              3, root / "out")
    ddp = {"kind": "ddp", "mode": "attach", "dir": str(root / "ddp"), "dump_resumed": True}
    run_cases([{**base, "name": "one", "iterations": 10, "fsck": True}, ref("one", "three", 3, 10),
               {**ddp, "name": "ddp_one", "iterations": 3}], 1, root / "out")
    run_cases([{**ddp, "name": "ddp_two", "iterations": 5, "fsck": True}], 2, root / "out")
    return root / "out"


def test_one_rank_commits_three_ranks_resume_it_not_step_0(out: Path) -> None:
    """The report as written; then each rank's piece is the saved state's, and training goes on exactly."""
    solo, three = Case(out, "solo", 1), Case(out, "three", 3)
    assert solo.rc(0) == 0, solo.log(0)
    assert [e["step"] for e in solo.events(0, "resumed")] == [None]
    for r in range(3):
        assert three.rc(r) == 0, three.log(r)
        assert [e["step"] for e in three.events(r, "resumed")] == [6], r
    assert_resharded(solo, 1, three, 3, 6, 8)


def test_after_one_to_three_the_root_is_multirank_and_fsck_clean(out: Path) -> None:
    report = Case(out, "three", 3).fsck()
    assert report["ok"], report["problems"]
    assert report["layout"] == "multirank"
    assert report["layout_record"] == {"format": 1, "layout": "multirank", "world_size": 3, "previous": [
        {"layout": "single", "world_size": 1, "newest_step": 6, "resumed": True}]}
    versions = {(v["name"], v["status"]) for v in report["versions"]}
    assert {("v000000000004", "superseded"), ("v000000000005", "superseded"),
            ("v000000000006", "superseded")} <= versions  # the single-process versions are listed, kept
    assert {("global/v000000000007.json", "committed"), ("global/v000000000008.json", "committed")} <= versions
    assert report["latest"] == 8


def test_three_ranks_resume_on_one_bit_exact_and_fsck_clean(out: Path) -> None:
    one = Case(out, "one", 1)
    assert_resharded(Case(out, "three", 3), 3, one, 1, 8, 10)
    report = one.fsck()
    assert report["ok"], report["problems"]
    assert report["layout_record"]["world_size"] == 1 and report["layout_record"]["layout"] == "multirank"
    assert report["latest"] == 10 and not (out.parent / "ck" / "LATEST").exists()


def test_start_fresh_is_explicit_and_recorded(out: Path) -> None:
    fresh = Case(out, "fresh", 3)
    for r in range(3):
        assert fresh.rc(r) == 0, fresh.log(r)
        assert [e["step"] for e in fresh.events(r, "resumed")] == [None]
    report = fresh.fsck()
    assert report["ok"], report["problems"]
    assert report["layout_record"]["previous"] == [
        {"layout": "single", "world_size": 1, "newest_step": 6, "resumed": False}]
    assert [v["step"] for v in report["versions"] if v["status"] == "superseded"] == [4, 5, 6]


def test_a_damaged_layout_record_is_the_same_typed_error_on_every_rank(out: Path) -> None:
    bad = Case(out, "bad", 3)
    for r in range(3):
        assert bad.rc(r) == 0, bad.log(r)
        [error] = bad.events(r, "error")
        assert error["type"] == "RootLayoutError" and "LAYOUT.json" in error["message"], error
    assert json.loads((out.parent / "bad" / "LAYOUT.json").read_text())["world_size"] == 3  # left as it was
    assert (out.parent / "bad" / "LATEST").read_text().strip() == "6"


def test_ddp_of_one_rank_resumes_on_two_whole_and_bit_exact(out: Path) -> None:
    """DDP holds every tensor whole: each of 2 ranks resumes the single-process version entire, bit for bit."""
    one, two = Case(out, "ddp_one", 1), Case(out, "ddp_two", 2)
    assert one.rc(0) == 0, one.log(0)
    saved = one.final(0)
    for r in range(2):
        assert two.rc(r) == 0, two.log(r)
        [resumed] = two.events(r, "resumed")
        assert (resumed["step"], resumed["tier"]) == (3, "resharded from 1 rank(s)")
        assert_same_state(saved, two.final(r, "resumed"))  # tensors, RNG states, scheduler, data position
        assert two.final(r).step == 5
    report = two.fsck()
    assert report["ok"], report["problems"]
    assert report["layout_record"]["previous"] == [
        {"layout": "single", "world_size": 1, "newest_step": 3, "resumed": True}]
