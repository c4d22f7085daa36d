"""FSDP2 resumed on another number of ranks (gloo, CPU, real processes): 2 ranks -> 1 -> 2 -> 4 -> 2.

``save2`` trains 4 iterations on 2 ranks with a checkpoint every iteration; ``one`` resumes that root on
1 rank (FSDP2 on a mesh of one: every piece is the whole global tensor), trains to 6 and commits there;
``two`` resumes the 1-rank version on 2 ranks again and trains to 8. Right after each resume, every
sharded tensor (parameters, AdamW moments) equals the matching rows of the global tensor the previous job
saved, bit for bit, and the tensors held whole (step counters, RNG states) come from old rank ``rank % N``;
``four`` then resumes that on 4 ranks and trains to 10, and ``back`` resumes the 4-rank version on 2 and
trains to 12, checked the same way. After each change of size, training goes on with losses (and ends in a
state) bit-identical to a reference run of the new size that loaded the old job's final state through torch's
own ``set_model_state_dict`` / ``set_optimizer_state_dict`` (mode ``"ref_from"`` of tests/support/fsdp2_cases.py).
fsck finds the root clean after each change of size (its layout record: multi-rank, of the new size).
And FSDP2 on a single rank (an ordinary store, resume reading straight into the local shards) stops after
3 iterations and resumes bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asymstore.format.pieces import TensorLayout, read_layouts
from asymstore.values import Checkpoint
from tests.support.fsdp2_cases import global_tensors
from tests.support.mr_harness import Case, assert_same_state, run_cases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP in this torch")
    root = tmp_path_factory.mktemp("fsdp2-reshard")
    ck = str(root / "ck")
    base = {"kind": "fsdp2", "mode": "attach", "dir": ck, "dump_resumed": True}
    run_cases([{**base, "name": "save2", "iterations": 4}], 2, root / "out")
    solo = {"kind": "fsdp2", "mode": "attach", "dir": str(root / "solo")}
    run_cases([{**base, "name": "one", "iterations": 6, "fsck": True}, ref("one", "save2", 2, 6),
               {"kind": "fsdp2", "mode": "ref", "name": "solo_ref", "iterations": 5},
               {**solo, "name": "solo_a", "iterations": 3}, {**solo, "name": "solo_b", "iterations": 5}],
              1, root / "out")
    run_cases([{**base, "name": "two", "iterations": 8, "fsck": True}, ref("two", "one", 1, 8)], 2, root / "out")
    run_cases([{**base, "name": "four", "iterations": 10}, ref("four", "two", 2, 10)], 4, root / "out")
    run_cases([{**base, "name": "back", "iterations": 12, "fsck": True}, ref("back", "four", 4, 12)], 2,
              root / "out")
    return root / "out"


def ref(name: str, old: str, old_world: int, iterations: int) -> dict[str, object]:
    """The reference run of case ``name``: ``old``'s final state loaded with torch's own API, trained on."""
    return {"kind": "fsdp2", "mode": "ref_from", "name": f"{name}_ref", "from": old, "from_world": old_world,
            "iterations": iterations}


def assert_pieces_of(before: list[Checkpoint], after: Checkpoint, old_world: int, rank: int) -> None:
    whole = global_tensors(before)
    layouts = read_layouts(after.manifest)
    assert whole and set(whole) <= set(layouts)
    for name, lay in layouts.items():
        got = after.tensors[name]
        if name in whole:
            assert lay.mesh is not None and lay.mesh.coordinate == (rank,)
            want = whole[name][tuple(slice(o, o + n) for o, n in zip(lay.offsets, lay.shape, strict=True))]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        else:  # held whole: from old rank ``rank % N``
            src = before[rank % old_world].tensors[name]
            assert torch.equal(got.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)), name
    assert after.meta["stateful"] == before[rank % old_world].meta["stateful"]


def test_fsdp2_version_of_two_ranks_resumes_on_one(out: Path) -> None:
    save2, one = Case(out, "save2", 2), Case(out, "one", 1)
    assert [save2.rc(r) for r in range(2)] == [0, 0] and one.rc(0) == 0, one.log(0)
    [resumed] = one.events(0, "resumed")
    assert resumed["step"] == 4 and resumed["tier"] == "resharded from 2 rank(s)"
    assert_resharded(save2, 2, one, 1, 4, 6)
    report = one.fsck()  # one process goes on in the multi-rank layout, recorded as of one rank
    assert report["ok"], report["problems"]
    assert (report["layout"], report["layout_record"]["world_size"]) == ("multirank", 1)
    after = one.final(0, "resumed")
    w = read_layouts(after.manifest)["model/0.weight"]
    assert w == TensorLayout.sharded((37, 16), "float32", w.mesh, ["S(0)"]) and w.shape == (37, 16)


def assert_resharded(old: Case, old_world: int, new: Case, new_world: int, resumed_at: int, ends_at: int) -> None:
    """Every rank of ``new`` resumed ``old``'s last version (of ``old_world`` ranks) re-cut, then trained on."""
    before = [old.final(q) for q in range(old_world)]
    for r in range(new_world):
        assert new.rc(r) == 0, new.log(r)
        [resumed] = new.events(r, "resumed")
        assert resumed["step"] == resumed_at and resumed["tier"] == f"resharded from {old_world} rank(s)"
        assert_pieces_of(before, new.final(r, "resumed"), old_world, r)
        assert new.final(r).step == ends_at
    # training goes on exactly as a run of the new size started from the same state by plain PyTorch
    reference = Case(new.dir.parent, f"{new.dir.name}_ref", new_world)
    for r in range(new_world):
        assert reference.rc(r) == 0, reference.log(r)
        want = reference.losses(r)
        assert [it for it, _ in want] == list(range(resumed_at, ends_at))
        assert new.losses(r) == want, r
        # torch's set_optimizer_state_dict hands AdamW its betas as a list, not the tuple it was made with
        a, b = reference.final(r), new.final(r)
        assert_same_state(a, b, ignore_meta=("optimizer/param_groups",))
        assert [g["lr"] for g in a.meta["optimizer"]["param_groups"]] == [
            g["lr"] for g in b.meta["optimizer"]["param_groups"]]


