"""Real DeepSpeed (CPU accelerator, gloo) on 1 and 2 ranks, ZeRO stages 0-3: attach() kill tests and
save_checkpoint/load_checkpoint round trips through AsymCheckpointEngine.

Per world size, one driver process per rank imports torch and DeepSpeed once and runs every case in a
forked child (tests/procs/mr_driver.py, tests/support/mr_cases.py); the ranks of a case rendezvous on their own
port. Per stage:

- ``ref``: 7 iterations without checkpoints (the uninterrupted run);
- ``kill``: ``attach()`` every iteration, every rank SIGKILLs itself inside the forward pass of an
  iteration; fsck then runs on the checkpoint root;
- ``resume``: a fresh engine resumes (collectively) from the newest global version and trains to the end:
  every rank's final state (ZeRO partitions of fp32 masters and optimizer moments, model states, LR
  scheduler, counters, RNG, data position) must equal ``ref``'s bit for bit, and every loss either run
  logged must equal ``ref``'s for that iteration;
- ``rt``: ``save_checkpoint`` through AsymCheckpointEngine after 3 steps, continue; tear DeepSpeed's
  ``latest`` file; a fresh engine loads through ``asymcheck.deepspeed.load_checkpoint`` and continues the
  same way: both continuations must end bit-identical.

With 2 ranks, below ZeRO-3, the replicated model states file (module parameters; at stage 0 the optimizer's
state too) is written in slices (``CommitOptions(dedup="replicas")``, the default): each rank writes about
half of it, where with ``dedup="off"`` (``off``: the same run) rank 0 writes all of it. ``div-*``: a frozen
parameter differs on rank 1 (ZeRO-2): the job falls back to whole copies with a WARNING and the resume is
still exact on both ranks (each rank loads its own copy).

With 2 ranks, one more pair: rank 1 is SIGKILLed in the middle of committing its shard of the last
version (half a manifest written, at ``close()``); rank 0 commits its shard, waits for rank 1's report
and gives up after the timeout, so no global manifest is published: fsck names the step partial, and
the resume starts from the previous global version, bit-identical again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")

ITERATIONS = 7
STAGES = (0, 1, 2, 3)
KILL_AT = {0: 4, 1: 5, 2: 4, 3: 5}  # iteration whose forward pass dies
SLICED_STAGES = (0, 1, 2)  # the model states file is the same on every rank
DIVERGED_ITERATIONS = 9
DIVERGED_KILL_AT = 7  # the versions in flight when the job falls back (a few) are not published either
MODEL_FILE = "ds/asymcheck/mp_rank_00_model_states.pt/"
MID_COMMIT_STAGE = 2
SHAPE_STAGES = (1, 3)
SHAPES = ("loader", "val", "accum")  # loop shapes of issue 9: fetching loader + global-RNG batch; validation after
#                                     the step; gradient accumulation


def cases_for(world: int, root: Path) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for s in STAGES:
        ck = str(root / f"ck{s}")
        cases += [
            {"name": f"ref{s}", "kind": "ds", "stage": s, "mode": "ref", "iterations": ITERATIONS},
            {"name": f"kill{s}", "kind": "ds", "stage": s, "mode": "attach", "iterations": ITERATIONS, "dir": ck,
             "kill": {"rank": None, "at": f"forward:{KILL_AT[s]}"}, "fsck": True},
            {"name": f"resume{s}", "kind": "ds", "stage": s, "mode": "attach", "iterations": ITERATIONS, "dir": ck},
            {"name": f"rt{s}", "kind": "ds", "stage": s, "mode": "roundtrip", "iterations": 6, "save_at": 3,
             "dir": str(root / f"rt{s}"), "fsck": True},
        ]
    for s in SHAPE_STAGES:
        for shape in SHAPES:
            ck = str(root / f"{shape}{s}")
            common = {"kind": "ds", "stage": s, "iterations": ITERATIONS, "shape": shape}
            cases += [
                {"name": f"{shape}-ref{s}", "mode": "ref", **common},
                {"name": f"{shape}-kill{s}", "mode": "attach", "dir": ck, "fsck": True,
                 "kill": {"rank": None, "at": f"forward:{KILL_AT[s]}"}, **common},
                {"name": f"{shape}-resume{s}", "mode": "attach", "dir": ck, **common},
            ]
    if world == 1:
        cases.append({"name": "refuse", "kind": "ds", "stage": 2, "mode": "refuse", "iterations": 2,
                      "dir": str(root / "refused")})
    if world == 2:
        for s in SLICED_STAGES:  # the same runs with whole copies (rank 0 writes the model states file)
            cases.append({"name": f"off{s}", "kind": "ds", "stage": s, "mode": "attach", "iterations": ITERATIONS,
                          "dir": str(root / f"off{s}"), "dedup": "off"})
        dv = str(root / "diverged")
        common = {"kind": "ds", "stage": 2, "iterations": DIVERGED_ITERATIONS, "diverge": True}
        cases += [
            {"name": "div-ref", "mode": "ref", **common},
            {"name": "div-kill", "mode": "attach", "dir": dv,
             "kill": {"rank": None, "at": f"forward:{DIVERGED_KILL_AT}"}, **common},
            {"name": "div-resume", "mode": "attach", "dir": dv, **common},
        ]
        mc = str(root / "midcommit")
        cases += [
            {"name": "mc_kill", "kind": "ds", "stage": MID_COMMIT_STAGE, "mode": "attach", "iterations": ITERATIONS,
             "dir": mc, "kill": {"rank": 1, "at": "commit:6"}, "timeout_s": 4.0, "fsck": True},
            {"name": "mc_resume", "kind": "ds", "stage": MID_COMMIT_STAGE, "mode": "attach",
             "iterations": ITERATIONS, "dir": mc},
        ]
    for c in cases:
        if c["mode"] == "roundtrip":
            c["fsck_dir"] = str(Path(c["dir"]) / "asymstore")
    return cases


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    n = int(request.param)
    root = tmp_path_factory.mktemp(f"ds{n}")
    run_cases(cases_for(n, root / "ckpt"), n, root / "out")
    return n, root / "out"


def check_losses(ref: Case, *runs: Case, rank: int) -> int:
    want = dict(ref.losses(rank))
    assert len(want) == ITERATIONS
    seen = 0
    for run in runs:
        for it, loss in run.losses(rank):
            assert loss == want[it], f"{run.dir.name} rank {rank} iteration {it}: {loss} != {want[it]}"
            seen += 1
    return seen


@pytest.mark.parametrize("stage", STAGES)
def test_attach_sigkill_resume_is_bit_identical_to_an_uninterrupted_run(world: tuple[int, Path],
                                                                        stage: int) -> None:
    n, out = world
    ref, kill, resume = (Case(out, f"{k}{stage}", n) for k in ("ref", "kill", "resume"))
    report = kill.fsck()
    restorable = report["newest_restorable"]
    for r in range(n):
        assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
        assert kill.rc(r) == -9, f"rank {r} of the killed run: rc {kill.rc(r)}\n{kill.log(r)}"
        assert [it for it, _ in kill.losses(r)] == list(range(KILL_AT[stage]))
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == restorable == resumed["iteration"], (resumed, report["problems"])
        assert 1 <= resumed["step"] < KILL_AT[stage]
        [stats] = resume.events(r, "stats")
        assert stats["failed"] == 0 and stats["committed"] == ITERATIONS - resumed["step"]
        assert_same_state(ref.final(r), resume.final(r))
        assert check_losses(ref, kill, resume, rank=r) == KILL_AT[stage] + ITERATIONS - resumed["step"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stage", SHAPE_STAGES)
def test_attach_is_bit_identical_in_every_loop_shape(world: tuple[int, Path], stage: int, shape: str) -> None:
    n, out = world
    ref, kill, resume = (Case(out, f"{shape}-{k}{stage}", n) for k in ("ref", "kill", "resume"))
    restorable = kill.fsck()["newest_restorable"]
    for r in range(n):
        assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
        assert kill.rc(r) == -9, f"rank {r} of the killed run: rc {kill.rc(r)}\n{kill.log(r)}"
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == restorable == resumed["iteration"]
        assert resumed["fetched"] == (resumed["step"] if shape == "loader" else None)
        assert 1 <= resumed["step"] < KILL_AT[stage]
        [stats] = resume.events(r, "stats")
        assert stats["failed"] == 0 and stats["dropped"] == 0
        assert_same_state(ref.final(r), resume.final(r))  # engine, RNG, this rank's buffers, the loader
        assert check_losses(ref, kill, resume, rank=r) == KILL_AT[stage] + ITERATIONS - resumed["step"]


@pytest.mark.parametrize("stage", STAGES)
def test_save_and_load_checkpoint_roundtrip_through_asym_checkpoint_engine(world: tuple[int, Path],
                                                                          stage: int) -> None:
    n, out = world
    rt = Case(out, f"rt{stage}", n)
    report = rt.fsck()
    assert report["ok"] and report["layout"] == "multirank" and report["ranks"] == list(range(n)), report["problems"]
    root = Path(report["root"]).parent
    assert (root / "latest").read_text() == ""  # torn on purpose before loading
    model_file = ("step3/zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3
                  else "step3/mp_rank_00_model_states.pt")
    assert (root / model_file).is_file()  # a stub: DeepSpeed's glob finds it, the data is in asymstore
    for r in range(n):
        assert rt.rc(r) == 0, rt.log(r)
        [loaded] = rt.events(r, "loaded")
        assert loaded["client"] == {"note": "hello", "at": 3} and loaded["global_steps"] == 3
        assert loaded["path"] in (model_file, model_file.replace("rank_0_", f"rank_{r}_"))
        # DeepSpeed's checkpoint does not hold micro_steps, and below ZeRO-3 it holds rank 0's module
        # buffers only (every rank loads rank 0's BatchNorm statistics); everything else must match
        ignore = "buffers/" if stage < 3 and r > 0 else None
        assert_same_state(rt.final(r, "continued"), rt.final(r, "reloaded"), ignore_meta=("deepspeed/engine",),
                          ignore_tensors=ignore)
        logged = rt.losses(r)
        assert [it for it, _ in logged] == [0, 1, 2, 3, 4, 5, 3, 4, 5]
        assert logged[3:6] == logged[6:]


def test_attach_and_install_refuse_a_real_engine_with_optimizer_offload(world: tuple[int, Path]) -> None:
    n, out = world
    if n != 1:
        pytest.skip("run on one rank")
    case = Case(out, "refuse", n)
    assert case.rc(0) == 0, case.log(0)
    refused = case.events(0, "refused")
    assert [e["api"] for e in refused] == ["attach", "install"] and not case.events(0, "accepted")
    assert all("zero_optimization.offload_optimizer.device=cpu" in e["message"] for e in refused)
    assert not (Path(out).parent / "ckpt" / "refused").exists()  # refused before any store was made
    assert len(case.losses(0)) == 2


def test_a_rank_killed_mid_commit_leaves_the_previous_global_version(world: tuple[int, Path]) -> None:
    n, out = world
    if n != 2:
        pytest.skip("needs two ranks")
    ref, kill, resume = Case(out, f"ref{MID_COMMIT_STAGE}", n), Case(out, "mc_kill", n), Case(out, "mc_resume", n)
    assert kill.rc(1) == -9, kill.log(1)
    assert kill.rc(0) == 1 and "GlobalCommitTimeoutError" in kill.log(0)  # close() gave up on rank 1
    report = kill.fsck()
    # rank 1 died committing its 7th shard (the last step): rank 0 committed step 7, no global manifest
    assert report["newest_restorable"] == 6 and report["latest"] == 6
    assert report["partial_steps"] == {"7": [0]}
    assert all(int(step) < 4 for step in report["stale_steps"])  # rank 1's shards retention had not dropped yet
    status = {v["name"]: v["status"] for v in report["versions"]}
    assert status["global/v000000000007.json"] == "partial"
    assert any(name.startswith("rank-00001/.tmp-v000000000007") and s == "partial" for name, s in status.items())
    for r in range(n):
        assert resume.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == 6
        assert_same_state(ref.final(r), resume.final(r))
        check_losses(ref, kill, resume, rank=r)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_export_writes_a_deepspeed_checkpoint_that_deepspeeds_own_tools_consolidate(
        world: tuple[int, Path], stage: int, tmp_path: Path) -> None:
    """The conversion path to another world size: export, then DeepSpeed's zero_to_fp32 over every rank's partition."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from asymcheck.deepspeed.export import main

    n, out = world
    ckpt_root = out.parent / "ckpt" / f"ck{stage}"  # attach() versions, the newest from the resumed run (step 7)
    dest = tmp_path / "ds"
    assert main([str(ckpt_root), str(dest)]) == 0
    assert (dest / "latest").read_text() == "asymcheck"
    partitions = sorted(p.name for p in (dest / "asymcheck").glob("*optim_states.pt"))
    assert len(partitions) == n  # one ZeRO partition file per rank of the saving job
    full = get_fp32_state_dict_from_zero_checkpoint(str(dest), tag="asymcheck")
    ref = Case(out, f"ref{stage}", n).final(0)
    params = {k.split("/module/", 1)[1]: v for k, v in ref.tensors.items()
              if "/module/" in k and "model_states" in k and k.split("/module/", 1)[1] in full}
    names = {k.split("/module/", 1)[1] for k in ref.tensors if "/module/" in k and "model_states" in k}
    assert full and set(full) <= names
    assert all(torch.isfinite(v).all() for v in full.values())
    if stage < 3:  # ZeRO-3 module states hold partitions only: there the optimizer files are the only copy
        assert set(params) == set(full)
        for name, tensor in params.items():  # the run's final weights, consolidated from every rank's partition
            assert torch.equal(full[name], tensor.float()), name


