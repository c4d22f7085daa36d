"""FSDP2 (``fully_shard``) on 2 real processes (gloo, CPU) under the Checkpointer: per-iteration snapshots of the
local shards, SIGKILL, bit-exact resume, and the two-phase global commit.

Cases (tests/support/fsdp2_cases.py, one forked child per rank and case), for two configurations: fp32 with
``reshard_after_forward=True``, and a bf16/fp32 ``MixedPrecisionPolicy`` with ``reshard_after_forward=False``
and gradient accumulation over two micro-batches (no gradient sync or reshard after the first).
``ref`` trains 7 iterations without checkpoints; ``kill`` checkpoints every iteration and every rank SIGKILLs
itself inside the forward pass of iteration 4; ``resume`` restores the newest global version and trains to the
end: each rank's local shards, AdamW moments and step, scheduler, data position and RNG states equal ``ref``'s
bit for bit, and so do the losses. ``mc_kill`` SIGKILLs rank 1 in the middle of committing its last shard, and
``mc_resume`` starts from the previous global version. Every shard records where its pieces sit in the global
tensors (``meta["layout"]``).

A model holding some other tensor subclass is still refused, in process, with a typed error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asymstore.format.pieces import TensorLayout, read_layouts
from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow

ITERATIONS = 7
KILL_AT = 4
CONFIGS = {"fp32": {}, "mp": {"mp": True, "raf": False, "accum": 2}}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP in this torch")
    root = tmp_path_factory.mktemp("fsdp2")
    cases: list[dict[str, Any]] = []
    for cfg, extra in CONFIGS.items():
        ck = str(root / f"ck-{cfg}")
        base = {"kind": "fsdp2", "iterations": ITERATIONS, **extra}
        cases += [
            {**base, "name": f"{cfg}-ref", "mode": "ref"},
            {**base, "name": f"{cfg}-kill", "mode": "attach", "dir": ck,
             "kill": {"rank": None, "at": f"forward:{KILL_AT}"}, "fsck": True},
            {**base, "name": f"{cfg}-resume", "mode": "attach", "dir": ck},
        ]
    cases.append({"kind": "fsdp2", "iterations": ITERATIONS, "name": "edit", "mode": "attach",
                  "dir": str(root / "edit"), "edit": 3})
    mc = str(root / "mc")
    cases += [
        {"kind": "fsdp2", "iterations": ITERATIONS, "name": "mc_kill", "mode": "attach", "dir": mc,
         "kill": {"rank": 1, "at": "commit:6"}, "timeout_s": 4.0, "fsck": True},
        {"kind": "fsdp2", "iterations": ITERATIONS, "name": "mc_resume", "mode": "attach", "dir": mc, "fsck": True},
    ]
    run_cases(cases, 2, root / "out", timeout=600)
    return root / "out"


def same_losses(ref: Case, *runs: Case, rank: int) -> None:
    want = dict(ref.losses(rank))
    assert sorted(want) == list(range(ITERATIONS))
    for run in runs:
        for it, loss in run.losses(rank):
            assert loss == want[it], f"{run.dir.name} rank {rank} iteration {it}"


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_fsdp2_sigkill_resume_is_bit_identical(out: Path, cfg: str) -> None:
    ref, kill, resume = Case(out, f"{cfg}-ref", 2), Case(out, f"{cfg}-kill", 2), Case(out, f"{cfg}-resume", 2)
    report = kill.fsck()
    for r in range(2):
        assert ref.rc(r) == 0 and resume.rc(r) == 0, resume.log(r)
        assert kill.rc(r) == -9, kill.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == report["newest_restorable"] == resumed["iteration"]
        assert 1 <= resumed["step"] < KILL_AT
        [stats] = resume.events(r, "stats")
        assert stats["committed"] >= 1 and stats["failed"] == 0 and stats["dropped"] == 0
        final = resume.final(r)
        assert any(name.startswith("optim/state/") and name.endswith("exp_avg") for name in final.tensors)
        assert_same_state(ref.final(r), final)
        same_losses(ref, kill, resume, rank=r)
        assert [it for it, _ in resume.losses(r)] == list(range(resumed["step"], ITERATIONS))


def test_fsdp2_shards_record_where_their_pieces_sit(out: Path) -> None:
    for r in range(2):
        final = Case(out, "fp32-resume", 2).final(r)
        layouts = read_layouts(final.manifest)
        w = layouts["model/0.weight"]  # Linear(16, 37): 19 rows on rank 0, 18 on rank 1
        assert w.global_shape == (37, 16) and w.placements == ("S(0)",) and w.mesh is not None
        assert (w.offsets, w.shape) == (((0, 0), (19, 16)) if r == 0 else ((19, 0), (18, 16)))
        assert w.mesh.ranks == (0, 1) and w.mesh.coordinate == (r,)
        b = layouts["model/6.bias"]  # one element: rank 1's piece is empty
        assert b.global_shape == (1,) and b.shape == ((1,) if r == 0 else (0,))
        moments = [n for n in layouts if n.startswith("optim/state/") and n.endswith("exp_avg")]
        assert moments and all(layouts[n].placements == ("S(0)",) for n in moments)
        step = next(n for n in layouts if n.startswith("optim/state/") and n.endswith("step"))
        assert layouts[step] == TensorLayout.whole((), "float32")  # a plain tensor: held whole
        assert all(layouts[n].is_whole for n in layouts if n.startswith("rng/"))


def test_fsdp2_rank_killed_mid_commit_leaves_the_previous_global_version(out: Path) -> None:
    ref, kill, resume = Case(out, "fp32-ref", 2), Case(out, "mc_kill", 2), Case(out, "mc_resume", 2)
    assert kill.rc(1) == -9, kill.log(1)
    assert kill.rc(0) == 1 and "GlobalCommitTimeoutError" in kill.log(0)
    report = kill.fsck()
    assert report["newest_restorable"] == 6 and report["partial_steps"] == {"7": [0]}
    after = resume.fsck()
    assert after["ok"] and after["partial_steps"] == {} and after["stale_steps"] == {}, after["problems"]
    for r in range(2):
        assert resume.rc(r) == 0, resume.log(r)
        [resumed] = resume.events(r, "resumed")
        assert resumed["step"] == 6
        assert_same_state(ref.final(r), resume.final(r))
        same_losses(ref, kill, resume, rank=r)


def test_fsdp2_edit_between_steps_drops_the_version_and_editing_keeps_it(out: Path) -> None:
    ref, run = Case(out, "fp32-ref", 2), Case(out, "edit", 2)
    for r in range(2):
        assert run.rc(r) == 0, run.log(r)
        [stats] = run.events(r, "stats")
        assert stats["dropped"] == 1 and stats["eager"] == ["model/0.weight"] and stats["failed"] == 0
        assert stats["committed"] == ITERATIONS - 1  # version 4 dropped; the edit inside editing() cost nothing
        assert_same_state(ref.final(r), run.final(r))
        same_losses(ref, run, rank=r)


class Tagged(torch.Tensor):
    """A tensor subclass the Checkpointer does not know."""


def test_other_tensor_subclasses_are_refused_with_a_typed_error(tmp_path: Path) -> None:
    from asymcheck import Checkpointer, UnsupportedModelError

    model = torch.nn.Linear(3, 2)
    model.weight = torch.nn.Parameter(model.weight.detach().as_subclass(Tagged))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedModelError, match="Tagged"):
        Checkpointer(model, opt, tmp_path / "ckpt")