def test_fsdp2_version_of_one_rank_resumes_on_two(out: Path) -> None:
    two = Case(out, "two", 2)
    report = two.fsck()
    assert report["ok"], report["problems"]
    assert (report["layout"], report["layout_record"]["world_size"]) == ("multirank", 2)
    assert_resharded(Case(out, "one", 1), 1, two, 2, 6, 8)


def test_fsdp2_version_of_two_ranks_resumes_on_four_and_back_on_two(out: Path) -> None:
    four, back = Case(out, "four", 4), Case(out, "back", 2)
    # 37 rows over 4 ranks: pieces of 10, 10, 10 and 7; Linear(37, 1)'s one row on rank 0 only
    assert_resharded(Case(out, "two", 2), 2, four, 4, 8, 10)
    report = back.fsck()
    assert report["ok"], report["problems"]
    assert_resharded(four, 4, back, 2, 10, 12)


def test_fsdp2_on_one_rank_resumes_in_place_bit_exact(out: Path) -> None:
    ref, a, b = Case(out, "solo_ref", 1), Case(out, "solo_a", 1), Case(out, "solo_b", 1)
    assert ref.rc(0) == a.rc(0) == b.rc(0) == 0, b.log(0)
    [resumed] = b.events(0, "resumed")
    assert resumed["step"] == 3 and resumed["tier"].startswith("local:")  # a plain store, not a RankStore
    assert_same_state(ref.final(0), b.final(0))
    want = dict(ref.losses(0))
    assert [loss for _, loss in a.losses(0) + b.losses(0)] == [want[i] for i in range(5)]


def test_export_assembles_the_global_tensors_for_the_reference_loaders(out: Path, tmp_path: Path) -> None:
    """safetensors and DCP exports of a 2-rank FSDP2 root hold each parameter whole, bit-exact."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from asymstore.export import main as export_main

    root = out.parent / "ck"  # the 2-rank job "back" committed its last version (step 12) on close
    whole = {k.removeprefix("model/"): v for k, v in
             global_tensors([Case(out, "back", 2).final(r) for r in range(2)]).items() if k.startswith("model/")}
    assert whole and all(not torch.isnan(v).any() for v in whole.values())
    st = tmp_path / "model.safetensors"
    assert export_main([str(root), "--to", "safetensors", str(st)]) == 0
    loaded = load_file(str(st))
    assert set(whole) <= set(loaded)
    for name, tensor in whole.items():
        assert loaded[name].shape == tensor.shape and torch.equal(loaded[name], tensor), name
    assert export_main([str(root), "--to", "dcp", str(tmp_path / "dcp")]) == 0
    state = {name: torch.empty_like(t) for name, t in loaded.items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(state[n], loaded[n]) for n in loaded)