def _model_file_bytes(root: Path, rank: int, step: int) -> tuple[int, int]:
    """(raw bytes of the model states file's tensors, of the whole shard) in ``rank``'s shard of ``step``."""
    import asyncio

    from asymstore import AsymStore, LocalTier

    async def read() -> tuple[int, int]:
        async with AsymStore([LocalTier(root / f"rank-{rank:05d}")], keep_last=None, read_only=True) as store:
            ckpt = await store.restore(step=step)
        sizes = {name: t.numel() * t.element_size() for name, t in ckpt.tensors.items()}
        return sum(v for k, v in sizes.items() if k.startswith(MODEL_FILE)), sum(sizes.values())

    return asyncio.run(read())


@pytest.mark.parametrize("stage", SLICED_STAGES)
def test_zero_replicated_model_states_are_written_in_slices_and_restored_from_them(
        world: tuple[int, Path], stage: int) -> None:
    """Each rank writes about half of the model states file (rank 0 all of it with dedup="off"); resumed from slices."""
    from asymstore.format.replicas import REPLICAS_KEY
    from tests.support.replicas import newest_global

    n, out = world
    if n != 2:
        pytest.skip("needs two ranks")
    ck, off = out.parent / "ckpt" / f"ck{stage}", out.parent / "ckpt" / f"off{stage}"
    g, whole = newest_global(ck), newest_global(off)
    assert g.step == whole.step == ITERATIONS
    claims = [g.shard(r).summary.get(REPLICAS_KEY) for r in range(n)]
    assert all(c is not None and c["mode"] == "slices" and c["world"] == n for c in claims), claims
    assert len({c["digest"] for c in claims if c is not None}) == 1
    assert all(REPLICAS_KEY not in s.summary for s in whole.shards)
    off_bytes = [_model_file_bytes(off, r, ITERATIONS) for r in range(n)]
    assert off_bytes[0][0] > 0 and off_bytes[1][0] == 0  # dedup="off": DeepSpeed's writer, rank 0, holds it all
    for r in range(n):
        sliced, total = _model_file_bytes(ck, r, ITERATIONS)
        assert 0.45 <= sliced / off_bytes[0][0] <= 0.6, (r, sliced, off_bytes)  # ~1/2 (+ the buffers, whole)
        assert total < off_bytes[0][1]  # no rank writes as much as rank 0 did
    resume = Case(out, f"resume{stage}", n)
    for r in range(n):
        [resumed] = resume.events(r, "resumed")
        assert resumed["tier"] == f"slices of {n} rank(s)", resumed  # bit-identical: the test above


