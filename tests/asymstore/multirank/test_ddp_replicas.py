"""DDP's replicated state written once per job (``CommitOptions(dedup="replicas")``, the default), on real gloo ranks.

Cases (tests/support/mr_cases.py): ``ref`` trains 7 iterations without checkpoints; ``off`` checkpoints
every iteration with ``dedup="off"`` (every rank writes all of the state); ``kill`` checkpoints with
slices (``ckpt.mark()`` ending every iteration: the claim survives its re-capture of the meta) and
every rank SIGKILLs itself in the forward pass of iteration 4; ``resume`` restores the
newest global version (each rank reads every slice from the shared root) and trains to the end, bit
for bit as ``ref``. ``one`` then resumes that root on a single rank (2 -> 1): its state is rank 0's
state at step 7. In a second job, rank 1's replica differs from rank 0's (``diverge``): no sliced
version is published, the job falls back to whole copies with a WARNING, and a kill and resume is
still exact.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asymstore.export import export
from asymstore.format.globalmanifest import GlobalManifest
from asymstore.format.replicas import REPLICAS_KEY
from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow

ITERATIONS = 7
KILL_AT = 4
DIVERGED_ITERATIONS = 9
DIVERGED_KILL_AT = 7  # the versions in flight when the job falls back (a few) are not published either


def globals_of(root: str) -> dict[int, GlobalManifest]:
    """Every global manifest published under ``root``, by step."""
    out = {}
    for path in sorted((Path(root) / "global").glob("v*.json")):
        g = GlobalManifest.from_json(path.read_bytes())
        out[g.step] = g
    return out


def same_losses(ref: Case, run: Case, rank: int) -> None:
    want = dict(ref.losses(rank))
    for it, loss in run.losses(rank):
        assert loss == want[it], f"{run.dir.name} rank {rank} iteration {it}"


@pytest.fixture(scope="module")
def sliced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, str]:
    root = tmp_path_factory.mktemp("replicas")
    ck, off = str(root / "ck"), str(root / "off")
    run_cases([
        {"name": "ref", "kind": "ddp", "mode": "ref", "iterations": ITERATIONS},
        {"name": "off", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": off, "dedup": "off"},
        {"name": "kill", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck, "mark": True,
         "kill": {"rank": None, "at": f"forward:{KILL_AT}"}, "fsck": True},
        {"name": "resume", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck, "mark": True,
         "fsck": True},
    ], 2, root / "out")
    run_cases([{"name": "one", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck,
                "dump_resumed": True}], 1, root / "out1")
    return root / "out", root / "out1", ck, off


def test_ddp_slices_halve_bytes_per_rank_and_kill_resume_is_bit_identical(
        sliced: tuple[Path, Path, str, str]) -> None:
    out, _, ck, off = sliced
    ref, kill, resume = Case(out, "ref", 2), Case(out, "kill", 2), Case(out, "resume", 2)
    sliced_g, whole_g = globals_of(ck), globals_of(off)
    for step in (5, 6, 7):  # the same steps, kept by both roots
        for r in range(2):
            claim = sliced_g[step].shard(r).summary[REPLICAS_KEY]
            assert claim["mode"] == "slices" and claim["world"] == 2
            assert REPLICAS_KEY not in whole_g[step].shard(r).summary
            ratio = sliced_g[step].shard(r).nbytes / whole_g[step].shard(r).nbytes
            assert 0.45 <= ratio <= 0.6, (step, r, ratio)  # ~1/2: the replicated part halves, RNG/buffers stay
        digests = {sliced_g[step].shard(r).summary[REPLICAS_KEY]["digest"] for r in range(2)}
        assert len(digests) == 1
    report = kill.fsck()
    assert resume.fsck()["ok"]
    for r in range(2):
        assert kill.rc(r) == -9, kill.log(r)
        assert resume.rc(r) == 0 and ref.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == report["newest_restorable"] == resumed["iteration"]
        assert 1 <= resumed["step"] < KILL_AT and resumed["tier"] == "slices of 2 rank(s)"
        assert_same_state(ref.final(r), resume.final(r))
        same_losses(ref, kill, r)
        same_losses(ref, resume, r)
        assert [it for it, _ in resume.losses(r)] == list(range(resumed["step"], ITERATIONS))


def test_ddp_slices_resume_on_one_rank_and_export(sliced: tuple[Path, Path, str, str]) -> None:
    out, out1, ck, _ = sliced
    g = globals_of(ck)[ITERATIONS]
    assert g.world_size == 2 and all(REPLICAS_KEY in s.summary for s in g.shards)  # the root holds slices
    one = Case(out1, "one", 1)
    assert one.rc(0) == 0, one.log(0)
    [resumed] = one.events(0, "resumed")
    assert resumed["step"] == ITERATIONS and resumed["tier"] == "resharded from 2 rank(s)"
    final = Case(out, "resume", 2).final(0)
    assert_same_state(final, one.final(0, "resumed"))
    exported = out1.parent / "export.safetensors"  # export assembles the slices as well
    asyncio.run(export(ck, "safetensors", str(exported)))
    weights = load_file(exported)
    assert sorted(f"model/{k}" for k in weights) == sorted(n for n in final.tensors if n.startswith("model/"))
    for key, value in weights.items():
        assert torch.equal(value, final.tensors[f"model/{key}"]), key


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("replicas_differ")
    ck = str(root / "ck")
    run_cases([
        {"name": "ref", "kind": "ddp", "mode": "ref", "iterations": DIVERGED_ITERATIONS, "diverge": True},
        {"name": "kill", "kind": "ddp", "mode": "attach", "iterations": DIVERGED_ITERATIONS, "dir": ck,
         "diverge": True, "kill": {"rank": None, "at": f"forward:{DIVERGED_KILL_AT}"}},
        {"name": "resume", "kind": "ddp", "mode": "attach", "iterations": DIVERGED_ITERATIONS, "dir": ck,
         "diverge": True},
    ], 2, root / "out")
    return root / "out", ck


def test_ddp_replicas_that_differ_fall_back_to_whole_copies_with_a_warning(diverged: tuple[Path, str]) -> None:
    out, ck = diverged
    ref, kill, resume = Case(out, "ref", 2), Case(out, "kill", 2), Case(out, "resume", 2)
    logs = [(out / f"driver-rank{r}.log").read_text() for r in range(2)]
    assert "the replicas differ across ranks" in logs[0]  # the coordinator refused a sliced version
    for r in range(2):
        assert "writing whole copies of it on every rank" in logs[r], logs[r][-3000:]
    published = globals_of(ck)
    assert published and all(REPLICAS_KEY not in s.summary for g in published.values() for s in g.shards)
    for r in range(2):
        assert kill.rc(r) == -9, kill.log(r)
        assert resume.rc(r) == 0 and ref.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] is not None and 2 <= resumed["step"] < DIVERGED_KILL_AT, resumed
        assert_same_state(ref.final(r), resume.final(r))
        same_losses(ref, resume, r)
    finals = [json.dumps(ref.final(r).tensors["model/module.0.bias"].tolist()) for r in range(2)]
    assert finals[0] != finals[1]  # the replicas really differed


@pytest.mark.exhaustive
def test_ddp_slices_on_4_ranks_kill_resume_and_resume_on_2(tmp_path: Path) -> None:
    """4 ranks (gradients averaged in rank order: bit-identical restarts), each writing about a quarter."""
    ck, off = str(tmp_path / "ck"), str(tmp_path / "off")
    out = tmp_path / "out"
    run_cases([
        {"name": "ref", "kind": "ddp", "mode": "ref", "iterations": ITERATIONS, "ordered": True},
        {"name": "off", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": off, "dedup": "off",
         "ordered": True},
        {"name": "kill", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck, "ordered": True,
         "kill": {"rank": None, "at": f"forward:{KILL_AT}"}},
        {"name": "resume", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck, "ordered": True},
    ], 4, out)
    run_cases([{"name": "two", "kind": "ddp", "mode": "attach", "iterations": ITERATIONS, "dir": ck,
                "dump_resumed": True}], 2, tmp_path / "out2")
    ref, resume = Case(out, "ref", 4), Case(out, "resume", 4)
    sliced_g, whole_g = globals_of(ck)[ITERATIONS], globals_of(off)[ITERATIONS]
    for r in range(4):
        assert REPLICAS_KEY in sliced_g.shard(r).summary
        assert sliced_g.shard(r).nbytes / whole_g.shard(r).nbytes <= 0.4  # ~1/4 of the replicated part
        assert resume.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert 1 <= resumed["step"] < KILL_AT
        assert_same_state(ref.final(r), resume.final(r))
    two = Case(tmp_path / "out2", "two", 2)
    for r in range(2):
        assert two.rc(r) == 0, two.log(r)
        assert_same_state(resume.final(r), two.final(r, "resumed"))  # ranks 0, 1 take their own whole state