def test_zero_replicas_that_differ_fall_back_to_whole_copies_with_a_warning(world: tuple[int, Path]) -> None:
    from asymstore.format.replicas import REPLICAS_KEY
    from tests.support.replicas import newest_global

    n, out = world
    if n != 2:
        pytest.skip("needs two ranks")
    ref, kill, resume = (Case(out, f"div-{k}", n) for k in ("ref", "kill", "resume"))
    logs = [(out / f"driver-rank{r}.log").read_text() for r in range(n)]
    assert "the replicas differ across ranks" in logs[0]  # the coordinator refused a sliced version
    for r in range(n):
        assert "writing whole copies of it on every rank" in logs[r], logs[r][-3000:]
    g = newest_global(out.parent / "ckpt" / "diverged")
    assert all(REPLICAS_KEY not in s.summary for s in g.shards)
    for r in range(n):
        assert kill.rc(r) == -9, kill.log(r)
        assert resume.rc(r) == 0 and ref.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] is not None and 2 <= resumed["step"] < DIVERGED_KILL_AT, resumed
        assert_same_state(ref.final(r), resume.final(r))  # rank 1 loads its own model states file
        check_losses_of(ref, resume, r)
    key = f"{MODEL_FILE}module/1.weight"
    assert not torch_equal(ref.final(0).tensors[key], ref.final(1).tensors[key])  # the replicas really differed


def check_losses_of(ref: Case, run: Case, rank: int) -> None:
    want = dict(ref.losses(rank))
    for it, loss in run.losses(rank):
        assert loss == want[it], f"{run.dir.name} rank {rank} iteration {it}"


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return bool(torch.equal(a, b))


@pytest.mark.exhaustive
@pytest.mark.parametrize("stage", (1, 2))
def test_zero_slices_on_4_ranks_kill_resume_and_refuse_2_ranks(tmp_path: Path, stage: int) -> None:
    """4 ranks: each writes about a quarter of the model states file; a 2-rank job refuses the version (typed)."""
    from asymstore.format.replicas import REPLICAS_KEY
    from tests.support.replicas import newest_global

    ck, off, out = tmp_path / "ck", tmp_path / "off", tmp_path / "out"
    common = {"kind": "ds", "stage": stage, "iterations": ITERATIONS}
    run_cases([
        {"name": "ref", "mode": "ref", **common},
        {"name": "off", "mode": "attach", "dir": str(off), "dedup": "off", **common},
        {"name": "kill", "mode": "attach", "dir": str(ck), "kill": {"rank": None, "at": f"forward:{KILL_AT[stage]}"},
         "fsck": True, **common},
        {"name": "resume", "mode": "attach", "dir": str(ck), **common},
    ], 4, out)
    run_cases([{"name": "two", "mode": "attach", "dir": str(ck), "refusal": True, **common}], 2, tmp_path / "out2")
    ref, kill, resume = (Case(out, k, 4) for k in ("ref", "kill", "resume"))
    g = newest_global(ck)
    assert g.step == ITERATIONS and all(s.summary[REPLICAS_KEY]["world"] == 4 for s in g.shards)
    whole = _model_file_bytes(off, 0, ITERATIONS)[0]
    restorable = kill.fsck()["newest_restorable"]
    for r in range(4):
        assert 0.2 <= _model_file_bytes(ck, r, ITERATIONS)[0] / whole <= 0.35  # ~1/4 (+ the buffers, whole)
        assert kill.rc(r) == -9 and resume.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == restorable and resumed["tier"] == "slices of 4 rank(s)"
        assert_same_state(ref.final(r), resume.final(r))
        assert check_losses(ref, kill, resume, rank=r) == KILL_AT[stage] + ITERATIONS - resumed["step"]
    two = Case(tmp_path / "out2", "two", 2)
    for r in range(2):
        assert two.rc(r) == 0, two.log(r)
        [refused] = two.events(r, "refused")
        assert refused["error"] == "WorldSizeMismatchError", refused
